"""Connections for long-running processes: bounded waits on a dead network, named sessions."""

from __future__ import annotations

from typing import Any, Final

from psycopg.conninfo import conninfo_to_dict

# A silent network partition is noticed within about 30 s instead of the kernel's two hours.
_NETWORK_DEFAULTS: Final = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # milliseconds: unacknowledged writes give up too
}


def connection_options(dsn: str, application_name: str) -> dict[str, Any]:
    """Keyword options for psycopg connections; anything the DSN sets itself wins."""
    given = conninfo_to_dict(dsn)
    options: dict[str, Any] = {k: v for k, v in _NETWORK_DEFAULTS.items() if k not in given}
    if "application_name" not in given:
        options["application_name"] = application_name
    return options

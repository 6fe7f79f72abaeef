"""Connections for long-running processes: bounded waits on a dead network, named sessions."""

from __future__ import annotations

from typing import Any, Final

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from outbox.db import statements

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


# Session limits for every connection of `outbox run`:
# - lock_timeout: a claim or record stuck behind a migration's ACCESS EXCLUSIVE lock fails fast
#   (a transient claim error) instead of holding a pool connection and queueing more traffic;
# - statement_timeout: no statement of ours should take seconds; a stuck one is cut off;
# - idle_in_transaction_session_timeout: a transaction left open (a bug) frees its row locks.
SESSION_LIMITS: Final = {
    "lock_timeout": "2s",
    "statement_timeout": "30s",
    "idle_in_transaction_session_timeout": "60s",
}


# PostgreSQL 14+: a backend checks that its client is still there while a statement runs, so a
# claim whose connection died while it waited (on a lock, say) is rolled back, not committed
# for a worker that will never learn of its leases.
CLIENT_CHECK: Final = ("client_connection_check_interval", "1s")


async def configure_session(conn: psycopg.AsyncConnection[Any]) -> None:
    """Run once per new pool connection (psycopg_pool's ``configure``)."""
    limits = list(SESSION_LIMITS.items())
    if conn.info.server_version >= 140000:
        limits.append(CLIENT_CHECK)
    for name, value in limits:
        await conn.execute(statements.SET_SESSION_LIMIT, (name, value))


def dispatcher_pool(dsn: str, *, max_size: int, name: str = "outbox") -> AsyncConnectionPool[Any]:
    """The pool `outbox run` uses: autocommit connections with the session limits, not opened."""
    return AsyncConnectionPool(
        dsn, min_size=min(2, max_size), max_size=max_size, open=False, name=name,
        kwargs={"autocommit": True, **connection_options(dsn, "outbox-run")},
        configure=configure_session,
    )  # fmt: skip

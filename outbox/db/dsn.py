"""Connection strings: read them, and never show their passwords."""

from __future__ import annotations

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.observability import redaction

REDACTED = "********"


def has_password(dsn: str) -> bool:
    """True if the connection string itself carries a password."""
    return bool(_parse(dsn).get("password"))


def redact(dsn: str) -> str:
    """The connection string in key=value form with its password masked, fit to print."""
    params = _parse(dsn)
    if params.get("password"):
        params["password"] = REDACTED
    return make_conninfo(**{k: str(v) for k, v in params.items() if v is not None})


def scrub(text: str, dsn: str) -> str:
    """``text`` (an error message, say) with every occurrence of the DSN's password masked, and
    any other secret :func:`outbox.observability.redaction.scrub` finds in it."""
    password = _parse(dsn).get("password")
    return redaction.scrub(text, marker=REDACTED, known=[str(password) if password else None])


def _parse(dsn: str) -> dict[str, object]:
    try:
        return dict(conninfo_to_dict(dsn))
    except psycopg.ProgrammingError:
        # The parser's message may quote the string, password and all: say only that it is bad.
        raise ValueError("the connection string cannot be parsed") from None

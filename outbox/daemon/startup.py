"""What `outbox run` checks before it claims anything (issue 21): each problem ends it with
exit code 2 and one line that names the cause and the fix, instead of a daemon that loops on
an error for ever.

* The database answers within ``database.startup_wait``. The first failed try is logged at once
  with its reason (issue 38: a wrong database name was silent for the whole minute), and each
  new reason after it; a refusal that waiting will not change (no such database or role, a
  failed authentication) ends the run at once instead of after the wait.
* Its schema is this outbox's: no schema, or an older one, says "run `outbox migrate`"; a
  newer one (a rolled-back deploy) is said loudly and tolerated, since migrations add to the
  schema and an older dispatcher keeps working on it.
"""

from __future__ import annotations

import asyncio
import re
import time
from datetime import timedelta
from typing import Final

import psycopg
import structlog

from outbox.core.durations import format_duration
from outbox.db import dsn as dsn_util
from outbox.db import statements
from outbox.db.connect import connection_options
from outbox.db.migrations import load_migrations

# Between two tries while the database does not answer.
RETRY_EVERY: Final = 1.0
# One try's own limit: a host that swallows packets must not use up the whole wait at once.
CONNECT_TIMEOUT: Final = 5
# The server's answers to a login that waiting will not change, as PostgreSQL words them (in
# English, its default language; libpq gives no SQLSTATE for a failed connection): no such
# database, no such role, a role that may not log in, an authentication that failed, no
# pg_hba.conf line for this client, no CONNECT privilege; and libpq's own "no password
# supplied". Anything else is waited for: refused, timed out, "the database system is starting
# up", "too many clients already", a host name that does not resolve yet, and these same answers
# in another language. systemd does not restart a run that exits 2: in doubt, wait.
_WILL_NOT_CHANGE: Final = re.compile(
    r'database ".*" does not exist'
    r'|role ".*" does not exist'
    r"|is not permitted to log in"
    r"|authentication failed for user"
    r"|no pg_hba\.conf entry for"
    r"|permission denied for database"
    r"|no password supplied"
)
# psycopg's message when it tried several hosts (or addresses): one "- host: ..." item each.
_EACH_ATTEMPT: Final = "All failures were:"

log = structlog.get_logger("outbox.startup")


def expected_version() -> int:
    """The newest migration this outbox ships."""
    return load_migrations()[-1].version


async def check_database(dsn: str, wait: timedelta) -> str | None:
    """None when the database answers and its schema is this outbox's or newer; otherwise
    why `outbox run` must not start, in one line that says what to do."""
    deadline = time.monotonic() + wait.total_seconds()
    told: str | None = None  # the reason last logged
    while True:
        try:
            version = await _schema_version(dsn)
        except (
            psycopg.errors.UndefinedFunction,
            psycopg.errors.InvalidSchemaName,
            psycopg.errors.UndefinedTable,
        ):
            return (
                f"the database has no outbox schema, or one from before migration 0027; "
                f"this outbox needs migration {expected_version():04d}: run `outbox migrate` "
                "first"
            )
        except psycopg.errors.InsufficientPrivilege as exc:
            return (
                f"the database refused outbox.schema_version() to this login "
                f"({exc.diag.message_primary}): run `outbox migrate --with-roles`, or grant "
                "it EXECUTE"
            )
        except psycopg.OperationalError as exc:
            why = failure_reason(exc, dsn)
            if will_not_change(exc):
                return (
                    f"the database refused the connection, and waiting will not change that: "
                    f"{why} (fix the connection string's database, user or password, or the "
                    "server's roles, grants or pg_hba.conf)"
                )
            if time.monotonic() >= deadline:
                return (
                    f"the database did not answer in {format_duration(wait)} "
                    f"(database.startup_wait): {why}"
                )
            if why != told:  # the first failure at once, then each new reason
                log.warning(
                    "waiting for the database to answer",
                    reason=why,
                    startup_wait=format_duration(wait),
                )
                told = why
            await asyncio.sleep(RETRY_EVERY)
            continue
        return _judge(version)


def will_not_change(exc: psycopg.OperationalError) -> bool:
    """Whether a failed connection was refused for a reason waiting will not change; with
    several hosts, only when each of them refused so."""
    attempts = _attempts(str(exc))
    return bool(attempts) and all(_WILL_NOT_CHANGE.search(a) for a in attempts)


def _attempts(message: str) -> list[str]:
    _, several, each = message.partition(_EACH_ATTEMPT)
    if not several:
        return [message] if message.strip() else []
    return [a.strip() for a in re.split(r"\n- (?=host: )", each) if a.strip()]


def failure_reason(exc: psycopg.OperationalError, dsn: str) -> str:
    """Why the connection failed, in one line without the password: each host's first line."""
    firsts = [a.strip().splitlines()[0] for a in _attempts(str(exc))]
    return dsn_util.scrub("; ".join(firsts), dsn) or type(exc).__name__


def _judge(version: int | None) -> str | None:
    expected = expected_version()
    if version is None or version < expected:
        have = "none" if version is None else f"{version:04d}"
        return (
            f"the database's outbox schema is at migration {have}; this outbox needs "
            f"{expected:04d}: run `outbox migrate` first"
        )
    if version > expected:
        log.error(
            "the database's schema is newer than this outbox (a rolled-back deploy?): "
            "starting anyway, since migrations only add; deploy the newer outbox soon",
            schema_version=version,
            outbox_version=expected,
        )
    return None


async def _schema_version(dsn: str) -> int | None:
    options = {
        "autocommit": True,
        "prepare_threshold": None,
        **connection_options(dsn, "outbox-startup"),
    }
    options.setdefault("connect_timeout", CONNECT_TIMEOUT)
    async with await psycopg.AsyncConnection.connect(dsn, **options) as conn:
        row = await (await conn.execute(statements.SCHEMA_VERSION)).fetchone()
    return None if row is None or row[0] is None else int(row[0])

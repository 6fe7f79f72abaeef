"""What `outbox run` checks before it claims anything (issue 21): each problem ends it with
exit code 2 and one line that names the cause and the fix, instead of a daemon that loops on
an error for ever.

* The database answers within ``database.startup_wait``.
* Its schema is this outbox's: no schema, or an older one, says "run `outbox migrate`"; a
  newer one (a rolled-back deploy) is said loudly and tolerated, since migrations add to the
  schema and an older dispatcher keeps working on it.
"""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from typing import Final

import psycopg
import structlog

from outbox.db import dsn as dsn_util
from outbox.db import statements
from outbox.db.connect import connection_options
from outbox.db.migrations import load_migrations
from outbox.durations import format_duration

# Between two tries while the database does not answer.
RETRY_EVERY: Final = 1.0
# One try's own limit: a host that swallows packets must not use up the whole wait at once.
CONNECT_TIMEOUT: Final = 5

log = structlog.get_logger("outbox.startup")


def expected_version() -> int:
    """The newest migration this outbox ships."""
    return load_migrations()[-1].version


async def check_database(dsn: str, wait: timedelta) -> str | None:
    """None when the database answers and its schema is this outbox's or newer; otherwise
    why `outbox run` must not start, in one line that says what to do."""
    deadline = time.monotonic() + wait.total_seconds()
    told = False
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
            if time.monotonic() >= deadline:
                why = dsn_util.scrub(str(exc).strip().splitlines()[0] if str(exc) else "", dsn)
                return (
                    f"the database did not answer in {format_duration(wait)} "
                    f"(database.startup_wait): {why or type(exc).__name__}"
                )
            if not told:
                log.warning(
                    "waiting for the database to answer", startup_wait=format_duration(wait)
                )
                told = True
            await asyncio.sleep(RETRY_EVERY)
            continue
        return _judge(version)


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

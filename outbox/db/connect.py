"""Connections for long-running processes: bounded waits on a dead network, named sessions.

Behind a transaction-mode pooler (PgBouncer's ``pool_mode = transaction``) each transaction may
run in another server session, shared with other clients: nothing session-scoped may be relied on
or left behind there. :func:`dispatcher_pool` then prepares nothing and sets nothing, and
:func:`shares_server_sessions` tells whether a URL leads to such a pooler.
"""

from __future__ import annotations

import asyncio
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
    # Our statements are short: at ten million rows JIT compiled the gauges' query afresh every
    # refresh (150-350 ms, bench/growth.py) for a plan that reads a few partial indexes.
    "jit": "off",
    # The claim's plan depends on no parameter's value (its shape is fixed by LATERAL and the
    # partial indexes), yet PostgreSQL judged the generic plan dearer and planned it afresh on
    # every call: 1.0-1.2 ms of a 100-row claim's 3-4 ms, where the generic plan takes 0.04 ms
    # and runs as fast. tests/integration/test_query_plans.py runs the generic plan of every
    # statement with parameters that `outbox run` repeats: none does more work than its custom one.
    "plan_cache_mode": "force_generic_plan",
    # The ordering triggers that run in the dispatcher's statements read after taking a key's
    # lock: only READ COMMITTED's fresh snapshot per statement sees the commit that lock waited
    # for. A database whose default is stricter must not make the dispatcher strand a key.
    "default_transaction_isolation": "read committed",
    # No name of ours resolves through public, where anyone could once create functions.
    "search_path": statements.SEARCH_PATH,
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


def pin_search_path(conn: psycopg.Connection[Any]) -> bool:
    """Pin this session's search_path (statements.SEARCH_PATH), committed so that no rollback
    undoes it. Through a transaction pooler a session setting would reach other clients, so
    there the login role's own setting rules: False if it is not pinned."""
    row = conn.execute(statements.SERVER_PID).fetchone()
    if row is not None and row[0] != conn.info.backend_pid:  # a pooler answered the startup
        shown = conn.execute(statements.SHOW_SEARCH_PATH).fetchone()
        if not conn.autocommit:
            conn.commit()
        return shown is not None and _pinned(str(shown[0]))
    conn.execute(statements.PIN_SEARCH_PATH)
    if not conn.autocommit:
        conn.commit()
    return True


async def pin_search_path_async(conn: psycopg.AsyncConnection[Any]) -> None:
    """``pin_search_path`` for a pool's new connection (psycopg_pool's ``configure``); through
    a pooler, nothing (the role's setting rules)."""
    if not await answered_by_pooler(conn):
        await conn.execute(statements.PIN_SEARCH_PATH)
    if not conn.autocommit:
        await conn.commit()


def _pinned(search_path: str) -> bool:
    return [p.strip() for p in search_path.split(",")] == ["pg_catalog", "pg_temp"]


def dispatcher_pool(
    dsn: str, *, max_size: int, name: str = "outbox", transaction_pooling: bool = False
) -> AsyncConnectionPool[Any]:
    """The pool `outbox run` uses: autocommit connections, not opened.

    Direct (or session-pooled), each connection gets the session limits and psycopg prepares
    the statements it runs often. Through a transaction pooler, neither: a statement prepared in
    one server session is missing (or another client's) in the next, and a session setting would
    stay behind for whichever client gets that server session next. The DBA sets the limits on
    the role instead (``ALTER ROLE ... SET``).
    """
    kwargs: dict[str, Any] = {"autocommit": True, **connection_options(dsn, "outbox-run")}
    if transaction_pooling:
        kwargs["prepare_threshold"] = None
    return AsyncConnectionPool(
        dsn,
        min_size=min(2, max_size),
        max_size=max_size,
        open=False,
        name=name,
        kwargs=kwargs,
        configure=None if transaction_pooling else configure_session,
    )


# Each round gives a transaction pooler a chance to hand the second connection the server
# session the first one just freed; PgBouncer reuses the most recently freed one first.
POOLER_PROBE_ROUNDS: Final = 10


async def shares_server_sessions(dsn: str, *, rounds: int = POOLER_PROBE_ROUNDS) -> bool:
    """True if two connections to ``dsn`` ran statements in one server session: the URL leads
    to a pooler in transaction (or statement) mode.

    Never True for a direct connection or a session-mode pooler. A transaction pooler busy
    enough to hand out other sessions every time may go unnoticed, so False proves nothing.
    Raises psycopg.OperationalError when the database cannot be reached.
    """
    options = {
        "autocommit": True,
        "prepare_threshold": None,
        **connection_options(dsn, "outbox-probe"),
    }
    async with await psycopg.AsyncConnection.connect(dsn, **options) as first:
        pid = await _server_pid(first)
        if pid == first.info.backend_pid:
            return False  # PostgreSQL itself answered the startup: a session of our own
        async with await psycopg.AsyncConnection.connect(dsn, **options) as second:
            for _ in range(rounds):
                if await _server_pid(second) == pid:
                    return True
                pid = await _server_pid(first)
    return False


# What `outbox migrate` says when its URL leads to a transaction pooler.
MIGRATE_THROUGH_POOLER: Final = (
    "this URL leads to a transaction-mode pooler (two connections ran in one server session): "
    "migrations hold a session-level advisory lock and set lock_timeout for their session, and "
    "through the pooler other clients would share both; run `outbox migrate` with a URL that "
    "reaches PostgreSQL directly (see docs/pgbouncer.md)"
)


def migration_blocker(dsn: str) -> str | None:
    """Why migrations must not run through ``dsn`` (MIGRATE_THROUGH_POOLER), or None.

    For synchronous callers such as the CLI. An unreachable database gives None: the
    migration's own connection then reports it.
    """
    try:
        shared = asyncio.run(shares_server_sessions(dsn))
    except psycopg.OperationalError:
        return None
    return MIGRATE_THROUGH_POOLER if shared else None


async def answered_by_pooler(conn: psycopg.AsyncConnection[Any]) -> bool:
    """True if a pooler, not PostgreSQL, answered this connection's startup: the backend key it
    sent names another process than the one running our statements. (A plain TCP proxy passes
    PostgreSQL's key through, and is not taken for a pooler.)"""
    return await _server_pid(conn) != conn.info.backend_pid


async def _server_pid(conn: psycopg.AsyncConnection[Any]) -> int:
    row = await (await conn.execute(statements.SERVER_PID)).fetchone()
    if row is None:  # pragma: no cover (SELECT of a function always returns a row)
        raise psycopg.InterfaceError("pg_backend_pid() returned no row")
    return int(row[0])

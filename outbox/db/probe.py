"""Whether a writable primary answers, for readiness: a short probe every second on a connection
of its own (docs/design.md, "HTTP").

Not the pool's connections: a claim waits up to 30 s for one, so readiness that followed claims
answered 200 through most of an outage, and a failover's new primary went unnoticed until the
next claim. The probe asks on its own connection, within PROBE_TIMEOUT, and logs once per
transition where it lost or found the database (host and port, never the DSN).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Final

import psycopg
import structlog

from outbox import loops, metrics
from outbox.db import statements
from outbox.db.connect import connection_options

PROBE_INTERVAL: Final = 1.0
# Connect and ask within this: a primary that takes longer is not one to be ready on.
PROBE_TIMEOUT: Final = 2.0

log = structlog.get_logger("outbox.readiness")


class DatabaseProbe:
    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.ok = False  # a writable primary answered the last probe
        self._told: bool | None = None  # the state last logged: None before the first probe
        self._where: dict[str, Any] = {}  # host and port of the last connection made
        self._abandoned: set[asyncio.Future[Any]] = set()  # probes let go, until they end

    async def probe_once(self) -> bool:
        """Ask now; sets ``ok`` and outbox_database_up, and logs a transition."""
        # Not awaited directly: a query cancelled on a silent connection makes psycopg send a
        # cancel request and wait for it (seconds more) before the timeout is seen. The answer
        # is waited for PROBE_TIMEOUT at most; an unanswered probe is let go with its connection.
        asking = asyncio.ensure_future(self._ask())
        done, _ = await asyncio.wait({asking}, timeout=PROBE_TIMEOUT)
        where = self._where
        if not done:
            self._let_go(asking)
            ok, why = False, "TimeoutError"
        elif (exc := asking.exception()) is not None:
            if not isinstance(exc, psycopg.Error | OSError):
                raise exc
            await self._drop()
            ok, why = False, type(exc).__name__
        else:
            ok, why = asking.result(), "a standby (read-only)"
        self.ok = ok
        metrics.DATABASE_UP.set(1 if ok else 0)
        self._tell(ok, why, where)
        return ok

    def _let_go(self, asking: asyncio.Future[bool]) -> None:
        """An unanswered probe: cancelled, kept referenced until it ends, its connection closed
        then; the next probe connects afresh."""
        conn, self._conn = self._conn, None
        asking.cancel()
        self._abandoned.add(asking)

        def ended(_: object) -> None:
            self._abandoned.discard(asking)
            if conn is not None and not conn.closed:
                closing = asyncio.ensure_future(conn.close())
                self._abandoned.add(closing)
                closing.add_done_callback(self._abandoned.discard)

        asking.add_done_callback(ended)

    async def aclose(self) -> None:
        await self._drop()

    async def _ask(self) -> bool:
        conn = await self._connection()
        self._where = {"host": conn.info.host, "port": conn.info.port}
        row = await (await conn.execute(statements.PROBE_WRITABLE)).fetchone()
        return row is not None and not row[0]

    async def run_forever(self) -> None:
        async def round_() -> float:
            await self.probe_once()
            return PROBE_INTERVAL

        try:
            await loops.forever("readiness", round_)
        finally:
            await self._drop()

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            options = {
                "autocommit": True,
                "prepare_threshold": None,
                "connect_timeout": max(1, int(PROBE_TIMEOUT)),
                **connection_options(self._dsn, "outbox-readiness"),
            }
            self._conn = await psycopg.AsyncConnection.connect(self._dsn, **options)
        return self._conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    def _tell(self, ok: bool, why: str, where: dict[str, Any]) -> None:
        if ok == self._told:
            return
        if ok:
            log.info("database reachable: a writable primary answers", **where)
        elif self._told is not None:  # not at start-up: startup.py has said why it waits
            log.warning("database lost: no writable primary answers", error_class=why, **where)
        self._told = ok

"""Whether a writable primary answers, for readiness: a short probe every second on a connection
of its own (docs/design.md, "HTTP").

Not the pool's connections: a claim waits up to 30 s for one, so readiness that followed claims
answered 200 through most of an outage, and a failover's new primary went unnoticed until the
next claim. The probe asks on its own connection, within PROBE_TIMEOUT, and logs once per
transition where it lost or found the database (host and port, never the DSN, and the server's
system identifier and timeline). When those change between two answers, a failover put another
server behind the DSN: ``on_new_server`` is told, with the new server's clock, so that the
dispatcher takes back its own leases that the new server holds for calls it no longer makes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import psycopg
import structlog

from outbox.db import statements
from outbox.db.connect import connection_options
from outbox.observability import metrics
from outbox.runtime import loops

PROBE_INTERVAL: Final = 1.0
# Connect and ask within this: a primary that takes longer is not one to be ready on.
PROBE_TIMEOUT: Final = 2.0

log = structlog.get_logger("outbox.readiness")


@dataclass(frozen=True)
class Answer:
    """What one probe learnt: a writable primary or not, which server, and its clock."""

    writable: bool
    system_identifier: str | None
    timeline: int | None
    server_now: datetime

    @property
    def identity(self) -> tuple[str, int] | None:
        """Which server: unknown (None) where the identifier cannot be read."""
        if self.system_identifier is None or self.timeline is None:
            return None
        return (self.system_identifier, self.timeline)


async def _nobody(since: datetime) -> None:
    """The default ``on_new_server``: nobody needs to know."""


class DatabaseProbe:
    def __init__(
        self, dsn: str, on_new_server: Callable[[datetime], Awaitable[None]] = _nobody
    ) -> None:
        self._dsn = dsn
        self._on_new_server = on_new_server
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self.ok = False  # a writable primary answered the last probe
        self._told: bool | None = None  # the state last logged: None before the first probe
        self._where: dict[str, Any] = {}  # host and port of the last connection made
        self._identity: tuple[str, int] | None = None  # of the last writable primary seen
        self._abandoned: set[asyncio.Future[Any]] = set()  # probes let go, until they end

    async def probe_once(self) -> bool:
        """Ask now; sets ``ok`` and outbox_database_up, and logs a transition."""
        # Not awaited directly: a query cancelled on a silent connection makes psycopg send a
        # cancel request and wait for it (seconds more) before the timeout is seen. The answer
        # is waited for PROBE_TIMEOUT at most; an unanswered probe is let go with its connection.
        asking = asyncio.ensure_future(self._ask())
        done, _ = await asyncio.wait({asking}, timeout=PROBE_TIMEOUT)
        where = self._where
        answer: Answer | None = None
        if not done:
            self._let_go(asking)
            why = "TimeoutError"
        elif (exc := asking.exception()) is not None:
            if not isinstance(exc, psycopg.Error | OSError):
                raise exc
            await self._drop()
            why = type(exc).__name__
        else:
            answer, why = asking.result(), "a standby (read-only)"
        ok = answer is not None and answer.writable
        changed = answer is not None and ok and self._server_changed(answer, where)
        self.ok = ok
        metrics.DATABASE_UP.set(1 if ok else 0)
        self._tell(ok, why, where)
        if changed and answer is not None:
            # After readiness is told: taking back leases must not hold it red meanwhile.
            try:
                await self._on_new_server(answer.server_now)
            except Exception:  # noqa: BLE001 (readiness must outlive what the dispatcher does)
                loops.note("readiness")
        return ok

    def _server_changed(self, answer: Answer, where: dict[str, Any]) -> bool:
        """A writable primary that is not the one of before: say so once; True then."""
        seen, before = answer.identity, self._identity
        if seen is None:
            return False
        self._identity = seen
        if before is None or seen == before:
            return False
        log.warning(
            "database server changed: a failover, or another server behind the DSN",
            system_identifier=seen[0],
            timeline=seen[1],
            previous_system_identifier=before[0],
            previous_timeline=before[1],
            **where,
        )
        return True

    def _let_go(self, asking: asyncio.Future[Answer]) -> None:
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

    async def _ask(self) -> Answer:
        conn = await self._connection()
        self._where = {"host": conn.info.host, "port": conn.info.port}
        row = await (await conn.execute(statements.PROBE_SERVER)).fetchone()
        if row is None:
            raise psycopg.ProgrammingError("the probe's statement returned no row")
        in_recovery, system_identifier, timeline, server_now = row
        return Answer(not in_recovery, system_identifier, timeline, server_now)

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
        server = {}
        if self._identity is not None:
            server = {"system_identifier": self._identity[0], "timeline": self._identity[1]}
        if ok:
            log.info("database reachable: a writable primary answers", **where, **server)
        elif self._told is not None:  # not at start-up: startup.py has said why it waits
            log.warning(
                "database lost: no writable primary answers", error_class=why, **where, **server
            )
        self._told = ok

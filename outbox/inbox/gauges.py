"""The inbox's database-wide gauges, read every ``every`` seconds by whichever process runs
``watch`` (a worker's lifespan, say), through ``outbox.inbox_gauges()`` so that a worker's role
needs no table privilege. A handler that had figures and has none now reads 0, not its last.
``outbox_inbox_database_up`` says whether the last read succeeded: the alerts leave out a
process whose gauges are stale."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from outbox.inbox import meters, statements

log = structlog.get_logger("outbox.inbox")


async def refresh(pool: AsyncConnectionPool[Any], known: set[str]) -> None:
    """Read the gauges once; ``known`` keeps the handlers seen, to zero the ones gone."""
    async with pool.connection() as conn:
        rows = await (await conn.execute(statements.GAUGES)).fetchall()
    seen = set()
    for handler, in_progress, oldest, abandoned in rows:
        seen.add(handler)
        meters.IN_PROGRESS.labels(handler).set(in_progress)
        meters.OLDEST_IN_PROGRESS.labels(handler).set(float(oldest or 0))
        meters.ABANDONED.labels(handler).set(abandoned)
    for handler in known - seen:
        for gauge in (meters.IN_PROGRESS, meters.OLDEST_IN_PROGRESS, meters.ABANDONED):
            gauge.labels(handler).set(0)
    known |= seen


async def watch(pool: AsyncConnectionPool[Any], *, every: float = 15.0) -> None:
    """Refresh the gauges until cancelled; a failed read is logged and tried again next time."""
    known: set[str] = set()
    while True:
        try:
            await refresh(pool, known)
        except (psycopg.Error, PoolTimeout) as exc:
            meters.DATABASE_UP.set(0)
            log.warning("inbox gauges not read", error=type(exc).__name__)
        else:
            meters.DATABASE_UP.set(1)
        await asyncio.sleep(every)

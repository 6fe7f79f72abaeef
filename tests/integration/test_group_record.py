"""The group commit of records (outbox.db.group_record) against the real database: no record
waits for a later one to be written."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db.group_record import GroupRecorder
from outbox.db.store import Claimed, Record, Store
from tests.support.dispatch import enqueue_many, rows


class GatedStore(Store):
    """A Store whose record statements, once written, wait for a gate before they return: so
    that two writers can be made to finish at the same moment."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        super().__init__(pool)
        self.gate = asyncio.Event()
        self.waiting = 0
        self.two_waiting = asyncio.Event()

    async def record_many(self, recs: Sequence[Record]) -> set[tuple[int, int]]:
        written = await super().record_many(recs)
        self.waiting += 1
        if self.waiting == 2:
            self.two_waiting.set()
        await self.gate.wait()
        return written


def succeeded(row: Claimed) -> Record:
    return Record(
        id=row.id,
        lease_token=row.lease_token,
        attempt=row.attempts,
        worker="w",
        status=Status.SUCCEEDED,
        outcome="succeeded",
        sent=True,
        provider_ref=f"ref-{row.id}",
    )


async def test_a_record_queued_as_both_writers_finish_is_still_written(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 3)
    store = GatedStore(pool)
    first, second, third = sorted(await store.claim("w", 3, timedelta(seconds=30)))
    recorder = GroupRecorder(store, writers=2)

    async def record_then_another() -> tuple[bool, bool]:
        done = await recorder.record(succeeded(first))
        # Runs as soon as its own record is settled: both writers have stopped taking batches,
        # and their done-callbacks have not run yet.
        return done, await recorder.record(succeeded(third))

    caller = asyncio.create_task(record_then_another())
    await asyncio.sleep(0)  # the first writer takes the first record
    other = asyncio.create_task(recorder.record(succeeded(second)))  # the second writer
    await asyncio.wait_for(store.two_waiting.wait(), timeout=10)  # both written, both held
    store.gate.set()
    assert await asyncio.wait_for(caller, timeout=10) == (True, True)
    assert await other is True
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY status") == [
        ("succeeded", 3)
    ]
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(3,)]

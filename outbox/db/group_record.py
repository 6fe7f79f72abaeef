"""Group commit for records: outcomes that arrive while a write is under way go together, in one
statement, as soon as it ends.

At low load each record is written at once, alone, as before: nothing waits for a batch to
fill. Under load the statement in progress is the batching window, so a round trip carries
dozens of outcomes instead of one. Each caller still learns whether its own record was written
(the lease fence is per row) or gets the statement's error, and retries as it would alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Final

import psycopg

from outbox.db.store import Record, Store

# Large enough to amortise a round trip; small enough that one statement stays short and a
# failed batch costs its callers little.
MAX_BATCH: Final = 200
# Two statements in flight: one is being written while the next batch forms on the other.
WRITERS: Final = 2


class GroupRecorder:
    """Writes :class:`Record` outcomes through ``store``, many per statement under load."""

    def __init__(self, store: Store, *, max_batch: int = MAX_BATCH, writers: int = WRITERS) -> None:
        self._store = store
        self._max_batch = max_batch
        self._writers = writers
        self._queue: list[tuple[Record, asyncio.Future[bool]]] = []
        self._running: set[asyncio.Task[None]] = set()
        # Looked up once: get_running_loop makes a getpid system call on Python 3.11.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def record(self, rec: Record) -> bool:
        """True if recorded; False if the lease was lost. Raises the statement's error."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        self._queue.append((rec, future))
        if len(self._running) < self._writers:
            task = loop.create_task(self._drain(), name="outbox-record-writer")
            self._running.add(task)
            # _drain counts itself out as it stops; this covers a task cancelled before it ran.
            task.add_done_callback(self._running.discard)
        return await future

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                await self._write(batch)
        finally:
            # Out of the count the moment it stops taking batches, with no await between. Its
            # done-callback runs later: a record queued meanwhile found every writer counted,
            # started none, and waited for whatever record came next (at the end of a burst,
            # until its lease ran out and the operation was sent again).
            task = asyncio.current_task()
            if task is not None:
                self._running.discard(task)

    async def _write(self, batch: list[tuple[Record, asyncio.Future[bool]]]) -> None:
        try:
            try:
                written = await self._store.record_many([rec for rec, _ in batch])
            except psycopg.DataError:
                # One outcome cannot be stored as it is: write each alone, so only its caller
                # hears of it.
                for rec, future in batch:
                    await _settle(future, self._store.record(rec))
            except Exception as exc:  # noqa: BLE001 (handed to every caller, who decides)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
            else:
                for rec, future in batch:
                    if not future.done():
                        future.set_result((rec.id, rec.attempt) in written)
        finally:
            for _, future in batch:  # the writer was cancelled: its callers must not wait forever
                if not future.done():
                    future.cancel()


async def _settle(future: asyncio.Future[bool], write: Awaitable[bool]) -> None:
    try:
        result = await write
    except Exception as exc:  # noqa: BLE001 (handed to the caller)
        if not future.done():
            future.set_exception(exc)
    else:
        if not future.done():
            future.set_result(result)

"""The dispatch loop on its own, with an in-process provider that always succeeds."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import SendRequest, SendResult
from outbox.providers.noop import NoopProvider
from tests.support.dispatch import dispatcher, enqueue_many, rows, statuses


async def test_run_once_dispatches_a_batch_and_records_every_attempt(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 30, provider="fast")
    d = dispatcher(pool, {"fast": NoopProvider("fast", timedelta(hours=24))}, batch_size=20)
    assert await d.run_once() == 20
    assert await d.run_once() == 10
    assert await d.run_once() == 0
    assert statuses(db_url) == {"succeeded": 30}
    attempts = rows(
        db_url,
        "SELECT count(*), count(DISTINCT operation_id), bool_and(sent), "
        "min(outcome), max(attempt) FROM outbox.attempts",
    )
    assert attempts == [(30, 30, True, "succeeded", 1)]
    refs = rows(
        db_url,
        "SELECT count(*) FROM outbox.operations "
        "WHERE provider_ref = 'noop_' || id AND lease_token IS NULL "
        "AND first_sent_at IS NOT NULL AND finished_at IS NOT NULL",
    )
    assert refs == [(30,)]


class CountingProvider(NoopProvider):
    """Succeeds after a short pause, counting how many calls are under way at once."""

    def __init__(self) -> None:
        super().__init__("slow", timedelta(hours=24))
        self.now = self.peak = self.calls = 0

    async def send(self, request: SendRequest) -> SendResult:
        self.now += 1
        self.calls += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.01)
            return await super().send(request)
        finally:
            self.now -= 1


async def test_several_claim_loops_never_lease_more_than_concurrency(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 400, provider="slow")
    provider = CountingProvider()
    d = dispatcher(
        pool,
        {"slow": provider},
        concurrency=20,
        batch_size=5,
        poll_interval=timedelta(milliseconds=50),
    )
    assert d.claims.claimers() == 3
    runner = asyncio.create_task(d.run())
    for _ in range(600):
        if statuses(db_url) == {"succeeded": 400}:
            break
        await asyncio.sleep(0.05)
    d.request_stop()
    await asyncio.wait_for(runner, timeout=30)
    assert statuses(db_url) == {"succeeded": 400}
    assert provider.calls == 400  # each sent once
    assert 5 < provider.peak <= 20  # parallel, and never beyond concurrency
    assert rows(db_url, "SELECT count(*), max(attempt) FROM outbox.attempts") == [(400, 1)]

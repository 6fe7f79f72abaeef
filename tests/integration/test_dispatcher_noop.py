"""The dispatch loop on its own, with an in-process provider that always succeeds."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
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


async def test_several_claim_loops_never_call_more_than_concurrency(
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


SLOW_RECORDS = """
CREATE FUNCTION public.slow_record() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM pg_sleep(0.01); RETURN NEW; END $$;
CREATE TRIGGER slow_record BEFORE UPDATE ON outbox.operations FOR EACH ROW
WHEN (OLD.status = 'in_flight' AND NEW.status <> 'in_flight') EXECUTE FUNCTION public.slow_record();
"""


async def test_a_claim_overlaps_the_last_batchs_record_within_twice_concurrency(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """`concurrency` counts calls: rows whose call is over and whose outcome is being written
    free their slots, so the next claim need not wait for the record (ClaimScheduler.free). The
    leases a process holds stay within twice `concurrency` however slow the records are: here
    each row's record takes 10 ms in the database, a call 10 ms in the provider."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(SLOW_RECORDS)
    enqueue_many(db_url, 300, provider="slow")
    provider = CountingProvider()
    d = dispatcher(pool, {"slow": provider}, concurrency=20, batch_size=20)
    leased: list[int] = []
    runner = asyncio.create_task(d.run())
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as watch:
        for _ in range(1500):
            cur = await watch.execute(
                "SELECT count(*) FILTER (WHERE status = 'in_flight'), "
                "count(*) FILTER (WHERE status = 'succeeded') FROM outbox.operations"
            )
            in_flight, done = await cur.fetchone() or (0, 0)
            leased.append(in_flight)
            if done == 300:
                break
            await asyncio.sleep(0.01)
    d.request_stop()
    await asyncio.wait_for(runner, timeout=30)
    assert statuses(db_url) == {"succeeded": 300}
    assert provider.calls == 300  # each sent once
    assert 5 < provider.peak <= 20  # calls: never beyond concurrency
    assert max(leased) <= 40  # leases: never beyond twice concurrency
    # A claim went out while a batch was still being recorded.
    assert max(leased) > 20

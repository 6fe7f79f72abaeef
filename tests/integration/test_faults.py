"""Real faults under the dispatcher: locks held by a migration, and connections cut under it.
Each test counts rows and provider effects afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.db.connect import dispatcher_pool
from outbox.observability import metrics
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, enqueue_many, statuses


@pytest.fixture
async def run_pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """The pool exactly as `outbox run` builds it (session limits included)."""
    pool = dispatcher_pool(db_url, max_size=4)
    await pool.open(wait=True)
    yield pool
    await pool.close()


async def test_a_migration_holding_the_table_makes_claims_fail_fast_and_lease_nothing(
    db_url: str,
    run_pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    enqueue_many(db_url, 5)
    d = dispatcher(run_pool, {"hook": hook})
    errors_before = metrics.DB_ERRORS.labels("claim")._value.get()
    with psycopg.connect(db_url) as migration:
        migration.execute("LOCK TABLE outbox.operations IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        assert await asyncio.wait_for(d.run_once(), timeout=20) == 0
        waited = time.monotonic() - started
        assert not d.database_ok
        migration.rollback()
    assert waited < 10  # the session's lock_timeout (2 s) plus the claim's back-off
    assert metrics.DB_ERRORS.labels("claim")._value.get() == errors_before + 1
    assert statuses(db_url) == {"pending": 5}
    assert len(receiver.received) == 0
    assert await d.run_once() == 5  # the lock is gone: dispatch resumes
    assert statuses(db_url) == {"succeeded": 5}
    assert receiver.effect_count() == 5


async def test_every_dispatcher_connection_carries_the_session_limits(
    run_pool: AsyncConnectionPool[Any],
) -> None:
    async with run_pool.connection() as conn:
        cur = await conn.execute(
            "SELECT current_setting('lock_timeout'), current_setting('statement_timeout'), "
            "current_setting('idle_in_transaction_session_timeout'), "
            "current_setting('jit'), current_setting('plan_cache_mode')"
        )
        assert await cur.fetchone() == ("2s", "30s", "1min", "off", "force_generic_plan")


async def test_a_claim_cut_off_while_it_waits_is_rolled_back_and_leases_nothing(
    db_url: str, receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    from tests.support.tcp_proxy import TcpProxy  # noqa: PLC0415

    enqueue_many(db_url, 4)
    with TcpProxy(db_url) as proxy:
        pool = dispatcher_pool(proxy.dsn, max_size=2)
        await pool.open(wait=True)
        try:
            d = dispatcher(pool, {"hook": hook})
            with psycopg.connect(db_url) as migration:
                migration.execute("LOCK TABLE outbox.operations IN SHARE MODE")
                claim = asyncio.create_task(d.run_once())
                await asyncio.sleep(0.3)  # the claim waits on the lock
                proxy.cut()  # the dispatcher's connection dies mid-statement
                # Released before the claim's lock_timeout (2 s) could end it: only the server's
                # client check (1 s) stops the claim from committing for a vanished worker.
                await asyncio.sleep(1.5)
                migration.rollback()
            assert await asyncio.wait_for(claim, timeout=20) == 0
        finally:
            await pool.close()
    await asyncio.sleep(0.5)
    assert statuses(db_url) == {"pending": 4}  # rolled back: nothing leased to a dead worker
    assert len(receiver.received) == 0

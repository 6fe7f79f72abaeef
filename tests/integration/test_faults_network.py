"""The network between the dispatcher and PostgreSQL fails under it, through a TCP proxy: the
answer to a record's commit is lost, the record itself is lost, the database goes silent. Each test
counts rows and the receiver's effects afterwards."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.daemon import wakeup
from outbox.db import store
from outbox.db.connect import dispatcher_pool
from outbox.db.store import STATEMENT_DEADLINE
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, enqueue_many, key_of, rows, statuses
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow


@pytest.fixture
async def proxy(db_url: str) -> AsyncIterator[TcpProxy]:
    with TcpProxy(db_url) as proxy:
        yield proxy


@pytest.fixture
async def proxied_pool(proxy: TcpProxy) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """The pool exactly as `outbox run` builds it, through the proxy."""
    pool = dispatcher_pool(proxy.dsn, max_size=4)
    await pool.open(wait=True)
    yield pool
    await pool.close()


async def eventually(predicate: Any, *, within: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails the test after ``within`` seconds."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > within:
            raise AssertionError(f"timed out after {within}s waiting for {what}")
        await asyncio.sleep(0.05)
    return time.monotonic() - started


def attempts_recorded(url: str) -> int:
    ((count,),) = rows(url, "SELECT count(*) FROM outbox.attempts")
    return int(count)


@pytest.mark.parametrize(
    "lost",
    ["down", "up"],
    ids=["the-commit-answer-is-lost", "the-record-never-arrives"],
)
async def test_a_record_cut_off_at_its_commit_is_stored_once_and_never_sent_twice(
    db_url: str,
    proxy: TcpProxy,
    proxied_pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    lost: str,
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    d = dispatcher(proxied_pool, {"hook": hook}, lease=timedelta(seconds=30))
    with receiver.hold(key) as held:
        run = asyncio.create_task(d.run_once())
        assert await asyncio.to_thread(held.arrived.wait, 10)
        # The provider has applied the effect; the record that follows crosses a broken link.
        proxy.mute(lost)
    if lost == "down":  # the server commits the record; the dispatcher never hears of it
        await eventually(
            lambda: attempts_recorded(db_url) == 1, within=10, what="the record to commit"
        )
    else:
        await asyncio.sleep(0.5)
        assert attempts_recorded(db_url) == 0
    proxy.cut()
    proxy.heal()
    assert await asyncio.wait_for(run, timeout=60) == 1
    ((status, ref, attempts),) = rows(
        db_url, "SELECT status, provider_ref, attempts FROM outbox.operations"
    )
    assert (status, attempts) == ("succeeded", 1)
    assert ref is not None  # never succeeded without the provider's reference
    assert attempts_recorded(db_url) == 1
    assert receiver.effect_count(key) == 1
    assert len(receiver.received) == 1  # recorded, or confirmed recorded: not sent again


# The statement deadline in this test, in place of store.STATEMENT_DEADLINE (35 s): the wait for
# it is the deadline itself, which the test adds back, plus what follows it (psycopg's attempt to
# cancel, the connection dropped), which is what it measures.
SHORT_DEADLINE = 3.0


async def test_a_silent_database_is_noticed_within_a_minute_and_dispatch_resumes(
    db_url: str,
    proxy: TcpProxy,
    proxied_pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store, "STATEMENT_DEADLINE", SHORT_DEADLINE)
    d = dispatcher(proxied_pool, {"hook": hook}, poll_interval=timedelta(milliseconds=200))
    runner = asyncio.create_task(d.run())
    listening: list[bool] = []
    listener = asyncio.create_task(
        wakeup.listen_forever(proxy.dsn, d.wake, probe_interval=1.0, on_listening=listening.append)
    )
    try:
        enqueue_many(db_url, 3, prefix="before")
        await eventually(
            lambda: statuses(db_url) == {"succeeded": 3}, within=15, what="the first operations"
        )
        await eventually(lambda: listening == [True], within=15, what="LISTEN")
        # Every relayed connection stays open and is acknowledged by the kernel, so keepalives
        # and tcp_user_timeout see nothing wrong: only our own deadlines can end the wait.
        proxy.deafen()
        enqueue_many(db_url, 3, prefix="during")
        noticed = await eventually(
            lambda: not d.database_ok, within=90, what="the dispatcher to notice"
        )
        assert noticed >= SHORT_DEADLINE  # the deadline, not something sooner, noticed it
        # With the real deadline: under a minute.
        assert noticed - SHORT_DEADLINE + STATEMENT_DEADLINE < 60, noticed
        await eventually(
            lambda: listening[-1:] == [False],
            within=60,
            what="the LISTEN connection's probe to give up",
        )
        assert statuses(db_url) == {"succeeded": 3, "pending": 3}
        proxy.heal()
        await eventually(
            lambda: statuses(db_url) == {"succeeded": 6}, within=60, what="dispatch to resume"
        )
        assert d.database_ok
        await eventually(lambda: listening[-1:] == [True], within=30, what="LISTEN to come back")
    finally:
        listener.cancel()
        d.request_stop()
        await asyncio.wait_for(runner, timeout=60)
    assert receiver.effect_count() == 6
    assert len(receiver.received) == 6

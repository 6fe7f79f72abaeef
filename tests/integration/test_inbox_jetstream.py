"""The inbox behind a NATS JetStream consumer (issue 40), on the machine's NATS server: the
shared workload (tests/support/inbox_queues.py) of copies, a conflict, refusals and a tenantless
message settles as ten invoices with nothing left pending or unacknowledged; a failing handler's
message comes again and converges."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Inbox
from outbox.inbox.jetstream import consume, consumer_of
from outbox.inbox.queues import Consumer
from tests.support.inbox_queues import COPIES, assert_copies_settled, create_invoice, failing, pool
from tests.support.invoice_worker import count
from tests.support.queue_beds import memory_stream
from tests.support.queues import require_service

__all__ = ["pool"]  # the fixture, used by name
URL = "nats://127.0.0.1:4222"


@pytest.fixture(autouse=True)
def _nats() -> None:
    require_service("NATS", 4222, "see .ci/run")


@pytest.fixture
async def stream() -> AsyncIterator[tuple[Any, str, str]]:
    async with memory_stream("inbox.test") as made:
        yield made


async def drain(js: Any, name: str, consumer: Consumer, within: float = 30) -> Any:
    """Two consumers of one durable until it has nothing pending and nothing unacknowledged;
    the consumer's info then. No Nats-Msg-Id is published: JetStream keeps every copy."""
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            consume(js, consumer, stream=name, durable="workers", stop=stop, ack_wait=5)
        )
        for _ in range(2)
    ]
    try:
        for _ in range(int(within / 0.2)):
            await asyncio.sleep(0.2)
            info = await js.consumer_info(name, "workers")
            if info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq:
                return info
        raise AssertionError(f"not drained: {info}")
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_copies_conflicts_and_refusals_settle_once_each(
    db_url: str, pool: AsyncConnectionPool[Any], stream: tuple[Any, str, str]
) -> None:
    js, name, subject = stream
    for body, headers in COPIES:
        await js.publish(subject, json.dumps(body).encode(), headers=headers)
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)
    info = await drain(js, name, consumer, within=10)
    assert info.num_pending == 0 and info.num_ack_pending == 0
    assert_copies_settled(db_url)


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], stream: tuple[Any, str, str]
) -> None:
    js, name, subject = stream
    handle, left = failing(2)
    body, headers = COPIES[0]
    await js.publish(subject, json.dumps(body).encode(), headers=headers)
    info = await drain(
        js, name, consumer_of(Inbox(pool), "invoice.create", handle, retry_after=0.1)
    )
    assert left["left"] == 0
    assert info.delivered.consumer_seq >= 3  # delivered, given back twice, delivered again
    assert count(db_url, "SELECT count(*) FROM invoices") == 1

"""The inbox behind a RabbitMQ consumer (issue 40), on the machine's RabbitMQ: the shared
workload (tests/support/inbox_queues.py) settles as ten invoices, and the four messages that can
never succeed are rejected into the dead-letter queue, never requeued; a failing handler's
message is requeued and converges."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aio_pika
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Inbox
from outbox.inbox.queues import Consumer
from outbox.inbox.rabbitmq import consume, consumer_of
from tests.support.inbox_queues import (
    COPIES,
    assert_copies_settled,
    create_invoice,
    failing,
    final,
    pool,
)
from tests.support.invoice_worker import count
from tests.support.queues import require_service

__all__ = ["pool"]  # the fixture, used by name
URL = "amqp://guest:guest@127.0.0.1:5672/"


@pytest.fixture(autouse=True)
def _rabbitmq() -> None:
    require_service("RabbitMQ", 5672, "see .ci/run")


@pytest.fixture
async def queues() -> AsyncIterator[tuple[Any, str, str]]:
    """A queue that dead-letters into a queue of its own; both deleted after."""
    name = f"inbox-test-{uuid.uuid4().hex[:10]}"
    dead = f"{name}-dead"
    connection = await aio_pika.connect_robust(URL)
    channel = await connection.channel()
    await channel.declare_queue(dead, auto_delete=False)
    arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead}
    await channel.declare_queue(name, auto_delete=False, arguments=arguments)
    try:
        yield connection, name, dead
    finally:
        for queue in (name, dead):
            await channel.queue_delete(queue)
        await connection.close()


async def publish(connection: Any, queue: str, body: object, headers: dict[str, Any]) -> None:
    # aio-pika gives every message a message_id of its own: a key for redeliveries only.
    channel = await connection.channel()
    message = aio_pika.Message(json.dumps(body).encode(), headers=headers)
    await channel.default_exchange.publish(message, routing_key=queue)
    await channel.close()


async def held(connection: Any, queue: str) -> int:
    channel = await connection.channel()
    declared = await channel.declare_queue(queue, passive=True)
    await channel.close()
    return int(declared.declaration_result.message_count or 0)


async def run_consumers(
    connection: Any, name: str, consumer: Consumer, settled: Callable[[], Awaitable[bool]]
) -> None:
    """Two consumers on channels of their own until ``settled()`` holds (at most 20 s)."""
    stop = asyncio.Event()
    tasks = []
    for _ in range(2):
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=8)
        queue = await channel.get_queue(name)
        tasks.append(asyncio.create_task(consume(queue, consumer, stop=stop)))
    try:
        for _ in range(100):
            await asyncio.sleep(0.2)
            if await settled():
                break
        else:
            raise AssertionError("not settled")
        await asyncio.sleep(0.5)  # a message requeued by mistake would be back by now
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_copies_conflicts_and_refusals_settle_once_each(
    db_url: str, pool: AsyncConnectionPool[Any], queues: tuple[Any, str, str]
) -> None:
    connection, name, dead = queues
    for body, headers in COPIES:
        await publish(connection, name, body, headers)
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)

    async def settled() -> bool:
        return await held(connection, dead) >= final(db_url) and await held(connection, name) == 0

    await run_consumers(connection, name, consumer, settled)
    assert (await held(connection, name), await held(connection, dead)) == (0, final(db_url))
    assert_copies_settled(db_url)


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], queues: tuple[Any, str, str]
) -> None:
    connection, name, dead = queues
    handle, left = failing(2)
    await publish(connection, name, *COPIES[0])

    async def settled() -> bool:
        return count(db_url, "SELECT count(*) FROM invoices") == 1

    consumer = consumer_of(Inbox(pool), "invoice.create", handle, retry_after=0.1)
    await run_consumers(connection, name, consumer, settled)
    assert left["left"] == 0
    assert (await held(connection, name), await held(connection, dead)) == (0, 0)

"""The inbox behind a RabbitMQ consumer (issue 40), on the machine's RabbitMQ: copies of one
message make one invoice; a conflict, a refusal and a keyless message are rejected into the
dead-letter queue, never requeued; a failing handler's message is requeued and converges.
Counted in invoices, records and the messages each queue holds afterwards."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Delivery, Inbox, Refuse
from outbox.inbox.queues import Consumer
from outbox.inbox.rabbitmq import consume, consumer_of
from tests.support.invoice_worker import count
from tests.support.queues import require_service

URL = "amqp://guest:guest@127.0.0.1:5672/"
INSERT = "INSERT INTO invoices (tenant_id, account_id, amount) VALUES (%s, %s, %s)"


@pytest.fixture(autouse=True)
def _rabbitmq() -> None:
    require_service("RabbitMQ", 5672, "see .ci/run")


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE invoices (id serial, tenant_id text, account_id text, amount bigint)"
        )
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


@pytest.fixture
async def queues() -> AsyncIterator[tuple[aio_pika.abc.AbstractRobustConnection, str, str]]:
    """A queue that dead-letters into a queue of its own; both deleted after."""
    name = f"inbox-test-{uuid.uuid4().hex[:10]}"
    dead = f"{name}-dead"
    connection = await aio_pika.connect_robust(URL)
    channel = await connection.channel()
    await channel.declare_queue(dead, auto_delete=False)
    await channel.declare_queue(
        name,
        auto_delete=False,
        arguments={"x-dead-letter-exchange": "", "x-dead-letter-routing-key": dead},
    )
    try:
        yield connection, name, dead
    finally:
        for queue in (name, dead):
            await channel.queue_delete(queue)
        await connection.close()


async def create_invoice(d: Delivery, body: bytes) -> None:
    invoice = json.loads(body)
    assert d.conn is not None
    await d.conn.execute(INSERT, (d.identity.tenant_id, invoice["account_id"], invoice["amount"]))
    if invoice["amount"] <= 0:  # refused after a write: the refusal must undo it
        raise Refuse("amount must be positive")
    await asyncio.sleep(0.05)


async def publish(connection: Any, queue: str, body: object, headers: dict[str, Any]) -> None:
    channel = await connection.channel()
    message = aio_pika.Message(json.dumps(body).encode(), headers=headers)
    await channel.default_exchange.publish(message, routing_key=queue)
    await channel.close()


def outbox_headers(operation: int) -> dict[str, Any]:
    return {"Outbox-Operation-Id": str(operation), "Outbox-Tenant-Id": "acme"}


async def held(connection: Any, queue: str) -> int:
    channel = await connection.channel()
    declared = await channel.declare_queue(queue, passive=True)
    await channel.close()
    return int(declared.declaration_result.message_count or 0)


async def run_consumers(connection: Any, name: str, consumer: Consumer, settled: Any) -> None:
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
    body = {"account_id": "a", "amount": 100}
    for op in range(10):
        for _ in range(3):
            await publish(connection, name, body, outbox_headers(op))
    await publish(connection, name, {**body, "amount": 7}, outbox_headers(3))
    for _ in range(2):
        await publish(connection, name, {**body, "amount": -1}, outbox_headers(50))
    # No tenant (aio-pika gives every message a message_id of its own: a key, for redeliveries).
    await publish(connection, name, body, {"Outbox-Operation-Id": "60"})
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)

    async def settled() -> bool:
        return await held(connection, dead) >= 4 and await held(connection, name) == 0

    await run_consumers(connection, name, consumer, settled)
    assert await held(connection, name) == 0
    assert await held(connection, dead) == 4  # the conflict, both refusals, the tenantless one
    assert count(db_url, "SELECT count(*) FROM invoices") == 10
    assert count(db_url, "SELECT count(*) FROM invoices WHERE amount = 100") == 10
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], queues: tuple[Any, str, str]
) -> None:
    connection, name, dead = queues
    failures = {"left": 2}

    async def flaky(d: Delivery, body: bytes) -> None:
        await create_invoice(d, body)
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("the handler's bug")

    await publish(connection, name, {"account_id": "a", "amount": 5}, outbox_headers(1))
    consumer = consumer_of(Inbox(pool), "invoice.create", flaky, retry_after=0.1)

    async def settled() -> bool:
        return count(db_url, "SELECT count(*) FROM invoices") == 1

    await run_consumers(connection, name, consumer, settled)
    assert failures["left"] == 0
    assert (await held(connection, name), await held(connection, dead)) == (0, 0)
    assert count(db_url, "SELECT count(*) FROM invoices") == 1

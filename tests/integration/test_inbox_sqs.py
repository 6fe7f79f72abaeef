"""The inbox behind an SQS consumer (issue 40), against moto's server: copies of one message make
one invoice; a conflict, a refusal and a tenantless message go to the dead-letter queue and
leave the queue; a failing handler's message comes back after its visibility and converges.
Counted in invoices, records and the messages each queue holds afterwards. moto stands for SQS
here as in the provider's tests (docs/providers.md, "Amazon SQS")."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from aiobotocore.session import get_session
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Delivery, Inbox, Refuse
from outbox.inbox.queues import Consumer
from outbox.inbox.sqs import consume, consumer_of
from tests.support.invoice_worker import count
from tests.support.moto_server import REGION, MotoServer, aws_env, moto

__all__ = ["aws_env", "moto"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("aws_env")
INSERT = "INSERT INTO invoices (tenant_id, account_id, amount) VALUES (%s, %s, %s)"


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE invoices (id serial, tenant_id text, account_id text, amount bigint)"
        )
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


@pytest.fixture
async def sqs(moto: MotoServer) -> AsyncIterator[tuple[Any, str, str]]:
    name = f"inbox-{uuid.uuid4().hex[:10]}"
    async with get_session().create_client(
        "sqs", region_name=REGION, endpoint_url=moto.url
    ) as client:
        queue = (await client.create_queue(QueueName=name))["QueueUrl"]
        dead = (await client.create_queue(QueueName=f"{name}-dead"))["QueueUrl"]
        yield client, queue, dead


async def create_invoice(d: Delivery, body: bytes) -> None:
    invoice = json.loads(body)
    assert d.conn is not None
    await d.conn.execute(INSERT, (d.identity.tenant_id, invoice["account_id"], invoice["amount"]))
    if invoice["amount"] <= 0:  # refused after a write: the refusal must undo it
        raise Refuse("amount must be positive")
    await asyncio.sleep(0.05)


async def send(client: Any, queue: str, body: object, attributes: dict[str, str]) -> None:
    await client.send_message(
        QueueUrl=queue,
        MessageBody=json.dumps(body),
        MessageAttributes={
            k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()
        },
    )


def outbox_attributes(operation: int) -> dict[str, str]:
    return {"Outbox-Operation-Id": str(operation), "Outbox-Tenant-Id": "acme"}


async def held(client: Any, queue: str) -> int:
    """Messages in the queue, visible or not (moto counts them exactly)."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    found = await client.get_queue_attributes(QueueUrl=queue, AttributeNames=names)
    return sum(int(found["Attributes"][n]) for n in names)


async def run_consumers(
    client: Any, queue: str, dead: str, consumer: Consumer, settled: Any
) -> None:
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(consume(client, queue, consumer, stop=stop, dead_letter_url=dead))
        for _ in range(2)
    ]
    try:
        for _ in range(100):
            await asyncio.sleep(0.2)
            if await settled():
                break
        else:
            raise AssertionError("not settled")
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_copies_conflicts_and_refusals_settle_once_each(
    db_url: str, pool: AsyncConnectionPool[Any], sqs: tuple[Any, str, str]
) -> None:
    client, queue, dead = sqs
    body = {"account_id": "a", "amount": 100}
    for op in range(10):
        for _ in range(3):
            await send(client, queue, body, outbox_attributes(op))
    await send(client, queue, {**body, "amount": 7}, outbox_attributes(3))
    for _ in range(2):
        await send(client, queue, {**body, "amount": -1}, outbox_attributes(50))
    await send(client, queue, body, {"Outbox-Operation-Id": "60"})  # no tenant
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)

    async def settled() -> bool:
        return await held(client, queue) == 0 and await held(client, dead) >= 4

    await run_consumers(client, queue, dead, consumer, settled)
    assert (await held(client, queue), await held(client, dead)) == (0, 4)
    assert count(db_url, "SELECT count(*) FROM invoices") == 10
    assert count(db_url, "SELECT count(*) FROM invoices WHERE amount = 100") == 10
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], sqs: tuple[Any, str, str]
) -> None:
    client, queue, dead = sqs
    failures = {"left": 2}

    async def flaky(d: Delivery, body: bytes) -> None:
        await create_invoice(d, body)
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("the handler's bug")

    await send(client, queue, {"account_id": "a", "amount": 5}, outbox_attributes(1))
    consumer = consumer_of(Inbox(pool), "invoice.create", flaky, retry_after=0.1)

    async def settled() -> bool:
        return await held(client, queue) == 0

    await run_consumers(client, queue, dead, consumer, settled)
    assert failures["left"] == 0
    assert await held(client, dead) == 0
    assert count(db_url, "SELECT count(*) FROM invoices") == 1

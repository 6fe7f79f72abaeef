"""The inbox behind an SQS consumer (issue 40), against moto's server: the shared workload
(tests/support/inbox_queues.py) settles as ten invoices, and the four messages that can never
succeed go to the dead-letter queue and leave the queue; a failing handler's message comes back
after its visibility and converges. moto stands for SQS here as in the provider's tests
(docs/providers.md, "Amazon SQS")."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiobotocore.session import get_session
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Inbox
from outbox.inbox.queues import Consumer
from outbox.inbox.sqs import consume, consumer_of
from tests.support.inbox_queues import (
    COPIES,
    assert_copies_settled,
    create_invoice,
    failing,
    final,
    pool,
)
from tests.support.invoice_worker import count
from tests.support.moto_server import REGION, MotoServer, aws_env, moto

__all__ = ["aws_env", "moto", "pool"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("aws_env")


@pytest.fixture
async def sqs(moto: MotoServer) -> AsyncIterator[tuple[Any, str, str]]:
    name = f"inbox-{uuid.uuid4().hex[:10]}"
    session = get_session()
    async with session.create_client("sqs", region_name=REGION, endpoint_url=moto.url) as client:
        queue = (await client.create_queue(QueueName=name))["QueueUrl"]
        dead = (await client.create_queue(QueueName=f"{name}-dead"))["QueueUrl"]
        yield client, queue, dead


async def send(client: Any, queue: str, body: object, attributes: dict[str, str]) -> None:
    attributes_of = {k: {"DataType": "String", "StringValue": v} for k, v in attributes.items()}
    await client.send_message(
        QueueUrl=queue, MessageBody=json.dumps(body), MessageAttributes=attributes_of
    )


async def held(client: Any, queue: str) -> int:
    """Messages in the queue, visible or not (moto counts them exactly)."""
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    found = await client.get_queue_attributes(QueueUrl=queue, AttributeNames=names)
    return sum(int(found["Attributes"][n]) for n in names)


async def run_consumers(
    client: Any, queue: str, dead: str, consumer: Consumer, settled: Callable[[], Awaitable[bool]]
) -> None:
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(consume(client, queue, consumer, stop=stop, dead_letter_url=dead))
        for _ in range(2)
    ]
    # A deadline, not a count of polls: moto answers slowly on a loaded machine (20 s once ran
    # out there), and a settled queue returns at the first poll that sees it.
    deadline = asyncio.get_running_loop().time() + 60
    try:
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.2)
            if await settled():
                return
        raise AssertionError("not settled within 60 s")
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_copies_conflicts_and_refusals_settle_once_each(
    db_url: str, pool: AsyncConnectionPool[Any], sqs: tuple[Any, str, str]
) -> None:
    client, queue, dead = sqs
    for body, attributes in COPIES:
        await send(client, queue, body, attributes)
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)

    async def settled() -> bool:
        return await held(client, queue) == 0 and await held(client, dead) >= final(db_url)

    await run_consumers(client, queue, dead, consumer, settled)
    assert (await held(client, queue), await held(client, dead)) == (0, final(db_url))
    assert_copies_settled(db_url)


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], sqs: tuple[Any, str, str]
) -> None:
    client, queue, dead = sqs
    handle, left = failing(2)
    await send(client, queue, *COPIES[0])

    async def settled() -> bool:
        return await held(client, queue) == 0

    consumer = consumer_of(Inbox(pool), "invoice.create", handle, retry_after=0.1)
    await run_consumers(client, queue, dead, consumer, settled)
    assert left["left"] == 0
    assert await held(client, dead) == 0
    assert count(db_url, "SELECT count(*) FROM invoices") == 1

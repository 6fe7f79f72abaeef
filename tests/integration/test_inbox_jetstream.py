"""The inbox behind a NATS JetStream consumer (issue 40), on the machine's NATS server: copies of
one message at once make one invoice, a conflict and a malformed message are terminated, a
failing handler's message comes again and converges. Counted in invoices, records and the
consumer's own numbers: nothing left unacknowledged, nothing redelivered for ever."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import psycopg
import pytest
from nats.js.api import StorageType, StreamConfig
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Delivery, Inbox, Refuse
from outbox.inbox.jetstream import consume, consumer_of
from tests.support.invoice_worker import count
from tests.support.queues import require_service

URL = "nats://127.0.0.1:4222"
INSERT = "INSERT INTO invoices (tenant_id, account_id, amount) VALUES (%s, %s, %s)"


@pytest.fixture(autouse=True)
def _nats() -> None:
    require_service("NATS", 4222, "see .ci/run")


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE invoices (id serial, tenant_id text, account_id text, amount bigint)"
        )
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


@pytest.fixture
async def stream() -> AsyncIterator[tuple[Any, str, str]]:
    suffix = uuid.uuid4().hex[:10]
    name, subject = f"INBOX_TEST_{suffix}", f"inbox.test.{suffix}"
    nc = await nats.connect(URL)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.MEMORY))
    try:
        yield js, name, subject
    finally:
        await js.delete_stream(name)
        await nc.close()


async def create_invoice(d: Delivery, body: bytes) -> None:
    invoice = json.loads(body)
    assert d.conn is not None
    await d.conn.execute(INSERT, (d.identity.tenant_id, invoice["account_id"], invoice["amount"]))
    if invoice["amount"] <= 0:  # refused after a write: the refusal must undo it
        raise Refuse("amount must be positive")
    await asyncio.sleep(0.05)  # in its transaction a while: copies arrive meanwhile


def headers(operation: int, tenant: str = "acme") -> dict[str, str]:
    return {"Outbox-Operation-Id": str(operation), "Outbox-Tenant-Id": tenant}


async def drain(js: Any, name: str, consumer: Any, durable: str, within: float = 30) -> None:
    """Two consumers of one durable until it has nothing pending and nothing unacknowledged."""
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(
            consume(js, consumer, stream=name, durable=durable, stop=stop, ack_wait=5)
        )
        for _ in range(2)
    ]
    try:
        for _ in range(int(within / 0.2)):
            await asyncio.sleep(0.2)
            info = await js.consumer_info(name, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq:
                break
        else:
            raise AssertionError(f"not drained: {info}")
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_copies_conflicts_and_refusals_settle_once_each(
    db_url: str, pool: AsyncConnectionPool[Any], stream: tuple[Any, str, str]
) -> None:
    js, name, subject = stream
    body = {"account_id": "a", "amount": 100}
    for op in range(10):  # three copies of each, with no Nats-Msg-Id: JetStream keeps all three
        for _ in range(3):
            await js.publish(subject, json.dumps(body).encode(), headers=headers(op))
    await js.publish(subject, json.dumps({**body, "amount": 7}).encode(), headers=headers(3))
    await js.publish(subject, json.dumps({**body, "amount": -1}).encode(), headers=headers(50))
    await js.publish(subject, json.dumps({**body, "amount": -1}).encode(), headers=headers(50))
    await js.publish(subject, b"{}", headers={"Outbox-Tenant-Id": "acme"})  # no key at all
    consumer = consumer_of(Inbox(pool), "invoice.create", create_invoice, retry_after=0.2)
    await drain(js, name, consumer, "workers", within=10)
    info = await js.consumer_info(name, "workers")
    assert info.num_pending == 0 and info.num_ack_pending == 0
    assert count(db_url, "SELECT count(*) FROM invoices") == 10
    assert count(db_url, "SELECT count(*) FROM invoices WHERE amount = 100") == 10
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 200") == 10
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1
    assert count(db_url, "SELECT sum(seen) FROM outbox.inbox_conflicts") == 1


async def test_a_failing_handler_gets_its_message_again_and_converges(
    db_url: str, pool: AsyncConnectionPool[Any], stream: tuple[Any, str, str]
) -> None:
    js, name, subject = stream
    failures = {"left": 2}

    async def flaky(d: Delivery, body: bytes) -> None:
        await create_invoice(d, body)  # written, then undone by the raise
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("the handler's bug")

    await js.publish(
        subject, json.dumps({"account_id": "a", "amount": 5}).encode(), headers=headers(1)
    )
    consumer = consumer_of(Inbox(pool), "invoice.create", flaky, retry_after=0.1)
    await drain(js, name, consumer, "workers")
    info = await js.consumer_info(name, "workers")
    assert failures["left"] == 0
    assert info.delivered.consumer_seq >= 3  # delivered, given back twice, delivered again
    assert info.num_ack_pending == 0
    assert count(db_url, "SELECT count(*) FROM invoices") == 1

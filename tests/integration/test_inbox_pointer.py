"""The key at a JSON pointer in the body (``KeyFrom.json_pointer``), through InboxMiddleware and
through a NATS JetStream consumer, on the test's PostgreSQL (issue 40): copies of one event,
however spelled, make one invoice; a body that gives no key is a 400 or a message dropped with
its reason, never a crash and never a record; so is a tenant header that is not
percent-encoded UTF-8, after which the consumer goes on."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, Final

import httpx
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from outbox.inbox import Inbox, InboxMiddleware, KeyFrom, delivery
from outbox.inbox.jetstream import consume, consumer_of
from tests.support.inbox_queues import INSERT, create_invoice, pool
from tests.support.invoice_worker import count
from tests.support.queue_beds import memory_stream

__all__ = ["pool"]  # the fixture, used by name
NATS: Final = "nats://127.0.0.1:4222"
EVENT: Final = {"event": {"id": "evt_1", "type": "invoice.created"}, "account_id": "a", "amount": 5}
INVOICES: Final = "SELECT count(*) FROM invoices"
RECORDS: Final = "SELECT count(*) FROM outbox.inbox"
# Bodies that give no key at /event/id, each with the start of the 400's detail.
NO_KEY: Final = [
    (b'{"account_id": "a", "amount": 5}', "the body has nothing at /event/id"),
    (b'{"event": {"id": 7}}', "the body's /event/id is a number, not a string"),
    (b'{"event": {"id": ["evt_1"]}}', "the body's /event/id is an array, not a string"),
    (b'{"event": {"id": "evt_1"}', "the body is not JSON"),
    (b'{"event": {"id": "\\u0000"}}', "the body's /event/id holds a control"),
    (b'{"event": {"id": "\\ud800"}}', "the body's /event/id holds a control"),
    (json.dumps({"event": {"id": "e" * 509}}).encode(), "the body's /event/id is longer than"),
]


def worker(inbox: Inbox) -> InboxMiddleware:
    async def create(request: Request) -> Response:
        d, invoice = delivery(request), await request.json()
        assert d.conn is not None
        await d.conn.execute(
            INSERT, (d.identity.tenant_id, invoice["account_id"], invoice["amount"])
        )
        return Response(b'{"created": true}', status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/events", create, methods=["POST"])])
    return InboxMiddleware(
        app,
        inbox=inbox,
        routes={"POST /events": "invoice.create"},
        key=KeyFrom.json_pointer("/event/id"),
    )


async def post(c: httpx.AsyncClient, body: bytes, tenant: str = "acme") -> httpx.Response:
    headers = {"Content-Type": "application/json", "Outbox-Tenant-Id": tenant}
    return await c.post("/events", content=body, headers=headers)


async def test_copies_of_an_event_however_spelled_are_one_invoice_keyed_by_its_id(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    transport = httpx.ASGITransport(app=worker(Inbox(pool)))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        first = await post(c, json.dumps(EVENT).encode())
        respelled = await post(c, json.dumps(EVENT, sort_keys=True, indent=2).encode())
        changed = await post(c, json.dumps({**EVENT, "amount": 6}).encode())
        other_tenant = await post(c, json.dumps(EVENT).encode(), tenant="globex")
    decisions = [
        (a.status_code, a.headers["Outbox-Inbox-Decision"])
        for a in (first, respelled, changed, other_tenant)
    ]
    assert decisions == [(201, "new"), (201, "replayed"), (422, "conflict"), (201, "new")]
    assert count(db_url, INVOICES) == 2
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE key = 'ptr:evt_1'") == 2


async def test_a_body_that_gives_no_key_is_a_400_with_the_reason_and_no_record(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    transport = httpx.ASGITransport(app=worker(Inbox(pool)))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        answers = [await post(c, body) for body, _ in NO_KEY]
        bad_tenant = await post(c, json.dumps(EVENT).encode(), tenant="caf%E9")
    for answer, (_, why) in zip(answers, NO_KEY, strict=True):
        assert answer.status_code == 400
        assert answer.json()["detail"].startswith(why)
        assert "evt_1" not in answer.text and "eeee" not in answer.text  # never the value
    assert bad_tenant.status_code == 400
    assert bad_tenant.json()["detail"] == "Outbox-Tenant-Id is not percent-encoded UTF-8"
    assert (count(db_url, INVOICES), count(db_url, RECORDS)) == (0, 0)


@pytest.fixture
async def stream() -> AsyncIterator[tuple[Any, str, str]]:
    async with memory_stream("inbox.pointer") as made:
        yield made


async def test_a_consumer_keys_by_the_pointer_and_drops_what_gives_no_identity_with_a_reason(
    db_url: str, pool: AsyncConnectionPool[Any], stream: tuple[Any, str, str]
) -> None:
    """Three copies each of three events (one respelled), every body of NO_KEY and an event
    whose tenant is badly encoded, published without Nats-Msg-Id so that JetStream keeps every
    copy: three invoices, one drop with its reason for each of the others, and the consumer
    still running to drain them all."""
    js, name, subject = stream
    events = [{**EVENT, "event": {"id": f"evt_{i}"}} for i in range(3)]
    acme = {"Outbox-Tenant-Id": "acme"}
    for event in events:
        for indent in (None, None, 2):
            await js.publish(subject, json.dumps(event, indent=indent).encode(), headers=acme)
    for body, _ in NO_KEY:
        await js.publish(subject, body, headers=acme)
    await js.publish(subject, json.dumps(EVENT).encode(), headers={"Outbox-Tenant-Id": "%ff"})
    consumer = consumer_of(
        Inbox(pool), "invoice.create", create_invoice, key=KeyFrom.json_pointer("/event/id")
    )
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        task = asyncio.create_task(consume(js, consumer, stream=name, durable="w", stop=stop))
        try:
            info = await drained(js, name)
        finally:
            stop.set()
            await task
    assert (info.num_pending, info.num_ack_pending, info.num_redelivered) == (0, 0, 0)
    assert count(db_url, INVOICES) == 3
    assert count(db_url, "SELECT count(DISTINCT key) FROM outbox.inbox") == 3
    reasons = sorted(e["reason"] for e in logs if e["event"] == "inbox message dropped")
    expected = [*(why for _, why in NO_KEY), "Outbox-Tenant-Id is not percent-encoded UTF-8"]
    assert len(reasons) == len(expected)
    assert all(any(r.startswith(why) for r in reasons) for why in expected)


async def drained(js: Any, name: str, within: float = 15) -> Any:
    for _ in range(int(within / 0.2)):
        await asyncio.sleep(0.2)
        info = await js.consumer_info(name, "w")
        if info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq:
            return info
    raise AssertionError(f"not drained: {info}")

"""The inbox's spans (issue 40), with the OpenTelemetry SDK's in-memory exporter: one span per
delivery, ``inbox <handler>``, through InboxMiddleware and a NATS JetStream consumer, linked to
the sender's W3C traceparent (and tracestate) and never its child; every duplicate its own span
with its decision; failures with ``error.type`` and never an exception's text; no key or body
value on any span. And the whole chain: enqueue under a span, dispatch to JetStream with outbox's
NATS provider, consume with the inbox: the consumer's span links to the enqueue's trace."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any, Final

import httpx
import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import outbox
from outbox.config.settings import ProviderSettings
from outbox.inbox import Inbox, InboxMiddleware, delivery
from outbox.inbox.jetstream import consume, consumer_of
from outbox.providers.nats.provider import build
from tests.support.dispatch import dispatcher
from tests.support.inbox_queues import INSERT, create_invoice, failing, pool
from tests.support.invoice_worker import count
from tests.support.queue_beds import memory_stream
from tests.support.spans import attributes, named, spans

__all__ = ["pool", "spans"]  # the fixtures, used by name
NATS: Final = "nats://127.0.0.1:4222"
SPAN: Final = "inbox invoice.create"
TRACESTATE: Final = "vendor=opaque"
CALLERS_KEY: Final = "client-key-5f1c"  # a caller's Idempotency-Key: never on a span


def sender_headers() -> tuple[dict[str, str], Any]:
    """The W3C headers a sender's span puts on its delivery, with a tracestate; its context."""
    with trace.get_tracer("the-sender").start_as_current_span("publish") as origin:
        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier)
    return {**carrier, "tracestate": TRACESTATE}, origin.get_span_context()


def assert_linked_to(span: ReadableSpan, origin: Any) -> None:
    (link,) = span.links
    assert link.context.trace_id == origin.trace_id
    assert link.context.span_id == origin.span_id
    assert link.context.trace_state.get("vendor") == "opaque"
    assert span.parent is None and span.context.trace_id != origin.trace_id  # not its child
    assert span.kind is SpanKind.CONSUMER


def worker(inbox: Inbox) -> InboxMiddleware:
    """Writes an invoice inside a span of its own; raises or answers 503 when told to."""

    async def create(request: Request) -> Response:
        d, invoice = delivery(request), await request.json()
        assert d.conn is not None
        with trace.get_tracer("the-worker").start_as_current_span("insert invoice"):
            await d.conn.execute(INSERT, (d.identity.tenant_id, "a", invoice["amount"]))
        if invoice.get("fail") == "raise":
            raise RuntimeError(f"amount {invoice['amount']} refused")  # quotes the payload
        if invoice.get("fail") == "503":
            return Response(b"busy", status_code=503)
        return Response(b"{}", status_code=201, media_type="application/json")

    app = Starlette(routes=[Route("/invoices", create, methods=["POST"])])
    return InboxMiddleware(app, inbox=inbox, routes={"POST /invoices": "invoice.create"})


async def test_every_http_delivery_has_its_own_span_linked_to_the_senders(
    db_url: str, pool: AsyncConnectionPool[Any], spans: InMemorySpanExporter
) -> None:
    traced, origin = sender_headers()
    json_body = {"Content-Type": "application/json"}
    acme = {**traced, **json_body, "Outbox-Tenant-Id": "acme"}
    deliveries: list[tuple[dict[str, str], dict[str, Any]]] = [
        ({**acme, "Outbox-Operation-Id": "42"}, {"amount": 12345}),  # new
        ({**acme, "Outbox-Operation-Id": "42"}, {"amount": 12345}),  # replayed
        ({**acme, "Outbox-Operation-Id": "42"}, {"amount": 1}),  # conflict
        ({**traced, **json_body, "Outbox-Operation-Id": "42"}, {"amount": 12345}),  # no tenant
        ({**acme, "Outbox-Operation-Id": "43", "X-Fail": "1"}, {"amount": 12345, "fail": "raise"}),
        ({**acme, "Outbox-Operation-Id": "44"}, {"amount": 12345, "fail": "503"}),
        ({**json_body, "Outbox-Tenant-Id": "acme", "Idempotency-Key": CALLERS_KEY}, {"amount": 7}),
        ({**acme, "traceparent": "00-zz-zz-01", "Idempotency-Key": "k2"}, {"amount": 8}),
    ]
    transport = httpx.ASGITransport(app=worker(Inbox(pool)))
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as c:
        answers = [
            await c.post("/invoices", content=json.dumps(body), headers=headers)
            for headers, body in deliveries
        ]
    assert [a.status_code for a in answers] == [201, 201, 422, 400, 500, 503, 201, 201]

    got = named(spans, SPAN)
    assert len(got) == len(deliveries)  # one span per delivery, duplicates included
    for span in got[:6]:
        assert_linked_to(span, origin)
    assert (got[6].links, got[7].links) == ((), ())  # no traceparent; a malformed one
    op = {"outbox.inbox.handler": "invoice.create", "outbox.tenant_id": "acme"}
    op |= {"outbox.inbox.key_source": "op"}
    assert [attributes(s) for s in got[:6]] == [
        {**op, "outbox.operation_id": 42, "outbox.inbox.decision": "new",
         "http.response.status_code": 201},
        {**op, "outbox.operation_id": 42, "outbox.inbox.decision": "replayed",
         "http.response.status_code": 201},
        {**op, "outbox.operation_id": 42, "outbox.inbox.decision": "conflict",
         "http.response.status_code": 422},
        {"outbox.inbox.handler": "invoice.create", "outbox.inbox.decision": "invalid",
         "http.response.status_code": 400},
        {**op, "outbox.operation_id": 43, "outbox.inbox.decision": "failed",
         "http.response.status_code": 500, "error.type": "RuntimeError"},
        {**op, "outbox.operation_id": 44, "outbox.inbox.decision": "rolled_back",
         "http.response.status_code": 503, "error.type": "503"},
    ]  # fmt: skip
    assert attributes(got[6])["outbox.inbox.key_source"] == "key"
    assert [s.status.status_code for s in got[:6]] == [StatusCode.UNSET] * 4 + [
        StatusCode.ERROR
    ] * 2
    for span in got:  # no exception's text, no key, no body
        assert span.events == () and span.status.description is None
        assert not any(
            text in str(value)
            for value in attributes(span).values()
            for text in ("12345", CALLERS_KEY, "k2")
        )
    # The handler's own spans are children of the delivery that ran it: new, failed, 503, two new.
    handled = [s.parent.span_id for s in named(spans, "insert invoice") if s.parent]
    assert handled == [got[i].context.span_id for i in (0, 4, 5, 6, 7)]
    assert count(db_url, "SELECT count(*) FROM invoices") == 3


@pytest.fixture
async def stream() -> AsyncIterator[tuple[Any, str, str]]:
    async with memory_stream("inbox.trace", duplicate_window=120) as made:
        yield made


async def drained(js: Any, name: str, consumer: Any, within: float = 15) -> Any:
    """One consumer of the durable ``w`` until nothing is pending or unacknowledged."""
    stop = asyncio.Event()
    task = asyncio.create_task(consume(js, consumer, stream=name, durable="w", stop=stop))
    try:
        for _ in range(int(within / 0.2)):
            await asyncio.sleep(0.2)
            info = await js.consumer_info(name, "w")
            if info.num_pending == 0 and info.num_ack_pending == 0 and info.delivered.stream_seq:
                return info
        raise AssertionError(f"not drained: {info}")
    finally:
        stop.set()
        await task


async def test_every_message_the_broker_delivers_has_its_own_span_linked_to_the_senders(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    stream: tuple[Any, str, str],
    spans: InMemorySpanExporter,
) -> None:
    """Three copies of one message, whose handler fails the first time, and a message whose
    tenant is badly encoded; then a conflicting copy: a span for each of the broker's six
    deliveries (the failed one comes again), each linked to its sender's span."""
    js, name, subject = stream
    traced, origin = sender_headers()
    copy = {**traced, "Outbox-Operation-Id": "7", "Outbox-Tenant-Id": "acme"}
    body = json.dumps({"account_id": "a", "amount": 100}).encode()
    for _ in range(3):
        await js.publish(subject, body, headers=copy)
    await js.publish(subject, body, headers={**copy, "Outbox-Tenant-Id": "%ff"})
    handle, left = failing(1)
    consumer = consumer_of(Inbox(pool), "invoice.create", handle, retry_after=0.2)
    await drained(js, name, consumer)
    await js.publish(subject, json.dumps({"account_id": "a", "amount": 9}).encode(), headers=copy)
    info = await drained(js, name, consumer)

    got = named(spans, SPAN)
    assert len(got) == info.delivered.consumer_seq == 6
    for span in got:
        assert_linked_to(span, origin)
    shown = [attributes(s) for s in got]
    assert Counter((a["outbox.inbox.decision"], a["outbox.inbox.verdict"]) for a in shown) == {
        ("failed", "retry"): 1,
        ("new", "ack"): 1,
        ("replayed", "ack"): 2,
        ("invalid", "drop"): 1,
        ("conflict", "drop"): 1,
    }
    (failed,) = [s for s in got if attributes(s)["outbox.inbox.decision"] == "failed"]
    assert attributes(failed)["error.type"] == "RuntimeError"
    assert failed.status.status_code is StatusCode.ERROR and failed.events == ()
    (dropped,) = [a for a in shown if a["outbox.inbox.decision"] == "invalid"]
    assert dropped == {
        "outbox.inbox.handler": "invoice.create",
        "outbox.inbox.decision": "invalid",
        "outbox.inbox.verdict": "drop",
        "outbox.inbox.reason": "Outbox-Tenant-Id is not percent-encoded UTF-8",
    }
    assert left["left"] == 0
    assert count(db_url, "SELECT count(*) FROM invoices") == 1


async def test_the_consumers_span_links_to_the_trace_that_enqueued_through_outbox_nats(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    stream: tuple[Any, str, str],
    spans: InMemorySpanExporter,
) -> None:
    """outbox's NATS provider carries the traceparent enqueue stored: the consumer's span links
    to the request that enqueued, and names the same operation as the dispatch span."""
    js, name, subject = stream
    with (
        trace.get_tracer("the-application").start_as_current_span("POST /orders") as request,
        psycopg.connect(db_url) as conn,
    ):
        enqueued = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice.create",
            operation_key="order-7",
            provider="jets",
            action="invoice.create",
            payload={"account_id": "a", "amount": 100},
        )
    jets = build(
        ProviderSettings(
            "jets",
            type="nats",
            key_retention=timedelta(minutes=1),
            timeout=timedelta(seconds=3),
            options={
                "servers": [NATS],
                "actions": {"invoice.create": {"subject": subject, "stream": name}},
            },
        )
    )
    await jets.start()
    try:
        assert await dispatcher(pool, {"jets": jets}).run_once() == 1
    finally:
        await jets.aclose()
    await drained(js, name, consumer_of(Inbox(pool), "invoice.create", create_invoice))

    origin = request.get_span_context()
    (dispatched,) = named(spans, "outbox.dispatch")
    (consumed,) = named(spans, SPAN)
    assert [link.context.trace_id for link in consumed.links] == [origin.trace_id]
    assert [link.context.span_id for link in consumed.links] == [origin.span_id]
    assert consumed.context.trace_id not in (origin.trace_id, dispatched.context.trace_id)
    operation = attributes(dispatched)["outbox.operation_id"]
    assert operation == enqueued.operation_id == attributes(consumed)["outbox.operation_id"]
    assert count(db_url, "SELECT count(*) FROM invoices") == 1


def test_without_the_extra_a_delivery_is_settled_and_nothing_is_imported() -> None:
    script = """
import asyncio, importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
from psycopg_pool import AsyncConnectionPool
from outbox.inbox import Inbox, InboxMiddleware
from outbox.inbox.jetstream import consumer_of

async def main():
    inbox = Inbox(AsyncConnectionPool("postgresql://nowhere", open=False))
    traced = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    settled = await consumer_of(inbox, "h", None).settle(traced, b"{}")
    assert (settled.verdict, settled.decision) == ("drop", "invalid"), settled
    app = InboxMiddleware(None, inbox=inbox, routes={"POST /h": "h"})
    scope = {"type": "http", "method": "POST", "path": "/h",
             "headers": [(b"traceparent", traced["traceparent"].encode())]}
    sent = []
    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}
    async def send(message):
        sent.append(message)
    await app(scope, receive, send)
    assert sent[0]["status"] == 400, sent

asyncio.run(main())
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "ok"  # after the log lines

"""The invoice worker: ``POST /invoices`` records one invoice per delivery identity.

Run it with ``uvicorn invoice_worker.app:app`` and ``OUTBOX_DATABASE_URL`` set. At start it
applies outbox's migrations (the inbox's tables) and creates its own ``invoices`` table if
missing. The handler writes on the delivery's connection, inside the transaction that also
records its answer: a repeat of the delivery gets that answer back and never a second invoice.
``INVOICE_WORKER_TRANSPORT=cloudtasks`` answers as a Cloud Tasks HTTP target must.
``INVOICE_WORKER_DELAY_MS`` makes the handler sleep after its insert and before the commit, so
that tests can catch a delivery in flight.

``POST /payments`` is the same request in external-effect mode: the handler collects the amount
from a payment provider (``INVOICE_WORKER_PAYMENTS_URL``, any API that honours
``Idempotency-Key``) before it can answer. It sends the claim's downstream key, the same on
every redelivery, so a call that timed out after the provider acted is one payment when it is
made again; the ``payments`` row commits with the recorded answer. A worker killed mid-call
leaves its claim's lease (``INVOICE_WORKER_LEASE_S``, 30) to run out; the next delivery
reclaims it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, Final

import httpx
import psycopg
from outbox.db.migrations import migrate
from outbox.inbox import External, Inbox, InboxMiddleware, claimed, delivery
from outbox.inbox.gauges import watch
from outbox.observability import logs
from prometheus_client import make_asgi_app
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

CREATE_INVOICES: Final = """
CREATE TABLE IF NOT EXISTS invoices (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id  text NOT NULL,
    account_id text NOT NULL,
    amount     bigint NOT NULL,
    currency   text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""
CREATE_PAYMENTS: Final = """
CREATE TABLE IF NOT EXISTS payments (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant_id  text NOT NULL,
    account_id text NOT NULL,
    amount     bigint NOT NULL,
    currency   text NOT NULL,
    reference  text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)"""
INSERT_PAYMENT: Final = (
    "INSERT INTO payments (tenant_id, account_id, amount, currency, reference)"
    " VALUES (%s, %s, %s, %s, %s) RETURNING id"
)
INSERT_INVOICE: Final = (
    "INSERT INTO invoices (tenant_id, account_id, amount, currency)"
    " VALUES (%s, %s, %s, %s) RETURNING id"
)
# Several workers may start at once: one creates the table, the others wait for it.
SETUP_LOCK: Final = 7_220_001

DSN: Final = os.environ.get("OUTBOX_DATABASE_URL", "")
PAYMENTS_URL: Final = os.environ.get("INVOICE_WORKER_PAYMENTS_URL", "")
PAYMENTS_TIMEOUT: Final = int(os.environ.get("INVOICE_WORKER_PAYMENTS_TIMEOUT_MS", "10000")) / 1000
LEASE: Final = timedelta(seconds=int(os.environ.get("INVOICE_WORKER_LEASE_S", "30")))
pool: AsyncConnectionPool[Any] = AsyncConnectionPool(DSN, open=False, min_size=2, max_size=10)
inbox = Inbox(pool)
payments = httpx.AsyncClient(timeout=PAYMENTS_TIMEOUT)


def _setup() -> None:
    with psycopg.connect(DSN, autocommit=True) as conn:
        migrate(conn)
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (SETUP_LOCK,))
            conn.execute(CREATE_INVOICES)
            conn.execute(CREATE_PAYMENTS)


@asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    if not DSN:
        raise RuntimeError("set OUTBOX_DATABASE_URL to the worker's database")
    # JSON lines at info (INVOICE_WORKER_LOG_LEVEL): structlog unconfigured prints every
    # delivery's debug line, a twentieth of the worker's CPU under load.
    logs.configure(os.environ.get("INVOICE_WORKER_LOG_LEVEL", "info"), json=True)
    await asyncio.to_thread(_setup)
    await pool.open(wait=True)
    gauges = asyncio.create_task(watch(pool))  # outbox_inbox_* gauges, for /metrics
    try:
        yield
    finally:
        gauges.cancel()
        await payments.aclose()
        await pool.close()


def _problems(body: Any) -> list[str]:
    """What is wrong with an invoice request, in words; nothing when it is right."""
    if not isinstance(body, dict):
        return ["the body is a JSON object"]
    wanted = {"account_id": str, "amount": int, "currency": str}
    found = [
        f"{name} is a {kind.__name__}"
        for name, kind in wanted.items()
        if type(body.get(name)) is not kind
    ]
    if isinstance(body.get("amount"), int) and not 0 < body["amount"] < 2**63:
        found.append("amount is positive and below 2**63")
    return found


async def _invoice(request: Request) -> tuple[Any, list[str]]:
    """The request's body, and what is wrong with it as an invoice (nothing when right)."""
    try:
        body = await request.json()
    except ValueError:
        body = None
    return body, _problems(body)


async def create_invoice(request: Request) -> JSONResponse:
    d = delivery(request)
    body, problems = await _invoice(request)
    if problems or d.conn is None:
        # Recorded like a success: the same request is refused the same way every time.
        return JSONResponse({"errors": problems}, status_code=422)
    cur = await d.conn.execute(
        INSERT_INVOICE, (d.identity.tenant_id, body["account_id"], body["amount"], body["currency"])
    )
    row = await cur.fetchone()
    delay = int(os.environ.get("INVOICE_WORKER_DELAY_MS", "0"))
    if delay > 0:
        await asyncio.sleep(delay / 1000)
    return JSONResponse({"invoice_id": row[0] if row else None}, status_code=201)


class PaymentFailed(Exception):
    """The provider did not take the payment this time: nothing is recorded, the sender
    delivers again, and the same downstream key makes the retry the same payment."""


async def collect_payment(request: Request) -> JSONResponse:
    claim = claimed(request)
    body, problems = await _invoice(request)
    if not PAYMENTS_URL:  # the worker's configuration, not the request: never recorded
        return JSONResponse({"errors": ["no payment provider is set"]}, 503)
    if problems:
        return JSONResponse({"errors": problems}, 422)
    answer = await payments.post(
        PAYMENTS_URL,
        json=body,
        headers={"Idempotency-Key": claim.downstream_key("payment")},
    )
    if answer.status_code != 201:  # a 409 (our first call still running), a 5xx: try again
        raise PaymentFailed(f"the provider answered {answer.status_code}")
    reference = str(answer.json()["id"])
    conn = await claim.transaction()  # commits with the recorded answer, or not at all
    cur = await conn.execute(
        INSERT_PAYMENT,
        (claim.identity.tenant_id, body["account_id"], body["amount"], body["currency"], reference),
    )
    row = await cur.fetchone()
    return JSONResponse({"payment_id": row[0] if row else None, "reference": reference}, 201)


app = InboxMiddleware(
    Starlette(
        routes=[
            Route("/invoices", create_invoice, methods=["POST"]),
            Route("/payments", collect_payment, methods=["POST"]),
            Mount("/metrics", make_asgi_app()),  # Prometheus: the inbox's metrics among them
        ],
        lifespan=lifespan,
    ),
    inbox=inbox,
    routes={
        "POST /invoices": "invoice.create",
        "POST /payments": External("payment.collect", lease=LEASE),
    },
    # "cloudtasks" where the worker is a Cloud Tasks HTTP target: final answers are 2xx there.
    transport=os.environ.get("INVOICE_WORKER_TRANSPORT", "http"),
)

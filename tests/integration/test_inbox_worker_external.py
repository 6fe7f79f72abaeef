"""External-effect mode through the adapters (issue 40): examples/invoice-worker's
``POST /payments`` under a real uvicorn, collecting from a real HTTP payment provider on
loopback (FakeWebhookReceiver, which honours Idempotency-Key as the IETF draft has it), and a
queue Consumer in ``Claiming`` mode. Every test counts the provider's effects and the worker's
rows: one payment per delivery identity, whatever timed out or died in between."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from outbox.inbox import (
    Claim,
    Claiming,
    Consumer,
    External,
    Inbox,
    InboxWSGIMiddleware,
    KeyFrom,
    Refuse,
    SyncInbox,
    TenantFrom,
    Verdict,
    wsgi_claimed,
)
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.invoice_worker import (
    InvoiceWorker,
    count,
    headers,
    invoice,
    open_transactions,
    wait_for,
)

PAYMENTS = "SELECT count(*) FROM payments"
COMPLETED = "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'"
StartWorker = Callable[..., InvoiceWorker]


@pytest.fixture
def provider() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as receiver:
        yield receiver


@pytest.fixture
def start_worker(
    db_url: str, tmp_path: Path, provider: FakeWebhookReceiver
) -> Iterator[StartWorker]:
    started: list[InvoiceWorker] = []

    def start(*, timeout_ms: int = 5000, lease_s: int = 30) -> InvoiceWorker:
        env = {
            "INVOICE_WORKER_PAYMENTS_URL": provider.url,
            "INVOICE_WORKER_PAYMENTS_TIMEOUT_MS": str(timeout_ms),
            "INVOICE_WORKER_LEASE_S": str(lease_s),
        }
        worker = InvoiceWorker(db_url, tmp_path / "worker.log", env=env)
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.kill()


async def pay(client: httpx.AsyncClient, url: str, key: str) -> httpx.Response:
    body = json.dumps(invoice())
    return await client.post(f"{url}/payments", content=body, headers=headers(key))


async def redeliver(client: httpx.AsyncClient, url: str, key: str) -> httpx.Response:
    """As a sender does: again after each answer that asks for it (409, 5xx), 20 s at most."""
    for _ in range(200):
        answer = await pay(client, url, key)
        if answer.status_code not in (409, 500, 503):
            return answer
        await asyncio.sleep(0.1)
    raise AssertionError(f"never settled: {answer.status_code} {answer.text}")


def one_key(provider: FakeWebhookReceiver) -> str:
    keys = {str(r.key) for r in provider.received}
    assert len(keys) == 1, keys
    return keys.pop()


async def test_a_call_that_timed_out_after_the_provider_acted_is_one_payment(
    db_url: str, start_worker: StartWorker, provider: FakeWebhookReceiver
) -> None:
    """The provider takes the payment, then answers after the worker gave up: the handler
    fails (500, nothing recorded, the lease ended), the redelivery reclaims and sends the same
    key, and the provider replays its answer: one payment there, one row here."""
    worker = start_worker(timeout_ms=400)
    provider.inject(WebhookFault.delay_after_apply(1.5))
    async with httpx.AsyncClient(timeout=30) as client:
        first = await pay(client, worker.url, "pay-1")
        assert first.status_code == 500, first.text
        assert provider.effect_count() == 1
        assert count(db_url, PAYMENTS) == 0
        settled = await redeliver(client, worker.url, "pay-1")
        again = await pay(client, worker.url, "pay-1")
    assert settled.status_code == 201, settled.text
    assert settled.headers["Outbox-Inbox-Decision"] == "reclaimed"
    assert (again.status_code, again.content) == (201, settled.content)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert provider.effect_count() == 1
    assert count(db_url, PAYMENTS) == 1
    assert count(db_url, COMPLETED) == 1
    assert one_key(provider).startswith("ib1_")
    reference = json.loads(settled.content)["reference"]
    assert count(db_url, "SELECT count(*) FROM payments WHERE reference = %s", (reference,)) == 1


async def test_a_worker_killed_mid_call_is_reclaimed_after_its_lease_under_the_same_key(
    db_url: str, start_worker: StartWorker, provider: FakeWebhookReceiver
) -> None:
    """SIGKILL while the provider holds the call: the claim stays until its lease runs out
    (a repeat meanwhile is 409 with what is left of it), then another worker reclaims."""
    worker = start_worker(lease_s=2)
    provider.inject(WebhookFault.delay_after_apply(1.0))
    async with httpx.AsyncClient(timeout=30) as client:
        cut = asyncio.create_task(pay(client, worker.url, "pay-2"))
        await asyncio.to_thread(wait_for, lambda: provider.effect_count() == 1, 10, "the call")
        worker.kill()
        with pytest.raises(httpx.TransportError):
            await cut
        worker = start_worker(lease_s=2)
        early = await pay(client, worker.url, "pay-2")
        settled = await redeliver(client, worker.url, "pay-2")
    assert settled.status_code == 201, settled.text
    if early.status_code == 409:
        assert 1 <= int(early.headers["Retry-After"]) <= 2
        assert settled.headers["Outbox-Inbox-Decision"] == "reclaimed"
    else:  # the restart took longer than the lease: the first repeat reclaimed it
        assert early.status_code == 201, early.text
        assert early.headers["Outbox-Inbox-Decision"] == "reclaimed"
        assert settled.headers["Outbox-Inbox-Decision"] == "replayed"
    assert provider.effect_count() == 1
    assert count(db_url, PAYMENTS) == 1
    assert count(db_url, "SELECT claims FROM outbox.inbox WHERE state = 'completed'") == 2
    one_key(provider)


async def test_duplicates_at_once_make_one_payment_and_agree(
    db_url: str, start_worker: StartWorker, provider: FakeWebhookReceiver
) -> None:
    worker = start_worker()
    provider.inject(WebhookFault.delay_after_apply(0.5))
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(*(pay(client, worker.url, "pay-3") for _ in range(20)))
    decisions = [a.headers["Outbox-Inbox-Decision"] for a in answers]
    assert decisions.count("new") == 1, decisions
    assert set(decisions) <= {"new", "in_progress", "replayed"}, decisions
    first = next(a for a in answers if a.headers["Outbox-Inbox-Decision"] == "new")
    for answer in answers:
        if answer.status_code == 409:
            assert int(answer.headers["Retry-After"]) >= 1
        else:
            assert (answer.status_code, answer.content) == (201, first.content)
    assert provider.effect_count() == 1
    assert count(db_url, PAYMENTS) == 1


# --- a queue consumer in external-effect mode -------------------------------------------------


@pytest.fixture
async def pool(db_url: str) -> Any:
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS sent (key text, amount bigint)")
        yield opened


def claiming_consumer(pool: AsyncConnectionPool[Any], url: str, timeout: float) -> Consumer:
    async def handle(claim: Claim, body: bytes) -> None:
        order = json.loads(body)
        if order["amount"] <= 0:
            conn = await claim.transaction()
            await conn.execute("INSERT INTO sent VALUES ('refused', 0)")  # undone by Refuse
            raise Refuse("the amount is not positive")
        async with httpx.AsyncClient(timeout=timeout) as client:
            answer = await client.post(
                url, content=body, headers={"Idempotency-Key": claim.downstream_key("send")}
            )
        answer.raise_for_status()
        conn = await claim.transaction()
        await conn.execute(
            "INSERT INTO sent VALUES (%s, %s)", (claim.identity.key, order["amount"])
        )

    return Consumer(
        Inbox(pool),
        "order.send",
        handle,
        KeyFrom.header("idempotency-key"),
        TenantFrom.header(),
        claiming=Claiming(lease=timedelta(seconds=2)),
    )


MESSAGE = {"idempotency-key": "m-1", "outbox-tenant-id": "acme"}


async def test_a_claiming_consumer_retries_a_timeout_as_one_effect_and_acks_once(
    db_url: str, pool: AsyncConnectionPool[Any], provider: FakeWebhookReceiver
) -> None:
    consumer = claiming_consumer(pool, provider.url, timeout=0.3)
    provider.inject(WebhookFault.delay_after_apply(1.0))
    body = json.dumps({"amount": 5}).encode()
    verdicts = [await consumer.settle(MESSAGE, body)]
    assert verdicts[0].verdict is Verdict.RETRY and verdicts[0].decision == "failed"
    while verdicts[-1].verdict is Verdict.RETRY and len(verdicts) < 40:
        await asyncio.sleep(0.1)
        verdicts.append(await consumer.settle(MESSAGE, body))
    assert (verdicts[-1].verdict, verdicts[-1].decision) == (Verdict.ACK, "reclaimed")
    replayed = await consumer.settle(MESSAGE, body)
    assert (replayed.verdict, replayed.decision) == (Verdict.ACK, "replayed")
    assert provider.effect_count() == 1
    assert count(db_url, "SELECT count(*) FROM sent") == 1
    one_key(provider)


async def test_a_claiming_consumers_refusal_keeps_none_of_its_writes_and_drops_every_copy(
    db_url: str, pool: AsyncConnectionPool[Any], provider: FakeWebhookReceiver
) -> None:
    consumer = claiming_consumer(pool, provider.url, timeout=5)
    body = json.dumps({"amount": 0}).encode()
    first = await consumer.settle(MESSAGE, body)
    again = await consumer.settle(MESSAGE, body)
    assert (first.verdict, first.decision) == (Verdict.DROP, "new")
    assert (again.verdict, again.decision) == (Verdict.DROP, "replayed")
    assert count(db_url, "SELECT count(*) FROM sent") == 0
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1
    assert provider.effect_count() == 0


async def test_a_claiming_consumer_whose_claim_was_taken_over_keeps_nothing_and_retries(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The handler stalls past its lease (its heartbeat could not run) and another delivery
    reclaims: the stale handler's writes roll back, its message is given back, not acked."""

    async def stalled(claim: Claim, body: bytes) -> None:
        conn = await claim.transaction()
        await conn.execute("INSERT INTO sent VALUES ('stale', 1)")
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
            await other.execute("UPDATE outbox.inbox SET lease_expires_at = now()")
            cur = await other.execute(
                "SELECT decision FROM outbox.inbox_claim('acme', 'order.send', %s, %s, NULL,"
                " '1 min', 5, '1 day')",
                (claim.identity.key, body.decode()),
            )
            assert await cur.fetchone() == ("reclaimed",)

    consumer = Consumer(
        Inbox(pool),
        "order.send",
        stalled,
        KeyFrom.header("idempotency-key"),
        TenantFrom.header(),
        claiming=Claiming(lease=timedelta(seconds=30)),
    )
    settled = await consumer.settle(MESSAGE, json.dumps({"amount": 5}).encode())
    assert (settled.verdict, settled.decision) == (Verdict.RETRY, "in_progress")
    assert count(db_url, "SELECT count(*) FROM sent") == 0
    assert count(db_url, COMPLETED) == 0


# --- a WSGI app (Flask) in external-effect mode ------------------------------------------------


def flask_payments(sync_pool: ConnectionPool[Any], provider_url: str, timeout: float) -> Any:
    """A Flask route in external-effect mode: it charges the provider under the claim's key,
    then writes ``sent`` on the final transaction."""
    from flask import Flask, request  # noqa: PLC0415 (the dev extra's)

    app = Flask(__name__)

    @app.post("/pay")
    def pay() -> tuple[dict[str, Any], int]:
        claim = wsgi_claimed(request)
        answer = httpx.post(
            provider_url,
            content=request.get_data(),
            headers={"Idempotency-Key": claim.downstream_key("pay")},
            timeout=timeout,
        )
        answer.raise_for_status()
        conn = claim.transaction()
        conn.execute("INSERT INTO sent VALUES (%s, 1)", (claim.identity.key,))
        return {"reference": answer.json()["id"]}, 201

    app.wsgi_app = InboxWSGIMiddleware(  # type: ignore[method-assign]
        app.wsgi_app,
        inbox=SyncInbox(sync_pool),
        routes={"POST /pay": External("pay", lease=timedelta(seconds=2))},
    )
    return app


async def test_a_wsgi_route_in_external_mode_retries_a_timeout_as_one_payment(
    db_url: str, pool: AsyncConnectionPool[Any], provider: FakeWebhookReceiver
) -> None:
    from tests.integration.test_inbox_wsgi import serving  # noqa: PLC0415 (Flask's, lazily)

    provider.inject(WebhookFault.delay_after_apply(1.0))
    body = json.dumps(invoice())
    sent = {"Content-Type": "application/json", "Idempotency-Key": "w-1", "Outbox-Tenant-Id": "t"}
    with (
        ConnectionPool(db_url, min_size=1, max_size=8, open=True) as sync_pool,
        serving(flask_payments(sync_pool, provider.url, timeout=0.3)) as url,
    ):

        def deliver_until_settled() -> list[httpx.Response]:
            answers = [httpx.post(f"{url}/pay", content=body, headers=sent, timeout=10)]
            while answers[-1].status_code in (409, 500) and len(answers) < 60:
                time.sleep(0.1)
                answers.append(httpx.post(f"{url}/pay", content=body, headers=sent, timeout=10))
            answers.append(httpx.post(f"{url}/pay", content=body, headers=sent, timeout=10))
            return answers

        answers = await asyncio.to_thread(deliver_until_settled)
    decisions = [a.headers["Outbox-Inbox-Decision"] for a in answers]
    # Flask answers its handler's raise with a 500 of its own: rolled back, nothing recorded.
    assert answers[0].status_code == 500 and decisions[0] == "rolled_back", decisions
    assert decisions[-2:] == ["reclaimed", "replayed"], decisions
    assert answers[-1].content == answers[-2].content
    assert provider.effect_count() == 1
    assert count(db_url, "SELECT count(*) FROM sent") == 1
    one_key(provider)


async def test_a_handlers_tasks_asking_at_once_share_one_final_transaction(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Two tasks of one handler open claim.transaction() at once: one transaction, both writes
    committed with the outcome, no connection left checked out."""

    async def both(claim: Claim, body: bytes) -> None:
        async def write(note: str) -> None:
            conn = await claim.transaction()
            await conn.execute("INSERT INTO sent VALUES (%s, 1)", (note,))

        await asyncio.gather(write("a"), write("b"))

    consumer = Consumer(
        Inbox(pool),
        "order.send",
        both,
        KeyFrom.header("idempotency-key"),
        TenantFrom.header(),
        claiming=Claiming(),
    )
    settled = await consumer.settle(MESSAGE, json.dumps({"amount": 5}).encode())
    assert (settled.verdict, settled.decision) == (Verdict.ACK, "new")
    assert count(db_url, "SELECT count(*) FROM sent") == 2
    assert count(db_url, COMPLETED) == 1
    assert open_transactions(db_url) == 0  # the other transaction would idle here, open


async def test_a_handler_that_finds_its_claim_taken_over_hears_in_progress_not_a_failure(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The lease runs out under a stalled handler and another delivery reclaims; the handler's
    heartbeat learns it, and the handler's transaction() then raises LeaseLost: answered 409
    "in progress" (the owner records), its writes never made."""
    from starlette.applications import Starlette  # noqa: PLC0415
    from starlette.requests import Request  # noqa: PLC0415
    from starlette.responses import Response  # noqa: PLC0415
    from starlette.routing import Route  # noqa: PLC0415

    from outbox.inbox import InboxMiddleware, claimed  # noqa: PLC0415

    async def stalled(request: Request) -> Response:
        claim = claimed(request)
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as other:
            await other.execute("UPDATE outbox.inbox SET lease_expires_at = now()")
            await other.execute(
                "SELECT outbox.inbox_claim('acme', 'stall', %s, %s, NULL, '1 min', 5, '1 day')",
                (claim.identity.key, (await request.body()).decode()),
            )
        await asyncio.sleep(0.6)  # the heartbeat (every 0.33 s) hears the claim is gone
        conn = await claim.transaction()
        await conn.execute("INSERT INTO sent VALUES ('stale', 1)")
        return Response(b"done", status_code=201)

    app = InboxMiddleware(
        Starlette(routes=[Route("/stall", stalled, methods=["POST"])]),
        inbox=Inbox(pool),
        routes={"POST /stall": External("stall", lease=timedelta(seconds=1))},
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
        sent = {
            "Content-Type": "application/json",
            "Idempotency-Key": "s-1",
            "Outbox-Tenant-Id": "acme",
        }
        answer = await client.post("/stall", content=b'{"a": 1}', headers=sent)
    assert answer.status_code == 409, answer.text
    assert answer.headers["Outbox-Inbox-Decision"] == "in_progress"
    assert count(db_url, "SELECT count(*) FROM sent") == 0
    assert count(db_url, "SELECT claims FROM outbox.inbox") == 2  # the other delivery's claim


def test_a_handler_is_external_on_every_route_or_on_none(db_url: str) -> None:
    with (
        ConnectionPool(db_url, min_size=1, max_size=1, open=True) as sync_pool,
        pytest.raises(ValueError, match="External on every route or on none"),
    ):
        InboxWSGIMiddleware(
            lambda environ, start: [],
            inbox=SyncInbox(sync_pool),
            routes={"POST /a": "pay", "POST /b": External("pay")},
        )

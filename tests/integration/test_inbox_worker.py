"""The inbox's promise, against examples/invoice-worker under a real uvicorn (issue 40).

Every test counts persisted invoices and inbox records, never answers alone: one invoice per
delivery identity, whatever arrives, however often, and whatever dies in between.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.invoice_worker import (
    InvoiceWorker,
    count,
    headers,
    invoice,
    open_transactions,
    wait_for,
)

INVOICES = "SELECT count(*) FROM invoices"
COMPLETED = "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'"
RECORDS = "SELECT count(*) FROM outbox.inbox"

StartWorker = Callable[..., InvoiceWorker]


@pytest.fixture
def start_worker(db_url: str, tmp_path: Path) -> Iterator[StartWorker]:
    started: list[InvoiceWorker] = []

    def start(*, workers: int = 1, delay_ms: int = 0) -> InvoiceWorker:
        worker = InvoiceWorker(db_url, tmp_path / "worker.log", workers=workers, delay_ms=delay_ms)
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.kill()


async def post(client: httpx.AsyncClient, url: str, key: str, body: object) -> httpx.Response:
    return await client.post(f"{url}/invoices", content=json.dumps(body), headers=headers(key))


async def test_dozens_of_duplicates_at_once_make_one_invoice_and_agree(
    db_url: str, start_worker: StartWorker
) -> None:
    """50 copies of one delivery at once, across two worker processes, while the first is in
    its transaction: one invoice, one record; every answer is the outcome or "in progress"."""
    worker = start_worker(workers=2, delay_ms=500)
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            *(post(client, worker.url, "dup-1", invoice()) for _ in range(50))
        )
        settled = await post(client, worker.url, "dup-1", invoice())
    assert count(db_url, INVOICES) == 1
    assert count(db_url, COMPLETED) == 1
    first = [a for a in answers if a.headers["Outbox-Inbox-Decision"] == "new"]
    assert len(first) == 1, [a.headers["Outbox-Inbox-Decision"] for a in answers]
    for answer in answers:
        decision = answer.headers["Outbox-Inbox-Decision"]
        if decision == "in_progress":
            assert answer.status_code == 409
            assert int(answer.headers["Retry-After"]) >= 1
        else:
            assert (answer.status_code, answer.content) == (201, first[0].content), decision
    assert settled.status_code == 201
    assert settled.content == first[0].content
    assert settled.headers["Idempotent-Replayed"] == "true"


async def test_a_worker_killed_before_its_commit_leaves_nothing_and_the_redelivery_makes_one(
    db_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker(delay_ms=5000)
    async with httpx.AsyncClient(timeout=30) as client:
        sent = asyncio.create_task(post(client, worker.url, "crash-1", invoice()))
        await asyncio.to_thread(wait_for, lambda: open_transactions(db_url) == 1, 10, "the insert")
        worker.kill()
        with pytest.raises(httpx.TransportError):
            await sent
        await asyncio.to_thread(wait_for, lambda: open_transactions(db_url) == 0, 10, "rollback")
        assert (count(db_url, INVOICES), count(db_url, RECORDS)) == (0, 0)
        worker = start_worker()
        again = await post(client, worker.url, "crash-1", invoice())
        once_more = await post(client, worker.url, "crash-1", invoice())
    assert again.status_code == 201
    assert again.headers["Outbox-Inbox-Decision"] == "new"
    assert once_more.headers["Outbox-Inbox-Decision"] == "replayed"
    assert once_more.content == again.content
    assert (count(db_url, INVOICES), count(db_url, COMPLETED)) == (1, 1)


async def test_a_sender_gone_before_the_answer_gets_the_recorded_outcome_on_redelivery(
    db_url: str, start_worker: StartWorker
) -> None:
    """The worker commits although nobody waits for the answer; the redelivery is a replay."""
    worker = start_worker(delay_ms=600)
    async with httpx.AsyncClient(timeout=0.2) as impatient:
        with pytest.raises(httpx.TimeoutException):
            await post(impatient, worker.url, "gone-1", invoice())
    await asyncio.to_thread(wait_for, lambda: count(db_url, COMPLETED) == 1, 10, "the commit")
    async with httpx.AsyncClient(timeout=10) as client:
        again = await post(client, worker.url, "gone-1", invoice())
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == {"invoice_id": count(db_url, "SELECT max(id) FROM invoices")}
    assert count(db_url, INVOICES) == 1


async def test_the_same_key_with_other_input_is_a_conflict_and_the_first_invoice_stays(
    db_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker()
    async with httpx.AsyncClient(timeout=10) as client:
        first = await post(client, worker.url, "k-1", invoice(amount=100))
        changed = await post(client, worker.url, "k-1", invoice(amount=999))
        changed_again = await post(client, worker.url, "k-1", invoice(amount=999))
        # The same JSON, spelled otherwise (key order, spacing), is the same delivery.
        respelled = await client.post(
            f"{worker.url}/invoices",
            content=b'{ "currency" : "EUR", "amount": 100, "account_id": "acct-1" }',
            headers=headers("k-1"),
        )
    assert first.status_code == 201
    assert [changed.status_code, changed_again.status_code] == [422, 422]
    assert changed.headers["Outbox-Inbox-Decision"] == "conflict"
    assert respelled.status_code == 201
    assert respelled.content == first.content
    assert count(db_url, "SELECT count(*) FROM invoices WHERE amount = 100") == 1
    assert count(db_url, INVOICES) == 1
    assert count(db_url, "SELECT sum(seen) FROM outbox.inbox_conflicts") == 2
    assert count(db_url, "SELECT count(*) FROM outbox.inbox_conflicts") == 1


async def test_a_delivery_without_key_or_tenant_is_refused_and_records_nothing(
    db_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker()
    body = json.dumps(invoice())
    async with httpx.AsyncClient(timeout=10) as client:
        no_key = await client.post(
            f"{worker.url}/invoices", content=body, headers={"Outbox-Tenant-Id": "acme"}
        )
        no_tenant = await client.post(
            f"{worker.url}/invoices", content=body, headers={"Idempotency-Key": '"k"'}
        )
        not_json = await client.post(
            f"{worker.url}/invoices", content=b'{"amount": ', headers=headers("k-2")
        )
    assert [no_key.status_code, no_tenant.status_code, not_json.status_code] == [400, 400, 400]
    assert (count(db_url, INVOICES), count(db_url, RECORDS)) == (0, 0)


async def test_a_refusal_is_recorded_and_replayed_like_a_success(
    db_url: str, start_worker: StartWorker
) -> None:
    worker = start_worker()
    async with httpx.AsyncClient(timeout=10) as client:
        refused = await post(client, worker.url, "bad-1", {"account_id": "a", "amount": "ten"})
        again = await post(client, worker.url, "bad-1", {"account_id": "a", "amount": "ten"})
    assert (refused.status_code, again.status_code) == (422, 422)
    assert again.headers["Outbox-Inbox-Decision"] == "replayed"
    assert again.content == refused.content
    assert count(db_url, INVOICES) == 0
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1


async def test_a_worker_stopped_with_work_under_way_answers_only_what_committed(
    db_url: str, start_worker: StartWorker
) -> None:
    """SIGTERM while 20 deliveries sleep in their transactions: every 201 has its invoice, and
    the redelivery of every one converges on exactly one."""
    worker = start_worker(delay_ms=700)
    async with httpx.AsyncClient(timeout=30) as client:
        sent = [
            asyncio.create_task(post(client, worker.url, f"s-{i}", invoice())) for i in range(20)
        ]
        await asyncio.to_thread(wait_for, lambda: open_transactions(db_url) >= 5, 10, "work")
        await asyncio.to_thread(worker.stop)
        answers = await asyncio.gather(*sent, return_exceptions=True)
        acknowledged = {
            f"s-{i}"
            for i, a in enumerate(answers)
            if isinstance(a, httpx.Response) and a.status_code == 201
        }
        assert count(db_url, INVOICES) >= len(acknowledged)
        worker = start_worker()
        redelivered = await asyncio.gather(
            *(post(client, worker.url, f"s-{i}", invoice()) for i in range(20))
        )
    assert {a.status_code for a in redelivered} == {201}
    assert count(db_url, INVOICES) == 20
    assert count(db_url, "SELECT count(DISTINCT tenant_id || account_id || id) FROM invoices") == 20
    for i, answer in enumerate(redelivered):
        if f"s-{i}" in acknowledged:
            assert answer.headers["Outbox-Inbox-Decision"] == "replayed"


async def test_every_key_generation_of_one_operation_finds_its_one_record(
    db_url: str, start_worker: StartWorker
) -> None:
    """An outbox delivery is identified by its operation, not by the key it travels under: a
    `reconcile retry` sends generation :r2 of the key, and gets the recorded outcome."""
    worker = start_worker()
    body = json.dumps(invoice())
    sent = {**headers("ob2_first"), "Outbox-Operation-Id": "42"}
    retried = {**headers("ob2_first:r2"), "Outbox-Operation-Id": "42"}
    async with httpx.AsyncClient(timeout=10) as client:
        first = await client.post(f"{worker.url}/invoices", content=body, headers=sent)
        again = await client.post(f"{worker.url}/invoices", content=body, headers=retried)
    assert (first.status_code, again.status_code) == (201, 201)
    assert again.headers["Outbox-Inbox-Decision"] == "replayed"
    assert count(db_url, INVOICES) == 1
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE key = 'op:42'") == 1

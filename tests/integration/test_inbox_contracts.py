"""The inbox checks a delivery's body against the contract its sender names (Outbox-Contract,
issue 42) before anything is decided: a body that breaks it is a conflict of input (HTTP 422, a
queue drops it), never run and never recorded; a contract the receiver's database has not
published is tried again later (503, a queue retries), never taken unchecked. Each test counts
the handler's effects and the inbox's records after the fact.

The deliveries carry the headers outbox's providers write (outbox.providers.kit), built from
operations enqueued in the same database; the breaking ones were enqueued through the SQL
function, which checks no schema, as a producer in another language may, and sent by a
dispatcher that did not check them (one of the previous version during a rolling upgrade).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from outbox.inbox import ContractBreach, Inbox, SyncInbox, Verdict
from outbox.inbox.http import KeyFrom, TenantFrom, identity_of
from outbox.inbox.queues import Consumer
from outbox.providers.base import Intent
from outbox.providers.kit import intent_headers
from tests.integration.test_contracts_enqueue import CHARGE, publish
from tests.integration.test_inbox import EFFECTS, app_with, client, created, setup_effects
from tests.integration.test_inbox_origin import operation_headers
from tests.support.dispatch import rows as rows_of
from tests.support.invoice_worker import count

RECORDS = "SELECT count(*) FROM outbox.inbox"
MODES = pytest.mark.parametrize("external", [False, True], ids=["transaction", "external"])
MARKER = "4242-MARKER-VALUE"  # in breaking bodies: never in an answer


@pytest.fixture
async def pool(db_url: str) -> Any:
    setup_effects(db_url)
    publish(db_url, "charge", 1, CHARGE)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


def sent(db_url: str, payload: object, version: int = 1) -> tuple[str, dict[str, str]]:
    """An operation enqueued through the SQL function under ``charge/v<version>``: its body as
    a provider sends it (the stored text) and the headers it sends with it."""
    with psycopg.connect(db_url) as conn:
        ((op,),) = conn.execute(
            "SELECT operation_id FROM outbox.enqueue(tenant_id => 'acme', operation_type =>"
            " 'charge', operation_key => %s, provider => 'billing', action => 'invoice.generate',"
            " payload => %s::jsonb, contract_version => %s)",
            (str(uuid.uuid4()), json.dumps(payload), version),
        ).fetchall()
        ((text, fingerprint, origin),) = conn.execute(
            "SELECT payload::text, fingerprint, outbox.origin()::text FROM outbox.operations"
            " WHERE id = %s",
            (op,),
        ).fetchall()
    intent = Intent(origin, bytes(fingerprint), "billing", None, f"charge/v{version}")
    headers = operation_headers(op, origin=origin)
    headers.update(intent_headers(intent, body_is_payload=True))
    return text, headers


GOOD = {"amount": 5, "currency": "eur"}
BREAKING = [
    ({"amount": MARKER, "currency": "eur"}, "/amount", "type"),
    ({"amount": 5, "currency": "eur", "lines": [{"sku": ""}]}, "/lines/0/sku", "minLength"),
    ({"amount": 5, "currency": "eur", "ammount": MARKER}, "", "additionalProperties"),
    # Past THREAD_BYTES: checked on a thread, with the same verdict.
    (
        {"amount": 5, "currency": "eur", "lines": [{"sku": "a"}] * 6000 + [{"sku": ""}]},
        "/lines/6000/sku",
        "minLength",
    ),
]


@MODES
async def test_a_body_that_breaks_its_contract_is_refused_before_anything_is_decided(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    inbox = Inbox(pool)
    async with client(app_with(inbox, created, external=external)) as c:
        body, headers = sent(db_url, GOOD)
        ok = await c.post("/work", content=body, headers=headers)
        assert (ok.status_code, ok.headers["Outbox-Inbox-Decision"]) == (201, "new")
        for payload, path, rule in BREAKING:
            body, headers = sent(db_url, payload)
            for _ in range(2):  # a redelivery gets the same answer: never retried into success
                answer = await c.post("/work", content=body, headers=headers)
                assert answer.status_code == 422, answer.text
                assert answer.headers["Outbox-Inbox-Decision"] == "contract_violation"
                detail = answer.json()["detail"]
                assert f"contract charge/v1 at {path or '/'}: {rule}" in detail, detail
                assert MARKER not in answer.text
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (1, 1)


async def test_a_contract_the_receivers_database_has_not_published_is_tried_later(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The sender pushed charge/v2 and the receiving service has not yet: never taken
    unchecked, never dropped. Once it is published there, the next delivery runs: the refusal
    is not kept."""
    publish(db_url, "charge", 2, CHARGE)
    body, headers = sent(db_url, GOOD, version=2)
    headers["Outbox-Contract"] = "charge/v3"  # what this database does not have
    inbox = Inbox(pool)
    async with client(app_with(inbox, created)) as c:
        later = await c.post("/work", content=body, headers=headers)
        assert later.status_code == 503
        assert later.headers["Outbox-Inbox-Decision"] == "contract_unknown"
        assert later.headers["Retry-After"] == "30"
        assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)
        publish(db_url, "charge", 3, CHARGE)
        now = await c.post("/work", content=body, headers=headers)
        assert (now.status_code, now.headers["Outbox-Inbox-Decision"]) == (201, "new")
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (1, 1)


@pytest.mark.parametrize(
    "value",
    ["charge", "charge/v0", "charge/v", "/v1", "charge/v99999999999", "charge/v1x", "%ff/v1"],
)
async def test_a_contract_header_that_cannot_be_read_is_refused_unchecked_never_taken(
    db_url: str, pool: AsyncConnectionPool[Any], value: str
) -> None:
    body, headers = sent(db_url, GOOD)
    headers["Outbox-Contract"] = value
    async with client(app_with(Inbox(pool), created)) as c:
        answer = await c.post("/work", content=body, headers=headers)
    assert (answer.status_code, answer.headers["Outbox-Inbox-Decision"]) == (400, "invalid")
    assert "Outbox-Contract" in answer.json()["detail"]
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)


async def test_a_queue_consumer_drops_a_breach_and_retries_an_unknown_contract(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    handled: list[bytes] = []

    async def handle(d: Any, body: bytes) -> None:
        handled.append(body)

    consumer = Consumer(
        Inbox(pool), "invoice", handle, KeyFrom.auto(), TenantFrom.header(), retry_after=1.0
    )

    def lowered(headers: dict[str, str]) -> dict[str, str]:
        return {k.lower(): v for k, v in headers.items()}

    body, headers = sent(db_url, GOOD)
    assert (await consumer.settle(lowered(headers), body.encode())).verdict is Verdict.ACK
    body, headers = sent(db_url, BREAKING[0][0])
    dropped = await consumer.settle(lowered(headers), body.encode())
    assert (dropped.verdict, dropped.decision) == (Verdict.DROP, "contract_violation")
    assert dropped.reason is not None and "at /amount: type" in dropped.reason
    assert MARKER not in dropped.reason
    headers["Outbox-Contract"] = "charge/v9"
    later = await consumer.settle(lowered(headers), body.encode())
    assert (later.verdict, later.decision, later.delay) == (Verdict.RETRY, "contract_unknown", 30)
    assert len(handled) == 1
    assert count(db_url, RECORDS) == 1


def test_the_sync_inbox_checks_the_same(db_url: str) -> None:
    publish(db_url, "charge", 1, CHARGE)
    body, headers = sent(db_url, BREAKING[1][0])
    lower = {k.lower(): v for k, v in headers.items()}
    identity = identity_of("acme", "invoice", "op:x", lower)
    with ConnectionPool(db_url, min_size=1, max_size=2) as sync_pool:
        inbox = SyncInbox(sync_pool)
        with (
            pytest.raises(ContractBreach, match="at /lines/0/sku: minLength"),
            inbox.deliver(identity, body.encode(), is_json=True),
        ):
            raise AssertionError("the handler ran")
        with (
            pytest.raises(ContractBreach),
            inbox.claim(identity, body.encode(), is_json=True),
        ):
            raise AssertionError("the handler ran")
    assert count(db_url, RECORDS) == 0


@MODES
async def test_a_handler_that_requires_a_contract_refuses_deliveries_naming_none_or_another(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """Left to the header alone, a sender could pass any body unchecked by leaving it out. A
    handler that requires a type's contract refuses a delivery naming none, or another type's,
    as a breach (422); one naming it is checked and runs."""
    publish(db_url, "refund", 1, CHARGE)
    inbox = Inbox(pool, contracts={"work": ("charge", "payments.charge")})
    body, headers = sent(db_url, GOOD)
    async with client(app_with(inbox, created, external=external)) as c:
        unnamed = {k: v for k, v in headers.items() if k != "Outbox-Contract"}
        other = {**headers, "Outbox-Contract": "refund/v1"}
        for sent_headers, named in ((unnamed, "none"), (other, "refund/v1")):
            answer = await c.post("/work", content=body, headers=sent_headers)
            assert answer.status_code == 422, answer.text
            assert answer.headers["Outbox-Inbox-Decision"] == "contract_violation"
            detail = answer.json()["detail"]
            assert (
                f"takes deliveries under contract charge or payments.charge; this one names {named}"
                in detail
            )
        ok = await c.post("/work", content=body, headers=headers)
        assert (ok.status_code, ok.headers["Outbox-Inbox-Decision"]) == (201, "new")
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (1, 1)


@MODES
async def test_one_key_under_another_contract_version_is_a_conflict(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """The same key and body under charge/v1, then under charge/v2: another intent, a conflict
    (422), never a replay of v1's answer; a copy that names no contract (a sender from before
    contracts) replays, as a record without a fingerprint does (sql/0056)."""
    publish(db_url, "charge", 2, CHARGE)
    body = json.dumps(GOOD)
    headers = {
        "Content-Type": "application/json",
        "Idempotency-Key": "same-key",
        "Outbox-Tenant-Id": "acme",
        "Outbox-Contract": "charge/v1",
    }
    async with client(app_with(Inbox(pool), created, external=external)) as c:
        first = await c.post("/work", content=body, headers=headers)
        other = await c.post(
            "/work", content=body, headers={**headers, "Outbox-Contract": "charge/v2"}
        )
        unnamed = {k: v for k, v in headers.items() if k != "Outbox-Contract"}
        again = await c.post("/work", content=body, headers=unnamed)
    decisions = [a.headers["Outbox-Inbox-Decision"] for a in (first, other, again)]
    assert decisions == ["new", "conflict", "replayed"]
    assert [first.status_code, other.status_code, again.status_code] == [201, 422, 201]
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (1, 1)
    assert rows_of(db_url, "SELECT contract FROM outbox.inbox") == [("charge/v1",)]

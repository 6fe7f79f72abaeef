"""What the inbox checks of a delivery from outbox (sql/0045, 0046): the database it came from
is part of its identity, and its body must be the one whose fingerprint the sender's enqueue
stored. Each test counts the handler's effects and the inbox's records after the fact, in both
modes (the default transaction mode and an External route).

The deliveries carry the headers that outbox's own providers write (outbox.providers.kit),
built from operations enqueued in the same database: what the sender computes and what the
receiver checks meet here.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.errors import SQLSTATE_INBOX_BODY_ALTERED
from outbox.inbox import Inbox
from outbox.providers.base import Intent
from outbox.providers.kit import header_safe, intent_headers
from tests.integration.test_inbox import EFFECTS, app_with, client, created, setup_effects
from tests.support.invoice_worker import count

RECORDS = "SELECT count(*) FROM outbox.inbox"
MODES = pytest.mark.parametrize("external", [False, True], ids=["transaction", "external"])


@pytest.fixture
async def pool(db_url: str) -> Any:
    setup_effects(db_url)
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


def operation_headers(
    operation_id: int, *, origin: str | None, tenant: str = "acme"
) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Outbox-Operation-Id": str(operation_id),
        "Outbox-Tenant-Id": header_safe(tenant),
        "Outbox-Action": "invoice.generate",
    }
    if origin is not None:
        headers["Outbox-Origin"] = origin
    return headers


def enqueued(db_url: str, payload: dict[str, Any], ordering_key: str | None = None) -> Any:
    """An operation enqueued here: its id, its payload as stored, and the headers a provider
    sends with it (origin and fingerprint as outbox.providers.kit writes them)."""
    with psycopg.connect(db_url) as conn:
        op = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice",
            operation_key=str(uuid.uuid4()),
            provider="billing",
            action="invoice.generate",
            payload=payload,
            ordering_key=ordering_key,
        ).operation_id
        ((text, fingerprint, origin),) = conn.execute(
            "SELECT payload::text, fingerprint, outbox.origin()::text FROM outbox.operations"
            " WHERE id = %s",
            (op,),
        ).fetchall()
    intent = Intent(origin, bytes(fingerprint), "billing", ordering_key)
    headers = operation_headers(op, origin=origin)
    headers.update(intent_headers(intent, body_is_payload=True))
    return op, text, headers, bytes(fingerprint)


@MODES
async def test_operations_of_two_databases_with_one_id_are_two_deliveries(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """Two services, each with its own outbox database, send operation 7 with the same body to
    one handler for one tenant: two effects and two records, and each one's redelivery replays
    its own. Keyed by the operation id alone, the second would have been replayed the first's
    answer and its effect lost."""
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    body = json.dumps({"account_id": "a1", "amount": 100, "currency": "usd"})
    async with client(app_with(Inbox(pool), created, external=external)) as c:
        answers = [
            await c.post("/work", content=body, headers=operation_headers(7, origin=origin))
            for origin in (first, second, first, second)
        ]
    decisions = [a.headers.get("Outbox-Inbox-Decision") for a in answers]
    assert [a.status_code for a in answers] == [201] * 4
    assert decisions == ["new", "new", "replayed", "replayed"]
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (2, 2)
    identities = set(rows(db_url, "SELECT key, origin::text FROM outbox.inbox"))
    assert identities == {("op:7", first), ("op:7", second)}


@MODES
async def test_a_record_from_either_side_of_an_upgrade_answers_the_other_sides_redelivery(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """A rolling upgrade, both ways round. An older dispatcher delivered operation 7 (no
    origin) and its retry comes from an upgraded one (with it); an upgraded one delivered
    operation 8 and its retry comes from an older one, or a message published before the
    upgrade. Each retry finds the other side's record of the same operation (same body) and
    replays it: one effect and one record per operation."""
    origin = str(uuid.uuid4())
    body = json.dumps({"n": 1})
    async with client(app_with(Inbox(pool), created, external=external)) as c:
        answers = [
            await c.post("/work", content=body, headers=operation_headers(n, origin=o))
            for n, o in ((7, None), (7, origin), (8, origin), (8, None))
        ]
    decisions = [a.headers["Outbox-Inbox-Decision"] for a in answers]
    assert [a.status_code for a in answers] == [201] * 4
    assert decisions == ["new", "replayed", "new", "replayed"]
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (2, 2)


@MODES
async def test_another_databases_operation_from_before_the_upgrade_is_not_this_one(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """Database A's operation 7 was recorded before A named its origin; database B's operation
    7, with another body, arrives with B's origin. One operation never changes its body, so
    A's record is not B's operation: B's runs (it was a conflict, never run, when the key was
    the id alone). Unnamed deliveries keep their own record: A's retry still replays."""
    body_a, body_b = json.dumps({"for": "a"}), json.dumps({"for": "b"})
    b = str(uuid.uuid4())
    async with client(app_with(Inbox(pool), created, external=external)) as c:
        first = await c.post("/work", content=body_a, headers=operation_headers(7, origin=None))
        other = await c.post("/work", content=body_b, headers=operation_headers(7, origin=b))
        again = await c.post("/work", content=body_a, headers=operation_headers(7, origin=None))
    assert (first.status_code, other.status_code, again.status_code) == (201, 201, 201)
    assert other.headers["Outbox-Inbox-Decision"] == "new"
    assert again.headers["Outbox-Inbox-Decision"] == "replayed"
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (2, 2)


def test_a_claim_keeps_its_downstream_key_across_an_upgrade_and_two_databases_have_two(
    db_url: str,
) -> None:
    """External mode: the first claim (no origin) failed and was handed back; the upgraded
    sender's retry reclaims the same record and is handed the same downstream key, so the
    provider downstream still recognises the call. Another database's operation 7 is handed
    another key: the provider must not take it for a repeat."""
    origin, other = uuid.uuid4(), uuid.uuid4()
    claim = "SELECT decision, inbox_id, token, downstream_key FROM outbox.inbox_claim("
    claim += "'acme', 'work', 'op:7', %s, NULL, '1 min', 5, '1 day', %s)"
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = conn.execute(claim, ('{"n": 1}', None)).fetchone()
        assert first is not None and first[0] == "new"
        conn.execute("SELECT outbox.inbox_fail(%s, %s, 'timeout')", (first[1], first[2]))
        again = conn.execute(claim, ('{"n": 1}', origin)).fetchone()
        elsewhere = conn.execute(claim, ('{"n": 2}', other)).fetchone()
        # A claim with no origin is handed 0042's key: claims made before 0048 keep theirs.
        ((before,),) = conn.execute(
            "SELECT 'ib1_' || encode(sha256(key_secret || sha256(key_secret || convert_to("
            "jsonb_build_array('acme', 'work', 'op:7')::text, 'UTF8'))), 'hex')"
            " FROM outbox.installation"
        ).fetchall()
    assert again is not None and elsewhere is not None
    assert (again[0], again[1], again[3]) == ("reclaimed", first[1], first[3])
    assert first[3] == before
    assert elsewhere[0] == "new" and elsewhere[3] != first[3]
    assert count(db_url, RECORDS) == 2


@MODES
async def test_the_body_enqueued_is_taken_and_another_is_refused_unrecorded(
    db_url: str, pool: AsyncConnectionPool[Any], external: bool
) -> None:
    """The body as stored, or respelled (keys reordered, spacing, 1e2 for 100), matches the
    sender's fingerprint: taken once, the record keeps the sender's fingerprint. A body a proxy
    re-encoded (1.50 sent as 1.5), or one under another ordering key, does not: 400 and nothing
    recorded or run. So does a fingerprint header that cannot be read."""
    payload = {"amount": Decimal("1.50"), "items": [{"sku": "a", "qty": 100}], "currency": "eur"}
    op, text, headers, fingerprint = enqueued(db_url, payload, ordering_key="acct 7 %")
    respelled = '{"currency":"eur","items":[{"qty":1e2,"sku":"a"}],"amount":1.50}'
    altered = '{"amount": 1.5, "items": [{"sku": "a", "qty": 100}], "currency": "eur"}'
    moved = {**headers, "Outbox-Fingerprint": headers["Outbox-Fingerprint"].replace("%", "-")}
    unreadable = {**headers, "Outbox-Fingerprint": ':not base64!:;provider="billing"'}
    no_action = {k: v for k, v in headers.items() if k != "Outbox-Action"}
    async with client(app_with(Inbox(pool), created, external=external)) as c:
        refused = [
            await c.post("/work", content=altered, headers=headers),
            await c.post("/work", content=text, headers=moved),
            await c.post("/work", content=text, headers=unreadable),
            await c.post("/work", content=text, headers=no_action),
        ]
        assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)
        taken = await c.post("/work", content=text, headers=headers)
        again = await c.post("/work", content=respelled, headers=headers)
    assert [a.status_code for a in refused] == [400] * 4, [a.text for a in refused]
    assert "fingerprint" in refused[0].json()["detail"]
    assert (taken.status_code, again.headers["Outbox-Inbox-Decision"]) == (201, "replayed")
    ((stored, key, origin),) = rows(
        db_url, "SELECT fingerprint, key, origin::text FROM outbox.inbox"
    )
    assert (bytes(stored), key, origin) == (fingerprint, f"op:{op}", headers["Outbox-Origin"])
    assert count(db_url, EFFECTS) == 1


def rows(db_url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(query).fetchall()


async def test_a_delivery_with_its_origin_waits_for_one_without_it_in_flight(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """An older dispatcher's delivery of operation 7 is still in its transaction when an
    upgraded one's retry arrives: both take the lock of the bare operation key, so the retry
    waits and hears "in progress", and no second effect is possible once the first commits."""
    origin = str(uuid.uuid4())
    holder = await psycopg.AsyncConnection.connect(db_url)
    try:
        await holder.execute(
            "SELECT outbox.inbox_begin('acme', 'work', 'op:7', '{}', NULL, '1 s', '1 day')"
        )
        inbox = Inbox(pool, wait=timedelta(milliseconds=200))
        async with client(app_with(inbox, created)) as c:
            busy = await c.post("/work", content=b"{}", headers=operation_headers(7, origin=origin))
        assert (busy.status_code, busy.headers["Outbox-Inbox-Decision"]) == (409, "in_progress")
    finally:
        await holder.close()
    assert (count(db_url, EFFECTS), count(db_url, RECORDS)) == (0, 0)


def test_the_database_refuses_a_body_unlike_its_fingerprint_with_its_own_sqlstate(
    db_url: str,
) -> None:
    """What a worker of any language gets from inbox_begin and inbox_claim: OB007 and nothing
    written, whichever input differs (body, provider, action, ordering key); the same inputs
    are taken, and the record keeps the fingerprint."""
    _, text, _, fingerprint = enqueued(db_url, {"n": Decimal("1.0")}, ordering_key="k")
    call = {
        "begin": "SELECT decision FROM outbox.inbox_begin('acme', 'w', %s, %s, NULL, '1 s',"
        " '1 day', NULL, %s, %s, %s, %s)",
        "claim": "SELECT decision FROM outbox.inbox_claim('acme', 'w', %s, %s, NULL, '1 min', 5,"
        " '1 day', NULL, %s, %s, %s, %s)",
    }
    right = (text, fingerprint, "billing", "invoice.generate", "k")
    # A receiver that reads the body as bytes checks the exact bytes (sql/0048).
    raw = call["begin"].replace("%s, %s, NULL, '1 s'", "%s, NULL, %s, '1 s'")
    with psycopg.connect(db_url) as conn:
        ((decision,),) = conn.execute(raw, ("key:raw", text.encode(), *right[1:])).fetchall()
        conn.rollback()
        with pytest.raises(psycopg.Error) as refused:
            conn.execute(raw, ("key:raw", text.encode() + b" ", *right[1:]))
    assert decision == "new" and refused.value.sqlstate == SQLSTATE_INBOX_BODY_ALTERED
    wrong = [
        ('{"n": 1}', *right[1:]),
        (text, fingerprint, "billing2", "invoice.generate", "k"),
        (text, fingerprint, "billing", "invoice.void", "k"),
        (text, fingerprint, "billing", "invoice.generate", None),
    ]
    with psycopg.connect(db_url) as conn:
        for mode, sql in call.items():
            for n, args in enumerate(wrong):
                with pytest.raises(psycopg.Error) as refused:
                    conn.execute(sql, (f"key:{mode}{n}", *args))
                conn.rollback()
                assert refused.value.sqlstate == SQLSTATE_INBOX_BODY_ALTERED, (mode, n)
            ((decision,),) = conn.execute(sql, (f"key:{mode}", *right)).fetchall()
            assert decision == "new", mode
            if mode == "begin":  # a record in progress may not commit (OB006): the claim's may
                conn.rollback()
            else:
                conn.commit()
    stored = rows(db_url, "SELECT key, fingerprint FROM outbox.inbox")
    assert [(k, bytes(f)) for k, f in stored] == [("key:claim", fingerprint)]

"""What the `http` provider refuses before sending, and what no payload can change, through the
dispatcher against loopback fakes: a bad row is quarantined with the reason, never sent, and
never holds up the rows behind it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import ProviderSettings
from outbox.providers.base import Provider
from outbox.providers.registry import build_providers
from outbox.testing.apis import FakeEffectsService, FakeSquare
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, rows, webhook
from tests.support.intent import assert_carries_intent, expected_intent


def http(name: str, base_url: str, **options: Any) -> Provider:
    table = {"base_url": base_url, **options}
    ps = ProviderSettings(name, "http", key_retention=timedelta(days=7), options=table)
    return build_providers({name: ps}, {})[name]


def enqueue(
    db_url: str, provider: str, action: str, payloads: Mapping[str, Any], **extra: Any
) -> dict[str, int]:
    ids = {}
    with psycopg.connect(db_url) as conn:
        for key, payload in payloads.items():
            ids[key] = outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="t",
                operation_key=key,
                provider=provider,
                action=action,
                payload=payload,
                **extra.get(key, {}),
            ).operation_id
    return ids


def outcome(db_url: str, op: int) -> tuple[str, str | None, int]:
    (row,) = rows(
        db_url,
        "SELECT status::text, last_error, (SELECT count(*) FROM outbox.attempts a "
        "WHERE a.operation_id = o.id AND a.sent) FROM outbox.operations o WHERE id = %s",
        (op,),
    )
    return row[0], row[1], int(row[2])


@pytest.fixture
def service() -> Iterator[FakeEffectsService]:
    with FakeEffectsService() as fake:
        yield fake


async def run(pool: AsyncConnectionPool[Any], providers: Mapping[str, Provider]) -> None:
    d = dispatcher(pool, providers)
    for _ in range(3):
        await d.run_once()
    for p in providers.values():
        await p.aclose()


async def test_what_the_provider_would_refuse_is_quarantined_unsent_and_the_rest_delivered(
    db_url: str, pool: AsyncConnectionPool[Any], service: FakeEffectsService
) -> None:
    actions = {"post": {"path": "/v1/effects"}, "by_account": {"path": "/v1/{/account}/effects"}}
    provider = http("svc", service.url, key={"max_length": 80}, actions=actions)
    long_key = {"too-long": {"idempotency_key": "k" * 81}}
    bad = enqueue(db_url, "svc", "post", {"too-long": {"n": 1}}, **long_key)
    bad |= enqueue(db_url, "svc", "by_account", {"no-account": {"n": 2}})
    bad |= enqueue(db_url, "svc", "refund", {"unknown-action": {"n": 3}})
    good = enqueue(db_url, "svc", "post", {f"good-{n}": {"n": n} for n in range(3)})
    await run(pool, {"svc": provider})
    causes = {
        "too-long": "81 characters; the provider takes at most 80",
        "no-account": "the payload has no /account",
        "unknown-action": "has no action 'refund'",
    }
    for name, op in bad.items():
        status, error, sent = outcome(db_url, op)
        assert (status, sent) == ("quarantined", 0), name
        assert error is not None and causes[name] in error, (name, error)
    assert all(outcome(db_url, op)[:1] == ("succeeded",) for op in good.values())
    assert len(service.effects) == len(good)  # the refused ones never reached the service


async def test_a_payload_cannot_choose_the_key_that_travels_in_the_body(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Two operations whose payloads carry the same idempotency_key field: each is sent with
    its own key (written over the field), so the API makes two payments, not one."""
    with FakeSquare() as square:
        provider = http(
            "square",
            square.url,
            key={"field": "/idempotency_key", "max_length": 45, "form": "uuid"},
            actions={"payments": {"path": "/v2/payments", "reference": "/payment/id"}},
        )
        forged = {"source_id": "cnon:card-nonce-ok", "idempotency_key": "shared-by-both"}
        money = {"amount_money": {"amount": 100, "currency": "USD"}}
        ids = enqueue(
            db_url,
            "square",
            "payments",
            {"one": {**forged, **money, "note": "1"}, "two": {**forged, **money, "note": "2"}},
        )
        await run(pool, {"square": provider})
        keys = [r.key for r in square.received]
        assert len(set(keys)) == 2 and "shared-by-both" not in keys
        assert len(square.effects) == 2
        assert {outcome(db_url, op)[0] for op in ids.values()} == {"succeeded"}


async def test_each_delivery_carries_its_origin_and_enqueues_fingerprint(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The webhook sends the payload as stored: its deliveries carry the database's origin and
    enqueue's fingerprint with the provider and the ordering key, which a receiver reads back
    exactly, whatever text the ordering key holds (sql/0045). An `http` action whose body is a
    part of the payload carries the origin only: its body could never match the fingerprint."""
    ordering = ['acct "7" \\ 50% café', "semi;colon=:,x", None]
    with psycopg.connect(db_url) as conn:
        ids = [
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="t",
                operation_key=f"k{n}",
                provider="hooks",
                action="invoice.paid",
                payload={"n": n, "amount": 1.50, "nested": {"b": 1, "a": [1e2]}},
                ordering_key=key,
            ).operation_id
            for n, key in enumerate(ordering)
        ]
        part = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="t",
            operation_key="part",
            provider="svc",
            action="post",
            payload={"inner": {"n": 1}},
        ).operation_id
    with FakeWebhookReceiver() as receiver, FakeWebhookReceiver() as other:
        hooks = webhook("hooks", receiver.url)
        base = other.url.removesuffix(other.path)
        svc = http(
            "svc",
            base,
            outbox_headers=True,
            key={"header": "Idempotency-Key"},
            actions={"post": {"path": other.path, "body": "/inner"}},
        )
        d = dispatcher(pool, {"hooks": hooks, "svc": svc})
        for _ in range(3):
            await d.run_once()
        await hooks.aclose()
        await svc.aclose()
        assert receiver.effect_count() == len(ids) and other.effect_count() == 1
        by_id = {int(e.headers["outbox-operation-id"]): e.headers for e in receiver.effects}
        for op in ids:
            assert_carries_intent(db_url, op, by_id[op])
        [effect] = other.effects
        origin, _, _ = expected_intent(db_url, part)
        assert effect.headers["outbox-origin"] == origin
        assert "outbox-fingerprint" not in effect.headers

"""A request that could not even be built is "not sent", never "unknown" (issue 21).

Before, httpx's refusal to encode a header value and h11's refusal to write one (CR, LF, a space
at either end) read as "connection failed after sending": the attempt was recorded as one that
may have reached the provider, retried inside its key window and then sent to reconciliation, for
a request no byte of which had left the host. A webhook operation of tenant "acme " (enqueue
takes it) went that way. Now identities a header cannot carry travel percent-encoded, and what
still cannot be built is recorded as not sent and quarantined as ``unencodable_request``
(outbox/providers/building.py), while the rest of the backlog is delivered.

Every test runs the real dispatcher against the fake providers. enqueue refuses the keys and
versions below, so those rows are written behind its back, as a superuser or a restore may
write them (tests/support/producers.plant does the same for payloads).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
import stripe
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.providers.base import Provider
from outbox.providers.http import wire as http_wire
from outbox.testing.stripe import FakeStripe
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, enqueue_charges, enqueue_many, rows, statuses

# Keys no request can carry as outbox sends them (1 to 255 visible ASCII characters).
BAD_KEYS = {
    "past Latin-1": "ob1_日本",
    "Latin-1": "ob1_é",
    "line feed": "ob1_a\nb",
    "carriage return": "ob1_a\rb",
    "space at the end": "ob1_a ",
    "inner space": "ob1_a b",
    "empty": "",
    "past 255": "k" * 256,
}
# Stripe-Version values no header carries: httpx cannot encode the first two, h11 refuses the rest.
BAD_VERSIONS = ["2026-10-28.endivé", "二〇二六", "2026-10-28.endive\n", " 2026-10-28.endive"]
GOOD = 3  # operations enqueued behind the unbuildable ones, each to be delivered once


def plant(
    db_url: str,
    *,
    provider: str,
    action: str,
    key: str,
    payload: str = '{"n": -1}',
    tenant: str = "acme",
    api_version: str | None = None,
) -> int:
    """A row written behind enqueue's back, with the key (and API version) given."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint, "
            "provider, action, payload, idempotency_key, api_version) "
            "VALUES (%s, 'poison', %s, sha256(%s::bytea), %s, %s, %s::jsonb, %s, %s) RETURNING id",
            (tenant, f"poison-{key!r}", key.encode(), provider, action, payload, key, api_version),
        ).fetchone()
    assert row is not None
    return int(row[0])


def assert_quarantined_unsent(db_url: str, ids: list[int], cause: str) -> None:
    """One attempt each, recorded not sent; quarantined as unencodable_request, no key window
    started, the cause in last_error."""
    attempts = rows(
        db_url,
        "SELECT operation_id, attempt, outcome, sent, error_class, "
        "error_message FROM outbox.attempts WHERE operation_id = ANY(%s) "
        "ORDER BY 1",
        (ids,),
    )
    assert [a[:5] for a in attempts] == [
        (i, 1, "permanent", False, "unencodable_request") for i in sorted(ids)
    ]
    assert all(cause in a[5] for a in attempts), attempts
    ops = rows(
        db_url,
        "SELECT status, status_reason, last_error_class, first_sent_at "
        "FROM outbox.operations WHERE id = ANY(%s)",
        (ids,),
    )
    assert ops == [("quarantined", "unencodable_request", "permanent", None)] * len(ids)


async def run(pool: AsyncConnectionPool[Any], providers: Mapping[str, Provider]) -> None:
    d = dispatcher(pool, providers)
    for _ in range(3):
        await d.run_once()


# --- the webhook -----------------------------------------------------------------------------


async def test_identities_a_header_cannot_carry_as_they_are_travel_percent_encoded(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """Legitimate tenants, actions and correlation ids, enqueued as any producer would: past
    ASCII, inner spaces (a space at either end is refused at enqueue since sql/0036), a "%".
    Each arrives percent-encoded UTF-8, decodes to itself, and no two arrive the same."""
    tenants = ["日本", "café", "a\u00a0b", "a  b", "50%", "caf%C3%A9", "a b", "acme"]
    with psycopg.connect(db_url) as conn:
        for i, tenant in enumerate(tenants):
            outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="t",
                operation_key=f"k{i}",
                provider="hook",
                action="invoice paid",
                payload={"n": i},
                correlation_id=f"req {i}",
            )
    await run(pool, {"hook": hook})
    assert statuses(db_url) == {"succeeded": len(tenants)}
    assert rows(db_url, "SELECT DISTINCT sent FROM outbox.attempts") == [(True,)]
    arrived = {r.body["n"]: r.headers for r in receiver.received}
    assert len(arrived) == len(tenants) and receiver.effect_count() == len(tenants)
    for i, tenant in enumerate(tenants):
        headers = arrived[i]
        assert urllib.parse.unquote(headers["outbox-tenant-id"]) == tenant
        assert urllib.parse.unquote(headers["outbox-action"]) == "invoice paid"
        assert urllib.parse.unquote(headers["outbox-correlation-id"]) == f"req {i}"
    assert arrived[tenants.index("acme")]["outbox-tenant-id"] == "acme"  # as before
    assert arrived[tenants.index("a b")]["outbox-tenant-id"] == "a b"
    assert arrived[tenants.index("a\u00a0b")]["outbox-tenant-id"] == "a%C2%A0b"
    assert len({h["outbox-tenant-id"] for h in arrived.values()}) == len(tenants)


async def test_a_webhook_row_whose_key_no_request_can_carry_is_quarantined_unsent(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    bad = [plant(db_url, provider="hook", action="invoice.paid", key=k) for k in BAD_KEYS.values()]
    enqueue_many(db_url, GOOD)
    await run(pool, {"hook": hook})
    assert len(receiver.received) == GOOD and receiver.effect_count() == GOOD
    assert_quarantined_unsent(db_url, bad, "its idempotency key is not 1 to 255 visible ASCII")
    assert statuses(db_url) == {"quarantined": len(bad), "succeeded": GOOD}


async def test_a_webhook_header_outbox_fails_to_encode_is_recorded_unsent(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The class, not the examples: with the tenant's encoding undone, httpx refuses "日本" and
    "café" while they are built. Both are recorded as not sent, naming the header."""
    monkeypatch.setattr(http_wire, "header_safe", lambda value: value)
    with psycopg.connect(db_url) as conn:
        bad = [
            outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="t",
                operation_key="k",
                provider="hook",
                action="invoice.paid",
                payload={},
            ).operation_id
            for tenant in ("日本", "café")
        ]
    enqueue_many(db_url, GOOD)
    await run(pool, {"hook": hook})
    assert len(receiver.received) == GOOD and receiver.effect_count() == GOOD
    assert_quarantined_unsent(db_url, bad, "the Outbox-Tenant-Id header cannot carry its value")
    assert statuses(db_url) == {"quarantined": len(bad), "succeeded": GOOD}


# --- Stripe ----------------------------------------------------------------------------------


async def test_a_stripe_row_whose_key_no_request_can_carry_is_quarantined_unsent(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    """The empty key too: the SDK would have sent that request with no Idempotency-Key."""
    bad = [
        plant(db_url, provider="stripe", action="customers.create", key=k, payload='{"name": "n"}')
        for k in BAD_KEYS.values()
    ]
    enqueue_charges(db_url, GOOD)
    await run(pool, {"stripe": provider})
    assert len(fake.received) == GOOD and fake.object_count() == GOOD
    assert_quarantined_unsent(db_url, bad, "its idempotency key is not 1 to 255 visible ASCII")
    assert statuses(db_url) == {"quarantined": len(bad), "succeeded": GOOD}


async def test_a_stripe_version_no_header_can_carry_is_quarantined_unsent(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    """The version an operation keeps from its first send goes out as Stripe-Version: one
    httpx cannot encode or h11 will not write fails inside the SDK's call, and is not sent."""
    bad = [
        plant(
            db_url,
            provider="stripe",
            action="customers.create",
            key=f"ob1_v{i}",
            payload='{"name": "n"}',
            api_version=v,
        )
        for i, v in enumerate(BAD_VERSIONS)
    ]
    enqueue_charges(db_url, GOOD)
    await run(pool, {"stripe": provider})
    assert len(fake.received) == GOOD and fake.object_count() == GOOD
    assert_quarantined_unsent(db_url, bad, "the Stripe-Version header cannot carry its value")
    assert statuses(db_url) == {"quarantined": len(bad), "succeeded": GOOD}


async def test_a_failure_of_the_sdk_before_it_hands_over_its_request_is_not_sent(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    provider: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An exception of the SDK's own, raised while it builds the request (here its headers),
    was taken for an answer it could not read ("unreadable_success", unknown)."""
    original = stripe._api_requestor._APIRequestor.request_headers

    def refuse(self: Any, method: Any, api_mode: Any, options: Any) -> Any:
        if options.get("idempotency_key") == "ob1_the_sdk_refuses":
            raise TypeError("the SDK cannot build this request")
        return original(self, method, api_mode, options)

    monkeypatch.setattr(stripe._api_requestor._APIRequestor, "request_headers", refuse)
    bad = plant(
        db_url,
        provider="stripe",
        action="customers.create",
        key="ob1_the_sdk_refuses",
        payload='{"name": "n"}',
    )
    enqueue_charges(db_url, GOOD)
    await run(pool, {"stripe": provider})
    assert len(fake.received) == GOOD and fake.object_count() == GOOD
    assert_quarantined_unsent(db_url, [bad], "it cannot be encoded (TypeError)")
    assert statuses(db_url) == {"quarantined": 1, "succeeded": GOOD}

"""The whole flow, for every Stripe action: send, the answer lost, the key window passes, then
the daemon's check and the on-call engineer's `outbox reconcile check` (issue 19).

Each action's object is found by its own list (with the filters its payload allows) and the
events of its creation, through the real stripe SDK against the fake; the operation succeeds
with the object's id, and nothing is sent twice.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.providers.stripe.actions import ACTIONS
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, make_due, rows, stripe_provider

PAYLOADS: dict[str, dict[str, Any]] = {
    "payment_intents.create": {"amount": 2500, "currency": "usd", "customer": "cus_1"},
    "refunds.create": {"payment_intent": "pi_1", "amount": 500},
    "customers.create": {"email": "ada@example.com", "name": "Ada"},
    "transfers.create": {
        "amount": 700,
        "currency": "usd",
        "destination": "acct_1",
        "transfer_group": "order-7",
    },
    "payouts.create": {"amount": 900, "currency": "usd"},
    "invoices.create": {
        "customer": "cus_1",
        "collection_method": "send_invoice",
        "days_until_due": 30,
    },
    "subscriptions.create": {"customer": "cus_1", "items": [{"price": "price_1"}]},
    "setup_intents.create": {"customer": "cus_1", "usage": "off_session"},
    "checkout.sessions.create": {
        "customer": "cus_1",
        "mode": "payment",
        "success_url": "https://example.com/ok",
        "line_items": [{"price": "price_1", "quantity": 1}],
    },
}

# A change: (its target's resource, the target's state before, the payload besides its id,
# the finding after the lost answer, the target's state after).
CHANGES: dict[str, tuple[str, str, dict[str, Any], str, str]] = {
    "payment_intents.confirm": (
        "payment_intents",
        "requires_confirmation",
        {"payment_method": "pm_card_visa"},
        "found",
        "succeeded",
    ),
    "payment_intents.capture": ("payment_intents", "requires_capture", {}, "found", "succeeded"),
    "payment_intents.cancel": (
        "payment_intents",
        "requires_payment_method",
        {"cancellation_reason": "abandoned"},
        "found",
        "canceled",
    ),
    "refunds.cancel": ("refunds", "pending", {}, "found", "canceled"),
    "invoices.finalize_invoice": ("invoices", "draft", {}, "found", "open"),
    "invoices.pay": ("invoices", "open", {}, "found", "paid"),
    "invoices.void_invoice": ("invoices", "open", {}, "found", "void"),
    # What an update changed cannot be read off the subscription: a person decides.
    "subscriptions.update": (
        "subscriptions",
        "active",
        {"metadata": {"plan": "gold"}},
        "undecided",
        "active",
    ),
    "subscriptions.cancel": ("subscriptions", "active", {}, "found", "canceled"),
}


# Changes whose absence the target's state cannot prove.
UNREADABLE_ABSENCE = frozenset({"invoices.pay", "subscriptions.update"})


async def lost_then_checked(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    check_env: dict[str, str],
    op: int,
    path: str,
) -> None:
    """Sent, applied, the answer lost; past the key window: reconciling. Then the daemon's
    periodic check, or `outbox reconcile check ID`."""
    stripe = stripe_provider("stripe", fake.url, timeout=0.5)
    try:
        d = dispatcher(pool, {"stripe": stripe})
        fake.inject(StripeFault.reset_after_apply())
        assert await d.run_once() == 1
        with psycopg.connect(db_url) as conn:  # Stripe forgets the key in half an hour
            conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
        make_due(db_url)
        assert await d.run_once() == 1
        assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
            ("reconciling", "key_window_passed")
        ]
        if path == "daemon":
            assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
        else:
            done = outbox_cli(check_env, "reconcile", "check", str(op))
            assert done.returncode == 0, done.stderr
    finally:
        await stripe.aclose()


def test_every_action_has_a_flow() -> None:
    assert set(PAYLOADS) | set(CHANGES) == set(ACTIONS)
    assert all(ACTIONS[a].is_change for a in CHANGES)
    assert not any(ACTIONS[a].is_change for a in PAYLOADS)


@pytest.mark.parametrize("path", ["daemon", "manual"])
@pytest.mark.parametrize("action", sorted(PAYLOADS))
async def test_a_lost_answer_past_the_key_window_is_found_and_succeeds(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    check_env: dict[str, str],
    action: str,
    path: str,
) -> None:
    resource = ACTIONS[action].service.replace(".", "/")
    with psycopg.connect(db_url) as conn:
        op = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="flow",
            operation_key="k-1",
            provider="stripe",
            action=action,
            payload=PAYLOADS[action],
        ).operation_id
    fake.seed_objects(resource, 150)  # a crowd created around it, by other requests
    await lost_then_checked(db_url, pool, fake, check_env, op, path)
    (mine,) = fake.objects_with_metadata("outbox_operation_id", str(op))
    assert rows(db_url, "SELECT status, provider_ref, check_finding FROM outbox.operations") == [
        ("succeeded", mine["id"], "found")
    ]
    assert sum(r.method == "POST" for r in fake.received) == 1
    assert fake.object_count(resource) == 151


def enqueue_change(db_url: str, fake: FakeStripe, action: str) -> tuple[int, str]:
    """A target in the state the change starts from, and the operation that changes it."""
    resource, before, params, _, _ = CHANGES[action]
    fake.seed_objects(resource, 1)
    target = fake.objects(resource)[-1]["id"]
    fake.update_object(target, status=before)
    with psycopg.connect(db_url) as conn:
        op = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="flow",
            operation_key="k-1",
            provider="stripe",
            action=action,
            payload={"id": target, **params},
        ).operation_id
    return op, target


@pytest.mark.parametrize("path", ["daemon", "manual"])
@pytest.mark.parametrize("action", sorted(CHANGES))
async def test_a_lost_change_past_the_key_window_is_decided_by_its_target(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    check_env: dict[str, str],
    action: str,
    path: str,
) -> None:
    """A change is sent to its target (the payload's id), applied once, its answer lost; the
    check retrieves the target and reads its state."""
    resource, _, _, finding, after = CHANGES[action]
    op, target = enqueue_change(db_url, fake, action)
    await lost_then_checked(db_url, pool, fake, check_env, op, path)
    (obj,) = [o for o in fake.objects(resource) if o["id"] == target]
    assert obj["status"] == after
    status = "succeeded" if finding == "found" else "reconciling"
    ref = target if finding == "found" else None
    assert rows(
        db_url, "SELECT status, provider_ref, check_finding, check_state FROM outbox.operations"
    ) == [(status, ref, finding, after)]
    (post,) = [r for r in fake.received if r.method in ("POST", "DELETE")]
    assert post.path.startswith(f"/v1/{resource}/{target}") and "id" not in post.params
    assert fake.object_count(resource) == 1


@pytest.mark.parametrize("action", sorted(CHANGES))
async def test_a_change_that_did_not_happen_is_not_found_and_may_be_retried(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, action: str
) -> None:
    """The request never reached Stripe (reset before it applied), the key window passed: the
    target's state says the change did not happen, a complete not-found, and a person's retry
    applies it once."""
    resource, _, _, _, after = CHANGES[action]
    op, target = enqueue_change(db_url, fake, action)
    stripe = stripe_provider("stripe", fake.url, timeout=0.5)
    try:
        d = dispatcher(pool, {"stripe": stripe})
        fake.inject(StripeFault.reset_before_apply())
        assert await d.run_once() == 1
        with psycopg.connect(db_url) as conn:
            conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
        make_due(db_url)
        assert await d.run_once() == 1
        with psycopg.connect(db_url) as conn:  # a check long after it proves the most
            conn.execute("UPDATE outbox.operations SET last_attempt_at = now() - interval '3h'")
        result = await Reconciler(pool, {"stripe": stripe}).run_once()
        assert result == 1
        # An open invoice may be a payment that failed: a person decides whether to pay again.
        expected = "undecided" if action in UNREADABLE_ABSENCE else "not_found"
        assert rows(db_url, "SELECT check_finding FROM outbox.operations") == [(expected,)]
        if expected == "not_found":
            with psycopg.connect(db_url, autocommit=True) as conn:
                operators.retry(conn, op, reason="not applied", actor="alice")
            assert await d.run_once() == 1
            assert rows(db_url, "SELECT status FROM outbox.operations") == [("succeeded",)]
            (obj,) = [o for o in fake.objects(resource) if o["id"] == target]
            assert obj["status"] == after
    finally:
        await stripe.aclose()


@pytest.mark.parametrize("target", [None, "", "cus_1", "pi_", "pi_1/capture", "pi_1\n", 7])
async def test_a_change_without_its_own_kind_of_target_is_refused_before_sending(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, target: object
) -> None:
    """The payload's id must name a PaymentIntent for a capture: nothing else is sent to."""
    payload: dict[str, Any] = {} if target is None else {"id": target}
    with psycopg.connect(db_url) as conn:
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="flow",
            operation_key="k-1",
            provider="stripe",
            action="payment_intents.capture",
            payload=payload,
        )
    stripe = stripe_provider("stripe", fake.url)
    try:
        assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    finally:
        await stripe.aclose()
    ((status, error),) = rows(db_url, "SELECT status, last_error FROM outbox.operations")
    assert status == "quarantined" and "must name the pi_... object" in error
    assert fake.received == []

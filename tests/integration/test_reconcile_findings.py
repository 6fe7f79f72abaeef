"""A reconciliation finding carries the state of the object found (issue 19, case 1).

A PaymentIntent whose confirmation the issuer declines exists at Stripe (requires_payment_method,
last_payment_error set) and Stripe saves the 402 under the key. Finding it is not finding the
payment: such an operation is quarantined as provider_declined with the decline's details, never
succeeded, whether the send path saw the 402 or lost it to a timeout.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Found, Lookup, NotFound, Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, make_due, rows, stripe_provider
from tests.support.lookups import lookup_request

DECLINED = {
    "amount": 2500,
    "currency": "usd",
    "customer": "cus_123",
    "confirm": True,
    "payment_method": "pm_card_chargeDeclined",
}
STATE = "SELECT status, status_reason, provider_ref, check_finding, check_state, last_error "
STATE += "FROM outbox.operations"
DECLINE = "card_declined: generic_decline: Your card was declined."


@pytest.fixture
async def stripe(fake: FakeStripe) -> AsyncIterator[Provider]:
    p = stripe_provider("stripe", fake.url, timeout=0.3)
    yield p
    await p.aclose()


def charge(url: str, payload: dict[str, Any], key: str = "inv-1") -> int:
    with psycopg.connect(url) as conn:
        return outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice.charge",
            operation_key=key,
            provider="stripe",
            action="payment_intents.create",
            payload=payload,
        ).operation_id


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    done = outbox_cli(env, *args)
    assert done.returncode == 0, done.stderr
    return done


def posts(fake: FakeStripe) -> int:
    return sum(r.method == "POST" for r in fake.received)


async def test_a_declined_charge_sent_to_reconciliation_is_quarantined_as_declined(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    check_env: dict[str, str],
) -> None:
    """The on-call path of the issue: quarantined by the 402, sent to reconciliation by a
    person, checked: back to quarantine, declined, never succeeded."""
    op = charge(db_url, DECLINED)
    assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    assert rows(
        db_url,
        "SELECT o.status, a.error_class FROM outbox.operations o "
        "JOIN outbox.attempts a ON a.operation_id = o.id",
    ) == [("quarantined", "http_402_card_declined")]
    (pi,) = fake.objects("payment_intents")  # the decline left its PaymentIntent
    cli(
        check_env,
        "quarantine",
        "reconcile",
        str(op),
        "--reason",
        "did it charge?",
        "--actor",
        "alice",
    )
    checked = cli(check_env, "reconcile", "check", str(op))
    assert "refused" in checked.stdout and "generic_decline" in checked.stdout
    assert rows(db_url, STATE) == [
        (
            "quarantined",
            "provider_declined",
            pi["id"],
            "refused",
            "requires_payment_method",
            DECLINE,
        )
    ]
    listed = cli(check_env, "quarantine", "list")
    assert "refused (requires_payment_method)" in listed.stdout
    shown = cli(check_env, "quarantine", "show", str(op))
    assert "last check   refused (object requires_payment_method)" in shown.stdout
    assert rows(db_url, "SELECT action, to_status FROM outbox.audit ORDER BY id") == [
        ("reconcile", "reconciling"),
        ("check", "quarantined"),
    ]
    assert posts(fake) == 1 and fake.object_count() == 1


async def test_a_decline_whose_answer_was_lost_is_quarantined_by_the_periodic_check(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """The decline executed and its 402 came too late: unknown, then past the key window, then
    the daemon's own check: quarantined as declined, with no resend."""
    charge(db_url, DECLINED)
    fake.inject(StripeFault.delay_after_apply(1.0))
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    fake.wait_idle(timeout=5)
    assert rows(db_url, "SELECT status, last_error_class FROM outbox.operations") == [
        ("pending", "unknown")
    ]
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    make_due(db_url)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("reconciling",)]
    assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
    (pi,) = fake.objects("payment_intents")
    assert rows(db_url, STATE) == [
        (
            "quarantined",
            "provider_declined",
            pi["id"],
            "refused",
            "requires_payment_method",
            DECLINE,
        )
    ]
    assert posts(fake) == 1


@pytest.mark.parametrize(
    ("payload", "state"),
    [
        ({"confirm": True, "payment_method": "pm_card_visa"}, "succeeded"),
        (
            {"confirm": True, "payment_method": "pm_card_visa", "capture_method": "manual"},
            "requires_capture",
        ),
        ({}, "requires_payment_method"),  # never confirmed: the object is the whole effect
    ],
)
async def test_a_payment_that_happened_is_found_and_succeeds(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    payload: dict[str, Any],
    state: str,
) -> None:
    op = charge(db_url, {"amount": 2500, "currency": "usd", **payload})
    fake.inject(StripeFault.reset_after_apply())  # created, and the answer lost on the wire
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    with psycopg.connect(db_url) as conn:  # past the key window
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    make_due(db_url)
    assert await d.run_once() == 1
    reconciler = Reconciler(pool, {"stripe": stripe})
    (check,) = await reconciler.candidates(op)
    result = await reconciler.check(check)
    (pi,) = fake.objects("payment_intents")
    assert (result.finding, result.state, result.reference) == ("found", state, pi["id"])
    ((*settled, error),) = rows(db_url, STATE)
    assert settled == ["succeeded", None, pi["id"], "found", state] and error


async def test_a_payment_awaiting_the_customer_stays_reconciling_until_its_state_decides(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """requires_action (3-D Secure): neither paid nor declined yet. Re-checked once it moved on."""
    op = charge(db_url, {"amount": 2500, "currency": "usd"})
    fake.inject(StripeFault.reset_after_apply())
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    (pi,) = fake.objects("payment_intents")
    fake.update_object(pi["id"], status="requires_action")
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.request_cancel(conn, op, reason="the customer left", actor="alice")
    reconciler = Reconciler(pool, {"stripe": stripe})
    (check,) = await reconciler.candidates(op)
    for _ in range(2):  # the same state twice is audited once
        assert (await reconciler.check(check)).finding == "undecided"
    assert rows(db_url, STATE)[0][:5] == (
        "reconciling",
        "cancel_requested",
        None,
        "undecided",
        "requires_action",
    )
    fake.update_object(pi["id"], status="canceled", cancellation_reason="abandoned")
    assert (await reconciler.check(check)).finding == "refused"
    assert rows(db_url, STATE) == [
        (
            "quarantined",
            "provider_declined",
            pi["id"],
            "refused",
            "canceled",
            "canceled: abandoned: refused by the provider",
        )
    ]
    audit = rows(db_url, "SELECT action, to_status FROM outbox.audit ORDER BY id")
    assert audit == [
        ("cancel_requested", "reconciling"),
        ("check", "reconciling"),
        ("check", "quarantined"),
    ]


@pytest.mark.parametrize("length", [40, 251, 252, 255])
async def test_every_generation_of_a_long_key_finds_the_first_generations_object(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider, length: int
) -> None:
    """Issue 19, case 2: a key too long for its :rN suffix takes a hashed form in later
    generations (outbox.key_for_generation); the lookup must still know the object its first
    generation made."""
    first = ("k" * length)[:length]
    with psycopg.connect(db_url) as conn:
        op = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice.charge",
            operation_key="long",
            provider="stripe",
            action="payment_intents.create",
            idempotency_key=first,
            payload={"amount": 2500, "currency": "usd"},
        ).operation_id
    fake.inject(StripeFault.reset_after_apply())
    assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    (pi,) = fake.objects("payment_intents")
    ((sent, last),) = rows(db_url, "SELECT first_sent_at, last_attempt_at FROM outbox.operations")
    assert isinstance(stripe, Lookup)
    for generation in (1, 2, 9, 10, 11):
        ((key,),) = rows(db_url, "SELECT outbox.key_for_generation(%s, %s)", (first, generation))
        assert len(key) <= 255
        found = await stripe.lookup(lookup_request("payment_intents.create", op, key, sent, last))
        assert isinstance(found, Found) and found.reference == pi["id"], (generation, key)
    other = await stripe.lookup(
        lookup_request("payment_intents.create", op, "another-key", sent, last)
    )
    assert isinstance(other, NotFound)


@pytest.mark.parametrize("path", ["daemon", "manual"])
async def test_after_reconcile_retry_the_check_still_finds_what_generation_1_made_hours_ago(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider, path: str
) -> None:
    """Issue 19, case 2: retry resets first_sent_at for the new generation's key window; the
    check must still search from generation 1's attempt."""
    op = charge(db_url, {"amount": 2500, "currency": "usd"})
    fake.inject(StripeFault.reset_after_apply())  # generation 1 creates the PaymentIntent, unseen
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    (pi,) = fake.objects("payment_intents")
    fake.update_object(pi["id"], created=pi["created"] - 3 * 3600)  # three hours ago, then
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("UPDATE outbox.attempt_log SET started_at = started_at - interval '3 hours'")
        conn.execute(
            "UPDATE outbox.operations SET first_sent_at = first_sent_at - "
            "interval '3 hours', last_attempt_at = last_attempt_at - interval '3 hours'"
        )
        who = {"reason": "no charge in the dashboard", "actor": "alice"}
        operators.request_cancel(conn, op, **who)
        operators.retry(conn, op, force=True, **who)  # generation 2, first_sent_at reset
        # It never reaches Stripe's ledger.
        fake.inject(StripeFault.status(503, error_type="api_error"))
        assert await d.run_once() == 1
        operators.request_cancel(conn, op, **who)
    assert rows(
        db_url,
        "SELECT status, key_generation, first_sent_at > now() - interval '1 hour' "
        "FROM outbox.operations",
    ) == [("reconciling", 2, True)]
    reconciler = Reconciler(pool, {"stripe": stripe})
    if path == "daemon":  # outbox run's periodic pass (outbox.claim_checks)
        assert await reconciler.run_once() == 1
    else:  # `outbox reconcile check ID`
        (check,) = await reconciler.candidates(op)
        assert (await reconciler.check(check)).finding == "found"
    assert rows(db_url, "SELECT status, provider_ref FROM outbox.operations") == [
        ("succeeded", pi["id"])
    ]
    assert fake.object_count() == 1

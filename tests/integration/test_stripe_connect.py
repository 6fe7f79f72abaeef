"""Connect per operation, and lookups that search where the operation was sent (issue 19).

An operation may name its connected account (payload field stripe_account, where the provider
allows it): it is sent with Stripe-Account and looked up in that account, whose objects the fake
keeps apart as Stripe does. A change of the provider's account or of its key's mode between the
send and the check used to search the wrong place and say "not found"; the check now says where
the operation went instead.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.dispatch import dispatcher, make_due, rows, stripe_provider

CHARGE = {"amount": 2500, "currency": "usd"}
STATE = "SELECT status, status_reason, check_finding, check_state FROM outbox.operations"


def enqueue(url: str, payload: dict[str, Any], key: str = "k-1") -> int:
    with psycopg.connect(url) as conn:
        return outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="t",
            operation_key=key,
            provider="stripe",
            action="payment_intents.create",
            payload=payload,
        ).operation_id


async def lost_past_the_window(
    url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    fake.inject(StripeFault.reset_after_apply())
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    with psycopg.connect(url) as conn:
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    make_due(url)
    assert await d.run_once() == 1
    assert rows(url, "SELECT status FROM outbox.operations") == [("reconciling",)]


async def test_an_operation_names_its_connected_account_for_the_send_and_the_lookup(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    stripe = stripe_provider("stripe", fake.url, operation_accounts=True, timeout=0.5)
    try:
        op = enqueue(db_url, {**CHARGE, "stripe_account": "acct_A"})
        await lost_past_the_window(db_url, pool, fake, stripe)
        assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
        enqueue(db_url, CHARGE, key="k-2")  # and one for the platform itself
        assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    finally:
        await stripe.aclose()
    (pi, platform) = fake.objects("payment_intents")
    assert "stripe_account" not in pi  # a header, never a parameter
    assert rows(
        db_url, "SELECT id, status, provider_ref, sent_scope FROM outbox.operations ORDER BY id"
    ) == [
        (op, "succeeded", pi["id"], "acct_A test"),
        (op + 1, "succeeded", platform["id"], "platform test"),
    ]
    assert {(r.method, r.account) for r in fake.received} == {
        ("POST", "acct_A"),
        ("GET", "acct_A"),
        ("POST", None),
    }


@pytest.mark.parametrize("account", ["acct_A", "acct_", "cus_1", 7, "acct_A\n", ""])
async def test_an_account_per_operation_is_refused_unless_the_provider_allows_it(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, account: object
) -> None:
    """A producer must not send on another account's behalf by default; where allowed, only
    an account id is one."""
    allowed = account != "acct_A"
    stripe = stripe_provider("stripe", fake.url, operation_accounts=allowed)
    try:
        enqueue(db_url, {**CHARGE, "stripe_account": account})
        assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    finally:
        await stripe.aclose()
    ((status, error),) = rows(db_url, "SELECT status, last_error FROM outbox.operations")
    assert status == "quarantined" and "stripe_account" in error
    assert fake.received == []


@pytest.mark.parametrize("change", ["account", "mode"])
async def test_a_check_after_the_account_or_the_keys_mode_changed_says_where_it_was_sent(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, change: str
) -> None:
    before = stripe_provider("stripe", fake.url, stripe_account="acct_A", timeout=0.5)
    try:
        op = enqueue(db_url, CHARGE)
        await lost_past_the_window(db_url, pool, fake, before)
    finally:
        await before.aclose()
    if change == "mode":
        fake.set_api_key("sk_live_fake")
        after = stripe_provider("stripe", fake.url, stripe_account="acct_A", api_key="sk_live_fake")
    else:
        after = stripe_provider("stripe", fake.url, stripe_account="acct_B")
    gets = sum(r.method == "GET" for r in fake.received)
    try:
        reconciler = Reconciler(pool, {"stripe": after})
        (row,) = await reconciler.candidates(op)
        result = await reconciler.check(row)
    finally:
        await after.aclose()
    assert (
        result.finding == "undecided" and "it was sent to acct_A test" in result.details["reason"]
    )
    assert rows(db_url, STATE) == [
        ("reconciling", "key_window_passed", "undecided", "search incomplete")
    ]
    assert sum(r.method == "GET" for r in fake.received) == gets  # searched nowhere wrong
    assert fake.object_count() == 1

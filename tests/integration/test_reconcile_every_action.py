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
from outbox.providers.fakes.stripe import FakeStripe, Fault
from outbox.providers.stripe import ACTIONS
from outbox.reconciler import Reconciler
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, make_due, rows, stripe_provider

PAYLOADS: dict[str, dict[str, Any]] = {
    "payment_intents.create": {"amount": 2500, "currency": "usd", "customer": "cus_1"},
    "refunds.create": {"payment_intent": "pi_1", "amount": 500},
    "customers.create": {"email": "ada@example.com", "name": "Ada"},
    "transfers.create": {"amount": 700, "currency": "usd", "destination": "acct_1",
                         "transfer_group": "order-7"},
    "payouts.create": {"amount": 900, "currency": "usd"},
    "invoices.create": {"customer": "cus_1", "collection_method": "send_invoice",
                        "days_until_due": 30},
    "subscriptions.create": {"customer": "cus_1", "items": [{"price": "price_1"}]},
}  # fmt: skip


def test_every_action_has_a_flow() -> None:
    assert set(PAYLOADS) == set(ACTIONS)


@pytest.mark.parametrize("path", ["daemon", "manual"])
@pytest.mark.parametrize("action", sorted(PAYLOADS))
async def test_a_lost_answer_past_the_key_window_is_found_and_succeeds(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, check_env: dict[str, str],
    action: str, path: str,
) -> None:  # fmt: skip
    resource = ACTIONS[action]
    with psycopg.connect(db_url) as conn:
        op = outbox.enqueue(conn, tenant_id="acme", operation_type="flow", operation_key="k-1",
                            provider="stripe", action=action,
                            payload=PAYLOADS[action]).operation_id  # fmt: skip
    fake.seed_objects(resource, 150)  # a crowd created around it, by other requests
    stripe = stripe_provider("stripe", fake.url, timeout=0.5)
    try:
        d = dispatcher(pool, {"stripe": stripe})
        fake.inject(Fault.reset_after_apply())  # created, and the answer lost on the wire
        assert await d.run_once() == 1
        with psycopg.connect(db_url) as conn:  # Stripe forgets the key in half an hour
            conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
        make_due(db_url)
        assert await d.run_once() == 1
        assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
            ("reconciling", "key_window_passed")]  # fmt: skip
        if path == "daemon":
            assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
        else:
            done = outbox_cli(check_env, "reconcile", "check", str(op))
            assert done.returncode == 0, done.stderr
    finally:
        await stripe.aclose()
    (mine,) = fake.objects_with_metadata("outbox_operation_id", str(op))
    assert rows(db_url, "SELECT status, provider_ref, check_finding FROM outbox.operations") == [
        ("succeeded", mine["id"], "found")]  # fmt: skip
    assert sum(r.method == "POST" for r in fake.received) == 1
    assert fake.object_count(resource) == 151

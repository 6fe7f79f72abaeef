"""A reconciliation check never says "not found" while the effect exists (issue 19, cases 2, 3).

The on-call engineer retries an operation the check did not find: a false not-found is a second
charge. Each test sets up a way the lookup used to miss an object that exists (deleted, canceled,
created past the window's end, buried under other objects, behind a list that never ends) and
asserts what the check records, and that nothing was sent twice.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import ProviderLimits
from outbox.db.store import Store
from outbox.dispatch.pauses import LookupPacer, LookupThrottled
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Found, Lookup, NotFound, Provider, SendRequest, Succeeded
from outbox.providers.stripe.lookup import LOOKUP_MAX_PAGES
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, make_due, rows, stripe_provider
from tests.support.lookups import lookup_request

STATE = "SELECT status, provider_ref, check_finding, check_state FROM outbox.operations"


@pytest.fixture
async def stripe(fake: FakeStripe) -> AsyncIterator[Provider]:
    p = stripe_provider("stripe", fake.url, timeout=0.3)
    yield p
    await p.aclose()


def enqueue(url: str, action: str, payload: dict[str, Any], key: str = "k-1") -> int:
    with psycopg.connect(url) as conn:
        return outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="t",
            operation_key=key,
            provider="stripe",
            action=action,
            payload=payload,
        ).operation_id


async def lost_then_reconciling(
    url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    *,
    hours_ago: float = 0,
) -> None:
    """Send every pending operation once with its answer lost, then past its key window:
    reconciling. ``hours_ago`` moves the attempts (not the objects) back in time."""
    fake.inject(StripeFault.reset_after_apply())
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    make_due(url)
    assert await d.run_once() == 1
    assert rows(url, "SELECT status FROM outbox.operations") == [("reconciling",)]
    if hours_ago:
        shift = timedelta(hours=hours_ago)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE outbox.attempt_log SET started_at = started_at - %s", (shift,))
            conn.execute(
                "UPDATE outbox.operations SET first_sent_at = first_sent_at - %s, "
                "last_attempt_at = last_attempt_at - %s",
                (shift, shift),
            )


def posts(fake: FakeStripe) -> int:
    return sum(r.method == "POST" for r in fake.received)


def gets(fake: FakeStripe) -> int:
    return sum(r.method == "GET" for r in fake.received)


async def test_a_deleted_customer_is_found_by_the_event_of_its_creation(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """Deleted customers drop out of /v1/customers; the customer.created event names the key."""
    enqueue(db_url, "customers.create", {"email": "ada@example.com"})
    await lost_then_reconciling(db_url, pool, fake, stripe)
    (customer,) = fake.objects("customers")
    fake.delete_object(customer["id"])
    assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
    assert rows(db_url, STATE) == [("succeeded", customer["id"], "found", "deleted")]
    assert posts(fake) == 1 and fake.object_count() == 1


async def test_a_deleted_draft_invoice_is_undecided_and_never_not_found(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    check_env: dict[str, str],
) -> None:
    op = enqueue(db_url, "invoices.create", {"customer": "cus_1"})
    await lost_then_reconciling(db_url, pool, fake, stripe)
    (invoice,) = fake.objects("invoices")
    fake.delete_object(invoice["id"])  # retrieved as 404 from now on
    assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
    assert rows(db_url, STATE) == [("reconciling", None, "undecided", "deleted")]
    ((ref,),) = rows(
        db_url, "SELECT details->>'provider_ref' FROM outbox.audit WHERE action = 'check'"
    )
    assert ref == invoice["id"]
    with psycopg.connect(db_url, autocommit=True) as conn, pytest.raises(operators.ActionRefused):
        operators.retry(conn, op, reason="not found?", actor="alice")  # not without --force
    assert posts(fake) == 1


async def test_a_canceled_subscription_is_found(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """Stripe leaves canceled subscriptions out of its list unless asked for status=all."""
    enqueue(db_url, "subscriptions.create", {"customer": "cus_1", "items": [{"price": "p_1"}]})
    await lost_then_reconciling(db_url, pool, fake, stripe)
    (sub,) = fake.objects("subscriptions")
    fake.update_object(sub["id"], status="canceled")
    assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
    assert rows(db_url, STATE) == [("succeeded", sub["id"], "found", "canceled")]


async def test_each_recheck_searches_up_to_the_check_before_it(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """An object Stripe dates past the last attempt and its hour of slack (clocks that disagree,
    a request Stripe ran late) is found once the window's end has grown to the last check."""
    enqueue(db_url, "payment_intents.create", {"amount": 100, "currency": "usd"})
    await lost_then_reconciling(db_url, pool, fake, stripe, hours_ago=3)
    reconciler = Reconciler(pool, {"stripe": stripe})
    assert await reconciler.run_once() == 1
    assert rows(db_url, STATE) == [("reconciling", None, "not_found", None)]
    assert await reconciler.run_once(recheck_after=timedelta(0)) == 1
    (pi,) = fake.objects("payment_intents")
    assert rows(db_url, STATE) == [("succeeded", pi["id"], "found", "requires_payment_method")]
    assert posts(fake) == 1


async def test_a_search_stopped_by_its_page_cap_is_undecided_with_the_reason(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    check_env: dict[str, str],
) -> None:
    """More objects in the window than the cap reads, and nothing to narrow by: no proof of
    absence, so undecided (a retry needs --force), in a bounded number of requests."""
    op = enqueue(db_url, "payment_intents.create", {"amount": 100, "currency": "usd"})
    fake.inject(StripeFault.status(503, error_type="api_error"))  # nothing created
    d = dispatcher(pool, {"stripe": stripe})
    assert await d.run_once() == 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.request_cancel(conn, op, reason="stuck", actor="alice")
    fake.seed_objects("payment_intents", LOOKUP_MAX_PAGES * 100 + 1, amount=1, currency="usd")
    before = gets(fake)
    checked = outbox_cli(check_env, "reconcile", "check", str(op))
    assert checked.returncode == 0, checked.stderr
    assert "undecided" in checked.stdout and "stopped after" in checked.stdout
    assert gets(fake) - before == 2 * LOOKUP_MAX_PAGES  # objects, then events
    assert rows(db_url, STATE) == [("reconciling", None, "undecided", "search incomplete")]
    shown = outbox_cli(check_env, "reconcile", "show", str(op))
    assert "incomplete   payment_intents: stopped after" in shown.stdout
    with psycopg.connect(db_url, autocommit=True) as conn, pytest.raises(operators.ActionRefused):
        operators.retry(conn, op, reason="not found?", actor="alice")
    assert fake.object_count("payment_intents") == LOOKUP_MAX_PAGES * 100 + 1


async def test_the_payloads_list_filters_narrow_the_search_past_the_crowd(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    check_env: dict[str, str],
) -> None:
    """The customer narrows /v1/payment_intents: found at once among thousands of others."""
    enqueue(
        db_url, "payment_intents.create", {"amount": 100, "currency": "usd", "customer": "cus_mine"}
    )
    await lost_then_reconciling(db_url, pool, fake, stripe)
    fake.seed_objects("payment_intents", LOOKUP_MAX_PAGES * 100 * 2, customer="cus_other")
    before = gets(fake)
    assert await Reconciler(pool, {"stripe": stripe}).run_once() == 1
    mine = fake.objects_with_metadata(
        "outbox_idempotency_key",
        rows(db_url, "SELECT idempotency_key FROM outbox.operations")[0][0],
    )
    assert rows(db_url, STATE) == [("succeeded", mine[0]["id"], "found", "requires_payment_method")]
    (page,) = [r for r in fake.received[before:] if r.method == "GET"]
    assert page.params["customer"] == "cus_mine"


async def test_a_list_that_never_ends_costs_a_bounded_number_of_requests(
    fake: FakeStripe, stripe: Provider
) -> None:
    """A broken API answering has_more for ever, the same page each time, or an empty one."""
    assert isinstance(stripe, Lookup)
    fake.seed_objects("refunds", 3, payment_intent="pi_1")
    fake.answer_lists_endlessly()
    now = datetime.now(UTC)
    found = await stripe.lookup(lookup_request("refunds.create", 1, "k", now, now))
    assert isinstance(found, NotFound) and not found.complete
    assert found.reason is not None and "gave nothing new" in found.reason
    assert gets(fake) <= 4  # two pages a source: the second repeats the first


async def test_a_not_found_says_what_it_searched(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    stripe: Provider,
    check_env: dict[str, str],
) -> None:
    op = enqueue(
        db_url, "payment_intents.create", {"amount": 1, "currency": "usd", "customer": "cus_9"}
    )
    fake.inject(StripeFault.status(503, error_type="api_error"))
    assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.request_cancel(conn, op, reason="stuck", actor="alice")
        # Sent 40 days ago: older than the events Stripe keeps.
        conn.execute("UPDATE outbox.attempt_log SET started_at = now() - interval '40 days'")
    checked = outbox_cli(check_env, "reconcile", "check", str(op))
    assert checked.returncode == 0, checked.stderr
    assert "not_found" in checked.stdout
    assert "searched payment_intents (customer), events from" in checked.stdout
    shown = outbox_cli(check_env, "reconcile", "show", str(op))
    assert "searched     payment_intents (customer), events from" in shown.stdout
    ((details,),) = rows(db_url, "SELECT check_details FROM outbox.operations")
    since = datetime.fromisoformat(details["since"])
    assert datetime.now(UTC) - since > timedelta(days=40)  # from the first attempt, less slack


def _request(op: int, key: str, action: str, payload: dict[str, Any]) -> SendRequest:
    return SendRequest(op, "acme", "t", f"k{op}", action, payload, key, None, 1)


@pytest.mark.parametrize("seed", range(3))
async def test_randomized_fates_never_yield_a_false_not_found(
    fake: FakeStripe, stripe: Provider, seed: int
) -> None:
    """Seeded workloads: each operation's object made or not, deleted or not, under one of
    several key generations, among a random crowd. A complete not-found is never said of an
    operation whose object exists, and a found names its own object."""
    assert isinstance(stripe, Lookup)
    rng = random.Random(seed)
    start = datetime.now(UTC)
    made: dict[int, str] = {}
    cases = []
    for op in range(1, 31):
        action = rng.choice(["customers.create", "payment_intents.create", "refunds.create"])
        payloads: dict[str, dict[str, Any]] = {
            "customers.create": {"email": f"u{op}@example.com"},
            "payment_intents.create": {"amount": 1, "currency": "usd"},
            "refunds.create": {"payment_intent": f"pi_{op}"},
        }
        payload = payloads[action]
        generation = rng.randint(1, 3)
        keys = [f"k{op}"] + [f"k{op}:r{g}" for g in range(2, generation + 1)]
        if rng.random() < 0.6:  # one of its generations reached Stripe
            sent = await stripe.send(_request(op, rng.choice(keys), action, payload))
            assert isinstance(sent, Succeeded)
            made[op] = sent.reference
            if action == "customers.create" and rng.random() < 0.5:
                fake.delete_object(sent.reference)
        cases.append((op, action, payload, keys))
        fake.seed_objects(action.split(".")[0], rng.randint(0, 40))
    now = datetime.now(UTC)
    for op, action, payload, keys in cases:
        given = payload if rng.random() < 0.5 else {}
        answer = await stripe.lookup(
            lookup_request(action, op, keys[-1], start, now, keys=keys, payload=given)
        )
        if op in made:
            assert isinstance(answer, Found) and answer.reference == made[op], (seed, op)
        else:
            assert isinstance(answer, NotFound) and answer.complete, (seed, op)


async def test_lookups_go_through_the_providers_rate_limit(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """Each request of a lookup takes a token of the shared bucket: six pages at 20 a second
    (burst 1) span at least a quarter of a second, whatever else the machine does."""
    op = enqueue(db_url, "payment_intents.create", {"amount": 1, "currency": "usd"})
    fake.inject(StripeFault.status(503, error_type="api_error"))
    assert await dispatcher(pool, {"stripe": stripe}).run_once() == 1
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.request_cancel(conn, op, reason="stuck", actor="alice")
    fake.seed_objects("payment_intents", 250, amount=1, currency="usd")
    before = len(fake.received)
    limits = {"stripe": ProviderLimits(rate=20.0, burst=1)}
    reconciler = Reconciler(pool, {"stripe": stripe}, limits=limits)
    (row,) = await reconciler.candidates(op)
    assert (await reconciler.check(row)).finding == "not_found"
    pages = [r.at for r in fake.received[before:]]
    assert len(pages) == 6  # three pages of objects, three of events
    assert pages[-1] - pages[0] >= (len(pages) - 1) / 20.0 * 0.9


async def test_a_lookup_that_waits_too_long_for_a_token_fails_and_is_retried_later(
    pool: AsyncConnectionPool[Any],
) -> None:
    limits = {"stripe": ProviderLimits(rate=1.0, burst=1)}
    pacer = LookupPacer(Store(pool), limits, max_wait=timedelta(seconds=0.3))
    await Store(pool).throttle_bucket("stripe", 1.0, 1, timedelta(hours=1))  # a 429's debt
    pace = pacer.pace("stripe")
    assert pace is not None and pacer.pace("other") is None
    with pytest.raises(LookupThrottled):
        await pace()

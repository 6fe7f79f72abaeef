"""Reconciliation against the fake Stripe: an operation whose key window passed is never resent
blindly; the reconciler finds its effect or records that there is none, and a person retries."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderLimits
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Found, NotFound, Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import (
    dispatcher,
    enqueue_charges,
    key_of,
    make_due,
    rows,
    stripe_provider,
)
from tests.support.lookups import lookup_request


@pytest.fixture
async def provider(fake: FakeStripe) -> AsyncIterator[Provider]:
    p = stripe_provider("stripe", fake.url, timeout=0.3)
    yield p
    await p.aclose()


async def unknown_then_past_the_window(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> int:
    """An attempt with an unknown outcome, then time passes beyond the key window."""
    (op,) = enqueue_charges(db_url, 1)
    d = dispatcher(pool, {"stripe": provider})
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, last_error_class FROM outbox.operations") == [
        ("pending", "unknown")
    ]
    fake.wait_idle(timeout=5)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    make_due(db_url)
    requests = len(fake.received)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "key_window_passed")
    ]
    assert len(fake.received) == requests  # no blind resend
    return op


async def test_an_effect_stripe_applied_is_found_and_the_operation_succeeds_with_its_id(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    provider: Provider,
    check_env: dict[str, str],
) -> None:
    fake.inject(StripeFault.delay_after_apply(1.0))  # applied, but the answer comes too late
    op = await unknown_then_past_the_window(db_url, pool, fake, provider)
    assert fake.object_count() == 1

    dry = outbox_cli(check_env, "reconcile", "check", str(op), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)[0]["finding"] == "found"
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("reconciling",)]

    done = outbox_cli(check_env, "reconcile", "check", str(op))
    assert done.returncode == 0, done.stderr
    (obj,) = fake.objects()
    assert obj["id"] in done.stdout
    assert rows(db_url, "SELECT status, provider_ref, check_finding FROM outbox.operations") == [
        ("succeeded", obj["id"], "found")
    ]
    assert rows(
        db_url, "SELECT actor, action, to_status, details->>'provider_ref' FROM outbox.audit"
    ) == [("outbox-reconciler (manual)", "check", "succeeded", obj["id"])]
    assert fake.object_count() == 1


async def test_an_effect_stripe_never_applied_is_recorded_missing_then_retried_once(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    provider: Provider,
    check_env: dict[str, str],
) -> None:
    fake.inject(StripeFault.reset_before_apply())  # the connection dies; nothing was created
    op = await unknown_then_past_the_window(db_url, pool, fake, provider)
    first_key = key_of(db_url, op)
    with psycopg.connect(db_url) as conn:  # a check right after an attempt proves little
        conn.execute("UPDATE outbox.operations SET last_attempt_at = now() - interval '5 minutes'")

    checked = outbox_cli(check_env, "reconcile", "check", "--all")
    assert checked.returncode == 0, checked.stderr
    assert "not_found" in checked.stdout
    assert rows(db_url, "SELECT status, check_finding FROM outbox.operations") == [
        ("reconciling", "not_found")
    ]

    retried = outbox_cli(check_env, "reconcile", "retry", str(op), "--reason", "not at Stripe")
    assert retried.returncode == 0, retried.stderr
    assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
    (obj,) = fake.objects()
    assert obj["metadata"]["outbox_idempotency_key"] == f"{first_key}:r2"
    assert rows(db_url, "SELECT status, provider_ref FROM outbox.operations") == [
        ("succeeded", obj["id"])
    ]


async def test_the_periodic_reconciler_finds_a_500_that_stripe_rolled_forward(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    enqueue_charges(db_url, 1)
    fake.inject(StripeFault.error_500_after_apply())  # created, saved 500: indeterminate
    d = dispatcher(pool, {"stripe": provider})
    assert await d.run_once() == 1
    make_due(db_url)
    assert await d.run_once() == 1  # the replay answers the same saved 500
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "indeterminate_provider_error")
    ]
    checker = Reconciler(pool, {"stripe": provider})
    assert await checker.run_once() == 1
    (obj,) = fake.objects()
    assert rows(db_url, "SELECT status, provider_ref FROM outbox.operations") == [
        ("succeeded", obj["id"])
    ]
    assert await checker.run_once() == 0


async def test_a_not_found_is_audited_once_however_often_it_is_checked(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    fake.inject(StripeFault.reset_before_apply())
    await unknown_then_past_the_window(db_url, pool, fake, provider)
    checker = Reconciler(pool, {"stripe": provider})
    for _ in range(3):
        assert await checker.run_once(recheck_after=timedelta(0)) == 1
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [(1,)]
    assert rows(
        db_url,
        "SELECT check_finding, checked_at > now() - interval '1 minute' FROM outbox.operations",
    ) == [("not_found", True)]


def test_check_needs_an_id_or_all(check_env: dict[str, str]) -> None:
    done = outbox_cli(check_env, "reconcile", "check")
    assert done.returncode == 2 and "give an operation ID, or select several" in done.stderr


async def test_the_lookup_pages_through_lists_and_reports_duplicate_effects(
    fake: FakeStripe, provider: Provider
) -> None:
    from datetime import UTC, datetime  # noqa: PLC0415

    from outbox.providers.stripe.provider import StripeProvider  # noqa: PLC0415

    assert isinstance(provider, StripeProvider)
    import stripe  # noqa: PLC0415

    http = stripe.HTTPXClient()
    client = stripe.StripeClient("sk_test_fake", base_addresses={"api": fake.url}, http_client=http)
    try:
        # Operation 42's key family twice (generations 1 and 2), 150 others, and an object that
        # claims operation 42 under a foreign key (another database's operation 42).
        for n, key in (
            (42, "k42"),
            *((n, f"k{n}") for n in range(1000, 1150)),
            (42, "someone-else"),
            (42, "k42:r2"),
        ):
            await client.v1.payment_intents.create_async(
                params={
                    "amount": 100,
                    "currency": "usd",
                    "metadata": {"outbox_operation_id": str(n), "outbox_idempotency_key": key},
                }
            )
    finally:
        await http.close_async()  # type: ignore[no-untyped-call]
    objects = fake.objects("payment_intents")
    first, last = objects[0], objects[-1]
    now = datetime.now(UTC)
    found = await provider.lookup(lookup_request("payment_intents.create", 42, "k42:r2", now, now))
    assert isinstance(found, Found)
    assert (found.reference, found.duplicates) == (first["id"], (last["id"],))
    missing = await provider.lookup(lookup_request("payment_intents.create", 7, "k7", now, now))
    assert isinstance(missing, NotFound) and missing.complete
    pages = [r for r in fake.received if r.method == "GET"]
    assert len(pages) >= 4  # 152 objects, 100 a page, twice


async def test_an_operator_sends_a_quarantined_operation_to_the_reconciler(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    provider: Provider,
    check_env: dict[str, str],
) -> None:
    (op,) = enqueue_charges(db_url, 1)
    fake.inject(StripeFault.delay_after_apply(1.0))  # applied; the answer comes too late
    d = dispatcher(pool, {"stripe": provider}, max_attempts=1)
    assert await d.run_once() == 1
    # In doubt, so reconciling (docs/design.md, "Attempts"); outbox before issue 37 quarantined
    # it as attempts_exhausted, and such rows stay in databases it ran on: one is made so here.
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "indeterminate_provider_error")
    ]
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'attempts_exhausted'"
        )
    fake.wait_idle(timeout=5)
    sent = outbox_cli(
        check_env,
        "quarantine",
        "reconcile",
        str(op),
        "--reason",
        "did the charge happen?",
        "--actor",
        "carol",
    )
    assert sent.returncode == 0, sent.stderr
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "operator_request")
    ]
    assert await Reconciler(pool, {"stripe": provider}).run_once() == 1
    (obj,) = fake.objects()
    assert rows(db_url, "SELECT status, provider_ref FROM outbox.operations") == [
        ("succeeded", obj["id"])
    ]
    assert rows(db_url, "SELECT actor, action, to_status FROM outbox.audit ORDER BY id") == [
        ("carol", "reconcile", "reconciling"),
        ("outbox-reconciler", "check", "succeeded"),
    ]


async def test_the_periodic_reconciler_skips_providers_it_cannot_ask(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    from tests.support.dispatch import enqueue_many  # noqa: PLC0415

    hooks = enqueue_many(db_url, 150, provider="hook")  # older, and nobody can ask about them
    (charge,) = enqueue_charges(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', attempts = 1, "
            "first_sent_at = now(), last_attempt_at = now()"
        )
    from tests.support.dispatch import webhook  # noqa: PLC0415

    hook = webhook("hook", "http://127.0.0.1:9/")  # a webhook has no lookup
    try:
        checker = Reconciler(pool, {"stripe": provider, "hook": hook})
        assert await checker.run_once() == 1  # only the Stripe operation, despite 150 older
    finally:
        await hook.aclose()
    assert rows(db_url, "SELECT check_finding FROM outbox.operations WHERE id = %s", (charge,)) == [
        ("not_found",)
    ]
    assert len(hooks) == 150


def test_sql_guards_null_force_stale_findings_blank_refs_and_audit_deletes(db_url: str) -> None:
    from tests.support.dispatch import enqueue_many  # noqa: PLC0415

    (op,) = enqueue_many(db_url, 1)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', attempts = 1, "
            "last_attempt_at = now() - interval '1 hour' WHERE id = %s",
            (op,),
        )
        with pytest.raises(psycopg.Error, match="was not checked"):
            conn.execute("SELECT outbox.retry_operation(%s, 'r', 'me', NULL)", (op,))
        stale = conn.execute("SELECT outbox.record_check(%s, NULL, 'r', '{}', 2, 1)", (op,))
        assert stale.fetchone() == ("stale",)  # checked for a key generation it no longer has
        with pytest.raises(psycopg.Error, match="must give its reference"):
            conn.execute("SELECT outbox.record_check(%s, '  ', 'r', '{}', 1, 1)", (op,))
        assert conn.execute(
            "SELECT outbox.record_check(%s, NULL, 'r', NULL, 1, 1)", (op,)
        ).fetchone() == ("reconciling",)
        with pytest.raises(psycopg.Error, match="DELETE is refused"):
            conn.execute("DELETE FROM outbox.audit")
        with pytest.raises(psycopg.Error, match="TRUNCATE is refused"):
            conn.execute("TRUNCATE outbox.audit")
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [(1,)]


async def test_replicas_reconciling_at_once_look_each_operation_up_once(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    """Every replica runs a reconciler: each operation is claimed by one of them, so the
    provider is asked once and nobody reports the others' findings as a stranger's effect."""
    for n in range(6):
        enqueue_charges(db_url, 1, prefix=f"race-{n}")
        fake.inject(StripeFault.error_500_after_apply())  # created, saved 500: indeterminate
    # Six 500s in a row would open Stripe's circuit breaker; this test is about reconcilers.
    limits = {"stripe": ProviderLimits(breaker_failures=100)}
    d = dispatcher(pool, {"stripe": provider}, limits=limits)
    assert await d.run_once() == 6
    make_due(db_url)
    assert await d.run_once() == 6  # the replays answer the same saved 500s
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("reconciling", 6)
    ]
    gets_before = len([r for r in fake.received if r.method == "GET"])
    replicas = [Reconciler(pool, {"stripe": provider}, actor=f"replica-{n}") for n in range(3)]
    results: list[str] = []
    with structlog.testing.capture_logs() as logs:
        checked = await asyncio.gather(
            *(r.run_once(on_result=lambda res: results.append(res.finding)) for r in replicas)
        )
    assert sum(checked) == 6
    assert results == ["found"] * 6
    assert not [e for e in logs if e["log_level"] == "error"]
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("succeeded", 6)
    ]
    lookups = len([r for r in fake.received if r.method == "GET"]) - gets_before
    assert lookups <= 6 * 2  # one lookup each (a list page or two), not one per replica


async def test_a_failed_lookup_is_due_again_in_minutes_not_an_hour(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    fake.inject(StripeFault.error_500_after_apply())
    (op,) = enqueue_charges(db_url, 1)
    d = dispatcher(pool, {"stripe": provider})
    assert await d.run_once() == 1
    make_due(db_url)
    assert await d.run_once() == 1
    fake.inject(StripeFault.status(503, error_type="api_error"), times=5)  # the lookup fails
    checker = Reconciler(pool, {"stripe": provider})
    with structlog.testing.capture_logs() as logs:
        assert await checker.run_once() == 1
    (event,) = [e for e in logs if e["event"] == "reconciliation check"]
    assert (event["outcome"], event["error_class"]) == ("error", "APIError")
    ((due_in,),) = rows(
        db_url,
        "SELECT extract(epoch FROM checked_at + interval '1 hour' "
        "- now()) FROM outbox.operations WHERE id = %s",
        (op,),
    )
    assert 200 < due_in <= 300  # ERROR_RETRY (5 min), not RECHECK_AFTER (1 h)
    assert await checker.run_once() == 0  # not before then
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("reconciling",)]

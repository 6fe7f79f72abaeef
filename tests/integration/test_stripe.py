"""The Stripe provider through the real SDK against a fake Stripe on loopback. Each test counts
the objects at the fake and the rows afterwards."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderLimits
from outbox.observability import metrics
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import (
    dispatcher,
    enqueue_charges,
    enqueue_many,
    key_of,
    make_due,
    rows,
    statuses,
    stripe_provider,
    webhook,
)


def attempts(url: str) -> list[tuple[Any, ...]]:
    return rows(
        url,
        "SELECT attempt, outcome, error_class, http_status, provider_request_id "
        "IS NOT NULL FROM outbox.attempts ORDER BY operation_id, attempt",
    )


async def test_each_operation_creates_one_object_carrying_its_id_and_key(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    ids = enqueue_charges(db_url, 5)
    assert await dispatcher(pool, {"stripe": provider}).run_once() == 5
    assert statuses(db_url) == {"succeeded": 5}
    objects = fake.objects("payment_intents")
    assert len(objects) == 5
    refs = dict(rows(db_url, "SELECT id::text, provider_ref FROM outbox.operations"))
    for obj in objects:
        meta = obj["metadata"]
        assert refs[meta["outbox_operation_id"]] == obj["id"]
        assert meta["invoice"].startswith("inv-")  # the payload's own metadata is kept
        assert meta["outbox_idempotency_key"] == key_of(db_url, int(meta["outbox_operation_id"]))
    assert {r.idempotency_key for r in fake.received} == {key_of(db_url, i) for i in ids}
    assert all(a[4] for a in attempts(db_url))  # every attempt has Stripe's request id


@pytest.mark.parametrize(
    ("fault", "outcome", "status"),
    [
        (
            StripeFault.status(429, error_type="invalid_request_error", code_str="rate_limit"),
            "transient",
            "pending",
        ),
        (
            StripeFault.status(
                409, error_type="invalid_request_error", code_str="idempotency_key_in_use"
            ),
            "transient",
            "pending",
        ),
        (StripeFault.status(503, error_type="api_error"), "unknown", "pending"),
        (
            StripeFault.status(402, error_type="card_error", code_str="card_declined"),
            "permanent",
            "quarantined",
        ),
        (
            StripeFault.status(
                400, error_type="invalid_request_error", code_str="parameter_missing"
            ),
            "permanent",
            "quarantined",
        ),
        (
            StripeFault.status(
                404, error_type="invalid_request_error", code_str="resource_missing"
            ),
            "permanent",
            "quarantined",
        ),
        # A 5xx may follow Stripe's action: never permanent, whatever the header says.
        (
            StripeFault.status(503, error_type="api_error", should_retry=False),
            "unknown",
            "reconciling",
        ),
    ],
    ids=["429", "409", "503", "402-card", "400", "404", "should-retry-false"],
)
async def test_the_error_map(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    provider: Provider,
    fault: StripeFault,
    outcome: str,
    status: str,
) -> None:
    enqueue_charges(db_url, 1)
    fake.inject(fault)
    assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
    assert rows(db_url, "SELECT status FROM outbox.operations") == [(status,)]
    assert [a[1] for a in attempts(db_url)] == [outcome]
    if status == "pending":  # and the retry creates exactly one object
        make_due(db_url)
        assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
        assert statuses(db_url) == {"succeeded": 1}
    assert fake.object_count() == (1 if status == "pending" else 0)


async def test_a_timeout_after_stripe_acted_is_retried_with_the_same_key_once(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    enqueue_charges(db_url, 1)
    fake.inject(StripeFault.delay_after_apply(1.5))
    slow = stripe_provider("stripe", fake.url, timeout=0.3)
    try:
        d = dispatcher(pool, {"stripe": slow})
        assert await d.run_once() == 1
        assert rows(db_url, "SELECT status, last_error_class FROM outbox.operations") == [
            ("pending", "unknown")
        ]
        fake.wait_idle(timeout=5)
        make_due(db_url)
        assert await d.run_once() == 1
    finally:
        await slow.aclose()
    (obj,) = fake.objects()
    assert rows(db_url, "SELECT status, provider_ref, attempts FROM outbox.operations") == [
        ("succeeded", obj["id"], 2)
    ]
    assert [r.replayed for r in fake.received] == [False, True]


async def test_a_saved_500_goes_to_reconciling_without_a_loop_of_requests(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    enqueue_charges(db_url, 1)
    fake.inject(StripeFault.error_500_before_apply())  # saved: every replay answers the same 500
    d = dispatcher(pool, {"stripe": provider})
    assert await d.run_once() == 1
    ((status, delay),) = rows(
        db_url, "SELECT status, extract(epoch FROM available_at - now()) FROM outbox.operations"
    )
    assert status == "pending"
    assert float(delay) >= 25  # a settle delay before asking again
    make_due(db_url)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "indeterminate_provider_error")
    ]
    make_due(db_url)
    assert await d.run_once() == 0
    assert len(fake.received) == 2
    assert fake.object_count() == 0


async def test_an_idempotency_error_is_quarantined_as_a_producer_bug_without_a_new_key(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    (op,) = enqueue_charges(db_url, 1)
    key = key_of(db_url, op)
    fake.inject(StripeFault.reset_after_apply())  # created, but the answer never arrives
    d = dispatcher(pool, {"stripe": provider})
    assert await d.run_once() == 1
    with psycopg.connect(db_url) as conn:  # the payload changes under the stored key
        conn.execute("SET LOCAL session_replication_role = replica")  # past the immutability
        conn.execute(
            "UPDATE outbox.operations SET payload = jsonb_set(payload, '{amount}', "
            "'5000'), available_at = now()"
        )
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, status_reason, idempotency_key FROM outbox.operations") == [
        ("quarantined", "permanent_failure", key)
    ]
    ((error_class, message),) = rows(
        db_url, "SELECT error_class, error_message FROM outbox.attempts WHERE attempt = 2"
    )
    assert error_class == "idempotency_error"
    assert "producer bug" in message
    assert fake.object_count() == 1


def state_of(provider: str) -> dict[str, float]:
    return {
        state: metrics.PROVIDER_STATE.labels(provider, state)._value.get()
        for state in ("closed", "open", "half_open")
    }


async def test_a_refused_api_key_opens_the_breaker_keeps_attempts_and_a_probe_closes_it(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    stripe_ops = enqueue_charges(db_url, 3)
    enqueue_many(db_url, 4, provider="hook")
    fake.set_api_key("sk_test_rotated")  # ours is now wrong
    # One failure would not open the breaker on its own (breaker_failures = 5): a 401 does.
    limits = {"stripe": ProviderLimits(breaker_open_for=timedelta(milliseconds=300))}
    with FakeWebhookReceiver() as receiver, structlog.testing.capture_logs() as logs:
        hook = webhook("hook", receiver.url)
        d = dispatcher(pool, {"stripe": provider, "hook": hook}, limits=limits)
        try:
            assert await d.run_once() == 7
            assert receiver.effect_count() == 4  # other providers keep going
            assert metrics.PROVIDER_PAUSED.labels("stripe")._value.get() == 1
            assert state_of("stripe") == {"closed": 0, "open": 1, "half_open": 0}
            assert rows(
                db_url,
                "SELECT DISTINCT status, attempts FROM outbox.operations WHERE provider = 'stripe'",
            ) == [("pending", 0)]
            assert await d.run_once() == 0  # open: its rows are not claimed
            await asyncio.sleep(0.35)
            assert await d.run_once() == 1  # half-open: one probe, refused again
            assert metrics.PROVIDER_PAUSED.labels("stripe")._value.get() == 1
            assert await d.run_once() == 0  # open again, never closing on its own
            fake.set_api_key("sk_test_fake")  # the key is fixed
            await asyncio.sleep(0.35)
            assert await d.run_once() == 1  # the probe succeeds: closed
            assert state_of("stripe") == {"closed": 1, "open": 0, "half_open": 0}
            assert await d.run_once() == 2  # the rest follow
        finally:
            await hook.aclose()
    assert rows(
        db_url,
        "SELECT DISTINCT status, attempts FROM outbox.operations WHERE id = ANY(%s)",
        (stripe_ops,),
    ) == [("succeeded", 1)]
    assert metrics.PROVIDER_PAUSED.labels("stripe")._value.get() == 0
    assert fake.object_count() == 3
    assert [r.status for r in fake.received] == [401, 401, 401, 401, 200, 200, 200]
    opened = [e for e in logs if e["event"].startswith("provider breaker opened")]
    assert [(e["log_level"], e["reason"]) for e in opened] == [("warning", "credentials")] * 2
    closed = [e for e in logs if e["event"].startswith("provider breaker closed")]
    assert [(e["log_level"], e["provider"]) for e in closed] == [("info", "stripe")]


async def test_no_api_key_or_request_body_reaches_any_log_line(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    fake: FakeStripe,
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = "sk_test_4eC39HqLyjWDarjtT1zdp7dc"  # noqa: S105 (a key only the fake knows)
    fake.set_api_key(secret)
    provider = stripe_provider("stripe", fake.url, api_key=secret)
    enqueue_charges(db_url, 2)
    fake.inject(StripeFault.status(402, error_type="card_error", code_str="card_declined"))
    logging.getLogger("stripe").setLevel(logging.DEBUG)
    caplog.set_level(logging.DEBUG)
    try:
        with structlog.testing.capture_logs() as logs:
            assert await dispatcher(pool, {"stripe": provider}).run_once() == 2
    finally:
        await provider.aclose()
        logging.getLogger("stripe").setLevel(logging.NOTSET)
    captured = caplog.text + repr(logs)
    assert statuses(db_url) == {"succeeded": 1, "quarantined": 1}
    assert secret not in captured and secret[-8:] not in captured
    assert "cus_123" not in captured and "1000" not in captured.replace("duration", "")
    assert len(logs) == 2


async def test_a_payload_may_not_set_the_metadata_the_reconciler_matches_on(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    import outbox  # noqa: PLC0415

    with psycopg.connect(db_url) as conn:
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="refund",
            operation_key="r1",
            provider="stripe",
            action="refunds.create",
            payload={
                "payment_intent": "pi_1",
                "metadata": {"outbox_operation_id": "5", "order": "o-1"},
            },
        )
    assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
    assert rows(db_url, "SELECT status, last_error FROM outbox.operations") == [
        ("quarantined", "the payload's metadata may not set outbox_operation_id")
    ]
    assert fake.object_count() == 0

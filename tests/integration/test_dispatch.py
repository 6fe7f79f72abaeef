"""The dispatcher in the test's event loop against a real HTTP receiver on loopback.

Each test counts rows and the receiver's effects afterwards. Time moves in the data: retries are
made due, and first_sent_at and leases back-dated, instead of sleeping.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.db.store import Store
from outbox.observability import metrics
from outbox.providers.base import Provider, SendRequest, SendResult, Succeeded
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import (
    dispatcher,
    enqueue_many,
    key_of,
    make_due,
    rows,
    statuses,
    webhook,
)


def attempts_of(url: str, operation_id: int) -> list[tuple[Any, ...]]:
    return rows(
        url,
        "SELECT attempt, outcome, sent, error_class, http_status FROM outbox.attempts "
        "WHERE operation_id = %s ORDER BY attempt",
        (operation_id,),
    )


async def test_each_operation_makes_one_effect_and_keeps_its_reference(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_many(db_url, 25)
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 25
    assert statuses(db_url) == {"succeeded": 25}
    assert receiver.effect_count() == 25
    refs = dict(rows(db_url, "SELECT idempotency_key, provider_ref FROM outbox.operations"))
    for effect in receiver.effects:
        assert refs[effect.key] == effect.effect_id
        assert effect.headers["outbox-operation-id"] in {str(i) for i in ids}


async def test_transient_failures_retry_with_bounded_jittered_delays_then_succeed(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    receiver.inject(WebhookFault.status(429, retry_after=3), key=key)
    receiver.inject(WebhookFault.status(409), key=key)
    receiver.inject(WebhookFault.status(408), key=key)
    d = dispatcher(
        pool, {"hook": hook}, backoff_base=timedelta(seconds=10), backoff_max=timedelta(minutes=5)
    )
    delays = []
    for _ in range(3):
        assert await d.run_once() == 1
        ((delay, first_sent),) = rows(
            db_url,
            "SELECT extract(epoch FROM available_at - now()), first_sent_at FROM outbox.operations",
        )
        delays.append(float(delay))
        assert first_sent is None  # nothing reached the provider: no key window yet
        make_due(db_url)
    assert await d.run_once() == 1
    # Attempt n waits at most base * 2**(n-1); a Retry-After of 3 s is honoured as a minimum.
    assert 2.5 <= delays[0] <= 10.5
    assert -0.5 <= delays[1] <= 20.5
    assert -0.5 <= delays[2] <= 40.5
    assert attempts_of(db_url, op) == [
        (1, "transient", False, "http_429", 429),
        (2, "transient", False, "http_409", 409),
        (3, "transient", False, "http_408", 408),
        (4, "succeeded", True, None, 201),
    ]
    assert statuses(db_url) == {"succeeded": 1}
    assert receiver.effect_count(key) == 1


async def test_an_operation_that_never_succeeds_is_quarantined_with_every_attempt(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    # 408: transient, and the receiver looked at the request (a 409 or 429 spends no attempt).
    receiver.inject(WebhookFault.status(408), times=100)
    d = dispatcher(pool, {"hook": hook}, max_attempts=4)
    for _ in range(4):
        assert await d.run_once() == 1
        make_due(db_url)
    assert await d.run_once() == 0
    ((status, reason, attempts),) = rows(
        db_url, "SELECT status, status_reason, attempts FROM outbox.operations"
    )
    assert (status, reason, attempts) == ("quarantined", "attempts_exhausted", 4)
    assert [a[1] for a in attempts_of(db_url, op)] == ["transient"] * 4
    assert len(receiver.received) == 4
    assert receiver.effect_count() == 0


@pytest.mark.parametrize("code", [400, 404, 422])
async def test_a_permanent_answer_quarantines_after_one_attempt(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    code: int,
) -> None:
    (op,) = enqueue_many(db_url, 1)
    receiver.inject(WebhookFault.status(code), times=10)
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 1
    make_due(db_url)
    assert await d.run_once() == 0
    assert rows(
        db_url, "SELECT status, status_reason, last_error_class FROM outbox.operations"
    ) == [("quarantined", "permanent_failure", "permanent")]
    assert attempts_of(db_url, op) == [(1, "permanent", True, f"http_{code}", code)]
    assert len(receiver.received) == 1


async def test_a_timeout_after_the_provider_acted_is_retried_with_the_same_key_once(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    receiver.inject(WebhookFault.delay_after_apply(1.5), key=key)
    slow = webhook("hook", receiver.url, timeout=0.3)
    try:
        d = dispatcher(pool, {"hook": slow})
        assert await d.run_once() == 1
        ((status, first_sent),) = rows(
            db_url, "SELECT status, first_sent_at FROM outbox.operations"
        )
        assert status == "pending"
        assert first_sent is not None  # it may have reached the provider: the window has begun
        receiver.wait_idle(timeout=5)
        make_due(db_url)
        assert await d.run_once() == 1
    finally:
        await slow.aclose()
    (effect,) = receiver.effects_for(key)
    assert rows(db_url, "SELECT status, provider_ref, attempts FROM outbox.operations") == [
        ("succeeded", effect.effect_id, 2)
    ]
    assert [a[1] for a in attempts_of(db_url, op)] == ["unknown", "succeeded"]
    assert [r.replayed for r in receiver.received] == [False, True]


async def test_refused_connections_are_transient_and_start_no_key_window(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    receiver.refuse_connections()
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, first_sent_at FROM outbox.operations") == [
        ("pending", None)
    ]
    receiver.accept_connections()
    make_due(db_url)
    assert await d.run_once() == 1
    assert [a[1:4] for a in attempts_of(db_url, op)] == [
        ("transient", False, "connect_failed"),
        ("succeeded", True, None),
    ]
    assert receiver.effect_count() == 1


@pytest.mark.parametrize(
    ("back_by", "expected_status", "requests"),
    [
        # retention 24 h, margin 1 h: the window closes 23 h after the first send.
        (timedelta(hours=22, minutes=59), "succeeded", 1),
        (timedelta(hours=23, minutes=1), "reconciling", 0),
    ],
    ids=["just-inside", "just-past"],
)
async def test_the_key_window_decides_between_resending_and_reconciling(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    back_by: timedelta,
    expected_status: str,
    requests: int,
) -> None:
    (op,) = enqueue_many(db_url, 1)
    with psycopg.connect(db_url) as conn:
        # An earlier attempt whose outcome is unknown, back-dated.
        conn.execute(
            "UPDATE outbox.operations SET attempts = 1, first_sent_at = now() - %s, "
            "last_error_class = 'unknown' WHERE id = %s",
            (back_by, op),
        )
    before = metrics.RECONCILIATION_ROUTED.labels("hook", "key_window_passed")._value.get()
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status FROM outbox.operations") == [(expected_status,)]
    assert len(receiver.received) == requests
    if expected_status == "reconciling":
        assert rows(db_url, "SELECT status_reason, attempts FROM outbox.operations") == [
            ("key_window_passed", 1)
        ]  # routing is not an attempt
        after = metrics.RECONCILIATION_ROUTED.labels("hook", "key_window_passed")._value.get()
        assert after == before + 1


async def test_an_operation_that_never_reached_the_provider_is_sent_at_any_age(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET created_at = now() - interval '30 days', "
            "attempts = 3, last_error_class = 'transient'"
        )
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    assert statuses(db_url) == {"succeeded": 1}
    assert receiver.effect_count() == 1


async def test_poison_rows_are_quarantined_and_the_rest_of_the_batch_goes_on(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    good = enqueue_many(db_url, 6)
    (unknown_provider,) = enqueue_many(db_url, 1, provider="nobody", prefix="poison-a")
    (not_an_object,) = enqueue_many(db_url, 1, prefix="poison-b")
    with psycopg.connect(db_url) as conn:
        # A row corrupted behind outbox's back: only a superuser can get past the trigger that
        # keeps payloads immutable, by switching triggers off for the transaction.
        conn.execute("SET LOCAL session_replication_role = replica")
        conn.execute(
            "UPDATE outbox.operations SET payload = '[1, 2]' WHERE id = %s", (not_an_object,)
        )
        # Past the grace a rolling deploy gets to bring the provider.
        conn.execute("UPDATE outbox.operations SET created_at = now() - interval '1 hour'")
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 8
    quarantined = rows(
        db_url,
        "SELECT id, status_reason, last_error FROM outbox.operations "
        "WHERE status = 'quarantined' ORDER BY id",
    )
    assert quarantined == [
        (unknown_provider, "permanent_failure", "no provider named 'nobody' is configured"),
        (not_an_object, "invalid_payload", "the payload is a JSON array, not an object"),
    ]
    assert statuses(db_url) == {"succeeded": 6, "quarantined": 2}
    assert receiver.effect_count() == len(good)
    # The poison rows' history says they were never sent.
    assert rows(
        db_url,
        "SELECT DISTINCT outcome, sent FROM outbox.attempts WHERE operation_id IN (%s, %s)",
        (unknown_provider, not_an_object),
    ) == [("permanent", False)]


async def test_a_dead_workers_lease_is_rescued_as_unknown_and_sent_once(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    # A worker claims and dies: its lease is never renewed.
    (claimed,) = await Store(pool).claim("dead-worker", 1, timedelta(seconds=30))
    d = dispatcher(pool, {"hook": hook})
    assert await d.rescue_once() == 0  # the lease is still live
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET lease_expires_at = now() - interval '1 second'")
    assert await d.rescue_once() == 1
    ((status, first_sent, last_attempt),) = rows(
        db_url, "SELECT status, first_sent_at, last_attempt_at FROM outbox.operations"
    )
    assert status == "pending"
    assert first_sent == last_attempt  # the dead worker may have sent: the window starts there
    assert await d.run_once() == 1
    assert rows(
        db_url, "SELECT attempt, outcome, worker, error_class FROM outbox.attempts ORDER BY attempt"
    ) == [
        (1, "unknown", "dead-worker", "lease_expired"),
        (2, "succeeded", "test-worker", None),
    ]
    assert receiver.effect_count() == 1
    # The dead worker's late record changes nothing.
    from outbox.core.model import Status  # noqa: PLC0415
    from outbox.db.store import Record  # noqa: PLC0415

    late = Record(
        id=op,
        lease_token=claimed.lease_token,
        attempt=1,
        worker="dead-worker",
        status=Status.SUCCEEDED,
        outcome="succeeded",
        sent=True,
        provider_ref="stale",
    )
    assert await Store(pool).record(late) is False
    assert rows(db_url, "SELECT provider_ref FROM outbox.operations") != [("stale",)]


async def test_a_slow_live_call_keeps_its_lease_by_heartbeat(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    patient = webhook("hook", receiver.url, timeout=30.0)
    d = dispatcher(
        pool, {"hook": patient}, lease=timedelta(seconds=1), heartbeat=timedelta(milliseconds=200)
    )
    other = dispatcher(pool, {"hook": patient}, worker="other")
    try:
        with receiver.hold(key) as held:
            run = asyncio.create_task(d.run_once())
            assert await asyncio.to_thread(held.arrived.wait, 10)
            for _ in range(6):  # three leases long
                await d.heartbeat_once()
                assert await other.rescue_once() == 0
                await asyncio.sleep(0.5)
            held.release()
            await run
    finally:
        await patient.aclose()
    assert rows(db_url, "SELECT status, attempts FROM outbox.operations") == [("succeeded", 1)]
    assert receiver.effect_count(key) == 1


async def test_secret_headers_reach_the_receiver_and_no_log_line(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TEST_HOOK_TOKEN", "Bearer s3cr3t-t0ken")
    provider = webhook(
        "hook",
        receiver.url,
        headers={"X-Source": "outbox"},
        secret_headers={"Authorization": {"env": "TEST_HOOK_TOKEN"}},
    )
    enqueue_many(db_url, 2)
    try:
        with structlog.testing.capture_logs() as logs:
            assert await dispatcher(pool, {"hook": provider}).run_once() == 2
    finally:
        await provider.aclose()
    assert [e.headers["authorization"] for e in receiver.effects] == ["Bearer s3cr3t-t0ken"] * 2
    assert {e.headers["x-source"] for e in receiver.effects} == {"outbox"}
    assert len(logs) == 2
    assert all(log["operation_id"] and log["outcome"] == "succeeded" for log in logs)
    assert "s3cr3t" not in repr(logs)
    assert '"n"' not in repr(logs)  # nor the payload


async def test_a_503_may_have_acted_so_it_starts_the_key_window_and_keeps_the_key(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    receiver.inject(WebhookFault.status(503, retry_after=1), key=key)
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 1
    ((status, first_sent, delay),) = rows(
        db_url,
        "SELECT status, first_sent_at, "
        "extract(epoch FROM available_at - now()) "
        "FROM outbox.operations",
    )
    assert status == "pending"
    assert first_sent is not None
    assert float(delay) >= 0.5  # Retry-After still paces it
    make_due(db_url)
    assert await d.run_once() == 1
    assert [a[1:5] for a in attempts_of(db_url, op)] == [
        ("unknown", True, "http_503", 503),
        ("succeeded", True, None, 201),
    ]
    assert {r.key for r in receiver.received} == {key}
    assert receiver.effect_count() == 1


async def test_a_provider_this_process_does_not_know_yet_is_handed_back_not_quarantined(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 1, provider="billing-v2")
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    ((status, attempts, delay),) = rows(
        db_url,
        "SELECT status, attempts, extract(epoch FROM available_at - now()) FROM outbox.operations",
    )
    assert (status, attempts) == ("pending", 0)
    assert 20 <= float(delay) <= 30
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(0,)]


async def test_header_values_that_are_not_plain_ascii_are_encoded_not_lost(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    with psycopg.connect(db_url) as conn:
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="fee",
            operation_key="k1",
            provider="hook",
            action="gebühr.erstellt",
            payload={"a": 1},
            idempotency_key='key-"quoted"-\\-1',
            correlation_id="req-ü",
        )
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    (effect,) = receiver.effects
    assert effect.key == 'key-"quoted"-\\-1'
    assert effect.headers["outbox-action"] == "geb%C3%BChr.erstellt"
    assert effect.headers["outbox-correlation-id"] == "req-%C3%BC"
    assert statuses(db_url) == {"succeeded": 1}


class OddProvider:
    """An in-process provider whose behaviour a test chooses: an answer PostgreSQL cannot store,
    or a call that shrugs off its first cancellation."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.name = "odd"
        self.key_retention = timedelta(hours=24)
        self.calls = 0

    def check(self, action: str, payload: Any) -> None:
        """Accepts everything."""

    async def send(self, request: SendRequest) -> SendResult:
        self.calls += 1
        if self.mode == "nul":
            return Succeeded("ref\x00-1", {"note": "has \x00 a NUL", "x": float("nan")})
        if self.mode == "wide":  # past what orjson encodes, a NaN, and what is not JSON at all
            answers: list[dict[str, Any]] = [
                {"big": [2**70, -(2**64)]},
                {"nan": float("nan"), "ok": "é"},
                {"when": object()},
            ]
            return Succeeded(f"ref-{self.calls}", answers[self.calls - 1])
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0.3)  # ignores the first cancellation for a while
        return Succeeded("late")

    async def aclose(self) -> None:
        """Nothing to close."""


async def test_a_success_whose_answer_cannot_be_stored_is_still_recorded_as_success(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 1, provider="odd")
    provider = OddProvider("nul")
    assert await dispatcher(pool, {"odd": provider}).run_once() == 1
    assert rows(db_url, "SELECT status, provider_ref, result FROM outbox.operations") == [
        ("succeeded", "ref-1", None)
    ]
    assert provider.calls == 1


async def test_answers_past_the_fast_json_encoder_are_stored_whole(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    first, second, third = enqueue_many(db_url, 3, provider="odd")
    provider = OddProvider("wide")
    d = dispatcher(pool, {"odd": provider}, batch_size=1)
    assert [await d.run_once() for _ in range(3)] == [1, 1, 1]
    assert rows(
        db_url, "SELECT id, status, provider_ref, result FROM outbox.operations ORDER BY id"
    ) == [
        (first, "succeeded", "ref-1", {"big": [2**70, -(2**64)]}),  # past 64 bits, exact
        (second, "succeeded", "ref-2", {"nan": None, "ok": "é"}),  # NaN as null, the rest kept
        (third, "succeeded", "ref-3", None),  # not JSON: the success is kept, not its body
    ]
    assert provider.calls == 3


async def test_a_call_that_ignores_cancellation_is_abandoned_at_its_deadline(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 1, provider="odd")
    provider = OddProvider("hang")
    d = dispatcher(pool, {"odd": provider}, call_timeouts={"odd": timedelta(0)})
    done = await asyncio.wait_for(d.run_once(), timeout=15)  # guard: 0 s + 5 s margin
    assert done == 1
    assert rows(db_url, "SELECT status, last_error_class FROM outbox.operations") == [
        ("pending", "unknown")
    ]
    assert rows(db_url, "SELECT error_class FROM outbox.attempts") == [("call_guard",)]
    assert d.in_flight == 0
    await asyncio.sleep(0.5)  # let the abandoned call finish before the loop closes


DESIGN_FIELDS = {
    "operation_id",
    "tenant_id",
    "operation_type",
    "operation_key",
    "provider",
    "action",
    "attempt",
    "correlation_id",
    "outcome",
    "duration_ms",
    "error_class",
}


async def test_every_log_line_about_an_operation_carries_the_design_fields(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_many(db_url, 3, correlation_id="req-1")
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids[0]))
    with psycopg.connect(db_url) as conn:  # one past its key window: routed, not sent
        conn.execute(
            "UPDATE outbox.operations SET attempts = 1, first_sent_at = now() - "
            "interval '30 hours' WHERE id = %s",
            (ids[1],),
        )
    d = dispatcher(pool, {"hook": hook})
    with structlog.testing.capture_logs() as logs:
        assert await d.run_once() == 3
        enqueue_many(db_url, 1, prefix="late")
        await Store(pool).claim("dead-worker", 1, timedelta(seconds=30))
        with psycopg.connect(db_url) as conn:
            conn.execute(
                "UPDATE outbox.operations SET lease_expires_at = now() - "
                "interval '1 second' WHERE status = 'in_flight'"
            )
        assert await d.rescue_once() == 1
    about_operations = [e for e in logs if "operation_id" in e]
    assert {e["event"] for e in about_operations} == {
        "attempt recorded",
        "returned without sending",
        "lease expired; rescued",
    }
    for event in about_operations:
        assert set(event) >= DESIGN_FIELDS, (event["event"], DESIGN_FIELDS - set(event))
    assert all(
        e["correlation_id"] == "req-1"
        for e in about_operations
        if e["operation_key"].startswith("op-")
    )

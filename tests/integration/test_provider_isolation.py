"""Per-provider isolation (outbox.dispatch.limits): circuit breakers, max_in_flight and the shared
token bucket, against the real fakes on loopback. Every test counts requests at the fake and rows
in the database afterwards."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
import structlog
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import ProviderLimits, default_burst
from outbox.db.store import Store
from outbox.observability import metrics
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import (
    dispatcher,
    enqueue_charges,
    enqueue_many,
    make_due,
    rows,
    run_until,
    statuses,
    webhook,
)

FAST_BREAKER = timedelta(milliseconds=300)


def transitions(provider: str) -> dict[str, float]:
    return {
        state: metrics.PROVIDER_TRANSITIONS.labels(provider, state)._value.get()
        for state in ("closed", "open", "half_open")
    }


def since(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    return {key: after[key] - before[key] for key in after}


def attempts_total(url: str, provider: str) -> int:
    ((total,),) = rows(
        url,
        "SELECT coalesce(sum(attempts), 0) FROM outbox.operations WHERE provider = %s",
        (provider,),
    )
    return int(total)


# --- the circuit breaker ---------------------------------------------------------------------


async def test_a_run_of_failures_opens_the_breaker_and_only_a_probe_goes_until_one_succeeds(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 6)
    receiver.inject(WebhookFault.status(503), times=4)  # three in a row, then the first probe
    before = transitions("hook")
    limits = {"hook": ProviderLimits(breaker_failures=3, breaker_open_for=FAST_BREAKER)}
    # One call at a time; a retry waits 10 s, so three operations fail once each.
    ten = timedelta(seconds=10)
    d = dispatcher(
        pool, {"hook": hook}, concurrency=1, limits=limits, backoff_base=ten, backoff_max=ten
    )
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert await d.run_once() == 1
        assert await d.run_once() == 0  # open: nothing claimed, no attempt spent
        assert attempts_total(db_url, "hook") == 3
        await asyncio.sleep(0.35)
        assert await d.run_once() == 1  # half-open: one probe, which fails
        make_due(db_url)
        await asyncio.sleep(0.35)
        assert await d.run_once() == 0  # open again, for twice as long
        await asyncio.sleep(0.3)
        assert await d.run_once() == 1  # the second probe succeeds: closed
        for _ in range(5):
            await d.run_once()
    assert statuses(db_url) == {"succeeded": 6}
    assert [r.status for r in receiver.received] == [503] * 4 + [201] * 6
    assert attempts_total(db_url, "hook") == 10  # one per request: none while open
    assert since(before, transitions("hook")) == {"open": 2, "half_open": 2, "closed": 1}
    assert metrics.PROVIDER_STATE.labels("hook", "closed")._value.get() == 1
    assert metrics.PROVIDER_PAUSED.labels("hook")._value.get() == 0  # not a credentials pause
    said = [
        (e["event"].split(":")[0], e["log_level"])
        for e in logs
        if e["event"].startswith("provider breaker")
    ]
    assert said == [
        ("provider breaker opened", "warning"),
        ("provider breaker half-open", "info"),
        ("provider breaker opened again", "warning"),
        ("provider breaker half-open", "info"),
        ("provider breaker closed", "info"),
    ]
    assert [e["failures"] for e in logs if "failures" in e] == [3]
    assert [e["probe_in_s"] for e in logs if "probe_in_s" in e] == [0.3, 0.6]


def enqueue_tenants(url: str, plan: list[tuple[str, str]], **fields: Any) -> list[tuple[int, str]]:
    """One operation per (tenant, key) of ``plan``, in that order; their ids and stored keys."""
    made = []
    with psycopg.connect(url) as conn:
        for tenant, key in plan:
            result = outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="invoice.charge",
                operation_key=key,
                provider="hook",
                action="invoice.paid",
                payload={"key": key},
                **fields,
            )
            made.append(result.operation_id)
    found = dict(rows(url, "SELECT id, idempotency_key FROM outbox.operations"))
    return [(i, str(found[i])) for i in made]


def fail_always(receiver: FakeWebhookReceiver, keys: list[str]) -> None:
    """The receiver answers 500 to these keys, every time (as to a payload it chokes on)."""
    for key in keys:
        receiver.inject(WebhookFault.status(500), key=key, times=1000)


async def test_the_probe_is_an_operation_that_has_not_failed(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """The bug of issue 37: the probe was the oldest due row, so the rows that opened the
    breaker were every probe, and a provider that works for everything else stayed shut."""
    made = enqueue_tenants(
        db_url, [("a", f"bad-{n}") for n in range(3)] + [("a", f"good-{n}") for n in range(3)]
    )
    bad = [key for _, key in made[:3]]
    fail_always(receiver, bad)
    limits = {"hook": ProviderLimits(breaker_failures=3, breaker_open_for=FAST_BREAKER)}
    d = dispatcher(pool, {"hook": hook}, concurrency=1, limits=limits, max_attempts=3)
    for _ in range(3):  # oldest first: the three failures open the breaker
        assert await d.run_once() == 1
    assert metrics.PROVIDER_STATE.labels("hook", "open")._value.get() == 1
    make_due(db_url)  # the failed rows are due again, and the oldest: the old probe's pick
    await asyncio.sleep(0.35)
    assert await d.run_once() == 1  # the probe
    assert [r.key in bad for r in receiver.received] == [True, True, True, False]
    assert metrics.PROVIDER_STATE.labels("hook", "closed")._value.get() == 1


async def test_probes_go_round_the_tenants_and_take_failed_operations_last(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_tenants(db_url, [("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"), ("c", "c1")])
    with psycopg.connect(db_url) as conn:  # a0 and c1 failed before (c1 the longer ago)
        conn.execute(
            "UPDATE outbox.operations SET attempts = 1, last_attempt_at = now() - "
            "CASE operation_key WHEN 'c1' THEN interval '1 minute' ELSE interval '0' END "
            "WHERE operation_key IN ('a0', 'c1')"
        )
    store, probed, after = Store(pool), [], None
    while (row := await store.claim_probe("w", "hook", timedelta(seconds=30), after)) is not None:
        probed.append(row.operation_key)
        after = row.tenant_id
    assert probed == ["a1", "b0", "c0", "c1", "a0"]
    assert statuses(db_url) == {"in_flight": 5}


async def test_operations_that_fail_alone_spend_their_own_attempts_and_the_rest_is_delivered(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """Issue 37's trial in small: many operations of one provider that always get a 500, ahead
    of the healthy ones in the claim's order. Every healthy one is delivered once; every failing
    one uses its whole budget and leaves the line for a person."""
    plan = [(f"t{n % 4}", f"bad-{n}") for n in range(12)]
    plan += [(f"t{n % 4}", f"good-{n}") for n in range(20)]
    made = enqueue_tenants(db_url, plan)
    bad = [key for _, key in made[:12]]
    fail_always(receiver, bad)
    limits = {"hook": ProviderLimits(breaker_failures=5, breaker_open_for=FAST_BREAKER)}
    d = dispatcher(pool, {"hook": hook}, concurrency=4, limits=limits, max_attempts=3)

    def settled() -> bool:
        return all(r.status is not None for r in receiver.received) and (
            len([r for r in receiver.received if r.key not in bad]) >= 20
            and len([r for r in receiver.received if r.key in bad]) >= 12 * 3
        )

    await run_until(d, settled, within=30)
    by_key = dict(rows(db_url, "SELECT idempotency_key, status FROM outbox.operations"))
    # Every attempt was a 500, which may have acted: in doubt, to reconciliation (departure 20).
    assert {by_key[k] for k in bad} == {"reconciling"}
    assert [by_key[k] for _, k in made[12:]] == ["succeeded"] * 20
    assert receiver.effect_count() == 20  # each healthy one once
    spent = dict(rows(db_url, "SELECT idempotency_key, attempts FROM outbox.operations"))
    assert {spent[k] for k in bad} == {3}


async def test_healthy_rows_queued_behind_a_burst_of_bad_ones_are_delivered(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """A review's case: one tenant's 300 operations that always get a 500, queued ahead of 100
    good ones. The claim goes oldest first, so the bad rows open the breaker again and again;
    the probe must find the good rows at the other end, and each success must buy the bad rows
    room to be tried. Before: 0 of 300 good rows in 20 s."""
    made = enqueue_tenants(
        db_url, [("a", f"bad-{n}") for n in range(300)] + [("a", f"good-{n}") for n in range(100)]
    )
    fail_always(receiver, [key for _, key in made[:300]])
    limits = {"hook": ProviderLimits(breaker_open_for=FAST_BREAKER)}
    later = timedelta(seconds=30)  # retries
    d = dispatcher(
        pool,
        {"hook": hook},
        concurrency=8,
        batch_size=8,
        limits=limits,
        backoff_base=later,
        backoff_max=later,
    )
    took = await run_until(d, lambda: receiver.effect_count() >= 100, within=30)
    print(f"\n100 good rows behind 300 bad: delivered in {took:.1f} s")  # noqa: T201
    assert receiver.effect_count() == 100


async def test_one_tenant_s_flood_of_failures_does_not_shut_the_provider_to_the_others(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """A review's case: tenant "good" keeps sending; tenant "evil" enqueues 200 operations that
    always fail. Good's operations are delivered as they come, and the breaker never opens."""
    before = transitions("hook")
    limits = {"hook": ProviderLimits(breaker_open_for=timedelta(seconds=30))}
    d = dispatcher(pool, {"hook": hook}, concurrency=8, batch_size=8, limits=limits)

    async def produce() -> None:
        for n in range(40):
            await asyncio.to_thread(enqueue_tenants, db_url, [("good", f"good-{n}")])
            if n == 5:  # good traffic flows; then the flood, its faults armed before it is due
                flood = [("evil", f"bad-{m}") for m in range(200)]
                later = datetime.now(UTC) + timedelta(hours=1)
                made = await asyncio.to_thread(enqueue_tenants, db_url, flood, available_at=later)
                fail_always(receiver, [key for _, key in made])
                await asyncio.to_thread(make_due, db_url)
            await asyncio.sleep(0.05)

    def opened() -> bool:  # the test's failure, seen as it happens rather than at the end
        return since(before, transitions("hook"))["open"] > 0

    producer = asyncio.create_task(produce())
    try:
        await run_until(
            d,
            lambda: opened() or (producer.done() and receiver.effect_count() >= 40),
            within=30,
        )
        assert not opened(), "the flood opened the breaker for every tenant"
    finally:
        if not producer.done():
            producer.cancel()
    await producer
    assert receiver.effect_count() == 40
    assert since(before, transitions("hook"))["open"] == 0


async def test_permanent_answers_never_open_the_breaker(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 5)
    receiver.inject(WebhookFault.status(422), times=5)
    limits = {"hook": ProviderLimits(breaker_failures=2)}
    d = dispatcher(pool, {"hook": hook}, concurrency=1, limits=limits)
    for _ in range(5):
        assert await d.run_once() == 1
    assert statuses(db_url) == {"quarantined": 5}
    assert metrics.PROVIDER_STATE.labels("hook", "closed")._value.get() == 1


async def test_a_saved_500_goes_to_reconciliation_and_its_replays_never_open_the_breaker(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """The receiver acted, saved a 500 for each key and replays it on every retry: retrying only
    burns attempts, and the replays say nothing of the receiver's health (its other requests
    succeed), so they must not count toward the breaker."""
    enqueue_many(db_url, 3, prefix="saved")
    receiver.inject(WebhookFault.error_500_after_apply(), times=3)
    before = transitions("hook")
    limits = {"hook": ProviderLimits(breaker_failures=4, breaker_open_for=timedelta(minutes=5))}
    d = dispatcher(pool, {"hook": hook}, limits=limits)
    assert await d.run_once() == 3  # three first 500s: under the breaker's four
    assert statuses(db_url) == {"pending": 3}
    make_due(db_url)
    assert await d.run_once() == 3  # three replays of them: reconciliation, not failures
    assert rows(db_url, "SELECT DISTINCT status, status_reason FROM outbox.operations") == [
        ("reconciling", "indeterminate_provider_error")
    ]
    enqueue_many(db_url, 2, prefix="fresh")
    make_due(db_url)
    assert await d.run_once() == 2  # the breaker is closed: these go at once
    assert statuses(db_url) == {"reconciling": 3, "succeeded": 2}
    assert sorted((r.status, r.replayed) for r in receiver.received) == sorted(
        [(500, False)] * 3 + [(500, True)] * 3 + [(201, False)] * 2
    )
    assert receiver.effect_count() == 5  # one per key: the replays applied nothing
    assert attempts_total(db_url, "hook") == 3 * 2 + 2
    assert since(before, transitions("hook")) == {"open": 0, "half_open": 0, "closed": 0}
    assert metrics.PROVIDER_STATE.labels("hook", "closed")._value.get() == 1


def steady_rate(arrivals: list[float]) -> float:
    """Requests per second over the middle 80 % of ``arrivals``: start-up and the last stragglers
    left out, so two runs compare by their steady throughput."""
    times = sorted(arrivals)
    low, high = len(times) // 10, len(times) * 9 // 10
    return (high - low) / (times[high] - times[low])


async def test_a_failing_stripe_leaves_the_webhook_its_throughput_and_gets_only_probes(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, provider: Provider
) -> None:
    """Stripe answers 503 to everything. The webhook answers in 200 ms, so its throughput is set
    by concurrency (8 / 0.2 s = 40/s), not by the CPU the test gets on a busy machine: measured
    alone, then beside the failing Stripe."""
    count, open_for, concurrency = 160, 1.0, 8
    limits = {"stripe": ProviderLimits(breaker_open_for=timedelta(seconds=open_for))}
    fake.inject(StripeFault.status(503, error_type="api_error"), times=100_000)
    with FakeWebhookReceiver() as receiver:
        receiver.inject(WebhookFault.delay_after_apply(0.2), times=100_000)
        hook = webhook("hook", receiver.url)
        try:
            enqueue_many(db_url, count, prefix="solo")
            await run_until(
                dispatcher(pool, {"hook": hook}, concurrency=concurrency),
                lambda: receiver.effect_count() >= count,
                30,
            )
            stripe_ops = enqueue_charges(db_url, 100)
            enqueue_many(db_url, count, prefix="beside")
            d = dispatcher(
                pool, {"hook": hook, "stripe": provider}, concurrency=concurrency, limits=limits
            )
            started = time.monotonic()
            beside = await run_until(
                d,
                lambda: receiver.effect_count() >= 2 * count and time.monotonic() - started > 3.5,
                30,
            )
        finally:
            await hook.aclose()
    alone = steady_rate([e.at for e in receiver.effects[:count]])
    with_stripe = steady_rate([e.at for e in receiver.effects[count:]])
    print(  # noqa: T201 (the figures)
        f"\nwebhook alone {alone:.0f}/s, beside a failing Stripe {with_stripe:.0f}/s; "
        f"Stripe got {len(fake.received)} requests in {beside:.1f}s"
    )
    assert with_stripe >= alone * 0.8
    arrivals = sorted(r.at for r in fake.received)
    burst = [t for t in arrivals if t - arrivals[0] < 0.5]  # the calls before the breaker opened
    assert len(burst) <= concurrency
    probes = arrivals[len(burst) :]
    # At most one probe per open period, and open periods double while probes fail.
    assert 1 <= len(probes) <= 1 + (beside - 0.5) / open_for
    assert all(b - a >= open_for * 0.9 for a, b in itertools.pairwise(probes))
    assert statuses(db_url) == {"succeeded": 2 * count, "pending": len(stripe_ops)}
    # Every attempt was a request: none spent while the breaker was open.
    assert attempts_total(db_url, "stripe") == len(fake.received)
    assert fake.object_count() == 0


# --- max_in_flight -----------------------------------------------------------------------------


async def test_a_slow_provider_holds_only_its_own_slots(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 40, provider="slow", prefix="slow")  # first in line
    enqueue_many(db_url, 40, provider="fast", prefix="fast")
    with FakeWebhookReceiver() as slow_end, FakeWebhookReceiver() as fast_end:
        # Two seconds a call: room for the other provider's 40 even on a busy machine.
        slow_end.inject(WebhookFault.delay_after_apply(2.0), times=100)
        slow, fast = webhook("slow", slow_end.url, timeout=5.0), webhook("fast", fast_end.url)
        try:
            d = dispatcher(
                pool,
                {"slow": slow, "fast": fast},
                concurrency=16,
                limits={"slow": ProviderLimits(max_in_flight=2)},
            )
            await run_until(
                d, lambda: slow_end.effect_count() >= 2 and fast_end.effect_count() >= 40, 30
            )
        finally:
            await slow.aclose()
            await fast.aclose()
    # The other provider finished before the first slow call returned; the slow one never had
    # more than its 2 calls at once (without the cap it takes every slot it is offered).
    assert fast_end.effect_count() == 40
    first_slow_answer = min(r.answered_at for r in slow_end.received if r.answered_at)
    assert fast_end.effects[-1].at < first_slow_answer
    assert slow_end.peak_in_flight == 2
    assert statuses(db_url)["succeeded"] == 40 + slow_end.effect_count()


# --- the shared token bucket -------------------------------------------------------------------


def bucket(url: str, provider: str) -> float:
    ((tokens,),) = rows(
        url, "SELECT tokens FROM outbox.provider_buckets WHERE provider = %s", (provider,)
    )
    return float(tokens)


async def test_a_429_empties_the_shared_bucket_for_every_replica(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 10)
    rows(
        db_url,
        "INSERT INTO outbox.provider_buckets (provider, rate, burst, tokens, refilled_at)"
        " VALUES ('hook', 20, 20, 20, now()) RETURNING 1",
    )  # a full bucket
    receiver.inject(WebhookFault.status(429, retry_after=2))
    limits = {"hook": ProviderLimits(rate=20, burst=20)}
    first = dispatcher(pool, {"hook": hook}, worker="first", concurrency=1, limits=limits)
    other = dispatcher(pool, {"hook": hook}, worker="other", limits=limits)
    throttled = metrics.PROVIDER_THROTTLED.labels("hook")._value.get()
    before_429 = time.monotonic()
    assert await first.run_once() == 1  # 429, Retry-After: 2
    assert bucket(db_url, "hook") <= -39  # two seconds of debt at 20/s
    assert metrics.PROVIDER_THROTTLED.labels("hook")._value.get() == throttled + 1
    make_due(db_url)
    assert await other.run_once() == 0  # another replica waits too
    assert await first.run_once() == 0
    assert len(receiver.received) == 1
    # Time moves in the data: the Retry-After has passed, and the debt with it.
    rows(
        db_url,
        "UPDATE outbox.provider_buckets SET refilled_at = refilled_at - interval '2.2s'"
        " RETURNING 1",
    )
    resumed = await other.run_once()
    # 2.2 s at 20/s, less the 40 of debt: 4 tokens, and one more per 50 ms since the 429.
    assert 4 <= resumed <= 4 + 20 * (time.monotonic() - before_429)
    assert [r.status for r in receiver.received] == [429] + [201] * resumed


async def test_a_claim_takes_no_more_rows_than_tokens_and_gives_back_the_rest(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    enqueue_many(db_url, 10)
    other_ids = enqueue_many(db_url, 3, provider="other", prefix="other")
    rows(
        db_url,
        "INSERT INTO outbox.provider_buckets (provider, rate, burst, tokens, refilled_at)"
        " VALUES ('hook', 0.001, 5, 5, now()) RETURNING 1",
    )
    with FakeWebhookReceiver() as other_end:
        other = webhook("other", other_end.url)
        try:
            limits = {"hook": ProviderLimits(rate=0.001, burst=5)}  # 5 now, then nearly none
            d = dispatcher(pool, {"hook": hook, "other": other}, limits=limits)
            assert await d.run_once() == 5 + 3
            assert await d.run_once() == 0
        finally:
            await other.aclose()
    assert receiver.effect_count() == 5
    assert other_end.effect_count() == len(other_ids)
    assert bucket(db_url, "hook") < 1  # every token used, none lost or made up


@pytest.mark.slow
def test_three_processes_together_stay_under_the_rate_limit(db_url: str, tmp_path: Any) -> None:
    """50/s with the default burst (one second's worth): no second above 100, the whole run
    within 20 s x 50 + 50, and the rate reached, so that the test fails both ways."""
    from tests.support.daemon import outbox_processes, wait_until, write_config  # noqa: PLC0415

    rate, seconds = 50, 20.0
    burst = default_burst(rate)
    enqueue_many(db_url, 1_500)  # more than 20 s can take: saturated throughout
    with FakeWebhookReceiver() as receiver:
        cfg = write_config(
            tmp_path / "outbox.toml",
            providers={"hook": {"type": "webhook", "url": receiver.url, "rate_limit": f"{rate}/s"}},
            poll_interval="200ms",
            concurrency=64,
            lease="10s",
        )
        with outbox_processes(3, db_url, cfg, tmp_path):
            wait_until(lambda: len(receiver.received) > 0, timeout=30, what="a first request")
            first = receiver.received[0].at
            time.sleep(max(0.0, seconds + first - time.monotonic()))
            arrivals = sorted(r.at - first for r in receiver.received if r.at - first < seconds)
    # The busiest one-second window: every window that holds the most starts at an arrival.
    busiest = max(bisect.bisect_left(arrivals, start + 1.0) - i for i, start in enumerate(arrivals))
    achieved = len(arrivals) / seconds
    print(  # noqa: T201 (the figures)
        f"\n3 x outbox run at {rate}/s (burst {burst}): {achieved:.1f}/s "
        f"over {seconds:.0f}s, busiest second {busiest}"
    )
    assert busiest <= rate + burst
    assert len(arrivals) <= rate * seconds + burst
    assert achieved >= rate * 0.7
    assert rows(db_url, "SELECT count(DISTINCT worker) FROM outbox.attempts") == [(3,)]

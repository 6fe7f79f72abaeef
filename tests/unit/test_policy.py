"""The dispatcher's pure decisions: backoff, the key window, and what a failure leads to."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.core.model import FailureClass, Status
from outbox.core.policy import (
    REASON_EXHAUSTED,
    REASON_INDETERMINATE,
    REASON_INVALID_PAYLOAD,
    REASON_KEY_WINDOW,
    REASON_PERMANENT,
    Backoff,
    KeyWindow,
    Next,
    after_failure,
)

NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
BACKOFF = Backoff(timedelta(seconds=1), timedelta(minutes=10))
WINDOW = KeyWindow(timedelta(hours=24), timedelta(hours=1))


def test_full_jitter_stays_under_the_doubling_ceiling_and_the_cap() -> None:
    rng = random.Random(1)
    for attempt in range(1, 30):
        ceiling = min(600.0, 2.0 ** (attempt - 1))
        delays = [BACKOFF.delay(attempt, rng).total_seconds() for _ in range(200)]
        assert all(0 <= d <= ceiling for d in delays)
        # Spread over the whole range, not clustered: full jitter.
        assert max(delays) > 0.8 * ceiling and min(delays) < 0.2 * ceiling


def test_the_window_closes_margin_before_the_provider_forgets() -> None:
    first = NOW - timedelta(hours=23)
    assert WINDOW.closes_at(first) == NOW
    assert WINDOW.has_passed(first, NOW)
    assert not WINDOW.has_passed(first, NOW - timedelta(seconds=1))
    assert not WINDOW.has_passed(None, NOW + timedelta(days=365))


def decide(failure: FailureClass, **kwargs: Any) -> Next:
    args: dict[str, Any] = {
        "attempt": 1,
        "max_attempts": 10,
        "first_sent_at": None,
        "now": NOW,
        "window": WINDOW,
        "backoff": BACKOFF,
        "rng": random.Random(3),
    }
    args.update(kwargs)
    return after_failure(failure, **args)


def test_permanent_goes_to_quarantine_at_once() -> None:
    nxt = decide(FailureClass.PERMANENT)
    assert (nxt.status, nxt.reason) == (Status.QUARANTINED, REASON_PERMANENT)


@pytest.mark.parametrize("failure", [FailureClass.TRANSIENT, FailureClass.UNKNOWN])
def test_the_last_attempt_goes_to_quarantine(failure: FailureClass) -> None:
    nxt = decide(failure, attempt=10)
    assert (nxt.status, nxt.reason) == (Status.QUARANTINED, REASON_EXHAUSTED)


def test_retry_after_is_a_floor() -> None:
    nxt = decide(FailureClass.TRANSIENT, retry_after=timedelta(seconds=30))
    assert nxt.status is Status.PENDING
    assert nxt.retry_in is not None and nxt.retry_in >= timedelta(seconds=30)


def test_no_retry_is_scheduled_past_the_window() -> None:
    # The window closes in 2 minutes; the backoff alone could wait 10.
    first = NOW - timedelta(hours=22, minutes=58)
    for attempt in range(8, 10):
        nxt = decide(FailureClass.UNKNOWN, attempt=attempt, first_sent_at=first)
        assert nxt.status is Status.PENDING
        closes = WINDOW.closes_at(first)
        assert nxt.retry_in is not None and closes is not None
        assert NOW + nxt.retry_in < closes


def test_an_unknown_outcome_past_the_window_goes_to_reconciliation() -> None:
    nxt = decide(FailureClass.UNKNOWN, first_sent_at=NOW - timedelta(hours=23, minutes=1))
    assert (nxt.status, nxt.reason) == (Status.RECONCILING, REASON_KEY_WINDOW)


def test_a_transient_failure_without_any_send_retries_at_any_age() -> None:
    nxt = decide(FailureClass.TRANSIENT, first_sent_at=None, attempt=3)
    assert nxt.status is Status.PENDING


# --- The ceiling, the jitter's source, and where each failure goes --------------------------------

PROPERTY = settings(database=None, deadline=None)


class Top(random.Random):
    """A generator that always draws the top of the range: the delay is the ceiling itself."""

    def random(self) -> float:
        return 1.0


@PROPERTY
@given(
    base_ms=st.integers(1, 10_000),
    cap_ms=st.integers(1, 10**9),
    attempt=st.integers(-5, 63),
)
def test_the_ceiling_doubles_from_the_base_up_to_the_cap(
    base_ms: int, cap_ms: int, attempt: int
) -> None:
    base, cap = timedelta(milliseconds=base_ms), timedelta(milliseconds=cap_ms)
    # Attempts before the first count as the first.
    expected = min(cap.total_seconds(), base.total_seconds() * 2.0 ** max(attempt - 1, 0))
    delay = Backoff(base, cap).delay(attempt, Top())
    assert delay.total_seconds() == pytest.approx(expected, abs=1e-6)


def test_past_the_63rd_attempt_the_ceiling_stops_doubling() -> None:
    # Only a cap over 2**62 bases shows it: the ceiling stays at 2**62 bases, so an attempt
    # number of any size neither overflows nor reaches such a cap.
    backoff = Backoff(timedelta(microseconds=1), timedelta.max)
    ceiling = backoff.delay(63, Top())
    assert ceiling.total_seconds() == pytest.approx(2.0**62 / 1e6)
    assert backoff.delay(64, Top()) == backoff.delay(10**9, Top()) == ceiling


@PROPERTY
@given(seed=st.integers(0, 2**32), attempt=st.integers(1, 9))
def test_a_seeded_generator_gives_the_same_delay(seed: int, attempt: int) -> None:
    first = BACKOFF.delay(attempt, random.Random(seed))
    assert first == BACKOFF.delay(attempt, random.Random(seed))
    # ... and one equal to what after_failure schedules with that generator, before any send.
    nxt = decide(FailureClass.TRANSIENT, attempt=attempt, rng=random.Random(seed))
    assert nxt == Next(Status.PENDING, retry_in=first)


def test_without_a_generator_the_delay_is_still_full_jitter_under_the_ceiling() -> None:
    delays = [BACKOFF.delay(4).total_seconds() for _ in range(200)]
    assert all(0 <= d <= 8.0 for d in delays)
    assert len(set(delays)) > 1


def test_an_indeterminate_answer_goes_to_reconciliation_whatever_the_attempt() -> None:
    for attempt in (1, 10, 11):
        nxt = decide(FailureClass.UNKNOWN, attempt=attempt, reconcile=True)
        assert nxt == Next(Status.RECONCILING, REASON_INDETERMINATE)
    # A permanent failure still goes to quarantine, with the reason it was given.
    nxt = decide(FailureClass.PERMANENT, reconcile=True, quarantine_reason=REASON_INVALID_PAYLOAD)
    assert nxt == Next(Status.QUARANTINED, REASON_INVALID_PAYLOAD)


def test_the_window_is_passed_at_the_instant_it_closes() -> None:
    first = NOW - timedelta(hours=23)  # closes exactly at NOW
    nxt = decide(FailureClass.UNKNOWN, first_sent_at=first)
    assert nxt == Next(Status.RECONCILING, REASON_KEY_WINDOW)
    earlier = decide(FailureClass.UNKNOWN, first_sent_at=first, now=NOW - timedelta(microseconds=1))
    assert earlier.status is Status.PENDING


@PROPERTY
@given(
    left_us=st.integers(1, 10**12),
    retry_after_s=st.one_of(st.none(), st.integers(0, 10**6)),
    seed=st.integers(0, 2**32),
    attempt=st.integers(1, 9),
)
@example(left_us=120_000_000, retry_after_s=3600, seed=0, attempt=1)  # the halfway point wins
def test_a_retry_in_the_window_waits_the_backoff_but_at_most_half_the_time_left(
    left_us: int, retry_after_s: int | None, seed: int, attempt: int
) -> None:
    left = timedelta(microseconds=left_us)
    retry_after = None if retry_after_s is None else timedelta(seconds=retry_after_s)
    first = NOW + left - WINDOW.retention + WINDOW.margin  # the window closes `left` from NOW
    nxt = decide(
        FailureClass.UNKNOWN,
        attempt=attempt,
        first_sent_at=first,
        retry_after=retry_after,
        rng=random.Random(seed),
    )
    delay = BACKOFF.delay(attempt, random.Random(seed))
    if retry_after is not None:
        delay = max(delay, retry_after)
    assert nxt == Next(Status.PENDING, retry_in=min(delay, left / 2))


def test_unspent_attempts_still_grow_the_delay() -> None:
    """A 429 storm that spends no budget (attempt stays 1) must not retry at the base delay
    for ever: the delay grows with backoff_attempt, every attempt made."""
    spent = decide(FailureClass.TRANSIENT, first_sent_at=None, attempt=1, rng=Top())
    storm = decide(
        FailureClass.TRANSIENT, first_sent_at=None, attempt=1, rng=Top(), backoff_attempt=8
    )
    assert (spent.retry_in, storm.retry_in) == (timedelta(seconds=1), timedelta(seconds=128))


# --- One cause, one status (issue 37) -------------------------------------------------------------


@pytest.mark.parametrize("failure", [FailureClass.TRANSIENT, FailureClass.UNKNOWN])
def test_the_last_attempt_of_an_operation_in_doubt_goes_to_reconciliation(
    failure: FailureClass,
) -> None:
    """An attempt may have reached the provider (first_sent_at): out of budget it is in doubt,
    and quarantine would invite a replay: reconciling, inside the window as past it."""
    first = NOW - timedelta(minutes=5)
    nxt = decide(failure, attempt=10, first_sent_at=first)
    assert nxt == Next(Status.RECONCILING, REASON_INDETERMINATE)


def test_budget_and_window_run_out_together_the_window_says_why() -> None:
    nxt = decide(FailureClass.UNKNOWN, attempt=10, first_sent_at=NOW - timedelta(hours=23))
    assert nxt == Next(Status.RECONCILING, REASON_KEY_WINDOW)


@PROPERTY
@given(
    attempt=st.integers(1, 12),
    max_attempts=st.integers(1, 10),
    sent_minutes_ago=st.one_of(st.none(), st.integers(0, 48 * 60)),
    failure=st.sampled_from([FailureClass.TRANSIENT, FailureClass.UNKNOWN]),
)
def test_a_failure_that_may_have_reached_the_provider_is_never_quarantined(
    attempt: int, max_attempts: int, sent_minutes_ago: int | None, failure: FailureClass
) -> None:
    first = None if sent_minutes_ago is None else NOW - timedelta(minutes=sent_minutes_ago)
    nxt = decide(failure, attempt=attempt, max_attempts=max_attempts, first_sent_at=first)
    if first is not None:
        assert nxt.status in (Status.PENDING, Status.RECONCILING)
    elif attempt >= max_attempts:
        assert nxt == Next(Status.QUARANTINED, REASON_EXHAUSTED)
    else:
        assert nxt.status is Status.PENDING

"""The dispatcher's pure decisions: backoff, the key window, and what a failure leads to."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from outbox.model import FailureClass, Status
from outbox.policy import (
    REASON_EXHAUSTED,
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
    args: dict[str, Any] = {"attempt": 1, "max_attempts": 10, "first_sent_at": None,
                               "now": NOW, "window": WINDOW, "backoff": BACKOFF,
                               "rng": random.Random(3)}  # fmt: skip
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

"""Pure decisions of the dispatcher: what an attempt's result leads to, and when to retry.

Every time here is the database clock's, passed in: no function reads a local clock.
Pure: imports nothing from the database layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from outbox.core.model import FailureClass, Status


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with full jitter (the AWS architecture blog's "full jitter"):
    spreading retries uniformly keeps many operations that failed together from retrying
    together."""

    base: timedelta
    cap: timedelta

    def delay(self, attempt: int, rng: random.Random | None = None) -> timedelta:
        """A random delay in [0, min(cap, base * 2**(attempt-1))]."""
        exponent = min(max(attempt - 1, 0), 62)  # beyond this the cap always wins
        ceiling = min(self.cap.total_seconds(), self.base.total_seconds() * 2.0**exponent)
        return timedelta(seconds=(rng or random).uniform(0.0, ceiling))


@dataclass(frozen=True, slots=True)
class KeyWindow:
    """The span in which a retry with the stored key is safe: the provider still remembers it.

    It closes ``margin`` before the provider forgets the key, counted from the first attempt
    that may have reached the provider. Before any such attempt there is no window to close.
    """

    retention: timedelta
    margin: timedelta

    def closes_at(self, first_sent_at: datetime | None) -> datetime | None:
        return None if first_sent_at is None else first_sent_at + self.retention - self.margin

    def has_passed(self, first_sent_at: datetime | None, now: datetime) -> bool:
        closes = self.closes_at(first_sent_at)
        return closes is not None and now >= closes


@dataclass(frozen=True, slots=True)
class Next:
    """Where a failed attempt sends its operation."""

    status: Status
    reason: str | None = None
    retry_in: timedelta | None = None  # for PENDING: delay before the next attempt


# How long after its enqueue an operation's attempts that the provider did not act on
# (Failed.spends_attempt False: 429, 409) are free; after that they count like any transient
# failure, so that a rate limit that never lifts still ends in quarantine.
UNSPENT_FOR = timedelta(hours=24)


# Reasons are stable words: operators filter on them and metrics label by them.
REASON_PERMANENT = "permanent_failure"
REASON_EXHAUSTED = "attempts_exhausted"
REASON_KEY_WINDOW = "key_window_passed"
# An unknown outcome outbox stops retrying: one the provider will only repeat for this key, or
# the budget used up while an attempt that may have reached the provider stays unknown.
REASON_INDETERMINATE = "indeterminate_provider_error"
# The stored payload cannot be carried to the provider (outbox.core.payloads); nothing was sent.
REASON_INVALID_PAYLOAD = "invalid_payload"
# outbox itself failed before sending (a bug): quarantined rather than left to be rescued as an
# attempt that may have reached the provider.
REASON_INTERNAL_ERROR = "internal_error"
# The provider could not build the row's request (a key or header value HTTP cannot carry, a
# payload its encoding cannot hold): nothing was sent (outbox.providers.building).
REASON_UNENCODABLE_REQUEST = "unencodable_request"
# The payload breaks the contract its row names (a row enqueued past the Python API's check):
# nothing was sent (outbox.dispatch.contracts).
REASON_CONTRACT_VIOLATION = "contract_violation"


def after_failure(
    failure: FailureClass,
    *,
    attempt: int,
    max_attempts: int,
    first_sent_at: datetime | None,
    now: datetime,
    window: KeyWindow,
    backoff: Backoff,
    retry_after: timedelta | None = None,
    reconcile: bool = False,
    rng: random.Random | None = None,
    quarantine_reason: str | None = None,
    backoff_attempt: int | None = None,
) -> Next:
    """Decide the next status after a failed attempt.

    ``first_sent_at`` must already include this attempt if it may have reached the provider.
    ``quarantine_reason`` names a permanent failure more precisely than REASON_PERMANENT.
    ``attempt`` is the attempts spent of the budget; ``backoff_attempt`` (default ``attempt``)
    the one the delay grows with, which also counts the unspent ones.
    """
    if failure is FailureClass.PERMANENT:
        return Next(Status.QUARANTINED, quarantine_reason or REASON_PERMANENT)
    if reconcile:
        return Next(Status.RECONCILING, REASON_INDETERMINATE)
    closes = window.closes_at(first_sent_at)
    if closes is not None and now >= closes:
        return Next(Status.RECONCILING, REASON_KEY_WINDOW)
    if attempt >= max_attempts:
        return out_of_attempts(first_sent_at)
    delay = backoff.delay(attempt if backoff_attempt is None else backoff_attempt, rng)
    if retry_after is not None:
        delay = max(delay, retry_after)
    if closes is None:
        return Next(Status.PENDING, retry_in=delay)
    # Never schedule an automatic retry past the window's end. Halfway to it leaves the retry
    # time to be claimed and sent while the provider still remembers the key.
    return Next(Status.PENDING, retry_in=min(delay, (closes - now) / 2))


def out_of_attempts(first_sent_at: datetime | None) -> Next:
    """Where an operation goes whose budget is used up.

    In doubt, when an attempt may have reached the provider (``first_sent_at``) and none said
    what became of it: reconciling, where the provider is asked first. Quarantine would invite a
    replay, a resend on a person's word alone; and whether the budget or the key window ran out
    first, one cause lands in one status (docs/design.md, "Attempts"). When nothing may have
    reached the provider (transient answers, nothing sent), a replay is safe: quarantined.
    """
    if first_sent_at is not None:
        return Next(Status.RECONCILING, REASON_INDETERMINATE)
    return Next(Status.QUARANTINED, REASON_EXHAUSTED)

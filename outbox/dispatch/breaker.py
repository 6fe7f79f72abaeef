"""Each provider's circuit breaker, in this process: which of its calls' failures count, when it
opens, its half-open probe, and why (failures, or refused credentials). outbox.dispatch.limits
combines it with max_in_flight and the rate limit into each claim's cap (its docstring says how).
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import structlog

from outbox.config.settings import (
    BREAKER_OPEN_MAX,
    DEFAULT_FAILURE_RATE,
    DEFAULT_WINDOW,
)
from outbox.core.model import FailureClass
from outbox.db.store import Health
from outbox.observability import metrics
from outbox.providers.base import SendResult, Succeeded

# An operation found failing alone stays so this long (seconds), unless it succeeds; at most
# this many are remembered (and as many dates of failures), the oldest forgotten first.
ALONE_FOR: Final = 3600.0
# ... and only while the provider has succeeded for another operation in this many seconds:
# past that, with nothing but failures (an outage), every failure counts again.
ALONE_RECENT: Final = 600.0
# One tenant's failures are its own while another tenant succeeded in this many seconds.
TENANT_RECENT: Final = 60.0
# After a probe showed the provider working, the breaker weighs at least this many calls before
# it may open again (doubling per episode from its window), for this long (seconds).
GRACE_MAX: Final = 640
GRACE_FOR: Final = 3600.0
# Failures of at least this many operations open a breaker.
DISTINCT_FAILING: Final = 2
MARKS_KEPT: Final = 10_000

REASON_FAILURES: Final = "failures"
REASON_CREDENTIALS: Final = "credentials"

log = structlog.get_logger("outbox.provider_limits")  # its name before the split, kept


class State(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Verdict(enum.Enum):
    """What one call says about its provider's health."""

    HEALTHY = "healthy"  # it answered and acted
    NEUTRAL = "neutral"  # it answered, refusing this request (permanent): no word on its health
    FAILING = "failing"  # transient or unknown
    REFUSED = "refused"  # our credentials were refused


def verdict(result: SendResult) -> Verdict:
    if isinstance(result, Succeeded):
        return Verdict.HEALTHY
    if result.pause:
        return Verdict.REFUSED
    if result.failure is FailureClass.PERMANENT or result.request_only:
        return Verdict.NEUTRAL
    return Verdict.FAILING


class Breaker:
    """One provider's circuit breaker in this process (docs/design.md, "Provider health").

    Closed, it keeps the verdicts of the last ``window`` calls and opens when at least
    ``failures`` of them failed and they are at least ``rate`` of the window: a share of calls,
    not a run, so that a few failing operations among working ones never open it. An operation
    that fails again after the provider succeeded for another since its last failure *fails
    alone*: its calls leave the window and count no more (until it succeeds, or an hour has
    passed), so it spends its own attempts and reaches quarantine while the rest goes on.

    Open, nothing is claimed until the period ends; then it is half-open, and one operation is
    claimed as the probe (the claim prefers operations that have not failed, from the next
    tenant in turn: outbox.db.statements.CLAIM_PROBE). The probe's success closes it; its failure
    opens it again, for twice as long if the probe had never failed before (the provider failed
    a fresh operation), for as long otherwise (the probe may be failing alone). While open for
    failures, any call that succeeds closes it: the provider works. Refused credentials open it
    at once with reason "credentials", and only a probe closes it then: a call sent before the
    key was revoked may still succeed.
    """

    def __init__(
        self,
        provider: str,
        failures: int,
        open_for: timedelta,
        clock: Callable[[], float] = time.monotonic,
        *,
        rate: float = DEFAULT_FAILURE_RATE,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        self.provider = provider
        self.state = State.CLOSED
        self.reason: str | None = None
        self._threshold = failures
        self._rate = rate
        # The last calls: (operation, failed, tenant, counted). A failure of an operation that
        # fails alone is not counted while the window holds a success.
        self._calls: deque[tuple[int, bool, str, bool]] = deque(maxlen=max(window, failures))
        # After a probe showed the provider working, the breaker may open again only once it
        # has weighed this many calls since (doubling with each such episode, for an hour).
        self._grace = 0
        self._episodes = 0
        self._since_close = 0
        self._closed_at = clock()
        self._base = open_for.total_seconds()
        self._longest = max(self._base, BREAKER_OPEN_MAX.total_seconds())
        self._open_for = self._base
        self._open_until = 0.0
        self._successes = 0  # successes so far: an operation's failures are dated by it
        self._last_success_at = -ALONE_RECENT
        self._tenant_ok: OrderedDict[str, float] = OrderedDict()  # tenant -> its last success
        self._failed_at: OrderedDict[int, int] = OrderedDict()  # op -> successes at its failure
        self._alone: OrderedDict[int, float] = OrderedDict()  # op -> when it was found alone
        self._probe: int | None = None  # the operation sent as the probe, while half-open
        self._probe_fresh = True  # it had never failed before
        self._answered: int | None = None  # the last probe whose answer decided the state
        self._clock = clock
        self.opened_at: float | None = None
        _show_state(provider, State.CLOSED, reason=None)

    # --- what the claim may take -------------------------------------------------------------

    def allowance(self) -> int | None:
        """How many rows the ordinary claim may take: None (no limit) or 0. A half-open
        breaker's probe is claimed on its own (``awaits_probe``)."""
        if self.state is State.OPEN and self._clock() >= self._open_until:
            self._enter(State.HALF_OPEN)
            log.info(
                "provider breaker half-open: one operation probes it",
                provider=self.provider,
                reason=self.reason,
            )
        return None if self.state is State.CLOSED else 0

    @property
    def awaits_probe(self) -> bool:
        """Half-open with no probe yet: the probe claim may take one row."""
        self.allowance()
        return self.state is State.HALF_OPEN and self._probe is None

    def claimed(self, operation_id: int, *, fresh: bool = True) -> None:
        """The probe was claimed; ``fresh``: it has not failed before (in this budget)."""
        if self.state is State.HALF_OPEN and self._probe is None:
            self._probe, self._probe_fresh = operation_id, fresh

    def may_send(self, operation_id: int) -> bool:
        """False for a row claimed before the breaker opened: it goes back unsent."""
        return self.state is State.CLOSED or operation_id == self._probe

    # --- what calls said ---------------------------------------------------------------------

    def record(self, operation_id: int, said: Verdict, tenant: str = "") -> None:
        """Count a call's outcome (``tenant``: the operation's)."""
        if operation_id == self._probe:
            self._probe_answered(operation_id, said, tenant)
        elif said is Verdict.REFUSED:
            if self.state is State.CLOSED:
                self._open(REASON_CREDENTIALS)
            elif self.reason != REASON_CREDENTIALS:
                # A call from before the breaker opened: the worse reason wins; the next probe
                # is not due any sooner.
                self.reason = REASON_CREDENTIALS
                _show_state(self.provider, self.state, self.reason)
        elif said is Verdict.HEALTHY:
            self._succeeded(operation_id, tenant)
            if self.state is State.CLOSED:
                self._calls.append((operation_id, False, tenant, True))
                self._since_close += 1
            elif self.reason == REASON_FAILURES:
                self._close(why="a call succeeded", works=True)
                self._answered = operation_id  # its end wakes the claim (released)
        elif said is Verdict.FAILING:
            counted = self._counts(operation_id)
            if self.state is State.CLOSED:
                self._calls.append((operation_id, True, tenant, counted))
                self._since_close += 1
                if self._too_many_failures():
                    self._open(REASON_FAILURES)

    def _probe_answered(self, operation_id: int, said: Verdict, tenant: str) -> None:
        self._probe, self._answered = None, operation_id
        if said is Verdict.REFUSED:
            self._reopen(REASON_CREDENTIALS)
        elif said is Verdict.FAILING:
            self._counts(operation_id)  # dates its failure
            # Credentials stay the reason until a probe gets past them.
            self._reopen(self.reason or REASON_FAILURES, longer=self._probe_fresh)
        else:
            if said is Verdict.HEALTHY:
                self._succeeded(operation_id, tenant)
            self._close(why="the probe succeeded", works=self.reason == REASON_FAILURES)

    def _succeeded(self, operation_id: int, tenant: str) -> None:
        now = self._clock()
        self._successes += 1
        self._last_success_at = now
        self._tenant_ok[tenant] = now
        self._tenant_ok.move_to_end(tenant)
        _trim(self._tenant_ok)
        self._failed_at.pop(operation_id, None)
        if self._alone.pop(operation_id, None) is not None:
            metrics.PROVIDER_FAILING_ALONE.labels(self.provider).set(len(self._alone))

    def _counts(self, operation_id: int) -> bool:
        """Date this failure; False if it says nothing of the provider: the operation failed
        before, and the provider has succeeded for another since, as lately as the calls the
        window holds (it fails alone while its neighbours succeed; in an outage the window
        holds no success, and its failures count again)."""
        now = self._clock()
        marked = self._alone.get(operation_id)
        if marked is not None and now - marked < ALONE_FOR:
            return False
        earlier = self._failed_at.pop(operation_id, None)
        self._failed_at[operation_id] = self._successes
        _trim(self._failed_at)
        if earlier is None or earlier == self._successes:
            return True
        if not self._recently_succeeded():
            return True
        self._alone[operation_id] = now
        self._alone.move_to_end(operation_id)
        _trim(self._alone)
        # Its earlier failures no longer count: they were its own.
        kept = [(op, f, t, c and op != operation_id) for op, f, t, c in self._calls]
        self._calls.clear()
        self._calls.extend(kept)
        metrics.PROVIDER_FAILING_ALONE.labels(self.provider).set(len(self._alone))
        return False

    def _another_tenant_succeeded(self, tenant: str) -> bool:
        """Another tenant's operation succeeded in the last TENANT_RECENT seconds (the newest
        successes are looked at first, and only those that recent)."""
        now = self._clock()
        for other, at in reversed(self._tenant_ok.items()):
            if now - at >= TENANT_RECENT:
                return False
            if other != tenant:
                return True
        return False

    def _recently_succeeded(self) -> bool:
        """The provider succeeded for some operation lately: failing alone still means that."""
        return self._clock() - self._last_success_at < ALONE_RECENT

    def _failing(self) -> list[tuple[int, str]]:
        """The failures in the window that weigh on the provider, as (operation, tenant): those
        counted, and with no success for a while (an outage) every one, alone or not."""
        every = not self._recently_succeeded()
        return [(op, t) for op, failed, t, counted in self._calls if failed and (counted or every)]

    def _too_many_failures(self) -> bool:
        failing = self._failing()
        if len(failing) < self._threshold or len(failing) < self._rate * len(self._calls):
            return False
        # One operation failing again and again says nothing of the provider: it spends its own
        # budget (a provider down with one operation to send loses no more than that).
        if len({op for op, _ in failing}) < min(DISTINCT_FAILING, self._threshold):
            return False
        # One tenant's operations failing while another tenant's succeed are that tenant's own.
        sick = {tenant for _, tenant in failing}
        if len(sick) == 1 and self._another_tenant_succeeded(next(iter(sick))):
            return False
        # Lately a probe showed the provider working: weigh more calls before believing it sick.
        if self._clock() - self._closed_at > GRACE_FOR:
            self._grace, self._episodes = 0, 0
        return self._since_close >= self._grace

    # --- what operators and start-up see and do ----------------------------------------------

    @property
    def failure_rate(self) -> float:
        """The share of failures among the calls in the window (0 with none)."""
        return len(self._failing()) / len(self._calls) if self._calls else 0.0

    @property
    def failing_alone(self) -> int:
        return len(self._alone)

    def next_probe_in(self) -> float | None:
        """Seconds until the next probe may go, while open; None otherwise."""
        if self.state is not State.OPEN:
            return None
        return max(0.0, self._open_until - self._clock())

    def snapshot(self) -> Health:
        """What ``outbox providers`` shows of this breaker (written by outbox.dispatch.health)."""
        self.allowance()  # open past its period: half-open now
        # Marks past ALONE_FOR count no more (_counts): they go here, oldest first (each is
        # added at the end), and the gauge follows.
        now = self._clock()
        while self._alone and now - next(iter(self._alone.values())) >= ALONE_FOR:
            self._alone.popitem(last=False)
        metrics.PROVIDER_FAILING_ALONE.labels(self.provider).set(len(self._alone))
        opened_ago = None
        if self.state is not State.CLOSED and self.opened_at is not None:
            opened_ago = self._clock() - self.opened_at
        return Health(
            provider=self.provider,
            state=self.state.value,
            reason=self.reason,
            failure_rate=round(self.failure_rate, 3),
            calls=len(self._calls),
            failing_alone=len(self._alone),
            opened_ago=opened_ago,
            probe_in=self.next_probe_in(),
            open_for=None if self.state is State.CLOSED else self._open_for,
        )

    def restore(self, reason: str | None, probe_in: float, open_for: float) -> None:
        """Start open, as another process of this provider left it (a restart in a crash loop
        must not forget a provider that is down and send a burst at it)."""
        self._open_for = min(max(open_for, self._base), self._longest)
        # Never longer than this process would wait on its own.
        self._open_until = self._clock() + min(max(0.0, probe_in), self._longest)
        self.reason = reason or REASON_FAILURES
        self._enter(State.OPEN)
        log.warning(
            "provider breaker open at start: a dispatcher left it open lately",
            provider=self.provider,
            reason=self.reason,
            probe_in_s=round(max(0.0, probe_in), 1),
        )

    def reset(self) -> None:
        """An operator closed it (``outbox providers reset``)."""
        if self.state is not State.CLOSED:
            self._probe = None
            self._close(why="an operator reset it")

    def probe_now(self) -> None:
        """An operator asked for a probe now (``outbox providers probe``)."""
        if self.state is State.OPEN:
            self._open_until = self._clock()

    # --- transitions -------------------------------------------------------------------------

    def released(self, operation_id: int) -> bool:
        """The row's task ended; True if it was the probe: it closed the breaker, or left
        without an answer (not sent) so that another may be claimed; either way, claim now."""
        if operation_id == self._answered:
            self._answered = None
            return True
        if operation_id != self._probe:
            return False
        self._probe = None
        return True

    def _open(self, reason: str) -> None:
        if reason == REASON_FAILURES and self._alone:
            # Found alone while it looked healthy; sick now, it may be every operation's.
            self._alone.clear()
            metrics.PROVIDER_FAILING_ALONE.labels(self.provider).set(0)
        self._open_for = self._base
        self._open_until = self._clock() + self._open_for
        self.reason = reason
        rate = self.failure_rate
        self._enter(State.OPEN)
        if reason == REASON_CREDENTIALS:
            log.warning(
                "provider breaker opened: its credentials were refused; operations wait",
                provider=self.provider,
                reason=reason,
                probe_in_s=self._open_for,
            )
        else:
            log.warning(
                "provider breaker opened: operations wait until a probe succeeds",
                provider=self.provider,
                reason=reason,
                failures=len(self._failing()),
                failure_rate=round(rate, 2),
                probe_in_s=self._open_for,
            )

    def _reopen(self, reason: str, *, longer: bool = False) -> None:
        """The probe failed. A provider that failed a fresh operation is probed less and less
        often; credentials at the base period, so that a fixed key resumes dispatch soon (a
        wrong one costs a request a probe); a probe that had failed before, as often as now."""
        if reason == REASON_FAILURES and self.reason == REASON_FAILURES and longer:
            self._open_for = min(self._open_for * 2, self._longest)
        elif reason != REASON_FAILURES or self.reason != REASON_FAILURES:
            self._open_for = self._base
        self._open_until = self._clock() + self._open_for
        self.reason = reason
        self._enter(State.OPEN)
        log.warning(
            "provider breaker opened again: the probe failed",
            provider=self.provider,
            reason=reason,
            probe_in_s=self._open_for,
        )

    def _close(self, *, why: str, works: bool = False) -> None:
        """``works``: a call succeeded while it was open for failures: the provider worked, so
        the failures that opened it were the operations' own (a burst of bad payloads ahead of
        good ones): it weighs twice as many calls as last time before it may open again."""
        if works:
            self._episodes += 1
            self._grace = min(self._calls.maxlen or 1, GRACE_MAX) * 2 ** min(self._episodes, 5)
            self._grace = min(self._grace, GRACE_MAX)
        self._since_close = 0
        self._closed_at = self._clock()
        self._open_for = self._base
        self._probe = None  # a probe still under way is an ordinary call now
        self._calls.clear()  # a fresh start: the failures before say nothing now
        reason, self.reason = self.reason, None
        self._enter(State.CLOSED)
        log.info(f"provider breaker closed: {why}", provider=self.provider, reason=reason)

    def _enter(self, state: State) -> None:
        self.state = state
        if state is State.CLOSED:
            self.opened_at = None
        elif self.opened_at is None:
            self.opened_at = self._clock()  # since when it has not been closed
        metrics.PROVIDER_TRANSITIONS.labels(self.provider, state.value).inc()
        _show_state(self.provider, state, self.reason)


def _trim(marks: OrderedDict[Any, Any]) -> None:
    while len(marks) > MARKS_KEPT:
        marks.popitem(last=False)


def _show_state(provider: str, state: State, reason: str | None) -> None:
    for each in State:
        metrics.PROVIDER_STATE.labels(provider, each.value).set(1 if each is state else 0)
    paused = state is not State.CLOSED and reason == REASON_CREDENTIALS
    metrics.PROVIDER_PAUSED.labels(provider).set(1 if paused else 0)

"""Per-provider isolation: one sick or slow provider starves nothing and is not hammered.

Three limits decide how many rows of each provider a claim may take (its *cap*):

* a **circuit breaker** per provider, in this process (``Breaker``). A high share of failures
  (transient or unknown) among its last calls opens it, not counting operations that fail alone
  while others succeed: its operations are not claimed, so they wait ``pending`` without
  spending attempts. After ``breaker_open_for`` it is half-open: one operation that has not
  failed, from the next tenant in turn, is claimed as a probe, whose success closes it and whose
  failure opens it again. Refused credentials (``Failed.pause``, a 401/403) open it at once
  with reason "credentials", and only a successful probe closes it; their probes come every
  ``breaker_open_for``, never less often.
* ``max_in_flight``: at most that many of the provider's calls in flight in this process.
* ``rate_limit``: a token bucket per provider in PostgreSQL (sql/0016), shared by every replica.
  A claim takes tokens first and claims at most as many rows as it got; what it did not use it
  gives back at once, so no replica sits on tokens another could use, and rows are sent as soon
  as they are claimed. A 429 from the provider pushes the bucket into debt for its Retry-After.

Caps are reserved for the claim that uses them, so concurrent claim loops together never exceed
a cap. Times of the breaker are this process's monotonic clock (it is per process); the bucket,
which is shared, only ever reads the database clock.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

import psycopg
import structlog

from outbox.config.settings import (
    BREAKER_OPEN_MAX,
    DEFAULT_FAILURE_RATE,
    DEFAULT_WINDOW,
    ProviderLimits,
)
from outbox.core.model import FailureClass
from outbox.db.store import Claimed, Health, Store, Tokens, TokenTake
from outbox.observability import metrics
from outbox.providers.base import SendResult, Succeeded

# A claim capped by a provider's tokens comes back this soon (or when the next token is due, if
# later) rather than after a whole poll interval: often enough to keep up with the rate, rarely
# enough that a replica makes at most ten claims a second for it.
TOKEN_PACE: Final = 0.1
# A 429 without a Retry-After (Stripe sends none) still empties the bucket for this long.
DEFAULT_THROTTLE: Final = timedelta(seconds=1)
HTTP_TOO_MANY_REQUESTS: Final = 429

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
# A half-open provider whose probe claim found no due row is looked at again this much later.
PROBE_LOOK_AGAIN: Final = 0.5
MARKS_KEPT: Final = 10_000

REASON_FAILURES: Final = "failures"
REASON_CREDENTIALS: Final = "credentials"

log = structlog.get_logger("outbox.provider_limits")


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


@dataclass
class Grant:
    """What one claim may take: ``caps`` (provider -> most rows; absent: no cap), and the
    tokens it took for them."""

    caps: dict[str, int]
    tokens: dict[str, Tokens] = field(default_factory=dict)
    needed: dict[str, int] = field(default_factory=dict)  # tokens asked for, per provider


class Limits:
    """The per-provider limits of one dispatcher process."""

    def __init__(
        self,
        store: Store,
        limits: Mapping[str, ProviderLimits],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._limits = dict(limits)
        self._breakers = {
            name: Breaker(
                name,
                lim.breaker_failures,
                lim.breaker_open_for,
                clock,
                rate=lim.breaker_failure_rate,
                window=lim.breaker_window,
            )
            for name, lim in limits.items()
        }
        self._probing: set[str] = set()  # providers whose probe a claim is taking now
        self._probed_tenant: dict[str, str] = {}  # the tenant of each provider's last probe
        self._no_probe_until: dict[str, float] = {}  # a probe claim found none: not before
        self._clock = clock
        self._in_flight: Counter[str] = Counter()
        self._reserved: Counter[str] = Counter()  # rows promised to claims under way
        self._claim_again_in: float | None = None

    # --- before and after a claim -------------------------------------------------------------

    def caps(self) -> dict[str, int]:
        """Most rows per provider the ordinary claim may take now, before tokens: breaker not
        closed -> 0 (a half-open breaker's probe is claimed apart, ``probes_due``),
        max_in_flight less those in flight; less what claims under way were promised."""
        caps: dict[str, int] = {}
        for name, lim in self._limits.items():
            bounds = []
            allowance = self._breakers[name].allowance()
            if allowance is not None:
                bounds.append(allowance)
            if lim.max_in_flight is not None:
                bounds.append(lim.max_in_flight - self._in_flight[name])
            if bounds:
                caps[name] = max(0, min(bounds) - self._reserved[name])
        return caps

    def probes_due(self, most: int) -> list[str]:
        """Up to ``most`` providers whose half-open breaker waits for its probe, now reserved for
        the caller's probe claim (``probe_claimed`` ends it): one claim loop at a time takes a
        provider's probe."""
        now = self._clock()
        due = [
            name
            for name, breaker in self._breakers.items()
            if name not in self._probing
            and breaker.awaits_probe
            and self._has_slot(name)
            and self._no_probe_until.get(name, 0.0) <= now
        ][:most]
        self._probing.update(due)
        return due

    def probe_claimed(self, provider: str, row: Claimed | None) -> None:
        """The probe claim for ``provider`` is over: ``row`` is its probe (None: none due)."""
        self._probing.discard(provider)
        if row is None:  # none due: look again in a while, not at every claim
            self._no_probe_until[provider] = self._clock() + PROBE_LOOK_AGAIN
        else:
            self._probed_tenant[provider] = row.tenant_id
            self._breakers[provider].claimed(row.id, fresh=row.attempts - 1 <= row.attempt_base)

    def probe_cursor(self, provider: str) -> str | None:
        """The tenant of the provider's last probe: the next is taken after it."""
        return self._probed_tenant.get(provider)

    def _has_slot(self, provider: str) -> bool:
        lim = self._limits[provider]
        return lim.max_in_flight is None or self._in_flight[provider] < lim.max_in_flight

    def breaker(self, provider: str) -> Breaker:
        return self._breakers[provider]

    async def grant(self, want: int) -> Grant:
        """Caps for a claim of up to ``want`` rows, with tokens taken for the rate-limited
        providers (as many as the claim could use): reserved until ``settle``."""
        grant = Grant(self.caps())
        rated = [name for name, lim in self._limits.items() if lim.rate is not None]
        needed = {name: min(want, grant.caps.get(name, want)) for name in rated}
        grant.needed = {name: n for name, n in needed.items() if n > 0}
        grant.tokens = await self._take(grant.needed, {})
        for name in rated:
            tokens = grant.tokens.get(name)
            grant.caps[name] = 0 if tokens is None else tokens.granted
        self._reserved.update(grant.caps)
        return grant

    async def settle(self, grant: Grant, claimed: Sequence[Claimed]) -> None:
        """The claim is over: its rows count as in flight, unused tokens go back."""
        self._reserved.subtract(grant.caps)
        counts = Counter(row.provider for row in claimed)
        self._in_flight.update(counts)
        unused = {name: t.granted - counts[name] for name, t in grant.tokens.items()}
        unused = {name: n for name, n in unused.items() if n > 0}
        if unused:
            await self._take({}, unused)
        self._claim_again_in = self._token_wait(grant, counts)

    def claim_again_in(self) -> float | None:
        """Seconds until tokens are likely for a provider whose tokens ran out in the last
        claim while its rows may still wait; None if no claim was capped by tokens."""
        return self._claim_again_in

    # --- around a call ------------------------------------------------------------------------

    def may_send(self, row: Claimed) -> bool:
        """False when the provider's breaker opened since the row was claimed."""
        breaker = self._breakers.get(row.provider)
        return breaker is None or breaker.may_send(row.id)

    def observe(self, row: Claimed, result: SendResult) -> timedelta | None:
        """Feed a call's outcome to the breaker. A 429 from a rate-limited provider returns how
        long its shared bucket should be emptied for (``throttle``); anything else None. Not a
        coroutine: nearly every call needs no round trip, and so no await."""
        breaker = self._breakers.get(row.provider)
        if breaker is not None:
            breaker.record(row.id, verdict(result), row.tenant_id)
        if isinstance(result, Succeeded) or result.http_status != HTTP_TOO_MANY_REQUESTS:
            return None
        lim = self._limits.get(row.provider)
        if lim is None or lim.rate is None:
            return None
        return result.retry_after or DEFAULT_THROTTLE

    async def throttle(self, provider: str, pause: timedelta) -> None:
        """Empty the provider's shared bucket for ``pause`` (after ``observe`` asked for it)."""
        await self._throttle(provider, self._limits[provider], pause)

    def finished(self, row: Claimed) -> bool:
        """The row's task ended; True if a claim may now take more of its provider (a slot of
        its max_in_flight is free, or its probe is over)."""
        self._in_flight[row.provider] -= 1
        breaker = self._breakers.get(row.provider)
        probe_released = breaker is not None and breaker.released(row.id)
        lim = self._limits.get(row.provider)
        return probe_released or (lim is not None and lim.max_in_flight is not None)

    # --- the shared buckets -------------------------------------------------------------------

    async def _take(
        self, wanted: Mapping[str, int], returned: Mapping[str, int]
    ) -> dict[str, Tokens]:
        """One round trip to the buckets; on a database error, no tokens (and returned ones are
        lost, which only makes the limit stricter for a moment)."""
        takes = [
            TokenTake(name, lim.rate, lim.burst, wanted.get(name, 0), returned.get(name, 0))
            for name, lim in self._limits.items()
            if lim.rate is not None and (name in wanted or name in returned)
        ]
        if not takes:
            return {}
        try:
            return await self._store.take_tokens(takes)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("take_tokens").inc()
            log.warning(
                "could not take tokens; rate-limited providers wait", error_class=type(exc).__name__
            )
            return {}

    async def _throttle(self, provider: str, lim: ProviderLimits, pause: timedelta) -> None:
        assert lim.rate is not None  # noqa: S101 (only rate-limited providers have a bucket)
        metrics.PROVIDER_THROTTLED.labels(provider).inc()
        try:
            level = await self._store.throttle_bucket(provider, lim.rate, lim.burst, pause)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("throttle_bucket").inc()
            log.warning(
                "could not throttle the provider's bucket",
                provider=provider,
                error_class=type(exc).__name__,
            )
            return
        log.info(
            "provider answered 429; its shared bucket is empty",
            provider=provider,
            pause_s=pause.total_seconds(),
            tokens=round(level, 1),
        )

    def _token_wait(self, grant: Grant, counts: Mapping[str, int]) -> float | None:
        """How soon to claim again for providers whose tokens, not their rows, ran out."""
        waits = []
        for name, needed in grant.needed.items():
            tokens = grant.tokens.get(name)
            got = 0 if tokens is None else tokens.granted
            if got < needed and counts[name] >= got:
                rate = self._limits[name].rate or 1.0
                level = 0.0 if tokens is None else tokens.level
                waits.append(max(TOKEN_PACE, (1 - level) / rate))
        return min(waits, default=None)


@dataclass
class _Pause:
    until: float
    probe: int | None = None  # the operation sent once the pause ran out, to see if it lifted


class ActionPauses:
    """Actions a provider refused to our credentials (``Failed.pause_action``: a 403 of a
    restricted key without that permission), paused in this process while the provider's other
    actions go on. A paused action's operations are handed back unsent, with their attempts,
    until the pause runs out; then one is sent as a probe, whose success lifts the pause and
    whose refusal renews it. The period is the provider's ``breaker_open_for``: like refused
    credentials, a permission granted meanwhile resumes dispatch soon."""

    def __init__(
        self, periods: Mapping[str, timedelta], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._periods = {name: p.total_seconds() for name, p in periods.items()}
        self._paused: dict[tuple[str, str], _Pause] = {}
        self._clock = clock

    def wait(self, row: Claimed) -> timedelta | None:
        """How long ``row`` must wait before its send; None: send it now."""
        if not self._paused:  # the hot path: nothing paused anywhere
            return None
        pause = self._paused.get((row.provider, row.action))
        if pause is None or pause.probe == row.id:
            return None
        now, period = self._clock(), self._period(row.provider)
        if now < pause.until:
            return timedelta(seconds=pause.until - now)
        # No probe yet, or one that left without an answer (handed back at shutdown): this one.
        if pause.probe is None or now - pause.until > period:
            pause.probe, pause.until = row.id, now
            return None
        return timedelta(seconds=period)

    def observe(
        self, row: Claimed, result: SendResult, labels: Callable[[Claimed], tuple[str, str]]
    ) -> None:
        """Pause on a refusal; lift the pause when its probe got past it. ``labels`` gives the
        metric labels, asked for only when a pause begins or ends."""
        refused = not isinstance(result, Succeeded) and result.pause_action
        if not refused and not self._paused:  # every call while nothing is paused
            return
        key = (row.provider, row.action)
        pause = self._paused.get(key)
        if refused:
            if pause is None or pause.probe in (None, row.id):
                self._paused[key] = _Pause(self._clock() + self._period(row.provider))
                metrics.ACTION_PAUSED.labels(*labels(row)).set(1)
                log.warning(
                    "action paused: the provider refused it permission; its operations wait",
                    provider=row.provider,
                    action=row.action,
                    probe_in_s=self._period(row.provider),
                )
        elif pause is not None and pause.probe == row.id:
            del self._paused[key]
            metrics.ACTION_PAUSED.labels(*labels(row)).set(0)
            log.info(
                "action resumed: its probe got past the refusal",
                provider=row.provider,
                action=row.action,
            )

    def _period(self, provider: str) -> float:
        return self._periods.get(provider, 60.0)


class LookupThrottled(Exception):
    """A lookup waited its longest for a token of its provider's rate limit."""


class LookupPacer:
    """Reconciliation lookups through their provider's ``rate_limit``: one token of the shared
    bucket (sql/0016) before each request a lookup makes, so that checks never push the
    provider's calls past the limit the dispatcher keeps. A lookup that waits longer than
    ``max_wait`` fails (the reconciler retries it later), rather than hold its pass."""

    def __init__(
        self,
        store: Store,
        limits: Mapping[str, ProviderLimits],
        *,
        max_wait: timedelta = timedelta(seconds=30),
    ) -> None:
        self._store = store
        self._rated = {name: lim for name, lim in limits.items() if lim.rate is not None}
        self._max_wait = max_wait.total_seconds()

    def pace(self, provider: str) -> Callable[[], Awaitable[None]] | None:
        """What a lookup of ``provider`` awaits before each request; None: no limit."""
        lim = self._rated.get(provider)
        if lim is None or lim.rate is None:
            return None
        take = TokenTake(provider, lim.rate, lim.burst, 1, 0)
        interval = 1.0 / lim.rate

        async def one_token() -> None:
            deadline = time.monotonic() + self._max_wait
            while True:
                granted = await self._store.take_tokens([take])
                if provider in granted and granted[provider].granted >= 1:
                    return
                level = granted[provider].level if provider in granted else 0.0
                # In debt (a 429 pushed it there): wait until the bucket is back at one.
                wait = max(interval, (1.0 - level) * interval)
                if time.monotonic() + wait > deadline:
                    raise LookupThrottled(
                        f"no token of {provider}'s rate limit in {self._max_wait:g} s"
                    )
                await asyncio.sleep(wait)

        return one_token

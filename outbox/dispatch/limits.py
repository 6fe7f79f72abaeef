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

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

import psycopg
import structlog

from outbox.config.settings import (
    ProviderLimits,
)
from outbox.db.store import Claimed, Store, Tokens, TokenTake
from outbox.dispatch.breaker import Breaker, verdict
from outbox.observability import metrics
from outbox.providers.base import SendResult, Succeeded

# A claim capped by a provider's tokens comes back this soon (or when the next token is due, if
# later) rather than after a whole poll interval: often enough to keep up with the rate, rarely
# enough that a replica makes at most ten claims a second for it.
TOKEN_PACE: Final = 0.1
# A 429 without a Retry-After (Stripe sends none) still empties the bucket for this long.
DEFAULT_THROTTLE: Final = timedelta(seconds=1)
HTTP_TOO_MANY_REQUESTS: Final = 429
# A half-open provider whose probe claim found no due row is looked at again this much later.
PROBE_LOOK_AGAIN: Final = 0.5

log = structlog.get_logger("outbox.provider_limits")  # its name before the split, kept


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

    def call_over(self, row: Claimed) -> bool:
        """The row's call ended (or it will not be sent): its slot of the provider's
        max_in_flight is free; True if the provider has one (a claim may take more of it)."""
        self._in_flight[row.provider] -= 1
        lim = self._limits.get(row.provider)
        return lim is not None and lim.max_in_flight is not None

    def finished(self, row: Claimed) -> bool:
        """The row's task ended, its outcome written; True if it was its provider's probe (a
        claim may now take more of the provider)."""
        breaker = self._breakers.get(row.provider)
        return breaker is not None and breaker.released(row.id)

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

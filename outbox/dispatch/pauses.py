"""Pauses narrower than a provider's breaker: an action its credentials may not use, paused in
this process while the provider's other actions go on (ActionPauses), and the reconciler's
lookups kept within the provider's shared rate limit (LookupPacer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import structlog

from outbox.config.settings import (
    ProviderLimits,
)
from outbox.db.store import Claimed, Store, TokenTake
from outbox.observability import metrics
from outbox.providers.base import SendResult, Succeeded

log = structlog.get_logger("outbox.provider_limits")  # its name before the split, kept


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

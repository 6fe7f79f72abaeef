"""Keeping leases: the heartbeat renews the lease of every call still running, and the call
guard cuts off a call that outlives its provider's timeout, so that no hung call holds a lease
(or a slot) for ever."""

from __future__ import annotations

import asyncio
import time

import psycopg

from outbox.dispatch.flight import Phase, log, release
from outbox.dispatch.shared import Shared
from outbox.observability import metrics
from outbox.runtime import loops


class LeaseKeeper:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._inflight = shared.inflight
        # One timer for every call guard: armed for the earliest deadline, it sweeps the calls
        # past theirs (a timer and asyncio.wait per call cost more than the no-op call itself).
        self._guard: asyncio.TimerHandle | None = None

    async def heartbeat_loop(self) -> None:
        interval = self._shared.settings.heartbeat_interval.total_seconds()

        async def round_() -> float:
            await self.heartbeat_once()
            return interval

        await asyncio.sleep(interval)
        await loops.forever("heartbeat", round_)

    async def heartbeat_once(self) -> None:
        """Renew the lease of every operation this process still holds."""
        held = [f for f in self._inflight.values() if f.phase is not Phase.RECORDING]
        if not held:
            return
        lease = self._shared.settings.lease
        sent_at = time.monotonic()
        try:
            alive = await self._shared.store.heartbeat([f.row for f in held], lease)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("heartbeat").inc()
            log.warning("heartbeat failed", error_class=type(exc).__name__)
            return
        for flight in held:
            if flight.row.id in alive:
                flight.lease_deadline = sent_at + lease.total_seconds()
            elif flight.phase is not Phase.RECORDING:
                flight.log.warning("lease lost during the call; its record will change nothing")

    def guard(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Have the guard's timer fire by ``deadline``. Deadlines mostly come in increasing
        order, so the timer already armed nearly always fires first and is left alone."""
        if self._guard is not None and self._guard.when() <= deadline:
            return
        if self._guard is not None:
            self._guard.cancel()
        self._guard = loop.call_at(deadline, self._sweep, loop)

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        """Release the calls past their guard deadline; re-arm for the earliest other one."""
        self._guard = None
        now = loop.time()
        later: float | None = None
        for flight in self._inflight.values():
            if flight.guard_at is None or flight.waiter is None:
                continue
            if flight.guard_at <= now:
                release(flight.waiter)
            elif later is None or flight.guard_at < later:
                later = flight.guard_at
        if later is not None:
            self.guard(loop, later)

    def disarm(self) -> None:
        """At the end of a run with no call left to guard."""
        if self._guard is not None and not self._inflight:
            self._guard.cancel()
            self._guard = None

"""The dispatcher: claim -> send (no transaction open) -> record (fenced by the lease).

One asyncio task per leased operation, at most ``concurrency`` at a time. A claim tops up the
free slots; a heartbeat renews the leases of calls still running; a rescuer takes back the rows of
dead dispatchers. Times that decide anything come from the database clock: the claim returns it,
and only durations are measured locally.

``Dispatcher`` puts together the parts of ``outbox.dispatch``, each with one job (that package's
docstring lists them); it owns the slots (one task per leased operation) and the shutdown.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Final

from outbox.config.settings import DispatcherSettings, ProviderLimits
from outbox.db import statements
from outbox.db.store import Claimed, Store
from outbox.dispatch.claims import ClaimScheduler, next_cursor
from outbox.dispatch.flight import InFlight, Phase
from outbox.dispatch.health import HealthKeeper
from outbox.dispatch.leases import LeaseKeeper
from outbox.dispatch.limits import Limits
from outbox.dispatch.maintenance import Maintenance
from outbox.dispatch.meters import Meters
from outbox.dispatch.pauses import ActionPauses
from outbox.dispatch.pipeline import UNKNOWN_PROVIDER_GRACE, Pipeline
from outbox.dispatch.recorder import Recorder
from outbox.dispatch.rules import ProviderRules
from outbox.dispatch.shared import Shared
from outbox.observability import metrics
from outbox.observability.metric_labels import Labels
from outbox.providers.base import Provider
from outbox.runtime import loops

__all__ = ["UNKNOWN_PROVIDER_GRACE", "Dispatcher", "InFlight", "Phase", "next_cursor"]

# Records still running when the shutdown grace ends get this long to reach the database.
RECORD_GRACE: Final = 5.0


class Dispatcher:
    """Delivers operations to providers for one process."""

    def __init__(
        self,
        store: Store,
        providers: Mapping[str, Provider],
        settings: DispatcherSettings,
        *,
        worker_id: str,
        call_timeouts: Mapping[str, timedelta] | None = None,
        rng: random.Random | None = None,
        limits: Mapping[str, ProviderLimits] | None = None,
        margins: Mapping[str, timedelta] | None = None,
    ) -> None:
        """``margins``: the providers with a retention margin of their own (Settings.margins)."""
        # Every provider has a breaker; the other limits only where configured.
        every = {name: (limits or {}).get(name, ProviderLimits()) for name in providers}
        labels = Labels({name: getattr(p, "actions", None) for name, p in providers.items()})
        self._shared = shared = Shared(
            store=store,
            providers=providers,
            settings=settings,
            worker=worker_id,
            labels=labels,
            limits=Limits(store, every),
            action_pauses=ActionPauses({n: lim.breaker_open_for for n, lim in every.items()}),
            rules=ProviderRules(providers, settings.retention_margin, call_timeouts, margins),
            meters=Meters(labels),
        )
        self._inflight = shared.inflight
        shared.on_call_over = self._call_over
        # The alerts' counters exist at 0 from now: a first increase must show (issue 21).
        metrics.start_at_zero(labels.provider(name) for name in providers)
        self.claims = ClaimScheduler(shared, self._start)
        self.maintenance = Maintenance(shared, wake_claims=self.claims.woken.set)
        self.leases = LeaseKeeper(shared)
        self._recorder = Recorder(
            shared,
            rng=rng or random.Random(),  # noqa: S311 (jitter)
            stage_by=self.maintenance.stage_by,
        )
        self._pipeline = Pipeline(shared, self._recorder, self.leases)
        self.health = HealthKeeper(shared)

    # --- control ------------------------------------------------------------------------------

    def wake(self, payload: str = "") -> None:
        """A notification came (something was enqueued): claim now, not at the next poll.
        ``payload`` WAKE_TAKEN: its sender took this dispatcher's mark (sql/0029)."""
        self.claims.notified(taken=payload == statements.WAKE_TAKEN)

    async def server_changed(self, since: datetime) -> None:
        """The readiness probe found another server behind the DSN (a failover) at ``since``,
        by the new server's clock: take back this process's stale leases now."""
        await self.maintenance.take_back_strays(since)

    def request_stop(self) -> None:
        """Stop claiming; in-flight calls finish within the shutdown grace."""
        self.claims.request_stop()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def database_ok(self) -> bool:
        """The last claim reached the database (readiness)."""
        return self.claims.database_ok

    @property
    def listening(self) -> bool:
        return self.claims.listening

    @listening.setter
    def listening(self, value: bool) -> None:
        """Set by the LISTEN connection while it listens (outbox.daemon.service)."""
        self.claims.listening = value

    @property
    def limits(self) -> Limits:
        """Each provider's breaker and limits in this process."""
        return self._shared.limits

    @property
    def rules(self) -> ProviderRules:
        """Each provider's key window and call limit (the gauges read the windows too)."""
        return self._shared.rules

    async def run(self) -> None:
        """Claim and dispatch until ``request_stop``, then drain."""
        self._shared.loop = asyncio.get_running_loop()
        await self.health.restore()
        background = [
            asyncio.create_task(loops.forever("health", self.health.round), name="outbox-health"),
            asyncio.create_task(self.leases.heartbeat_loop(), name="outbox-heartbeat"),
            asyncio.create_task(self.maintenance.rescue_loop(), name="outbox-rescuer"),
            asyncio.create_task(self.maintenance.repair_loop(), name="outbox-ordering-repair"),
            asyncio.create_task(self.maintenance.stage_loop(), name="outbox-stager"),
        ]
        try:
            await self.claims.run()
        finally:
            await self._drain()
            await self.claims.unmark()
            await loops.stop_tasks(background)
            self.leases.disarm()

    async def run_once(self) -> int:
        """Stage what is due, claim one batch, dispatch it and record every outcome; returns how
        many were claimed."""
        self._shared.loop = asyncio.get_running_loop()
        await self.maintenance.stage_once()
        settings = self._shared.settings
        claimed = await self.claims.claim(min(settings.batch_size, settings.concurrency))
        for row in claimed:
            self._start(row)
        await self.wait_idle()
        return len(claimed)

    async def rescue_once(self) -> int:
        """Take back expired leases once; returns how many rows were rescued."""
        return await self.maintenance.rescue_once()

    async def heartbeat_once(self) -> None:
        """Renew the lease of every operation this process still holds."""
        await self.leases.heartbeat_once()

    async def stage_once(self) -> float:
        """Move the scheduled operations that are due into the claim."""
        return await self.maintenance.stage_once()

    async def wait_idle(self) -> None:
        """Wait until every leased operation has been recorded or released."""
        tasks = [f.task for f in self._inflight.values() if f.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- the slots ----------------------------------------------------------------------------

    def _start(self, row: Claimed) -> None:
        now = time.monotonic()
        lease = self._shared.settings.lease.total_seconds()
        flight = InFlight(row, claimed_mono=now, lease_deadline=now + lease)
        self._inflight[row.id] = flight
        metrics.IN_FLIGHT.inc()
        loop = self._shared.running_loop()
        flight.task = loop.create_task(self._pipeline.process(flight), name=f"outbox-op-{row.id}")
        flight.task.add_done_callback(lambda task: self._finished(flight, task))

    def _call_over(self, flight: InFlight) -> None:
        """A call slot is free: the flight only records from now on (Shared.call_over)."""
        if self._shared.limits.call_over(flight.row):
            self.claims.woken.set()  # a capped provider has room again
        self.claims.slot_freed.set()

    def _finished(self, flight: InFlight, task: asyncio.Task[None]) -> None:
        # Only if it is this flight's: after an asynchronous failover the new primary may give
        # a lost row's id to another operation, claimed while the lost row's call still runs.
        if self._inflight.get(flight.row.id) is flight:
            del self._inflight[flight.row.id]
        metrics.IN_FLIGHT.dec()
        room = False
        if flight.phase is Phase.RECORDING:
            self._shared.recording -= 1
        else:  # ended before it could record (the send guard's refusal, a cancellation)
            room = self._shared.limits.call_over(flight.row)
        self.claims.slot_freed.set()
        if self._shared.limits.finished(flight.row) or room:
            # A capped provider has room again: claim now, not at the next poll.
            self.claims.woken.set()
        if not task.cancelled() and task.exception() is not None:
            # The send guard's refusal (see Pipeline.process); the rescuer takes the row back.
            metrics.INTERNAL_ERRORS.labels("dispatch").inc()
            flight.log.error("dispatch task failed", exc_info=task.exception())

    async def _drain(self) -> None:
        """Let calls finish within the grace; cut off the rest and record them as unknown."""
        self._shared.stopping = True
        tasks = [f.task for f in self._inflight.values() if f.task is not None]
        if tasks:
            grace = self._shared.settings.shutdown_grace.total_seconds()
            await asyncio.wait(tasks, timeout=grace)
        for flight in list(self._inflight.values()):
            if flight.send_task is not None and not flight.send_task.done():
                flight.send_task.cancel()
        remaining = [f.task for f in self._inflight.values() if f.task is not None]
        if remaining:
            await asyncio.wait(remaining, timeout=RECORD_GRACE)

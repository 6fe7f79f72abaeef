"""What keeps the queue whole around the claims: the rescuer takes back the rows of dead
workers, ordering-key repair frees keys whose next operation waits for no one, and the stager
moves scheduled operations that came due into the claim."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import Final

import psycopg

from outbox.core.model import Status
from outbox.core.policy import REASON_INDETERMINATE
from outbox.dispatch.flight import log
from outbox.dispatch.shared import Shared
from outbox.observability import metrics
from outbox.runtime import loops

RESCUE_BATCH: Final = 500
# A failover's stale leases are logged with this many of their ids at most.
STRAYS_LOGGED: Final = 20
# How often ordering keys noted for repair are looked at (seconds; sql/0015).
ORDERING_REPAIR_INTERVAL: Final = 1.0
# Scheduled operations staged per statement (sql/0019): a day of reminders coming due at once
# joins the claim a thousand at a time, each batch a short transaction.
STAGE_BATCH: Final = 1000
# Stage rounds at most this often: a retry's own backoff is random anyway, and a storm of
# retries must not become a storm of statements.
STAGE_MIN_GAP: Final = 0.05


class Maintenance:
    def __init__(self, shared: Shared, *, wake_claims: Callable[[], None]) -> None:
        self._shared = shared
        self._store = shared.store
        self._settings = shared.settings
        self._wake_claims = wake_claims  # rows came due: claim now, not at the next poll
        # The stager runs again by this loop time, earlier when told of a retry due sooner.
        self._stage_at = float("inf")
        self._stage_nudge = asyncio.Event()

    async def rescue_once(self) -> int:
        """Take back expired leases once; returns how many rows were rescued."""
        try:
            rescued = await self._store.rescue(RESCUE_BATCH, self._settings.max_attempts)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("rescue").inc()
            log.warning("rescue failed", error_class=type(exc).__name__)
            return 0
        for row in rescued:
            metrics.LEASE_EXPIRED.inc()
            if row["status"] is Status.RECONCILING and row["status_reason"] == REASON_INDETERMINATE:
                # Its budget used up on an attempt whose outcome nobody knows (RESCUE).
                label = self._shared.labels.provider(row["provider"])
                metrics.RECONCILIATION_ROUTED.labels(label, REASON_INDETERMINATE).inc()
            log.warning(
                "lease expired; rescued",
                operation_id=row["id"],
                tenant_id=row["tenant_id"],
                operation_type=row["operation_type"],
                operation_key=row["operation_key"],
                provider=row["provider"],
                action=row["action"],
                attempt=row["attempts"],
                correlation_id=row["correlation_id"],
                outcome="unknown",
                error_class="lease_expired",
                duration_ms=None,
                status=row["status"].value,
            )
        return len(rescued)

    async def take_back_strays(self, since: datetime) -> int:
        """After a failover: this process's leases that no call of it holds, granted before
        ``since``, are stale (the new server lost the record that ended them, or the call's
        end). They are this process's own, so nobody else holds them: expired now and rescued
        at once, not a lease later. Returns how many."""
        held = [flight.row.lease_token for flight in self._shared.inflight.values()]
        try:
            stray = await self._store.expire_stray_leases(self._shared.worker, held, since)
        except psycopg.Error as exc:  # they expire on their own, a lease from now
            metrics.DB_ERRORS.labels("rescue").inc()
            log.warning("taking back stale leases failed", error_class=type(exc).__name__)
            return 0
        if stray:
            log.warning(
                "leases of this process that the database server still held for calls it "
                "no longer makes; taken back now",
                operations=len(stray),
                operation_ids=stray[:STRAYS_LOGGED],
            )
            await self.rescue_once()
            self._wake_claims()
        return len(stray)

    async def rescue_loop(self) -> None:
        # Often enough that a dead worker's rows come back within about one lease.
        interval = max(self._settings.lease.total_seconds() / 4, 0.05)

        async def round_() -> float:
            return 0.0 if await self.rescue_once() >= RESCUE_BATCH else interval

        await loops.forever("rescue", round_)

    async def repair_loop(self) -> None:
        # A key noted for repair has its next operation waiting for no one: soon, not per lease.
        async def round_() -> float:
            try:
                await self._store.repair_ordering(RESCUE_BATCH)
            except psycopg.Error as exc:
                metrics.DB_ERRORS.labels("ordering_repair").inc()
                log.warning("ordering repair failed", error_class=type(exc).__name__)
            return ORDERING_REPAIR_INTERVAL

        await asyncio.sleep(ORDERING_REPAIR_INTERVAL)
        await loops.forever("ordering_repair", round_)

    async def stage_once(self) -> float:
        """Move the scheduled operations that are due into the claim (sql/0019), and wake the
        claim loop if any moved; returns how long until the stager should look again."""
        poll = self._settings.poll_interval.total_seconds()
        try:
            staged, next_in = await self._store.stage(STAGE_BATCH)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("stage").inc()
            log.warning("staging scheduled operations failed", error_class=type(exc).__name__)
            return poll
        if staged:
            metrics.STAGED.inc(staged)
            self._wake_claims()
        if staged >= STAGE_BATCH:
            return 0.0
        return poll if next_in is None else min(poll, max(next_in, 0.0))

    def stage_by(self, seconds: float) -> None:
        """This process scheduled a retry due in ``seconds``: have the stager look by then."""
        at = self._shared.running_loop().time() + seconds
        if at < self._stage_at:
            self._stage_at = at
            self._stage_nudge.set()

    async def stage_loop(self) -> None:
        loop = self._shared.running_loop()
        while True:
            # Any nudge from now on counts for the round after this one.
            self._stage_at = float("inf")
            last = loop.time()
            wait = await loops.survive("stage", self.stage_once, loops.ERROR_PAUSE)
            self._stage_at = min(self._stage_at, loop.time() + wait)
            while (delay := max(self._stage_at, last + STAGE_MIN_GAP) - loop.time()) > 0:
                self._stage_nudge.clear()
                await loops.wait_event(self._stage_nudge, delay)

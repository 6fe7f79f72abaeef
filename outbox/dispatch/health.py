"""Each provider's breaker, seen beyond this process (issue 37; sql/0031).

Every few seconds a dispatcher writes its breakers to ``outbox.provider_health`` (``outbox
providers`` shows them, one row per provider and worker) and acts on operators' requests in
``outbox.provider_actions`` (``outbox providers reset|probe``) that are newer than its start. At
start-up it opens the breakers another process left open in the last ten minutes, unless an
operator reset them since: a dispatcher restarting in a crash loop must not forget that its
provider is down and send it a burst each time. With the database away at start-up, the health
loop tries that again until it is done, but only while no breaker of this process has moved: then
its own word is newer than any row.

All of it is best effort: the database away costs the view, never a claim or a send.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Final

import psycopg
import structlog

from outbox.db.store import Health
from outbox.dispatch.shared import Shared
from outbox.observability import metrics

# How often operators' requests are read and changed breakers written (seconds); every breaker is
# written every WHOLE_EVERY rounds all the same (30 s), so that a live process is never taken
# for a gone one (`outbox providers list` calls a row a minute old stale). A hundred providers
# and fifty replicas then write about 170 rows a second, and fewer while nothing changes.
HEALTH_INTERVAL: Final = 2.0
WHOLE_EVERY: Final = 15
# Rows no one has written for a day go this often (seconds) per dispatcher, not at every write:
# the table has no index on updated_at, and fifty replicas would scan it 25 times a second.
PRUNE_EVERY: Final = 300.0

log = structlog.get_logger("outbox.health")


class HealthKeeper:
    def __init__(self, shared: Shared) -> None:
        self._shared = shared
        self._last_action: int | None = None  # the newest request seen; None: not read yet
        self._written: dict[str, tuple[object, ...]] = {}  # what each row says, as written
        self._rounds = 0
        self._restored = False  # restore() read the table, or may no longer (a breaker moved)
        self._restore_failed = False  # it could not: rounds try again (logged once)
        self._pruned_at: float | None = None  # monotonic; None: not yet

    async def restore(self) -> None:
        """Open the breakers another process left open lately, and note where operators'
        requests stand (only later ones are acted on)."""
        limits, store = self._shared.limits, self._shared.store
        try:
            if self._last_action is None:  # a round may have read it already
                self._last_action = await store.last_provider_action()
            left = await store.restore_health(list(self._shared.providers))
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("health").inc()
            (log.debug if self._restore_failed else log.warning)(
                "could not read the providers' health; trying again every few seconds",
                error_class=type(exc).__name__,
            )
            self._restore_failed = True
            return
        self._restored = True
        for breaker in left:
            limits.breaker(breaker.provider).restore(
                breaker.reason, breaker.probe_in, breaker.open_for
            )

    async def round(self) -> float:
        """Act on new requests, then write the breakers; returns the wait before the next."""
        store = self._shared.store
        try:
            if not self._restored:
                await self._restore_late()
            await self._act()
            snapshots = [
                self._shared.limits.breaker(name).snapshot() for name in self._shared.providers
            ]
            if not self._restored and _moved(snapshots):
                self._give_up_restore()
            self._rounds += 1
            every = self._rounds % WHOLE_EVERY == 1
            changed = [h for h in snapshots if every or self._written.get(h.provider) != _same(h)]
            if changed:
                await store.write_health(self._shared.worker, changed)
                self._written.update((h.provider, _same(h)) for h in changed)
            await self._prune()
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("health").inc()
            log.debug("could not write the providers' health", error_class=type(exc).__name__)
        return HEALTH_INTERVAL

    async def _restore_late(self) -> None:
        """The restore at start-up failed: do it now, unless a breaker of this process has
        moved since (it has its own word on its provider then, newer than any row)."""
        limits = self._shared.limits
        if _moved([limits.breaker(name).snapshot() for name in self._shared.providers]):
            self._give_up_restore()
        else:
            await self.restore()

    def _give_up_restore(self) -> None:
        self._restored = True
        log.info("breakers not restored: this process's own have moved since it started")

    async def _prune(self) -> None:
        now = time.monotonic()
        if self._pruned_at is not None and now - self._pruned_at < PRUNE_EVERY:
            return
        self._pruned_at = now  # an error waits for the next turn too: best effort
        await self._shared.store.prune_health()

    async def _act(self) -> None:
        store, limits = self._shared.store, self._shared.limits
        if self._last_action is None:
            self._last_action = await store.last_provider_action()
            return
        for request, provider, action in await store.provider_actions(self._last_action):
            self._last_action = request
            if provider not in self._shared.providers:
                continue
            breaker = limits.breaker(provider)
            if action == "reset":
                breaker.reset()
            elif action == "probe":
                breaker.probe_now()
            log.info("operator request carried out", provider=provider, action=action)


def _same(h: Health) -> tuple[object, ...]:
    """What must be written again when it changes (not the times, which always do)."""
    return (h.state, h.reason, round(h.failure_rate, 1), h.failing_alone, h.open_for)


def _moved(snapshots: Sequence[Health]) -> bool:
    """Some breaker has left closed, or weighed a call (``calls`` counts those since it last
    closed, ``failing_alone`` those found alone): this process knows something of its own."""
    return any(h.state != "closed" or h.calls or h.failing_alone for h in snapshots)

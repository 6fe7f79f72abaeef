"""The claim scheduler: claims rows into free slots, as many claim loops as help, from where the
fairness cursor says, and sleeps until woken (a notification, a slot freed, rows staged) or the
poll interval."""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Final

import psycopg

from outbox.db.store import Claimed
from outbox.dispatch.flight import log
from outbox.dispatch.shared import Shared
from outbox.observability import metrics
from outbox.runtime import loops

# Leases a process holds at most, per slot of `concurrency`: one row being sent, one recorded.
LEASED_PER_SLOT: Final = 2
# Claim loops per process at most: past two or three, claims only queue behind each other.
MAX_CLAIMERS: Final = 3
# An idle dispatcher renews its waiting mark this often (seconds); producers ignore marks older
# than 10 minutes, left by a dispatcher that died while it waited.
WAITING_REFRESH: Final = 60.0
# Back-off after a failed claim, so a database outage is not met with a busy loop.
CLAIM_RETRY_MIN: Final = 0.1
CLAIM_RETRY_MAX: Final = 5.0
# A claim woken by a notification that found nothing makes the next wake-up wait, from this
# long, doubling up to WAKE_GAP_MAX; a claim that finds something ends the wait. Any database
# role may NOTIFY outbox_enqueue: 40,000 notifications cost about 900 claims in 1.5 s before.
WAKE_GAP_MIN: Final = 0.001
WAKE_GAP_MAX: Final = 0.05
# A dispatcher about to sleep that finds a producer's commit still becoming visible (its mark
# could not take the wake-up lock, sql/0029) claims again after this pause, doubling up to
# BUSY_GAP_MAX while that goes on: commits that did not see its mark may not wake it.
BUSY_GAP_MIN: Final = 0.001
BUSY_GAP_MAX: Final = 0.02


class ClaimScheduler:
    def __init__(self, shared: Shared, start: Callable[[Claimed], None]) -> None:
        self._shared = shared
        self._settings = shared.settings
        self._store = shared.store
        self._limits = shared.limits
        self._inflight = shared.inflight
        self._start = start  # hands a claimed row to the pipeline
        self.woken = asyncio.Event()
        # Claims in a row that a notification started and that found nothing (WAKE_GAP_MIN);
        # wake-ups of this process's own (a slot freed, rows staged) neither count nor wait.
        self.empty_wakes = 0
        self._notified = False
        self._taken = False  # a notification since our last mark said it took the mark
        self.slot_freed = asyncio.Event()
        self.stop = asyncio.Event()
        self._claim_retry = CLAIM_RETRY_MIN
        self.database_ok = False  # the last claim reached the database (readiness)
        # Set by the LISTEN connection while it listens: only then is it worth asking producers
        # to notify (sql/0029), and marking this dispatcher waiting.
        self.listening = False
        self._waiting_since: float | None = None  # when we last marked ourselves waiting
        # Whether that mark found no producer's commit becoming visible (safe to sleep on), and
        # the pause before marking again when it did not.
        self._quiet = False
        self._busy_gap = BUSY_GAP_MIN
        # The count of commits that woke no one, read at our last mark (None: never marked).
        self._unnotified: int | None = None
        self._reserved = 0  # slots held for claims under way
        self._backlog = asyncio.Event()  # the last claim came back full: more claimers help
        # The (provider, tenant) group the next claim starts after.
        self._cursor: tuple[str, str] | None = None

    def notified(self, *, taken: bool = False) -> None:
        """A notification came (something was enqueued): claim now, not at the next poll.
        ``taken``: its sender took this dispatcher's mark (sql/0029), so mark again."""
        self._notified = True
        self._taken = self._taken or taken
        self.woken.set()

    def request_stop(self) -> None:
        self.stop.set()
        self.woken.set()
        self.slot_freed.set()
        self._backlog.set()

    def claimers(self) -> int:
        return claimers(self._settings.concurrency, self._settings.batch_size)

    async def run(self) -> None:
        """Several claim loops: one claim round trip at a time caps a process at a batch per
        round trip, however idle its slots. Slots are reserved before claiming, so the loops
        together never start more than `concurrency` calls, nor lease more than `free` allows."""
        await asyncio.gather(*[self._loop(primary=n == 0) for n in range(self.claimers())])

    async def unmark(self) -> None:
        """At shutdown: producers need not notify on this dispatcher's account any more."""
        if self._waiting_since is not None:
            await self._unmark_waiting()

    async def _loop(self, *, primary: bool) -> None:
        """Claim while there are free slots. Only the primary loop polls and waits for wake-ups;
        the others claim only while claims come back full (a backlog)."""
        # Top up in chunks: claiming for every freed slot would cost one query per operation.
        chunk = max(1, min(self._settings.batch_size, self._settings.concurrency) // 4)
        round_ = functools.partial(self._round, primary=primary, chunk=chunk)
        while not self.stop.is_set():
            pause = await loops.survive("claim", round_, loops.ERROR_PAUSE)
            if pause:
                # After an error; not cut short by wake-ups: a round that keeps failing must
                # not spin.
                await loops.wait_event(self.stop, pause)

    async def _round(self, *, primary: bool, chunk: int) -> float:
        """One claim and what follows it; returns 0 (the next round at once, as loops.survive
        wants a pause from a round)."""
        if not primary and not self._backlog.is_set():
            await self._backlog.wait()
            return 0.0
        free = self.free()
        if free < chunk and (self._inflight or self._reserved):
            self.slot_freed.clear()
            await self.slot_freed.wait()
            return 0.0
        # Cleared before claiming: a NOTIFY that arrives during the claim still wakes us.
        self.woken.clear()
        want = min(self._settings.batch_size, free)
        self._reserved += want
        try:
            claimed = await self.claim(want)
        finally:
            self._reserved -= want
        for row in claimed:
            self._start(row)
        if claimed:
            # Whatever woke us found work: the next notification is news, not a flood's.
            self._busy_gap = BUSY_GAP_MIN
            self.empty_wakes = 0
        if len(claimed) < want:
            self._backlog.clear()
            self.slot_freed.set()  # reserved slots came back unused
            if primary and not self.stop.is_set():
                if await self._mark_waiting():
                    return 0.0  # claim again: a row committed before the mark notified no one
                await self.idle(found=bool(claimed))
        elif claimed:
            self._backlog.set()
            self.empty_wakes = 0
            if self._waiting_since is not None:
                await self._unmark_waiting()  # a backlog: no wake-ups needed
        return 0.0

    def free(self) -> int:
        """Rows a claim may take now. `concurrency` counts provider calls: a row whose call is
        over and whose outcome is being written holds no slot, so the next claim overlaps the
        last batch's record instead of waiting for it (a claim, then a record, then a claim:
        the dispatcher idled half the time at full load). Leases held stay within twice
        `concurrency`: a database slow to record cannot make a process lease without bound."""
        concurrency = self._settings.concurrency
        leased = len(self._inflight) + self._reserved
        calls = leased - self._shared.recording
        return min(concurrency - calls, LEASED_PER_SLOT * concurrency - leased)

    async def idle(self, *, found: bool) -> None:
        """Wait for a wake-up or the poll interval. Notifications that keep finding nothing (a
        burst anyone can send) are coalesced: each waits for a gap that doubles, so a flood
        costs a claim per WAKE_GAP_MAX at most, and one claim that finds something brings back
        immediate wake-ups. This process's own wake-ups never wait."""
        self.empty_wakes = 0 if found else self.empty_wakes
        # A notification that came while we were awake and took our mark (sql/0029) is handled
        # as if it had woken us: asleep without a mark we would hear of the next commit only at
        # the next poll.
        woken = (self._taken and self.listening) or await self._sleep_until_woken(self._idle_wait())
        notified, self._notified = self._notified, False
        if not woken:
            self.empty_wakes = 0  # a poll: the next notification is news
            return
        if not notified:
            return
        if self.empty_wakes:
            gap = min(WAKE_GAP_MAX, WAKE_GAP_MIN * 2.0 ** (self.empty_wakes - 1))
            await loops.wait_event(self.stop, gap)
        # Counted as empty until the claim it starts finds something (then `found` resets it).
        self.empty_wakes += 1
        if not self._taken:
            return
        # The producer that notified took this dispatcher's mark (sql/0029): mark again. After
        # the claim this wake-up starts, so that its rows leave at once, and then claim once
        # more if a commit went by unnotified. While notifications keep finding nothing (a
        # flood), before the claim instead: one claim per gap.
        if self.empty_wakes > 1:
            await self._mark()
        else:
            self._waiting_since = None

    async def _mark(self) -> bool:
        """Mark this dispatcher waiting (in one statement with the try of the wake-up lock);
        False when it could not. A failure only costs wake-ups: polling goes on."""
        if not self.listening:
            return False
        self._taken = False  # one taken after this statement's upsert says so again
        try:
            self._quiet, self._unnotified = await self._store.mark_waiting(self._shared.worker)
        except psycopg.Error as exc:
            log.debug("could not mark this dispatcher waiting", error_class=type(exc).__name__)
            return False
        self._waiting_since = time.monotonic()
        return True

    async def _mark_waiting(self) -> bool:
        """Mark this dispatcher waiting for a wake-up, refresh an old mark, or mark again after
        a commit was seen becoming visible; True when the caller must claim once more before
        sleeping: a commit since the last mark woke no one, or one is still becoming visible.
        False when it may sleep now. A failure only costs wake-ups: polling goes on."""
        now = time.monotonic()
        if not self.listening:
            return False
        due = self._waiting_since is None or now - self._waiting_since >= WAITING_REFRESH
        if not due and self._quiet:
            return False
        if not due:
            # Marked, but a producer's commit was becoming visible: it may not have seen the
            # mark, so it may not wake us. Look again in a moment, not at the next poll.
            await self._sleep_until_woken(self._busy_gap)
            self._busy_gap = min(BUSY_GAP_MAX, self._busy_gap * 2)
        before, was_quiet = self._unnotified, self._quiet
        if not await self._mark():
            return False
        # Claim again unless nothing can have slipped by: the count of commits that woke no one
        # has not moved since the last mark (commits are counted only where marks are taken;
        # after an unmark `before` is None), no commit is becoming visible now, and none was at
        # the last mark (it may have become visible after the claim that followed).
        return before is None or self._unnotified != before or not (self._quiet and was_quiet)

    async def _unmark_waiting(self) -> None:
        # Unmarked, commits are not counted (sql/0029): the next mark claims once more.
        self._waiting_since, self._unnotified = None, None
        try:
            await self._store.unmark_waiting(self._shared.worker)
        except psycopg.Error as exc:  # the mark expires on its own (sql/0012)
            log.debug("could not unmark this dispatcher", error_class=type(exc).__name__)

    async def _sleep_until_woken(self, seconds: float) -> bool:
        """Sleep until woken or ``seconds`` have passed; True if woken."""
        return await loops.wait_event(self.woken, seconds)

    def _idle_wait(self) -> float:
        """How long a claim loop that found too little waits: a poll interval, or less when a
        provider ran out of tokens while its rows may still wait."""
        poll = self._settings.poll_interval.total_seconds()
        tokens_in = self._limits.claim_again_in()
        return poll if tokens_in is None else min(poll, tokens_in)

    async def claim(self, limit: int) -> list[Claimed]:
        """Lease up to ``limit`` due rows within the providers' limits."""
        # Probes first: a busy provider's backlog must not take every slot from them.
        claimed = await self._claim_probes(limit)
        grant = await self._limits.grant(limit - len(claimed))
        try:
            if len(claimed) < limit:
                claimed += await self._claim_capped(limit - len(claimed), grant.caps)
        finally:
            await self._limits.settle(grant, claimed)
        return claimed

    async def _claim_probes(self, room: int) -> list[Claimed]:
        """The probes of half-open breakers, each claimed on its own (statements.CLAIM_PROBE):
        the ordinary claim's oldest-first order would pick the rows that just failed."""
        if room <= 0:
            return []
        probes: list[Claimed] = []
        for provider in self._limits.probes_due(room):
            row = None
            try:
                row = await self._store.claim_probe(
                    self._shared.worker,
                    provider,
                    self._settings.lease,
                    self._limits.probe_cursor(provider),
                )
            except psycopg.Error as exc:
                metrics.DB_ERRORS.labels("claim").inc()
                log.warning(
                    "probe claim failed; retrying",
                    provider=provider,
                    error_class=type(exc).__name__,
                )
            finally:
                self._limits.probe_claimed(provider, row)
            if row is not None:
                probes.append(row)
        return probes

    async def _claim_capped(self, limit: int, caps: Mapping[str, int]) -> list[Claimed]:
        started = time.perf_counter()
        try:
            claimed = await self._store.claim(
                self._shared.worker, limit, self._settings.lease, caps=caps, after=self._cursor
            )
        except psycopg.Error as exc:
            self.database_ok = False
            metrics.DB_ERRORS.labels("claim").inc()
            log.warning(
                "claim failed; retrying",
                error_class=type(exc).__name__,
                retry_in_s=round(self._claim_retry, 2),
            )
            await self._sleep_until_woken(self._claim_retry)
            self._claim_retry = min(self._claim_retry * 2, CLAIM_RETRY_MAX)
            return []
        self.database_ok = True
        self._claim_retry = CLAIM_RETRY_MIN
        metrics.CLAIM_DURATION.observe(time.perf_counter() - started)
        self._cursor = next_cursor(self._cursor, claimed)
        return claimed


def claimers(concurrency: int, batch_size: int) -> int:
    """How many claim loops: enough for a claim to be under way while another's rows start, up
    to MAX_CLAIMERS, and never more than there are batches in `concurrency`."""
    batches = -(-concurrency // batch_size)
    return max(1, min(MAX_CLAIMERS, batches))


def next_cursor(cursor: tuple[str, str] | None, claimed: list[Claimed]) -> tuple[str, str] | None:
    """Where the next claim's visit of the groups starts, after a claim that took ``claimed``.

    After the group that took more than its share, so that the next group in line fills the
    next batch; with no such group (each took one row, or all they had), after the last group
    served, so that groups the claim did not reach come first; unchanged after a claim that
    took nothing. Python orders strings by code point, the database by its collation: where
    they differ the turns are less even, never skipped for good."""
    counts = Counter((row.provider, row.tenant_id) for row in claimed)
    if not counts:
        return cursor
    after = cursor or ("", "")
    order = sorted(counts)
    visit = [g for g in order if g > after] + [g for g in order if g <= after]
    least = min(counts.values())
    return next((g for g in visit if counts[g] > least), visit[-1])

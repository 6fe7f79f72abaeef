"""The dispatcher: claim -> send (no transaction open) -> record (fenced by the lease).

One asyncio task per leased operation, at most ``concurrency`` at a time. A claim tops up the
free slots; a heartbeat renews the leases of calls still running; a rescuer takes back the rows of
dead dispatchers. Times that decide anything come from the database clock: the claim returns it,
and only durations are measured locally.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import logging
import random
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, NamedTuple

import psycopg
import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, wait_random_exponential

from outbox import failpoints, loops, metrics, payloads, tracing
from outbox.config import DispatcherSettings, ProviderLimits
from outbox.db.group_record import GroupRecorder
from outbox.db.store import (
    Claimed,
    ConnectionHeldAcrossSend,
    Record,
    Store,
    assert_no_connection_held,
)
from outbox.durations import format_duration
from outbox.metric_labels import Labels
from outbox.model import Status
from outbox.policy import (
    REASON_INTERNAL_ERROR,
    REASON_INVALID_PAYLOAD,
    REASON_KEY_WINDOW,
    UNSPENT_FOR,
    Backoff,
    KeyWindow,
    after_failure,
)
from outbox.provider_limits import ActionPauses, Limits
from outbox.providers.base import (
    Failed,
    InvalidRequest,
    Provider,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    unknown,
)

# Records still running when the shutdown grace ends get this long to reach the database.
RECORD_GRACE: Final = 5.0
# Claim loops per process at most: past two or three, claims only queue behind each other.
MAX_CLAIMERS: Final = 3

# An idle dispatcher renews its waiting mark this often (seconds); producers ignore marks older
# than 10 minutes, left by a dispatcher that died while it waited.
WAITING_REFRESH: Final = 60.0

# A provider call that outlives its own timeout by this much is cut off: a hung plug-in must
# not hold a lease forever.
CALL_GUARD_MARGIN: Final = 5.0
# Back-off after a failed claim, so a database outage is not met with a busy loop.
CLAIM_RETRY_MIN: Final = 0.1
CLAIM_RETRY_MAX: Final = 5.0
RESCUE_BATCH: Final = 500
# How often ordering keys noted for repair are looked at (seconds; sql/0015).
ORDERING_REPAIR_INTERVAL: Final = 1.0
# A row naming a provider this process does not know is handed back for this long after its
# enqueue (a deploy adding the provider may be rolling out), then quarantined as a bad row.
UNKNOWN_PROVIDER_GRACE: Final = timedelta(minutes=10)
UNKNOWN_PROVIDER_RETRY: Final = timedelta(seconds=30)
# Scheduled operations staged per statement (sql/0019): a day of reminders coming due at once
# joins the claim a thousand at a time, each batch a short transaction.
STAGE_BATCH: Final = 1000
# Stage rounds at most this often: a retry's own backoff is random anyway, and a storm of
# retries must not become a storm of statements.
STAGE_MIN_GAP: Final = 0.05
# A claim woken by a notification that found nothing makes the next wake-up wait, from this
# long, doubling up to WAKE_GAP_MAX; a claim that finds something ends the wait. Any database
# role may NOTIFY outbox_enqueue: 40,000 notifications cost about 900 claims in 1.5 s before.
WAKE_GAP_MIN: Final = 0.001
WAKE_GAP_MAX: Final = 0.05

log = structlog.get_logger("outbox.dispatcher")


class Phase(enum.Enum):
    CLAIMED = "claimed"  # leased, not sent: may be released untouched
    SENDING = "sending"
    RECORDING = "recording"


@dataclass(eq=False)
class InFlight:
    """A leased operation and what this process knows of its lease."""

    row: Claimed
    claimed_mono: float
    lease_deadline: float  # local monotonic estimate, never later than the database's
    phase: Phase = Phase.CLAIMED
    task: asyncio.Task[None] | None = None
    send_task: asyncio.Task[SendResult] | None = None
    # While sending: resolved when the call ends, or by the call guard at guard_at (loop time).
    waiter: asyncio.Future[None] | None = None
    guard_at: float | None = None
    scope: str | None = None  # where the send went, as its provider names it (Provider.scope)
    _log: Any = None

    @property
    def log(self) -> Any:
        """A logger bound to the operation's fields. Bound on first use: a success, the common
        case, logs at debug, so most operations never need one."""
        if self._log is None:
            row = self.row
            self._log = log.bind(
                operation_id=row.id, tenant_id=row.tenant_id, operation_type=row.operation_type,
                operation_key=row.operation_key, provider=row.provider, action=row.action,
                attempt=row.attempts, correlation_id=row.correlation_id,
            )  # fmt: skip
        return self._log

    def db_now(self) -> datetime:
        """The database clock now: its reading at the claim plus the time elapsed since."""
        return self.row.claimed_at + timedelta(seconds=time.monotonic() - self.claimed_mono)


@dataclass(slots=True)
class _Meters:
    """The labelled metric children of one (provider, action)."""

    duration: Any  # outbox_dispatch_duration_seconds{provider,action}
    end_to_end: Any  # outbox_end_to_end_seconds{provider}
    outcomes: dict[str, Any]  # outcome -> outbox_dispatch_total{provider,action,outcome}


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
    ) -> None:
        self._store = store
        self._recorder = GroupRecorder(store)
        self._providers = providers
        self._settings = settings
        self._worker = worker_id
        self._call_timeouts = call_timeouts or {}
        self._rng = rng or random.Random()  # noqa: S311 (jitter, not cryptography)
        self._backoff = Backoff(settings.backoff_base, settings.backoff_max)
        # A send starts only this long before the lease's end at the latest: the request must
        # leave while no other worker can hold the row (local clock: only durations count).
        self._send_margin = settings.lease.total_seconds() / 10
        self._inflight: dict[int, InFlight] = {}
        self._abandoned: set[asyncio.Task[SendResult]] = set()
        # Every provider has a breaker; the other limits only where configured.
        every = {name: (limits or {}).get(name, ProviderLimits()) for name in providers}
        self._limits = Limits(store, every)
        self._action_pauses = ActionPauses({n: lim.breaker_open_for for n, lim in every.items()})
        self._labels = Labels({name: getattr(p, "actions", None) for name, p in providers.items()})
        self._unknown_told: set[str] = set()  # providers named by rows but not configured here
        # The alerts' counters exist at 0 from now: a first increase must show (issue 21).
        metrics.start_at_zero(self._labels.provider(name) for name in providers)
        self._wake = asyncio.Event()
        # Claims in a row that a notification started and that found nothing (WAKE_GAP_MIN);
        # wake-ups of this process's own (a slot freed, rows staged) neither count nor wait.
        self._empty_wakes = 0
        self._notified = False
        # The stager runs again by this loop time, earlier when told of a retry due sooner.
        self._stage_at = float("inf")
        self._stage_nudge = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._stop = asyncio.Event()
        self._stopping = False
        self._claim_retry = CLAIM_RETRY_MIN
        self.database_ok = False  # the last claim reached the database (readiness)
        # Set by the LISTEN connection while it listens: only then is it worth asking producers
        # to notify (sql/0012), and marking this dispatcher waiting.
        self.listening = False
        self._waiting_since: float | None = None  # when we last marked ourselves waiting
        self._reserved = 0  # slots held for claims under way
        self._backlog = asyncio.Event()  # the last claim came back full: more claimers help
        # The (provider, tenant) group the next claim starts after.
        self._cursor: tuple[str, str] | None = None
        # The running loop, looked up once: on Python 3.11 every asyncio.create_task and
        # get_running_loop makes a getpid system call, and there are several per operation.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Labelled metric children per (provider, action): a .labels() lookup takes a lock and
        # builds a key, several times per operation.
        self._meters: dict[tuple[str, str], _Meters] = {}
        self._spans = tracing.Spans()
        self._windows: dict[str, KeyWindow] = {}  # per provider: its key retention is fixed
        # One timer for every call guard: armed for the earliest deadline, it sweeps the calls
        # past theirs (a timer and asyncio.wait per call cost more than the no-op call itself).
        self._guard: asyncio.TimerHandle | None = None

    # --- control ------------------------------------------------------------------------------

    def wake(self) -> None:
        """A notification came (something was enqueued): claim now, not at the next poll."""
        self._notified = True
        self._wake.set()

    def request_stop(self) -> None:
        """Stop claiming; in-flight calls finish within the shutdown grace."""
        self._stop.set()
        self._wake.set()
        self._slot_freed.set()
        self._backlog.set()

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def run(self) -> None:
        """Claim and dispatch until ``request_stop``, then drain."""
        self._loop = asyncio.get_running_loop()
        background = [
            asyncio.create_task(self._heartbeat_loop(), name="outbox-heartbeat"),
            asyncio.create_task(self._rescue_loop(), name="outbox-rescuer"),
            asyncio.create_task(self._repair_loop(), name="outbox-ordering-repair"),
            asyncio.create_task(self._stage_loop(), name="outbox-stager"),
        ]
        try:
            # Several claim loops: one claim round trip at a time caps a process at a batch per
            # round trip, however idle its slots. Slots are reserved before claiming, so the
            # loops together never lease more than `concurrency`.
            loops = [self._claim_loop(primary=n == 0) for n in range(self._claimers())]
            await asyncio.gather(*loops)
        finally:
            await self._drain()
            if self._waiting_since is not None:
                await self._unmark_waiting()
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            if self._guard is not None and not self._inflight:  # no call left to guard
                self._guard.cancel()
                self._guard = None

    async def run_once(self) -> int:
        """Stage what is due, claim one batch, dispatch it and record every outcome; returns how
        many were claimed."""
        self._loop = asyncio.get_running_loop()
        await self.stage_once()
        claimed = await self._claim(min(self._settings.batch_size, self._settings.concurrency))
        for row in claimed:
            self._start(row)
        await self.wait_idle()
        return len(claimed)

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
            if row["status"] is Status.QUARANTINED:
                label = self._labels.provider(row["provider"])
                metrics.QUARANTINED.labels(label, "attempts_exhausted").inc()
            log.warning(
                "lease expired; rescued", operation_id=row["id"], tenant_id=row["tenant_id"],
                operation_type=row["operation_type"], operation_key=row["operation_key"],
                provider=row["provider"], action=row["action"], attempt=row["attempts"],
                correlation_id=row["correlation_id"], outcome="unknown",
                error_class="lease_expired", duration_ms=None, status=row["status"].value,
            )  # fmt: skip
        return len(rescued)

    async def wait_idle(self) -> None:
        """Wait until every leased operation has been recorded or released."""
        tasks = [f.task for f in self._inflight.values() if f.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    # --- the claim loop -----------------------------------------------------------------------

    def _claimers(self) -> int:
        """How many claim loops: enough for a claim to be under way while another's rows start,
        up to MAX_CLAIMERS, and never more than there are batches in `concurrency`."""
        batches = -(-self._settings.concurrency // self._settings.batch_size)
        return max(1, min(MAX_CLAIMERS, batches))

    async def _claim_loop(self, *, primary: bool) -> None:
        """Claim while there are free slots. Only the primary loop polls and waits for wake-ups;
        the others claim only while claims come back full (a backlog)."""
        # Top up in chunks: claiming for every freed slot would cost one query per operation.
        chunk = max(1, min(self._settings.batch_size, self._settings.concurrency) // 4)
        round_ = functools.partial(self._claim_round, primary=primary, chunk=chunk)
        while not self._stop.is_set():
            pause = await loops.survive("claim", round_, loops.ERROR_PAUSE)
            if pause:
                # After an error; not cut short by wake-ups: a round that keeps failing must
                # not spin.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), pause)

    async def _claim_round(self, *, primary: bool, chunk: int) -> float:
        """One claim and what follows it; returns 0 (the next round at once, as loops.survive
        wants a pause from a round)."""
        if not primary and not self._backlog.is_set():
            await self._backlog.wait()
            return 0.0
        free = self._settings.concurrency - len(self._inflight) - self._reserved
        if free < chunk and (self._inflight or self._reserved):
            self._slot_freed.clear()
            await self._slot_freed.wait()
            return 0.0
        # Cleared before claiming: a NOTIFY that arrives during the claim still wakes us.
        self._wake.clear()
        want = min(self._settings.batch_size, free)
        self._reserved += want
        try:
            claimed = await self._claim(want)
        finally:
            self._reserved -= want
        for row in claimed:
            self._start(row)
        if len(claimed) < want:
            self._backlog.clear()
            self._slot_freed.set()  # reserved slots came back unused
            if primary and not self._stop.is_set():
                if await self._mark_waiting():
                    return 0.0  # claim again: a row committed before the mark notified no one
                await self._idle(found=bool(claimed))
        elif claimed:
            self._backlog.set()
            self._empty_wakes = 0
            if self._waiting_since is not None:
                await self._unmark_waiting()  # a backlog: no wake-ups needed
        return 0.0

    async def _idle(self, *, found: bool) -> None:
        """Wait for a wake-up or the poll interval. Notifications that keep finding nothing (a
        burst anyone can send) are coalesced: each waits for a gap that doubles, so a flood
        costs a claim per WAKE_GAP_MAX at most, and one claim that finds something brings back
        immediate wake-ups. This process's own wake-ups never wait."""
        self._empty_wakes = 0 if found else self._empty_wakes
        woken = await self._sleep_until_woken(self._idle_wait())
        notified, self._notified = self._notified, False
        if not woken:
            self._empty_wakes = 0  # a poll: the next notification is news
            return
        if not notified:
            return
        if self._empty_wakes:
            gap = min(WAKE_GAP_MAX, WAKE_GAP_MIN * 2.0 ** (self._empty_wakes - 1))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), gap)
        # Counted as empty until the claim it starts finds something (then `found` resets it).
        self._empty_wakes += 1

    async def _mark_waiting(self) -> bool:
        """Mark this dispatcher waiting for wake-ups, or refresh an old mark; True when it was
        not marked before. A failure only costs wake-ups: polling goes on."""
        now = time.monotonic()
        if not self.listening or (
            self._waiting_since is not None and now - self._waiting_since < WAITING_REFRESH
        ):
            return False
        try:
            await self._store.mark_waiting(self._worker, waiting=True)
        except psycopg.Error as exc:
            log.debug("could not mark this dispatcher waiting", error_class=type(exc).__name__)
            return False
        fresh = self._waiting_since is None
        self._waiting_since = now
        return fresh

    async def _unmark_waiting(self) -> None:
        self._waiting_since = None
        try:
            await self._store.mark_waiting(self._worker, waiting=False)
        except psycopg.Error as exc:  # the mark expires on its own (sql/0012)
            log.debug("could not unmark this dispatcher", error_class=type(exc).__name__)

    async def _sleep_until_woken(self, seconds: float) -> bool:
        """Sleep until woken or ``seconds`` have passed; True if woken."""
        try:
            await asyncio.wait_for(self._wake.wait(), seconds)
        except TimeoutError:
            return False
        return True

    def _idle_wait(self) -> float:
        """How long a claim loop that found too little waits: a poll interval, or less when a
        provider ran out of tokens while its rows may still wait."""
        poll = self._settings.poll_interval.total_seconds()
        tokens_in = self._limits.claim_again_in()
        return poll if tokens_in is None else min(poll, tokens_in)

    async def _claim(self, limit: int) -> list[Claimed]:
        grant = await self._limits.grant(limit)
        claimed: list[Claimed] = []
        try:
            claimed = await self._claim_capped(limit, grant.caps)
        finally:
            await self._limits.settle(grant, claimed)
        return claimed

    async def _claim_capped(self, limit: int, caps: Mapping[str, int]) -> list[Claimed]:
        started = time.perf_counter()
        try:
            claimed = await self._store.claim(self._worker, limit, self._settings.lease,
                                              caps=caps, after=self._cursor)  # fmt: skip
        except psycopg.Error as exc:
            self.database_ok = False
            metrics.DATABASE_UP.set(0)
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
        metrics.DATABASE_UP.set(1)
        self._claim_retry = CLAIM_RETRY_MIN
        metrics.CLAIM_DURATION.observe(time.perf_counter() - started)
        self._advance_cursor(claimed)
        return claimed

    def _advance_cursor(self, claimed: list[Claimed]) -> None:
        self._cursor = next_cursor(self._cursor, claimed)

    def _start(self, row: Claimed) -> None:
        now = time.monotonic()
        flight = InFlight(
            row, claimed_mono=now, lease_deadline=now + self._settings.lease.total_seconds()
        )
        self._inflight[row.id] = flight
        metrics.IN_FLIGHT.inc()
        loop = self._loop or asyncio.get_running_loop()
        flight.task = loop.create_task(self._process(flight), name=f"outbox-op-{row.id}")
        flight.task.add_done_callback(lambda task: self._finished(flight, task))

    def _finished(self, flight: InFlight, task: asyncio.Task[None]) -> None:
        self._inflight.pop(flight.row.id, None)
        metrics.IN_FLIGHT.dec()
        self._slot_freed.set()
        if self._limits.finished(flight.row):
            self._wake.set()  # a capped provider has room again: claim now, not at the next poll
        if not task.cancelled() and task.exception() is not None:
            # The send guard's refusal (see _process); the rescuer takes the row back.
            metrics.INTERNAL_ERRORS.labels("dispatch").inc()
            flight.log.error("dispatch task failed", exc_info=task.exception())

    # --- one operation ------------------------------------------------------------------------

    async def _process(self, flight: InFlight) -> None:
        # One coroutine for the whole way of every operation, with plain calls where it can:
        # each coroutine more is a frame and an await more per operation, and the dispatcher
        # spends its CPU on such things (bench/README.md, Throughput).
        row = flight.row
        try:
            if failpoints.armed(failpoints.AFTER_CLAIM):
                await failpoints.hit(failpoints.AFTER_CLAIM)
            if failpoints.armed(failpoints.BUG):
                failpoints.bug("dispatch")
            provider = self._providers.get(row.provider)
            if provider is None:
                await self._unknown_provider(flight)
                return
            payload = self._to_send(flight, provider)
            if isinstance(payload, _Aside):
                await self._set_aside(flight, payload)
                return
            leak = failpoints.take(failpoints.LEAK_TRANSACTION)
            if leak is not None:
                await self._store.leave_transaction_open(row.id, idle_timeout=leak)
            # A bug that kept a transaction open here would hold row locks for the whole call:
            # refuse to send; the lease expires and the rescuer takes the row back.
            assert_no_connection_held()
            if self._spans.active():
                result = await self._traced_send(flight, provider, payload)
            else:
                result = await self._send(flight, provider, payload)
            if failpoints.armed(failpoints.BEFORE_RECORD):
                await failpoints.hit(failpoints.BEFORE_RECORD)
            await self._after_call(flight, result)
        except (asyncio.CancelledError, ConnectionHeldAcrossSend):
            # The guard's refusal ends the task as it is (the lease expires, the rescuer takes
            # the row back): nothing may be written through a connection in that state.
            raise
        except Exception as exc:  # noqa: BLE001 (one operation's bug must not cost its lease)
            await self._after_bug(flight, exc)

    async def _after_call(self, flight: InFlight, result: SendResult) -> None:
        row = flight.row
        pause = self._limits.observe(row, result)
        if pause is not None:
            await self._limits.throttle(row.provider, pause)
        self._action_pauses.observe(row, result, self._label_pair)
        if isinstance(result, Failed) and result.pause:
            # Refused credentials say nothing about this operation: it keeps its attempt and
            # waits, with the rest of its provider's, behind the breaker.
            await self._unclaim(flight, Status.PENDING, None)
        elif isinstance(result, Failed) and result.pause_action:
            # Likewise for one action refused permission: it waits with its action's.
            wait = self._action_pauses.wait(row)
            await self._unclaim(flight, Status.PENDING, None, delay=wait)
        else:
            await self._finish(flight, result)

    async def _after_bug(self, flight: InFlight, exc: Exception) -> None:
        """outbox itself failed on this operation. Before the send, nothing left this process:
        quarantined now (internal_error), never rescued later as an attempt that may have
        reached the provider. During or after it: recorded as unknown, if it can be. A failed
        record, or a connection held across the send, is left to the lease and the rescuer."""
        metrics.INTERNAL_ERRORS.labels("dispatch").inc()
        flight.log.error("dispatching this operation failed inside outbox", exc_info=exc)
        if flight.phase is Phase.RECORDING:
            return
        sent = flight.phase is not Phase.CLAIMED
        message = f"outbox failed {'after' if sent else 'before'} sending: {type(exc).__name__}"
        failure = (unknown if sent else permanent)("internal_error", message)
        try:
            await self._finish(flight, failure, sent=sent, reason=REASON_INTERNAL_ERROR)
        except Exception:
            # The rescuer takes the row back when the lease ends.
            flight.log.exception("recording the failure failed too; the lease will expire")

    async def _traced_send(self, flight: InFlight, provider: Provider,
                           payload: Mapping[str, Any]) -> SendResult:  # fmt: skip
        with tracing.attempt_span(flight.row.traceparent, _span_attributes(flight.row)) as span:
            result = await self._send(flight, provider, payload)
            if span is not None:
                span.set_attribute("outbox.outcome", _outcome(result))
        return result

    def _to_send(self, flight: InFlight, provider: Provider) -> Mapping[str, Any] | _Aside:
        """The payload to send, or where the row goes instead of the provider."""
        row = flight.row
        # Never sent before (the common case): no window to close, no clock to read.
        if row.first_sent_at is not None and self._window(provider).has_passed(
            row.first_sent_at, flight.db_now()
        ):
            return _Aside(Status.RECONCILING, REASON_KEY_WINDOW)
        payload, problem = _decoded(row)
        if payload is None:
            failure = permanent("invalid_payload", problem or "the payload cannot be read")
            return _Aside(Status.QUARANTINED, REASON_INVALID_PAYLOAD, failure)
        problem = _check(provider, row.action, payload)
        if problem is not None:
            return _Aside(Status.QUARANTINED, None, permanent("invalid_request", problem))
        return self._held_back(flight) or payload

    def _held_back(self, flight: InFlight) -> _Aside | None:
        """Back to pending unsent, its attempt unspent, or None: send it."""
        if self._stopping or not self._limits.may_send(flight.row):
            # Stopping, or the provider's breaker opened since the claim.
            return _Aside(Status.PENDING, None)
        paused = self._action_pauses.wait(flight.row)
        if paused is not None:  # its action was refused permission: back until the pause ends
            return _Aside(Status.PENDING, None, delay=paused)
        if time.monotonic() >= flight.lease_deadline - self._send_margin:
            # Frozen since the claim (SIGSTOP, a stalled host): the lease may have run out and
            # another worker sent the row, or the next one of its ordering key. A send now would
            # overtake theirs on the wire. Handed back unsent (fenced: a no-op if taken).
            flight.log.warning("the lease ran out before the send; handing the row back unsent")
            return _Aside(Status.PENDING, None)
        return None

    async def _set_aside(self, flight: InFlight, aside: _Aside) -> None:
        if aside.failure is not None:  # recorded as an attempt that never left
            await self._finish(flight, aside.failure, sent=False, reason=aside.reason)
        else:  # handed back without an attempt
            await self._unclaim(flight, aside.status, aside.reason, delay=aside.delay)

    async def _unknown_provider(self, flight: InFlight) -> None:
        row = flight.row
        if flight.db_now() - row.created_at < UNKNOWN_PROVIDER_GRACE:
            # Likely a rolling deploy that added the provider: a newer replica will take it.
            if row.provider not in self._unknown_told:  # once per provider and process
                self._unknown_told.add(row.provider)
                flight.log.warning(
                    "an operation names a provider this process does not have: it waits for a "
                    "replica that has it, and is quarantined as unknown_provider "
                    f"{format_duration(UNKNOWN_PROVIDER_GRACE)} after its enqueue")  # fmt: skip
            await self._unclaim(flight, Status.PENDING, None, delay=UNKNOWN_PROVIDER_RETRY)
            return
        failure = permanent("unknown_provider", f"no provider named {row.provider!r} is configured")
        await self._finish(flight, failure, sent=False)

    async def _send(self, flight: InFlight, provider: Provider,
                    payload: Mapping[str, Any]) -> SendResult:  # fmt: skip
        row = flight.row
        request = SendRequest(
            operation_id=row.id, tenant_id=row.tenant_id, operation_type=row.operation_type,
            operation_key=row.operation_key, action=row.action, payload=payload,
            idempotency_key=row.idempotency_key, correlation_id=row.correlation_id,
            attempt=row.attempts, payload_json=row.payload,
            api_version=_api_version(row, self._providers.get(row.provider)),
        )  # fmt: skip
        flight.scope = _scope(self._providers.get(row.provider), row.action, payload)
        flight.phase = Phase.SENDING
        loop = self._loop or asyncio.get_running_loop()
        send = flight.send_task = loop.create_task(provider.send(request))
        waiter = flight.waiter = loop.create_future()
        send.add_done_callback(functools.partial(_release, waiter))
        limit = self._call_limit(provider)
        if limit is not None:
            flight.guard_at = loop.time() + limit
            self._arm_guard(loop, flight.guard_at)
        started = time.perf_counter()
        try:
            # Not `await send`: a call that ignores cancellation would then hold this slot and
            # its lease for ever. The waiter ends with the call or at the guard's deadline.
            await waiter
            if not send.done():
                # A call that ignores cancellation must not keep this slot or its lease: let it
                # go (held here so it is not garbage-collected mid-flight) and move on.
                send.cancel()
                self._abandoned.add(send)
                send.add_done_callback(self._abandoned.discard)
                return unknown("call_guard", "the provider call outlived its timeout; abandoned")
            if send.cancelled():
                return unknown("shutdown", "the call was cut off at shutdown")
            return send.result()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 (a provider must not raise; if it does, it may have sent)
            return unknown("provider_error", f"the provider raised {type(exc).__name__}")
        finally:
            flight.waiter = flight.guard_at = None
            self._meters_for(row).duration.observe(time.perf_counter() - started)

    def _meters_for(self, row: Claimed) -> _Meters:
        meters = self._meters.get((row.provider, row.action))
        if meters is None:
            # Keyed by the labels too: the actions a producer makes up share the "other" meters,
            # and this cache cannot grow past the bounded labels (metric_labels).
            provider, action = self._label_pair(row)
            meters = self._meters.get((provider, action))
            if meters is None:
                meters = self._meters[provider, action] = _Meters(
                    duration=metrics.DISPATCH_DURATION.labels(provider, action),
                    end_to_end=metrics.END_TO_END.labels(provider),
                    outcomes={},
                )
        return meters

    def _label_pair(self, row: Claimed) -> tuple[str, str]:
        return self._labels.provider(row.provider), self._labels.action(row.provider, row.action)

    def _arm_guard(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """Have the guard's timer fire by ``deadline``. Deadlines mostly come in increasing
        order, so the timer already armed nearly always fires first and is left alone."""
        if self._guard is not None and self._guard.when() <= deadline:
            return
        if self._guard is not None:
            self._guard.cancel()
        self._guard = loop.call_at(deadline, self._sweep_guard, loop)

    def _sweep_guard(self, loop: asyncio.AbstractEventLoop) -> None:
        """Release the calls past their guard deadline; re-arm for the earliest other one."""
        self._guard = None
        now = loop.time()
        later: float | None = None
        for flight in self._inflight.values():
            if flight.guard_at is None or flight.waiter is None:
                continue
            if flight.guard_at <= now:
                _release(flight.waiter)
            elif later is None or flight.guard_at < later:
                later = flight.guard_at
        if later is not None:
            self._arm_guard(loop, later)

    async def _finish(self, flight: InFlight, result: SendResult, *, sent: bool | None = None,
                      reason: str | None = None) -> None:  # fmt: skip
        """Record ``result``; ``reason`` names a permanent failure's quarantine (policy)."""
        rec = self._record_for(flight, result, sent, reason)

        async def write() -> bool:
            try:
                return await self._recorder.record(rec)
            except psycopg.DataError:
                # The provider's answer cannot be stored as it is (a NUL, a NaN): keep the
                # outcome and drop what cannot be stored, rather than lose the outcome.
                flight.log.warning("provider answer not storable; recording it without its body")
                return await self._store.record(_storable(rec))

        recorded = await self._with_lease(flight, "record", write)
        row = flight.row
        outcomes = self._meters_for(row).outcomes
        counter = outcomes.get(rec.outcome)
        if counter is None:
            counter = outcomes[rec.outcome] = metrics.DISPATCH.labels(
                *self._label_pair(row), rec.outcome
            )
        counter.inc()
        if recorded:
            self._count(flight, rec)
        # A success at debug: the attempts table keeps it, and a line per operation would cost
        # a quarter of the dispatcher's time at full speed. Everything else at info. Below
        # debug, a success binds no logger and builds no line at all.
        success = recorded and rec.outcome == "succeeded"
        if success and not log.is_enabled_for(logging.DEBUG):
            return
        emit = flight.log.debug if success else flight.log.info
        emit(
            "attempt recorded" if recorded else "attempt not recorded",
            outcome=rec.outcome, status=rec.status.value, reason=rec.reason,
            error_class=rec.error_class, http_status=rec.http_status,
            duration_ms=round((time.monotonic() - flight.claimed_mono) * 1000, 1),
        )  # fmt: skip

    def _record_for(self, flight: InFlight, result: SendResult, sent: bool | None,
                    reason: str | None = None) -> Record:  # fmt: skip
        row = flight.row
        base: dict[str, Any] = {
            "id": row.id,
            "lease_token": row.lease_token,
            "attempt": row.attempts,
            "worker": self._worker,
            "http_status": result.http_status,
            "request_id": result.request_id,
            "api_version": _api_version(row, self._providers.get(row.provider)),
            "scope": flight.scope,
        }
        if isinstance(result, Succeeded):
            return Record(
                status=Status.SUCCEEDED,
                outcome="succeeded",
                sent=True,
                provider_ref=result.reference,
                result=result.result,
                **base,
            )
        reached = result.may_have_reached_provider if sent is None else sent
        provider = self._providers.get(row.provider)
        # Without a provider the failure is permanent and the window is never read; an empty one
        # would err towards reconciliation, never towards a resend.
        window = self._window(provider) if provider else KeyWindow(timedelta(0), timedelta(0))
        # The provider did not act: the budget is not spent, within UNSPENT_FOR of the enqueue.
        unspent = (not result.spends_attempt and not reached
                   and flight.db_now() - row.created_at < UNSPENT_FOR)  # fmt: skip
        nxt = after_failure(
            result.failure, attempt=row.attempts - row.attempt_base - unspent,
            backoff_attempt=row.attempts if unspent else None,
            max_attempts=row.max_attempts or self._settings.max_attempts,
            first_sent_at=row.first_sent_at or (row.claimed_at if reached else None),
            now=flight.db_now(), window=window, backoff=self._backoff,
            retry_after=result.retry_after, reconcile=result.reconcile, rng=self._rng,
            quarantine_reason=reason or result.reason,
        )  # fmt: skip
        return Record(
            status=nxt.status,
            reason=nxt.reason,
            retry_in=nxt.retry_in,
            outcome=result.failure.value,
            sent=reached,
            error=result.message,
            error_class=result.error_class,
            unspent=unspent,
            provider_ref=result.reference,
            **base,
        )

    def _count(self, flight: InFlight, rec: Record) -> None:
        provider = self._labels.provider(flight.row.provider)
        if rec.status is Status.SUCCEEDED:
            age = (flight.db_now() - flight.row.created_at).total_seconds()
            self._meters_for(flight.row).end_to_end.observe(max(age, 0.0))
        elif rec.status is Status.PENDING:
            metrics.RETRIES.labels(provider).inc()
            if rec.retry_in:
                self._stage_by(rec.retry_in.total_seconds())
        elif rec.status is Status.QUARANTINED:
            metrics.QUARANTINED.labels(provider, rec.reason or "").inc()
        elif rec.status is Status.RECONCILING:
            metrics.RECONCILIATION_ROUTED.labels(provider, rec.reason or "").inc()

    async def _unclaim(self, flight: InFlight, status: Status, reason: str | None,
                       *, delay: timedelta | None = None) -> None:  # fmt: skip
        done = await self._with_lease(
            flight, "unclaim", lambda: self._store.unclaim(flight.row, status, reason, delay)
        )
        if done and status is Status.RECONCILING:
            label = self._labels.provider(flight.row.provider)
            metrics.RECONCILIATION_ROUTED.labels(label, reason or "").inc()
        if done and delay:
            self._stage_by(delay.total_seconds())
        flight.log.info(
            "returned without sending", status=status.value, reason=reason, outcome="not_sent",
            error_class=reason, done=bool(done),
            duration_ms=round((time.monotonic() - flight.claimed_mono) * 1000, 1),
        )  # fmt: skip

    async def _with_lease(self, flight: InFlight, what: str, write: Any) -> bool | None:
        """Run a fenced write, retrying connection failures while the lease lasts.

        True: written. False: the lease was lost (a newer attempt owns the row; nothing changed).
        None: the database could not be reached in time; the lease will expire and the row be
        rescued, and its retry carries the same idempotency key.
        """
        flight.phase = Phase.RECORDING
        try:
            written: bool | None = await write()
        except psycopg.OperationalError:
            written = await self._retry_while_leased(flight, what, write)
            if written is False and what == "record" and await self._recorded_before(flight):
                written = True  # the first try committed; only its acknowledgement was lost
        if written is None:
            return None
        if not written:
            metrics.LEASE_LOST.inc()
            flight.log.warning(f"{what} found the lease taken; nothing was changed")
        return written

    async def _retry_while_leased(self, flight: InFlight, what: str, write: Any) -> bool | None:
        """The write again, with backoff (tenacity), until it succeeds or the lease runs out."""
        metrics.DB_ERRORS.labels(what).inc()
        retrying = AsyncRetrying(
            retry=retry_if_exception_type(psycopg.OperationalError),
            wait=wait_random_exponential(multiplier=0.05, max=2.0),
            stop=lambda _: time.monotonic() >= flight.lease_deadline,
            before_sleep=lambda _: metrics.DB_ERRORS.labels(what).inc(),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    written: bool = await write()
                    return written
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels(what).inc()
            # An expected outage, not a bug: no traceback.
            flight.log.error(  # noqa: TRY400
                f"{what} failed; the lease will expire and the row be rescued",
                error_class=type(exc).__name__,
            )
            return None
        return None  # pragma: no cover (the loop returns or raises)

    async def _recorded_before(self, flight: InFlight) -> bool:
        try:
            return await self._store.attempt_recorded(flight.row.id, flight.row.attempts,
                                                      self._worker)  # fmt: skip
        except psycopg.Error:
            return False

    # --- leases -------------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self._settings.heartbeat_interval.total_seconds()

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
        sent_at = time.monotonic()
        try:
            alive = await self._store.heartbeat([f.row for f in held], self._settings.lease)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("heartbeat").inc()
            log.warning("heartbeat failed", error_class=type(exc).__name__)
            return
        for flight in held:
            if flight.row.id in alive:
                flight.lease_deadline = sent_at + self._settings.lease.total_seconds()
            elif flight.phase is not Phase.RECORDING:
                flight.log.warning("lease lost during the call; its record will change nothing")

    async def _rescue_loop(self) -> None:
        # Often enough that a dead worker's rows come back within about one lease.
        interval = max(self._settings.lease.total_seconds() / 4, 0.05)

        async def round_() -> float:
            return 0.0 if await self.rescue_once() >= RESCUE_BATCH else interval

        await loops.forever("rescue", round_)

    async def _repair_loop(self) -> None:
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

    # --- scheduled operations -----------------------------------------------------------------

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
            self._wake.set()
        if staged >= STAGE_BATCH:
            return 0.0
        return poll if next_in is None else min(poll, max(next_in, 0.0))

    def _stage_by(self, seconds: float) -> None:
        """This process scheduled a retry due in ``seconds``: have the stager look by then."""
        loop = self._loop or asyncio.get_running_loop()
        at = loop.time() + seconds
        if at < self._stage_at:
            self._stage_at = at
            self._stage_nudge.set()

    async def _stage_loop(self) -> None:
        loop = self._loop or asyncio.get_running_loop()
        while True:
            # Any nudge from now on counts for the round after this one.
            self._stage_at = float("inf")
            last = loop.time()
            wait = await loops.survive("stage", self.stage_once, loops.ERROR_PAUSE)
            self._stage_at = min(self._stage_at, loop.time() + wait)
            while (delay := max(self._stage_at, last + STAGE_MIN_GAP) - loop.time()) > 0:
                self._stage_nudge.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stage_nudge.wait(), delay)

    # --- shutdown -----------------------------------------------------------------------------

    async def _drain(self) -> None:
        """Let calls finish within the grace; cut off the rest and record them as unknown."""
        self._stopping = True
        tasks = [f.task for f in self._inflight.values() if f.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=self._settings.shutdown_grace.total_seconds())
        for flight in list(self._inflight.values()):
            if flight.send_task is not None and not flight.send_task.done():
                flight.send_task.cancel()
        remaining = [f.task for f in self._inflight.values() if f.task is not None]
        if remaining:
            await asyncio.wait(remaining, timeout=RECORD_GRACE)

    # --- helpers ------------------------------------------------------------------------------

    def _window(self, provider: Provider) -> KeyWindow:
        window = self._windows.get(provider.name)
        if window is None:
            window = KeyWindow(provider.key_retention, self._settings.retention_margin)
            self._windows[provider.name] = window
        return window

    def _call_limit(self, provider: Provider) -> float | None:
        timeout = self._call_timeouts.get(provider.name)
        return None if timeout is None else timeout.total_seconds() + CALL_GUARD_MARGIN


def _api_version(row: Claimed, provider: Provider | None) -> str | None:
    """The version of the operation's first send, or, before one, the provider's own."""
    return row.api_version or getattr(provider, "api_version", None)


def _scope(provider: Provider | None, action: str, payload: Mapping[str, Any]) -> str | None:
    scope = getattr(provider, "scope", None)
    return None if scope is None else str(scope(action, payload))


class _Aside(NamedTuple):
    """Where a claimed row goes instead of its provider: with ``failure``, recorded as an
    attempt that never left; without, handed back (to ``status``) without one."""

    status: Status
    reason: str | None
    failure: Failed | None = None
    delay: timedelta | None = None  # handed back: due again after this long (None: at once)


def next_cursor(cursor: tuple[str, str] | None,
                claimed: list[Claimed]) -> tuple[str, str] | None:  # fmt: skip
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


def _release(waiter: asyncio.Future[None], _: object = None) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _decoded(row: Claimed) -> tuple[Mapping[str, Any] | None, str | None]:
    """The row's payload object, or None and why it cannot be carried. Never raises."""
    if row.payload is None:
        return None, (f"the payload is {row.payload_bytes} bytes of JSON; the claim hands over "
                      f"at most {row.payload_limit} (outbox.limits.max_payload_bytes)")  # fmt: skip
    try:
        return payloads.carried(row.payload), None
    except payloads.InvalidPayload as exc:
        return None, str(exc)


def _check(provider: Provider, action: str, payload: Mapping[str, Any]) -> str | None:
    """Why this row can never be sent, or None. Never raises."""
    try:
        provider.check(action, payload)
    except InvalidRequest as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 (a bad row must not stop the line)
        return f"the provider's check raised {type(exc).__name__}"
    return None


def _storable(rec: Record) -> Record:
    """``rec`` without the provider's body, and without NULs, which PostgreSQL text refuses."""

    def clean(text: str | None) -> str | None:
        return None if text is None else text.replace("\x00", "")

    return rec._replace(
        result=None, provider_ref=clean(rec.provider_ref), error=clean(rec.error),
        error_class=clean(rec.error_class), request_id=clean(rec.request_id),
    )  # fmt: skip


def _span_attributes(row: Claimed) -> dict[str, Any]:
    return {"outbox.operation_id": row.id, "outbox.attempt": row.attempts,
            "outbox.provider": row.provider, "outbox.action": row.action,
            "outbox.tenant_id": row.tenant_id}  # fmt: skip


def _outcome(result: SendResult) -> str:
    return "succeeded" if isinstance(result, Succeeded) else result.failure.value

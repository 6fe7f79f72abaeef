"""Writing each outcome: the attempt and the operation's next status, fenced by the lease, so a
worker that lost its lease changes nothing. This part alone handles the errors of recording: a
provider answer that cannot be stored, and a database that is gone for a while."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from tenacity import AsyncRetrying, retry_if_exception_type, wait_random_exponential

from outbox.core.model import Status
from outbox.core.policy import UNSPENT_FOR, Backoff, after_failure
from outbox.db.group_record import GroupRecorder
from outbox.db.store import Record
from outbox.dispatch.flight import InFlight, api_version, log
from outbox.dispatch.shared import Shared
from outbox.observability import metrics
from outbox.providers.base import SendResult, Succeeded


class Recorder:
    def __init__(
        self, shared: Shared, *, rng: random.Random, stage_by: Callable[[float], None]
    ) -> None:
        self._shared = shared
        self._store = shared.store
        self._group = GroupRecorder(shared.store)
        self._meters = shared.meters
        self._labels = shared.labels
        self._rng = rng
        self._backoff = Backoff(shared.settings.backoff_base, shared.settings.backoff_max)
        self._stage_by = stage_by  # a retry due in so many seconds: the stager looks by then

    async def finish(
        self,
        flight: InFlight,
        result: SendResult,
        *,
        sent: bool | None = None,
        reason: str | None = None,
    ) -> None:
        """Record ``result``; ``reason`` names a permanent failure's quarantine (policy)."""
        rec = self.record_for(flight, result, sent, reason)

        async def write() -> bool:
            try:
                return await self._group.record(rec)
            except psycopg.DataError:
                # The provider's answer cannot be stored as it is (a NUL, a NaN): keep the
                # outcome and drop what cannot be stored, rather than lose the outcome.
                flight.log.warning("provider answer not storable; recording it without its body")
                return await self._store.record(_storable(rec))

        recorded = await self._with_lease(flight, "record", write)
        self._meters.outcome(flight.row, rec.outcome).inc()
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
            outcome=rec.outcome,
            status=rec.status.value,
            reason=rec.reason,
            error_class=rec.error_class,
            http_status=rec.http_status,
            duration_ms=flight.elapsed_ms(),
        )

    def record_for(
        self, flight: InFlight, result: SendResult, sent: bool | None, reason: str | None = None
    ) -> Record:
        row = flight.row
        settings = self._shared.settings
        base: dict[str, Any] = {
            "id": row.id,
            "lease_token": row.lease_token,
            "attempt": row.attempts,
            "worker": self._shared.worker,
            "http_status": result.http_status,
            "request_id": result.request_id,
            "api_version": api_version(row, self._shared.providers.get(row.provider)),
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
        # The provider did not act: the budget is not spent, within UNSPENT_FOR of the enqueue.
        unspent = (
            not result.spends_attempt
            and not reached
            and flight.db_now() - row.created_at < UNSPENT_FOR
        )
        nxt = after_failure(
            result.failure,
            attempt=row.attempts - row.attempt_base - unspent,
            backoff_attempt=row.attempts if unspent else None,
            max_attempts=row.max_attempts or settings.max_attempts,
            first_sent_at=row.first_sent_at or (row.claimed_at if reached else None),
            now=flight.db_now(),
            window=self._shared.rules.window(row.provider, row.action),
            backoff=self._backoff,
            retry_after=result.retry_after,
            reconcile=result.reconcile,
            rng=self._rng,
            quarantine_reason=reason or result.reason,
        )
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
            self._meters.of(flight.row).end_to_end.observe(max(age, 0.0))
        elif rec.status is Status.PENDING:
            metrics.RETRIES.labels(provider).inc()
            if rec.retry_in:
                self._stage_by(rec.retry_in.total_seconds())
        elif rec.status is Status.QUARANTINED:
            metrics.QUARANTINED.labels(provider, rec.reason or "").inc()
        elif rec.status is Status.RECONCILING:
            metrics.RECONCILIATION_ROUTED.labels(provider, rec.reason or "").inc()

    async def unclaim(
        self,
        flight: InFlight,
        status: Status,
        reason: str | None,
        *,
        delay: timedelta | None = None,
    ) -> None:
        """Hand the row back without an attempt: to pending (due after ``delay``) or, its key
        window closed, to reconciliation."""
        done = await self._with_lease(
            flight, "unclaim", lambda: self._store.unclaim(flight.row, status, reason, delay)
        )
        if done and status is Status.RECONCILING:
            label = self._labels.provider(flight.row.provider)
            metrics.RECONCILIATION_ROUTED.labels(label, reason or "").inc()
        if done and delay:
            self._stage_by(delay.total_seconds())
        flight.log.info(
            "returned without sending",
            status=status.value,
            reason=reason,
            outcome="not_sent",
            error_class=reason,
            done=bool(done),
            duration_ms=flight.elapsed_ms(),
        )

    async def _with_lease(self, flight: InFlight, what: str, write: Any) -> bool | None:
        """Run a fenced write, retrying connection failures while the lease lasts.

        True: written. False: the lease was lost (a newer attempt owns the row; nothing changed).
        None: the database could not be reached in time; the lease will expire and the row be
        rescued, and its retry carries the same idempotency key.
        """
        self._shared.call_over(flight)
        try:
            written: bool | None = await write()
        except psycopg.OperationalError:
            written = await self._retry_while_leased(flight, what, write)
            if written is False and what == "record" and await self._recorded_before(flight):
                written = True  # the first try committed; only its acknowledgement was lost
        if written is None:
            return None
        if not written and not await self._row_exists(flight):
            metrics.RECORD_ROW_MISSING.inc()
            flight.log.error(
                f"{what} found no such operation: this database lost it (a failover to a standby "
                "that lacked it?); the provider may have acted on it (docs/operations.md, "
                '"Database failover")'
            )
        elif not written:
            metrics.LEASE_LOST.inc()
            flight.log.warning(f"{what} found the lease taken; nothing was changed")
        return written

    async def _row_exists(self, flight: InFlight) -> bool:
        """Only on the rare lease-lost path; an error counts as "exists" (the old message)."""
        try:
            return await self._store.operation_exists(flight.row.id, flight.row.idempotency_key)
        except psycopg.Error:
            return True

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
            return await self._store.attempt_recorded(
                flight.row.id, flight.row.attempts, self._shared.worker
            )
        except psycopg.Error:
            return False


def _storable(rec: Record) -> Record:
    """``rec`` without the provider's body, and without NULs, which PostgreSQL text refuses."""

    def clean(text: str | None) -> str | None:
        return None if text is None else text.replace("\x00", "")

    return rec._replace(
        result=None,
        provider_ref=clean(rec.provider_ref),
        error=clean(rec.error),
        error_class=clean(rec.error_class),
        request_id=clean(rec.request_id),
    )

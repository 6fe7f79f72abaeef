"""The dispatcher's side of the database: one method per statement, no SQL anywhere else.

Every method runs one statement on an autocommit pool connection, so each is its own short
transaction and costs one round trip.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, LiteralString

from psycopg.rows import dict_row, tuple_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from outbox.db import statements
from outbox.model import Status


@dataclass(frozen=True, slots=True)
class Claimed:
    """A row this worker leased: everything needed to send it and to fence the record."""

    id: int
    tenant_id: str
    operation_type: str
    operation_key: str
    provider: str
    action: str
    payload: Any  # a JSON object when enqueued through outbox.enqueue; checked before sending
    idempotency_key: str
    correlation_id: str | None
    traceparent: str | None
    attempts: int
    attempt_base: int  # attempts before the last operator replay: the budget counts from here
    max_attempts: int | None
    lease_token: uuid.UUID
    first_sent_at: datetime | None
    created_at: datetime
    claimed_at: datetime  # the database clock at the claim


@dataclass(frozen=True, slots=True)
class Record:
    """An attempt's outcome and the operation's next status."""

    id: int
    lease_token: uuid.UUID
    attempt: int
    worker: str
    status: Status
    outcome: str  # succeeded | transient | permanent | unknown
    sent: bool  # may the request have reached the provider?
    reason: str | None = None
    retry_in: timedelta | None = None
    provider_ref: str | None = None
    result: Mapping[str, Any] | None = None
    error: str | None = None
    error_class: str | None = None
    http_status: int | None = None
    request_id: str | None = None


class Store:
    """Named statements over a pool of autocommit connections."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def claim(self, worker: str, limit: int, lease: timedelta,
                    paused: Sequence[str] = ()) -> list[Claimed]:  # fmt: skip
        """Lease up to ``limit`` due rows, skipping the ``paused`` providers'."""
        params = {"worker": worker, "limit": limit, "lease": lease, "paused": list(paused)}
        async with self._pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            rows = await (await cur.execute(statements.CLAIM, params)).fetchall()
        return [Claimed(**row) for row in rows]

    async def record(self, rec: Record) -> bool:
        """True if recorded; False if this worker no longer held the lease (nothing changed)."""
        failure = None if rec.outcome == "succeeded" else rec.outcome
        params = {
            "id": rec.id, "lease_token": rec.lease_token, "attempt": rec.attempt,
            "worker": rec.worker, "status": rec.status.value, "reason": rec.reason,
            "retry_in": rec.retry_in or timedelta(0), "sent": rec.sent,
            "provider_ref": rec.provider_ref,
            "result": None if rec.result is None else Jsonb(rec.result),
            "error": rec.error, "failure": failure, "outcome": rec.outcome,
            "error_class": rec.error_class, "http_status": rec.http_status,
            "request_id": rec.request_id,
        }  # fmt: skip
        return await self._one(statements.RECORD, params)

    async def unclaim(self, claimed: Claimed, status: Status, reason: str | None,
                      delay: timedelta | None = None) -> bool:  # fmt: skip
        """Give the row back without an attempt, due again after ``delay`` (None: keep its
        place); False if the lease was lost meanwhile."""
        params = {"id": claimed.id, "lease_token": claimed.lease_token,
                  "status": status.value, "reason": reason, "delay": delay}  # fmt: skip
        return await self._one(statements.UNCLAIM, params)

    async def attempt_recorded(self, operation_id: int, attempt: int, worker: str) -> bool:
        """Whether ``worker``'s record of this attempt committed."""
        params = {"id": operation_id, "attempt": attempt, "worker": worker}
        return await self._one(statements.ATTEMPT_RECORDED, params)

    async def heartbeat(self, held: Sequence[Claimed], lease: timedelta) -> set[int]:
        """Renew these leases; returns the ids still held (the others were lost)."""
        if not held:
            return set()
        params = {
            "ids": [c.id for c in held],
            "tokens": [c.lease_token for c in held],
            "lease": lease,
        }
        async with self._pool.connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (await cur.execute(statements.HEARTBEAT, params)).fetchall()
        return {row[0] for row in rows}

    async def rescue(self, limit: int, max_attempts: int) -> list[dict[str, Any]]:
        """Take back expired leases; returns each rescued row's identity and new status."""
        params = {"limit": limit, "max_attempts": max_attempts}
        async with self._pool.connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            rows: list[dict[str, Any]] = await (
                await cur.execute(statements.RESCUE, params)
            ).fetchall()
        for row in rows:
            row["status"] = Status(row["status"])
        return rows

    async def _one(self, query: LiteralString, params: Mapping[str, Any]) -> bool:
        async with self._pool.connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(query, params)).fetchone()
        return row is not None

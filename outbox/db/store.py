"""The dispatcher's side of the database: one method per statement, no SQL anywhere else.

Every method runs one statement on an autocommit pool connection, so each is its own short
transaction and costs one round trip.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, LiteralString, NamedTuple

import orjson
import psycopg
from psycopg import AsyncConnection
from psycopg.pq import TransactionStatus
from psycopg.rows import args_row, dict_row, tuple_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db import statements

# The longest any statement of ours may go unanswered: the server's statement_timeout (30 s) plus
# a margin. A peer that went silent while the kernel still acknowledges (a hung proxy, a frozen
# server) defeats keepalives and tcp_user_timeout; only a deadline on our side ends the wait.
# psycopg then tries to cancel (up to 10 s more) and drops the connection: under 60 s in all.
STATEMENT_DEADLINE: Final = 35.0

# How many (provider, tenant) groups one claim visits at most: one index probe each. Beyond it,
# the cursor carries the visit on at the next claim. A claim of more rows may visit as many
# groups as it takes rows, and JUMPS_PER_CLAIM more for providers jumped over (capped): every
# group the visit reaches has a due row, so that is enough to fill it.
MAX_GROUPS_PER_CLAIM: Final = 200
JUMPS_PER_CLAIM: Final = 16
# After a claim that needed the fair statement, how many go straight to it before the one-group
# statement is tried again: with one active group and another capped at 0, it would fail on
# every claim; this way on one in 17.
FAIR_ONLY_CLAIMS: Final = 16

# The connections the current task has checked out. A tuple, never mutated: tasks started while
# one is held inherit it, which is exactly the bug the send guard looks for.
_HELD: ContextVar[tuple[AsyncConnection[Any], ...]] = ContextVar("outbox_held", default=())


class ConnectionHeldAcrossSend(RuntimeError):
    """A bug in outbox: a database connection is checked out while a provider call starts."""


def assert_no_connection_held() -> None:
    """Raise if this task holds a database connection. A transaction left open across a
    provider call holds row locks for the call's whole duration (and, were it the claim's, the
    lease would not even be visible to the record); a merely held connection starves the pool."""
    held = _HELD.get()
    if held:
        states = ", ".join(TransactionStatus(c.info.transaction_status).name for c in held)
        raise ConnectionHeldAcrossSend(
            f"{len(held)} database connection(s) held before a provider call ({states})"
        )


# Claimed and Record are NamedTuples rather than frozen dataclasses: just as immutable, and
# built about fifteen times faster (a frozen dataclass's __init__ goes through
# object.__setattr__ for every field), which counts at one of each per operation.
class Claimed(NamedTuple):
    """A row this worker leased: everything needed to send it and to fence the record."""

    id: int
    tenant_id: str
    operation_type: str
    operation_key: str
    provider: str
    action: str
    # PostgreSQL's JSON text of the payload, decoded by the dispatcher row by row
    # (outbox.core.payloads); None when its size in bytes (payload_bytes) is past payload_limit, the
    # limit of outbox.limits: such a payload is never handed over.
    payload: str | None
    payload_bytes: int
    payload_limit: int
    idempotency_key: str
    correlation_id: str | None
    traceparent: str | None
    attempts: int
    # Attempts not counted toward max_attempts: those before the last operator replay, and
    # those the provider said it did not act on (Failed.spends_attempt).
    attempt_base: int
    max_attempts: int | None
    lease_token: uuid.UUID
    first_sent_at: datetime | None
    created_at: datetime
    claimed_at: datetime  # the database clock at the claim
    # The provider API version of its first send (sql/0023); None until one may have reached it.
    api_version: str | None = None
    # What a delivery carries for its receiver to check (sql/0045, providers.base.Intent).
    ordering_key: str | None = None
    fingerprint: bytes | None = None
    origin: uuid.UUID | None = None
    # The version of its type's contract it was enqueued under (sql/0053), which the payload is
    # checked against before the first send (sql/0054); None for a type without contracts.
    contract_version: int | None = None


_CLAIMED_ROW: Final = args_row(Claimed)


class Record(NamedTuple):
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
    # The attempt does not count toward max_attempts (Failed.spends_attempt): attempt_base grows.
    unspent: bool = False
    api_version: str | None = None  # the provider API version this attempt was sent with
    scope: str | None = None  # where it was sent, as the provider names it (sql/0023)


class Health(NamedTuple):
    """One provider's breaker in one dispatcher, as ``outbox providers`` shows it."""

    provider: str
    state: str
    reason: str | None
    failure_rate: float
    calls: int
    failing_alone: int
    opened_ago: float | None  # seconds since it opened; None while closed
    probe_in: float | None  # seconds to the next probe, while open
    open_for: float | None  # the open period now, while not closed


class OpenBreaker(NamedTuple):
    """A breaker a dispatcher left open (RESTORE_HEALTH): seconds to its probe, its period."""

    provider: str
    reason: str | None
    probe_in: float
    open_for: float


def _seconds(value: float | None) -> timedelta | None:
    return None if value is None else timedelta(seconds=value)


def claim_params(
    worker: str,
    limit: int,
    lease: timedelta,
    caps: Mapping[str, int] | None = None,
    after: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """The parameters of statements.CLAIM, as :meth:`Store.claim` describes them (benchmarks and
    tests that run the statement directly build them here too)."""
    caps = caps or {}
    return {
        "worker": worker,
        "limit": limit,
        "lease": lease,
        "cap_providers": list(caps),
        "caps": list(caps.values()),
        "after_provider": after[0] if after else "",
        "after_tenant": after[1] if after else "",
        # Past `limit` groups each share is one row; the margin covers providers jumped over.
        "max_groups": min(2 * limit, max(MAX_GROUPS_PER_CLAIM, limit + JUMPS_PER_CLAIM)),
    }


class Store:
    """Named statements over a pool of autocommit connections."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool
        # Claims left that go straight to the fair CLAIM. While several (provider, tenant) groups
        # have rows, CLAIM_ONE_GROUP would take nothing and cost a statement on every claim.
        self._fair_only = 0

    async def claim(
        self,
        worker: str,
        limit: int,
        lease: timedelta,
        caps: Mapping[str, int] | None = None,
        after: tuple[str, str] | None = None,
    ) -> list[Claimed]:
        """Lease up to ``limit`` due rows, a share from each (provider, tenant) group, taking
        at most ``caps[p]`` rows of provider p (0: none). Groups are visited from just after
        ``after``, a (provider, tenant) pair, and around (see statements.CLAIM). While one group
        alone has claimable rows, statements.CLAIM_ONE_GROUP takes them for less."""
        params = claim_params(worker, limit, lease, caps, after)
        async with self._connection() as conn:
            # Built straight from the row, by position: the claims return Claimed's fields in
            # order.
            cur = conn.cursor(row_factory=_CLAIMED_ROW)
            tried = not self._fair_only
            if tried:
                claimed = await (await cur.execute(statements.CLAIM_ONE_GROUP, params)).fetchall()
                if claimed:
                    return claimed
            else:
                self._fair_only -= 1
            claimed = await (await cur.execute(statements.CLAIM, params)).fetchall()
        # Rows the one-group claim could not take, or of several groups: other groups have rows
        # (perhaps only rows capped or not yet due). Try it again only after a while.
        if claimed and (tried or len({(c.provider, c.tenant_id) for c in claimed}) > 1):
            self._fair_only = FAIR_ONLY_CLAIMS
        return claimed

    async def claim_probe(
        self, worker: str, provider: str, lease: timedelta, after_tenant: str | None
    ) -> Claimed | None:
        """Lease one row of ``provider`` as its breaker's probe (statements.CLAIM_PROBE), from
        the first tenant after ``after_tenant``; None when none is due."""
        params = {
            "worker": worker,
            "provider": provider,
            "lease": lease,
            "after_tenant": after_tenant if after_tenant is not None else "",
        }
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=_CLAIMED_ROW)
            return await (await cur.execute(statements.CLAIM_PROBE, params)).fetchone()

    async def record(self, rec: Record) -> bool:
        """True if recorded; False if this worker no longer held the lease (nothing changed)."""
        return (rec.id, rec.attempt) in await self.record_many([rec])

    async def record_many(self, recs: Sequence[Record]) -> set[tuple[int, int]]:
        """Record many outcomes in one statement; returns (id, attempt) of those recorded (the
        others' leases were lost). All of one worker."""
        batch = [
            {
                "id": r.id,
                "lease_token": str(r.lease_token),
                "attempt": r.attempt,
                "status": r.status.value,
                "reason": r.reason,
                "retry_in_s": (r.retry_in or timedelta(0)).total_seconds(),
                "sent": r.sent,
                "provider_ref": r.provider_ref,
                "result": r.result,
                "error": r.error,
                "failure": None if r.outcome == "succeeded" else r.outcome,
                "outcome": r.outcome,
                "error_class": r.error_class,
                "http_status": r.http_status,
                "request_id": r.request_id,
                "unspent": r.unspent,
                "api_version": r.api_version,
                "scope": r.scope,
            }
            for r in recs
        ]
        params = {"batch": Jsonb(batch, dumps=_batch_json), "worker": recs[0].worker}
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (await cur.execute(statements.RECORD_MANY, params)).fetchall()
        return {(row[0], row[1]) for row in rows}

    async def unclaim(
        self, claimed: Claimed, status: Status, reason: str | None, delay: timedelta | None = None
    ) -> bool:
        """Give the row back without an attempt, due again after ``delay`` (None: keep its
        place); False if the lease was lost meanwhile."""
        params = {
            "id": claimed.id,
            "lease_token": claimed.lease_token,
            "status": status.value,
            "reason": reason,
            "delay": delay,
        }
        return await self._one(statements.UNCLAIM, params)

    async def mark_waiting(self, worker: str) -> tuple[bool, int]:
        """Mark ``worker`` waiting idle for a wake-up (the next producer's commit notifies).
        Returns whether no commit that might not have seen the mark is still becoming visible,
        and the count of commits so far that woke no one."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(statements.MARK_WAITING, {"worker": worker})).fetchone()
        if row is None:
            raise psycopg.ProgrammingError("marking this dispatcher waiting returned no row")
        return bool(row[0]), int(row[1])

    async def unmark_waiting(self, worker: str) -> None:
        """``worker`` is busy: producers need not notify on its account."""
        async with self._connection() as conn:
            await conn.execute(statements.UNMARK_WAITING, {"worker": worker})

    async def attempt_recorded(self, operation_id: int, attempt: int, worker: str) -> bool:
        """Whether ``worker``'s record of this attempt committed."""
        params = {"id": operation_id, "attempt": attempt, "worker": worker}
        return await self._one(statements.ATTEMPT_RECORDED, params)

    async def operation_exists(self, operation_id: int, idempotency_key: str) -> bool:
        """Whether this operation (not merely its id, which a failover may reuse) exists."""
        params = {"id": operation_id, "idempotency_key": idempotency_key}
        return await self._one(statements.OPERATION_EXISTS, params)

    async def get_contract(self, operation_type: str, version: int) -> tuple[str, str] | None:
        """A published contract's canonical schema text and digest (sql/0052), whatever its
        state; None if this type has no such version."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (
                await cur.execute(statements.GET_CONTRACT, (operation_type, version))
            ).fetchone()
        return None if row is None else (str(row[0]), str(row[1]))

    async def heartbeat(self, held: Sequence[Claimed], lease: timedelta) -> set[int]:
        """Renew these leases; returns the ids still held (the others were lost)."""
        if not held:
            return set()
        params = {
            "ids": [c.id for c in held],
            "tokens": [c.lease_token for c in held],
            "lease": lease,
        }
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (await cur.execute(statements.HEARTBEAT, params)).fetchall()
        return {row[0] for row in rows}

    async def expire_stray_leases(
        self, worker: str, held: Sequence[uuid.UUID], since: datetime
    ) -> list[int]:
        """Expire ``worker``'s leases other than ``held`` taken before ``since`` (the database
        clock); returns their ids. The rescuer then takes them back."""
        params = {"worker": worker, "held": list(held), "since": since}
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (await cur.execute(statements.EXPIRE_STRAY_LEASES, params)).fetchall()
        return [int(row[0]) for row in rows]

    async def rescue(self, limit: int, max_attempts: int) -> list[dict[str, Any]]:
        """Take back expired leases; returns each rescued row's identity and new status."""
        params = {"limit": limit, "max_attempts": max_attempts}
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=dict_row)
            rows: list[dict[str, Any]] = await (
                await cur.execute(statements.RESCUE, params)
            ).fetchall()
        for row in rows:
            row["status"] = Status(row["status"])
        return rows

    async def repair_ordering(self, limit: int) -> int:
        """Promote the next operation of ordering keys noted for repair; returns how many keys
        were looked at. One transaction per key. A key that cannot be repaired now (its lock
        held, a statement that timed out) stays noted and the others go on; the first such
        error is raised once every key was tried."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            keys = await (await cur.execute(statements.REPAIRS_DUE, {"limit": limit})).fetchall()
        failed: psycopg.Error | None = None
        for tenant_id, ordering_key in keys:
            params = {"tenant_id": tenant_id, "ordering_key": ordering_key}
            try:
                async with self._connection() as conn:
                    await conn.execute(statements.REPAIR_ORDERING_KEY, params)
            except psycopg.Error as exc:
                failed = failed or exc
        if failed is not None:
            raise failed
        return len(keys)

    async def stage(self, limit: int) -> tuple[int, float | None]:
        """Move up to ``limit`` scheduled operations that are due into the claim index; returns
        how many moved and the seconds until the next scheduled one is due (None: none)."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(statements.STAGE, {"limit": limit})).fetchone()
        assert row is not None  # noqa: S101 (a SELECT of scalars returns one row)
        return int(row[0]), row[1]

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[AsyncConnection[Any]]:
        try:
            async with asyncio.timeout(STATEMENT_DEADLINE), self._pool.connection() as conn:
                token = _HELD.set((*_HELD.get(), conn))
                try:
                    yield conn
                finally:
                    _HELD.reset(token)
        except TimeoutError as exc:
            # Callers treat it as any lost connection: the statement may or may not have run.
            raise psycopg.OperationalError(
                f"the database did not answer within {STATEMENT_DEADLINE:.0f} s"
            ) from exc

    async def leave_transaction_open(self, operation_id: int, idle_timeout: float) -> None:
        """The fault tests' simulated bug: lock the row in a transaction nobody commits, on a
        connection never given back. Only the server's idle-in-transaction timeout ends it."""
        conn = await self._pool.getconn()
        _HELD.set((*_HELD.get(), conn))
        await conn.set_autocommit(False)
        await conn.execute(
            statements.SET_SESSION_LIMIT,
            ("idle_in_transaction_session_timeout", f"{idle_timeout}s"),
        )
        await conn.execute(statements.LOCK_OPERATION, (operation_id,))

    async def _one(self, query: LiteralString, params: Mapping[str, Any]) -> bool:
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(query, params)).fetchone()
        return row is not None

    # --- provider limits ----------------------------------------------------------------------

    async def take_tokens(self, takes: Sequence[TokenTake]) -> dict[str, Tokens]:
        """Give back and take tokens of rate-limited providers' shared buckets, in one round
        trip; returns what each provider's bucket granted."""
        ordered = sorted(takes, key=lambda t: t.provider)  # one lock order for every replica
        params = {
            "providers": [t.provider for t in ordered],
            "rates": [t.rate for t in ordered],
            "bursts": [float(t.burst) for t in ordered],
            "wanted": [t.wanted for t in ordered],
            "returned": [t.returned for t in ordered],
        }
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            rows = await (await cur.execute(statements.TAKE_TOKENS, params)).fetchall()
        return {provider: Tokens(granted, level) for provider, granted, level in rows}

    # --- provider health (sql/0031) -----------------------------------------------------------

    async def write_health(self, worker: str, rows: Sequence[Health]) -> None:
        """This worker's breakers as they are now, one row per provider."""
        params = {
            "worker": worker,
            "providers": [h.provider for h in rows],
            "states": [h.state for h in rows],
            "reasons": [h.reason for h in rows],
            "rates": [h.failure_rate for h in rows],
            "calls": [h.calls for h in rows],
            "alone": [h.failing_alone for h in rows],
            "opened_ago": [_seconds(h.opened_ago) for h in rows],
            "probe_in": [_seconds(h.probe_in) for h in rows],
            "open_for": [_seconds(h.open_for) for h in rows],
        }
        async with self._connection() as conn:
            await conn.execute(statements.WRITE_HEALTH, params)

    async def prune_health(self) -> None:
        """Drop the rows no one has written for a day, or dated a day ahead (PRUNE_HEALTH)."""
        async with self._connection() as conn:
            await conn.execute(statements.PRUNE_HEALTH)

    async def restore_health(self, providers: Sequence[str]) -> list[OpenBreaker]:
        """The breakers of ``providers`` that a dispatcher left open lately (RESTORE_HEALTH)."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=args_row(OpenBreaker))
            return await (
                await cur.execute(statements.RESTORE_HEALTH, {"providers": list(providers)})
            ).fetchall()

    async def last_provider_action(self) -> int:
        """The newest operator's request (0: none): a dispatcher acts only on later ones."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(statements.LAST_PROVIDER_ACTION)).fetchone()
        return int(row[0]) if row else 0

    async def provider_actions(self, after: int) -> list[tuple[int, str, str]]:
        """Operators' requests after id ``after``: (id, provider, action), oldest first."""
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            found = await (
                await cur.execute(statements.PROVIDER_ACTIONS_SINCE, {"after": after})
            ).fetchall()
        return [(int(i), str(p), str(a)) for i, p, a in found]

    async def throttle_bucket(
        self, provider: str, rate: float, burst: int, pause: timedelta
    ) -> float:
        """Push a provider's bucket into debt for ``pause``; returns its level now."""
        params = {"provider": provider, "rate": rate, "burst": float(burst), "pause": pause}
        async with self._connection() as conn:
            cur = conn.cursor(row_factory=tuple_row)
            row = await (await cur.execute(statements.THROTTLE_BUCKET, params)).fetchone()
        return float(row[0]) if row else 0.0


@dataclass(frozen=True, slots=True)
class TokenTake:
    """One provider's part of a take: its settings, what it wants and what it gives back."""

    provider: str
    rate: float  # tokens per second
    burst: int
    wanted: int
    returned: int = 0


@dataclass(frozen=True, slots=True)
class Tokens:
    """What a bucket granted, and its level after the take (negative: in debt)."""

    granted: int
    level: float


def _batch_json(batch: object) -> bytes:
    """The record batch as JSON: orjson, several times faster than json.dumps on the hot path.

    A provider's answer (``result``) may hold what orjson refuses, such as an integer past 64
    bits; json.dumps writes those. orjson writes a NaN as null, where json.dumps would write a
    token PostgreSQL rejects, which failed the whole batch. What neither can write (an object
    from a provider's own code) raises DataError, like a value PostgreSQL refuses.
    """
    try:
        return orjson.dumps(batch)
    except orjson.JSONEncodeError:
        pass
    try:
        return json.dumps(batch).encode()
    except (TypeError, ValueError) as exc:
        # As for an answer PostgreSQL refuses: the outcome is then recorded without its body.
        raise psycopg.DataError(f"a provider answer cannot be written as JSON: {exc}") from None

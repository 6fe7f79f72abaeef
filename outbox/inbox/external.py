"""External-effect mode: a delivery whose handler calls out (a charge, an email) before it can
answer, so its record cannot wait for one transaction (docs/design.md, "The inbox").

``claim`` commits a claim on its own, with a lease on the database clock that a heartbeat
renews; the handler gets a downstream key derived from the delivery's identity, the same on
every claim, for its own outbound calls; ``Claim.finish`` opens the final transaction, where the
handler's last writes and ``Claim.complete`` commit together, fenced by the claim's token. A
handler that raises ends the lease at once, so the redelivery reclaims with the same key; one
that dies leaves the lease to expire; after ``max_claims`` claims the record is abandoned.

The adapters (InboxMiddleware, Consumer) run a route declared ``External`` this way: the handler
makes its calls under ``downstream_key``, writes what must commit with its answer on
``await claim.transaction()``, and returns; the adapter records the answer in that transaction
(``keep``, then ``settle``), so the writes and the outcome commit together, fenced.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, TypeVar

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import statements
from outbox.inbox.contracts import Contracts
from outbox.inbox.core import (
    Decision,
    Identity,
    InvalidDelivery,
    Outcome,
    body_params,
    malformed,
    outcome_params,
)

RUNS: Final = frozenset({Decision.NEW, Decision.RECLAIMED})  # the decisions that run the handler


class LeaseLost(RuntimeError):
    """Another delivery reclaimed this claim (its lease had expired): this one must write
    nothing more; its final transaction was rolled back."""


@dataclass
class BaseClaim:
    """One external-mode delivery, whichever connection it runs on (``Claim`` on asyncio,
    ``SyncClaim`` on threads). Run the handler only when ``decision`` is new or reclaimed."""

    identity: Identity
    decision: Decision
    claims: int
    recorded: Outcome | None
    retry_after: timedelta | None
    _inbox_id: int
    _token: Any
    _downstream: str
    lost: bool = False
    _recorded: bool = field(default=False, repr=False)  # complete() went through
    _completed: bool = field(default=False, repr=False)  # and its transaction committed
    _kept: Outcome | None = field(default=None, repr=False)

    def downstream_key(self, step: str = "") -> str:
        """The idempotency key for this delivery's outbound call ``step``: the same on every
        claim of the delivery, so a call retried after an ambiguous timeout is one effect."""
        return f"{self._downstream}:{step}" if step else self._downstream

    def keep(self, outcome: Outcome) -> None:
        """The outcome ``settle`` records (an adapter's; as ``Delivery.keep`` is)."""
        if self.decision not in RUNS:
            raise RuntimeError(f"a {self.decision} claim records nothing")
        self._kept = outcome

    def roll_back(self) -> None:
        """Record nothing: ``settle`` rolls the final transaction back and the lease ends."""
        self._kept = None

    def fence(self, **more: Any) -> dict[str, Any]:
        """The parameters that name this claim to RENEW, FAIL and COMPLETE: id and token."""
        return {"inbox_id": self._inbox_id, "token": self._token, **more}


C = TypeVar("C", bound=BaseClaim)


def claim_params(
    identity: Identity,
    body: bytes,
    *,
    is_json: bool,
    lease: timedelta,
    max_claims: int,
    retention: timedelta,
) -> dict[str, Any]:
    """The parameters of statements.CLAIM."""
    params = body_params(identity, body, is_json)
    params.update(lease=lease, max_claims=max_claims, retention=retention)
    return params


def claimed(kind: type[C], identity: Identity, row: Any, **more: Any) -> C:
    """The claim that inbox_claim's row describes."""
    if row is None:
        raise RuntimeError("outbox.inbox_claim returned no row")
    decision, inbox_id, token, claims, downstream, retry_after, status, headers, stored = row
    recorded = None
    if status is not None:
        pairs = tuple((str(name), str(value)) for name, value in headers or ())
        recorded = Outcome(status, pairs, bytes(stored or b""))
    decided = Decision(decision)
    return kind(
        identity, decided, claims, recorded, retry_after, inbox_id, token, downstream, **more
    )


@dataclass
class Claim(BaseClaim):
    """An external-mode delivery of ``Inbox.claim``, on asyncio."""

    _pool: AsyncConnectionPool[Any] = field(kw_only=True, repr=False)
    _conn: psycopg.AsyncConnection[Any] | None = field(default=None, repr=False)
    _final: AsyncExitStack | None = field(default=None, repr=False)  # transaction()'s
    # One final transaction, however many of the handler's tasks ask for it at once.
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    @asynccontextmanager
    async def finish(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The final transaction, bound to the delivery's tenant: do the last writes on it and
        call ``complete`` inside; it commits when the block ends."""
        if self.lost:
            raise LeaseLost(f"claim {self._inbox_id} was reclaimed by another delivery")
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(statements.BIND_TENANT, {"tenant_id": self.identity.tenant_id})
            self._conn = conn
            try:
                yield conn
            finally:
                self._conn = None
        self._completed = self._recorded  # only once COMMIT went through

    async def complete(self, outcome: Outcome) -> None:
        """Record ``outcome`` in the final transaction (inside ``finish``), fenced by this
        claim's token; raises LeaseLost (rolling the transaction back) when it was reclaimed."""
        if self._conn is None:
            raise RuntimeError("complete() belongs inside `async with claim.finish()`")
        params = outcome_params(self._inbox_id, self._token, outcome)
        row = await (await self._conn.execute(statements.COMPLETE, params)).fetchone()
        if row is None or row[0] is not True:
            self.lost = True
            raise LeaseLost(f"claim {self._inbox_id} was reclaimed by another delivery")
        self._recorded = True

    async def transaction(self) -> psycopg.AsyncConnection[Any]:
        """For a handler an adapter runs: the final transaction, opened on the first call and
        left open. The adapter records the handler's answer in it, fenced, and commits
        (``settle``): what is written here commits with the outcome or not at all."""
        async with self._opening:
            if self._final is None:
                stack = AsyncExitStack()
                await stack.enter_async_context(self.finish())
                self._final = stack
        if self._conn is None:
            raise RuntimeError("the final transaction has no connection")
        return self._conn

    async def discard(self) -> None:
        """Roll back what the handler wrote in ``transaction`` (a refusal must not keep it)."""
        await self._close(psycopg.Rollback())

    async def settle(self) -> None:
        """Record the kept outcome in the final transaction and commit; LeaseLost (the writes
        rolled back) when another delivery reclaimed meanwhile. Without an outcome, roll the
        final transaction back: the claim's block then ends the lease."""
        if self._kept is None:
            await self.discard()
            return
        await self.transaction()
        try:
            await self.complete(self._kept)
        except BaseException as exc:
            await self._close(exc)
            raise
        await self._close(None)

    async def _close(self, exc: BaseException | None) -> None:
        """End the final transaction: COMMIT without ``exc``, ROLLBACK with it."""
        stack, self._final = self._final, None
        if stack is None:
            return
        if exc is None:
            await stack.aclose()
        else:
            await stack.__aexit__(type(exc), exc, exc.__traceback__)


@asynccontextmanager
async def claim(
    pool: AsyncConnectionPool[Any],
    identity: Identity,
    body: bytes,
    *,
    is_json: bool,
    lease: timedelta,
    max_claims: int,
    retention: timedelta,
    contracts: Contracts | None = None,
) -> AsyncIterator[Claim]:
    """Claim the delivery (committed at once); while the block runs a heartbeat renews the
    lease every third of it. A block that raises, or ends without completing, ends the lease
    now: the next delivery reclaims at once, with the same downstream key. The body is checked
    against the contract the identity names first (``contracts``; Inbox.deliver says how)."""
    if contracts is not None:
        await contracts.check(pool, identity.handler, identity.contract, body, is_json)
    params = claim_params(
        identity, body, is_json=is_json, lease=lease, max_claims=max_claims, retention=retention
    )
    the_claim = await _claim(pool, identity, params)
    if the_claim.decision not in RUNS:
        yield the_claim
        return
    beat = asyncio.create_task(_heartbeat(pool, the_claim, lease))
    try:
        yield the_claim
    except BaseException as exc:
        # The heartbeat first: a RENEW after the FAIL would give the lease back.
        await _stop(beat)
        await asyncio.shield(_abort(pool, the_claim, exc))
        raise
    finally:
        await _stop(beat)
    await asyncio.shield(the_claim.discard())  # a final transaction the adapter never settled
    if not the_claim._completed:
        await asyncio.shield(_fail(pool, the_claim, "no outcome"))


async def _claim(
    pool: AsyncConnectionPool[Any], identity: Identity, params: dict[str, Any]
) -> Claim:
    async with pool.connection() as conn:
        try:
            async with conn.transaction():
                row = await (await conn.execute(statements.CLAIM, params)).fetchone()
        except psycopg.Error as exc:
            if malformed(exc):
                raise InvalidDelivery(exc.diag.message_primary or str(exc)) from exc
            raise
    return claimed(Claim, identity, row, _pool=pool)


async def _stop(beat: asyncio.Task[None]) -> None:
    """Cancel the heartbeat and wait until it ended, without swallowing a cancellation of the
    task that waits (asyncio.wait raises only for that one)."""
    beat.cancel()
    await asyncio.wait({beat})


def beats(lease: timedelta) -> tuple[float, float, float]:
    """A heartbeat's timing, in seconds: the wait between renewals (a third of the lease), the
    wait after a failed one (a tenth: the lease must not lapse on one miss) and how long a
    renewal waits for a pooled connection (a sixth: never behind the whole pool's queue)."""
    seconds = lease.total_seconds()
    return seconds / 3, seconds / 10, seconds / 6


async def _heartbeat(pool: AsyncConnectionPool[Any], the_claim: Claim, lease: timedelta) -> None:
    params = the_claim.fence(lease=lease)
    every, again, patience = beats(lease)
    wait = every
    while True:
        await asyncio.sleep(wait)
        try:
            async with pool.connection(timeout=patience) as conn:
                row = await (await conn.execute(statements.RENEW, params)).fetchone()
        except psycopg.Error:
            # The database away or the pool exhausted: soon again; the lease may lapse, and
            # complete() will say so.
            wait = again
            continue
        if row is None or row[0] is not True:
            the_claim.lost = True
            return
        wait = every


async def _abort(pool: AsyncConnectionPool[Any], the_claim: Claim, exc: BaseException) -> None:
    """The block raised: its final transaction rolled back, the lease ended now."""
    with suppress(Exception):  # a broken connection: the pool discards it, nothing commits
        await the_claim._close(exc)
    await _fail(pool, the_claim, cause(exc))


def cause(exc: BaseException) -> str:
    """What failed, for the record's last_error: the class of the handler's own exception, not
    of an adapter's wrapper around it (never the text: it may quote the payload)."""
    return type(exc.__cause__ or exc).__name__


async def _fail(pool: AsyncConnectionPool[Any], the_claim: Claim, error: str) -> None:
    params = the_claim.fence(error=error)
    with suppress(psycopg.Error):  # unrecorded, the lease expires instead
        async with pool.connection() as conn:
            await conn.execute(statements.FAIL, params)

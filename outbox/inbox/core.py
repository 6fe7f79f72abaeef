"""The inbox's primitive: one delivery, decided and recorded in its handler's own transaction.

``Inbox.deliver`` opens a transaction on a pooled connection, asks the database what this
delivery is (``outbox.inbox_begin``, sql/0042) and hands the handler that connection while the
record is in progress. The handler's business writes and ``Delivery.complete`` commit together
or not at all (docs/design.md, "The inbox"): a crash, a raise or a failed COMMIT leaves neither,
so the sender's redelivery runs the handler again, once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar
from uuid import UUID

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from outbox.contracts import label
from outbox.inbox import statements
from outbox.inbox.contracts import Contracts, Required

if TYPE_CHECKING:
    from outbox.inbox.external import Claim

# Classes of SQLSTATE that mean "this delivery cannot be taken as it is" rather than "the
# database failed": data exceptions (a body that is not JSON PostgreSQL can store: 22P02, 22P05),
# program limits (a body nested too deep: 54001) and outbox's own refusals of an identity (OB002).
_MALFORMED: Final = ("22", "54", "OB")


# Database trouble a redelivery may not meet: answered "try again shortly", nothing recorded.
UNAVAILABLE: Final = (
    psycopg.errors.SerializationFailure,
    psycopg.errors.DeadlockDetected,
    psycopg.OperationalError,
    PoolTimeout,
)


class Decision(StrEnum):
    """What the inbox made of a delivery; also the metric label and ``Outbox-Inbox-Decision``."""

    NEW = "new"  # a record in progress, this transaction's: run the handler
    REPLAYED = "replayed"  # completed before: answer the recorded outcome
    CONFLICT = "conflict"  # the identity was recorded with another body: never run
    IN_PROGRESS = "in_progress"  # another transaction holds the identity: try later
    # External mode only (Inbox.claim):
    RECLAIMED = "reclaimed"  # an earlier claim's lease expired: run the handler again
    ABANDONED = "abandoned"  # claimed max_claims times without an outcome: a person decides


@dataclass(frozen=True)
class Identity:
    """Who a delivery is: the same identity is the same delivery, however often it arrives."""

    tenant_id: str
    handler: str
    key: str
    # The database that sent an operation (Outbox-Origin, sql/0045): operation ids are per
    # database, so two databases' operation 7 are two deliveries. None: not named (an older
    # sender, or a key that is not an operation's).
    origin: str | None = None
    # What the sender says the body is (outbox's Outbox-Fingerprint), checked by the database:
    # not part of who the delivery is, so two copies of it are one identity whatever they say.
    sent: Fingerprint | None = field(default=None, compare=False)
    # The contract the body was written to (Outbox-Contract: type and version), which the body
    # is checked against before the decision (outbox.inbox.contracts). Not part of who it is.
    contract: tuple[str, int] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Fingerprint:
    """The fingerprint that the sender's enqueue computed (sql/0045) and what it was computed
    over besides the body: a receiver computes the same from the body it got (sql/0046)."""

    digest: bytes
    provider: str
    action: str
    ordering_key: str | None


@dataclass(frozen=True)
class Outcome:
    """A response as recorded and replayed: headers as (name, value) pairs, in order."""

    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


class InvalidDelivery(ValueError):
    """The delivery cannot be taken (its identity or body is malformed); nothing was written.
    Answered as a refusal of input (HTTP 400), never retried into success."""


class NoOutcome(RuntimeError):
    """A new delivery's handler returned without recording an outcome or asking for a rollback:
    its writes were rolled back, since a record without an outcome would answer "in progress"
    to every repeat."""


# The connection a delivery's transaction runs on: asyncio's (Inbox) or a thread's (SyncInbox).
ConnT = TypeVar("ConnT", psycopg.AsyncConnection[Any], psycopg.Connection[Any])


@dataclass
class BaseDelivery(Generic[ConnT]):
    """One delivery, as the handler sees it, whichever connection it runs on. ``conn`` is the
    open transaction while the decision is new (do the business writes on it; never commit or
    roll back it yourself)."""

    identity: Identity
    decision: Decision
    conn: ConnT | None
    recorded: Outcome | None = None
    _inbox_id: int | None = None
    _token: UUID | None = None
    _outcome: dict[str, Any] | None = field(default=None, repr=False)
    _rollback: bool = field(default=False, repr=False)

    def keep(self, outcome: Outcome) -> None:
        """The outcome to record with the COMMIT; it needs no round trip of its own, so the
        async and the sync delivery share it (``complete`` is each one's name for it)."""
        if self.decision is not Decision.NEW or self.conn is None:
            raise RuntimeError(f"a {self.decision} delivery records nothing")
        self._outcome = outcome_params(self._inbox_id, self._token, outcome)

    def roll_back(self) -> None:
        """Record nothing and undo the handler's writes: the sender will deliver again."""
        self._rollback = True


D = TypeVar("D", bound=BaseDelivery[Any])


class Delivery(BaseDelivery[psycopg.AsyncConnection[Any]]):
    """A delivery of ``Inbox.deliver``, on an ``AsyncConnection``."""

    async def complete(self, outcome: Outcome) -> None:
        """Record ``outcome`` in this transaction: it commits with the handler's writes (sent
        with the COMMIT, in one round trip; the last call's outcome is the one recorded)."""
        self.keep(outcome)


class Inbox:
    """Deliveries decided and recorded on ``pool``'s connections (transaction mode).
    ``contracts`` maps a handler to the operation type (or types) whose contract its deliveries
    must name (``Outbox-Contract``); without it, a delivery is checked against the contract it
    names, if any (outbox.inbox.contracts)."""

    def __init__(
        self,
        pool: AsyncConnectionPool[Any],
        *,
        retention: timedelta = timedelta(days=7),
        wait: timedelta = timedelta(seconds=2),
        contracts: Required | None = None,
    ) -> None:
        self.pool = pool
        self.retention = retention
        self.wait = wait
        # Deliveries under way in this process, by identity: a duplicate waits here on the first
        # instead of holding a pooled connection while it waits in PostgreSQL.
        self._flights: dict[Identity, asyncio.Event] = {}
        self.contracts = Contracts(contracts)

    @asynccontextmanager
    async def deliver(
        self, identity: Identity, body: bytes, *, is_json: bool
    ) -> AsyncIterator[Delivery]:
        """Decide the delivery of ``body`` under ``identity`` and, when it is new, keep its
        transaction open for the handler until the block ends: then COMMIT if an outcome was
        recorded, ROLLBACK if ``roll_back`` was asked or the block raised. Raises
        ``InvalidDelivery`` for a malformed identity or body, ``ContractBreach`` for a body that
        breaks the contract the identity names and ``ContractUnknown`` for one this database
        cannot check (before anything is decided), ``NoOutcome`` for a new delivery that ended
        with neither."""
        await self.contracts.check(self.pool, identity.handler, identity.contract, body, is_json)
        async with (
            self._flight(identity) as left,
            self.pool.connection() as conn,
            _explicit_transactions(conn),
        ):
            delivery = await self._begin(conn, identity, body, is_json, left)
            try:
                yield delivery
            except BaseException:
                await asyncio.shield(_roll_back(conn))
                raise
            await asyncio.shield(_finish(conn, delivery))

    def claim(
        self,
        identity: Identity,
        body: bytes,
        *,
        is_json: bool,
        lease: timedelta = timedelta(seconds=30),
        max_claims: int = 5,
    ) -> AbstractAsyncContextManager[Claim]:
        """External-effect mode, for a handler that calls out before it can answer
        (outbox.inbox.external): a claim committed at once, with a lease and a downstream key."""
        from outbox.inbox import external  # noqa: PLC0415 (external imports this module)

        return external.claim(
            self.pool,
            identity,
            body,
            is_json=is_json,
            lease=lease,
            max_claims=max_claims,
            retention=self.retention,
            contracts=self.contracts,
        )

    @asynccontextmanager
    async def _flight(self, identity: Identity) -> AsyncIterator[timedelta]:
        """Wait (at most ``wait``) for a delivery of the same identity already under way in this
        process; yields how much of ``wait`` is left for the database's own wait."""
        started = time.monotonic()
        first = self._flights.get(identity)
        if first is not None:
            with suppress(TimeoutError):
                await asyncio.wait_for(first.wait(), self.wait.total_seconds())
            yield left_of(self.wait, started)
            return
        done = self._flights[identity] = asyncio.Event()
        try:
            yield self.wait
        finally:
            del self._flights[identity]
            done.set()

    async def _begin(
        self,
        conn: psycopg.AsyncConnection[Any],
        identity: Identity,
        body: bytes,
        is_json: bool,
        wait: timedelta,
    ) -> Delivery:
        params = body_params(identity, body, is_json)
        params.update(wait=wait, retention=self.retention)
        try:
            cur = psycopg.AsyncClientCursor(conn)
            await cur.execute(begin_statement(conn), params)
            cur.nextset()  # past BEGIN's result, to inbox_begin's row
            row = await cur.fetchone()
        except psycopg.Error as exc:
            await conn.rollback()
            if malformed(exc):
                raise InvalidDelivery(exc.diag.message_primary or str(exc)) from exc
            raise
        return decided(Delivery, identity, conn, row)


def left_of(wait: timedelta, started: float) -> timedelta:
    """What is left of ``wait`` since ``started`` (monotonic) for the database's own wait."""
    return max(timedelta(0), wait - timedelta(seconds=time.monotonic() - started))


def begin_statement(conn: psycopg.AsyncConnection[Any] | psycopg.Connection[Any]) -> str:
    """BEGIN as psycopg would send it for ``conn`` (its isolation level, read-only and
    deferrable flags), then the decision: one query (statements.begin_and_decide)."""
    isolation = None
    if conn.isolation_level is not None:
        isolation = psycopg.IsolationLevel(conn.isolation_level).name.replace("_", " ")
    return statements.begin_and_decide(isolation, conn.read_only, conn.deferrable)


def decided(kind: type[D], identity: Identity, conn: Any, row: Sequence[Any] | None) -> D:
    """The delivery inbox_begin's row describes; it keeps ``conn`` only when it is new."""
    if row is None:  # a function call returns one row
        raise RuntimeError("outbox.inbox_begin returned no row")
    decision, inbox_id, token, status, headers, stored_body = row
    recorded = None
    if status is not None:
        pairs = tuple((str(name), str(value)) for name, value in headers or ())
        recorded = Outcome(status, pairs, bytes(stored_body or b""))
    new = decision == Decision.NEW
    return kind(identity, Decision(decision), conn if new else None, recorded, inbox_id, token)


def body_params(identity: Identity, body: bytes, is_json: bool) -> dict[str, Any]:
    """The body as text for PostgreSQL to parse as jsonb (so its digest is the canonical text
    enqueue fingerprints), or as raw bytes for any other body."""
    body_json: str | None = None
    if is_json:
        try:
            body_json = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidDelivery("a JSON body must be UTF-8") from exc
        if "\x00" in body_json:
            raise InvalidDelivery("a JSON body must not contain NUL characters")
    sent = identity.sent
    return {
        "tenant_id": identity.tenant_id,
        "handler": identity.handler,
        "key": identity.key,
        "body_json": body_json,
        "body_raw": None if is_json else body,
        "origin": identity.origin,
        "fingerprint": None if sent is None else sent.digest,
        "provider": None if sent is None else sent.provider,
        "action": None if sent is None else sent.action,
        "ordering_key": None if sent is None else sent.ordering_key,
        # Another contract under one identity is a conflict, where both name one (sql/0056).
        "contract": None if identity.contract is None else label(*identity.contract),
    }


def outcome_params(inbox_id: int | None, token: Any, outcome: Outcome) -> dict[str, Any]:
    """The parameters of statements.COMPLETE: a record's outcome under its token."""
    return {
        "inbox_id": inbox_id,
        "token": token,
        "status": outcome.status,
        "headers": Jsonb([list(pair) for pair in outcome.headers]),
        "body": outcome.body,
    }


def malformed(exc: psycopg.Error) -> bool:
    """Whether the database refused the delivery itself rather than failed."""
    return (exc.sqlstate or "")[:2] in _MALFORMED


async def _finish(conn: psycopg.AsyncConnection[Any], delivery: Delivery) -> None:
    """COMMIT what may be kept, a new delivery's outcome with it; roll back a new delivery with
    no recorded outcome."""
    if delivery.decision is not Decision.NEW:
        await conn.commit()  # a conflict's count; nothing else was written
        return
    if delivery._rollback or delivery._outcome is None:
        await conn.rollback()
        if not delivery._rollback:
            raise NoOutcome(f"handler {delivery.identity.handler} recorded no outcome")
        return
    cur = psycopg.AsyncClientCursor(conn)
    await cur.execute(statements.COMPLETE_AND_COMMIT, delivery._outcome)
    row = await cur.fetchone()
    if row is None or row[0] is not True:
        # Unreachable while OB006 stands: the COMMIT of a record in progress is refused.
        raise RuntimeError("the inbox record of this delivery was not in progress")


@asynccontextmanager
async def _explicit_transactions(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    """The connection in autocommit while the inbox has it, so that psycopg sends no BEGIN of its
    own (statements.begin_and_decide sends it with the decision); as it was when it goes back to
    the pool. A connection left in a transaction by a failure is rolled back first."""
    before = conn.autocommit
    if not before:
        await conn.set_autocommit(True)
    try:
        yield
    finally:
        if not before:
            with suppress(psycopg.Error):
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    await conn.rollback()
                await conn.set_autocommit(False)


async def _roll_back(conn: psycopg.AsyncConnection[Any]) -> None:
    # A broken connection rolled back with it; the pool discards it.
    with suppress(psycopg.Error):
        await conn.rollback()


def pairs_of(headers: Sequence[tuple[bytes, bytes]]) -> tuple[tuple[str, str], ...]:
    """ASGI header pairs as text, latin-1 so that every byte round-trips."""
    return tuple((name.decode("latin-1"), value.decode("latin-1")) for name, value in headers)

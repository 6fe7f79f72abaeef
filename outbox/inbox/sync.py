"""The inbox on threads: ``SyncInbox.deliver``, the twin of ``Inbox.deliver`` on a psycopg
``ConnectionPool``, for WSGI apps (outbox.inbox.wsgi) and any threaded worker.

The same SQL (statements.py) and the same three round trips (docs/design.md, "The inbox",
"Round trips"): BEGIN travels with ``inbox_begin`` and the outcome with COMMIT, each pair one
simple query through psycopg's ``ClientCursor``; while the inbox holds a pooled connection it
runs it in autocommit, and gives it back as it found it. Duplicates within the process wait on
the first's ``threading.Event``, holding no pooled connection, at most ``wait``.

``SyncInbox.claim`` is ``Inbox.claim`` on threads (external-effect mode, outbox.inbox.external):
the same claim, lease, fence and downstream key, its heartbeat a thread of its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from outbox.inbox import statements
from outbox.inbox.contracts import Contracts, Required
from outbox.inbox.core import (
    BaseDelivery,
    Decision,
    Identity,
    InvalidDelivery,
    NoOutcome,
    Outcome,
    begin_statement,
    body_params,
    decided,
    left_of,
    malformed,
    outcome_params,
)
from outbox.inbox.external import RUNS, BaseClaim, LeaseLost, beats, cause, claim_params, claimed


class SyncDelivery(BaseDelivery[psycopg.Connection[Any]]):
    """A delivery of ``SyncInbox.deliver``, on a ``Connection``: ``conn`` is the open
    transaction while the decision is new (never commit or roll it back yourself)."""

    def complete(self, outcome: Outcome) -> None:
        """Record ``outcome`` in this transaction: it commits with the handler's writes (sent
        with the COMMIT, in one round trip; the last call's outcome is the one recorded)."""
        self.keep(outcome)


class SyncInbox:
    """Deliveries decided and recorded on ``pool``'s connections, from any thread."""

    def __init__(
        self,
        pool: ConnectionPool[Any],
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
        self._flights: dict[Identity, threading.Event] = {}
        self._flights_lock = threading.Lock()
        self.contracts = Contracts(contracts)

    @contextmanager
    def deliver(self, identity: Identity, body: bytes, *, is_json: bool) -> Iterator[SyncDelivery]:
        """Decide the delivery of ``body`` under ``identity`` and, when it is new, keep its
        transaction open for the handler until the block ends: then COMMIT if an outcome was
        recorded, ROLLBACK if ``roll_back`` was asked or the block raised. Raises as
        ``Inbox.deliver`` does (ContractBreach, ContractUnknown before anything is decided)."""
        self.contracts.check_sync(self.pool, identity.handler, identity.contract, body, is_json)
        with (
            self._flight(identity) as left,
            self.pool.connection() as conn,
            _explicit_transactions(conn),
        ):
            delivery = self._begin(conn, identity, body, is_json, left)
            try:
                yield delivery
            except BaseException:
                _roll_back(conn)
                raise
            _finish(conn, delivery)

    @contextmanager
    def claim(
        self,
        identity: Identity,
        body: bytes,
        *,
        is_json: bool,
        lease: timedelta = timedelta(seconds=30),
        max_claims: int = 5,
    ) -> Iterator[SyncClaim]:
        """External-effect mode on threads, as ``Inbox.claim``: a claim committed at once, a
        heartbeat thread renewing its lease every third of it while the block runs; a block
        that raises, or ends without an outcome, ends the lease now."""
        self.contracts.check_sync(self.pool, identity.handler, identity.contract, body, is_json)
        params = claim_params(
            identity,
            body,
            is_json=is_json,
            lease=lease,
            max_claims=max_claims,
            retention=self.retention,
        )
        the_claim = _claim(self.pool, identity, params)
        if the_claim.decision not in RUNS:
            yield the_claim
            return
        stop = threading.Event()
        beat = threading.Thread(
            target=_heartbeat, args=(self.pool, the_claim, lease, stop), daemon=True
        )
        beat.start()
        try:
            yield the_claim
        except BaseException as exc:
            # The heartbeat first: a RENEW after the FAIL would give the lease back.
            _stop(beat, stop, lease)
            _abort(self.pool, the_claim, exc)
            raise
        finally:
            _stop(beat, stop, lease)
        the_claim.discard()  # a final transaction the adapter never settled
        if not the_claim._completed:
            _fail(self.pool, the_claim, "no outcome")

    @contextmanager
    def _flight(self, identity: Identity) -> Iterator[timedelta]:
        """Wait (at most ``wait``) for a delivery of the same identity already under way in this
        process; yields how much of ``wait`` is left for the database's own wait."""
        started = time.monotonic()
        done = threading.Event()
        with self._flights_lock:
            first = self._flights.setdefault(identity, done)
        if first is not done:
            first.wait(self.wait.total_seconds())
            yield left_of(self.wait, started)
            return
        try:
            yield self.wait
        finally:
            with self._flights_lock:
                del self._flights[identity]
            done.set()

    def _begin(
        self,
        conn: psycopg.Connection[Any],
        identity: Identity,
        body: bytes,
        is_json: bool,
        wait: timedelta,
    ) -> SyncDelivery:
        params = body_params(identity, body, is_json)
        params.update(wait=wait, retention=self.retention)
        try:
            cur = psycopg.ClientCursor(conn)
            cur.execute(begin_statement(conn), params)
            cur.nextset()  # past BEGIN's result, to inbox_begin's row
            row = cur.fetchone()
        except psycopg.Error as exc:
            conn.rollback()
            if malformed(exc):
                raise InvalidDelivery(exc.diag.message_primary or str(exc)) from exc
            raise
        return decided(SyncDelivery, identity, conn, row)


def _finish(conn: psycopg.Connection[Any], delivery: SyncDelivery) -> None:
    """COMMIT what may be kept, a new delivery's outcome with it; roll back a new delivery with
    no recorded outcome."""
    if delivery.decision is not Decision.NEW:
        conn.commit()  # a conflict's count; nothing else was written
        return
    if delivery._rollback or delivery._outcome is None:
        conn.rollback()
        if not delivery._rollback:
            raise NoOutcome(f"handler {delivery.identity.handler} recorded no outcome")
        return
    cur = psycopg.ClientCursor(conn)
    cur.execute(statements.COMPLETE_AND_COMMIT, delivery._outcome)
    row = cur.fetchone()
    if row is None or row[0] is not True:
        # Unreachable while OB006 stands: the COMMIT of a record in progress is refused.
        raise RuntimeError("the inbox record of this delivery was not in progress")


@contextmanager
def _explicit_transactions(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """The connection in autocommit while the inbox has it, so that psycopg sends no BEGIN of its
    own (statements.begin_and_decide sends it with the decision); as it was when it goes back to
    the pool. A connection left in a transaction by a failure is rolled back first."""
    before = conn.autocommit
    if not before:
        conn.autocommit = True
    try:
        yield
    finally:
        if not before:
            with suppress(psycopg.Error):
                if conn.info.transaction_status != TransactionStatus.IDLE:
                    conn.rollback()
                conn.autocommit = False


def _roll_back(conn: psycopg.Connection[Any]) -> None:
    # A broken connection rolled back with it; the pool discards it.
    with suppress(psycopg.Error):
        conn.rollback()


@dataclass
class SyncClaim(BaseClaim):
    """An external-mode delivery of ``SyncInbox.claim``: ``Claim``'s twin on a ``Connection``."""

    _pool: ConnectionPool[Any] = field(kw_only=True, repr=False)
    _conn: psycopg.Connection[Any] | None = field(default=None, repr=False)
    _final: ExitStack | None = field(default=None, repr=False)  # transaction()'s
    # One final transaction, however many of the handler's threads ask for it at once.
    _opening: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @contextmanager
    def finish(self) -> Iterator[psycopg.Connection[Any]]:
        """The final transaction, bound to the delivery's tenant: do the last writes on it and
        call ``complete`` inside; it commits when the block ends."""
        if self.lost:
            raise LeaseLost(f"claim {self._inbox_id} was reclaimed by another delivery")
        with self._pool.connection() as conn, conn.transaction():
            conn.execute(statements.BIND_TENANT, {"tenant_id": self.identity.tenant_id})
            self._conn = conn
            try:
                yield conn
            finally:
                self._conn = None
        self._completed = self._recorded  # only once COMMIT went through

    def complete(self, outcome: Outcome) -> None:
        """Record ``outcome`` inside ``finish``, fenced by this claim's token; LeaseLost (the
        transaction rolled back) when another delivery reclaimed it."""
        if self._conn is None:
            raise RuntimeError("complete() belongs inside `with claim.finish()`")
        params = outcome_params(self._inbox_id, self._token, outcome)
        row = self._conn.execute(statements.COMPLETE, params).fetchone()
        if row is None or row[0] is not True:
            self.lost = True
            raise LeaseLost(f"claim {self._inbox_id} was reclaimed by another delivery")
        self._recorded = True

    def transaction(self) -> psycopg.Connection[Any]:
        """For a handler an adapter runs: the final transaction, opened on the first call and
        left open until the adapter records the handler's answer in it (``settle``)."""
        with self._opening:
            if self._final is None:
                stack = ExitStack()
                stack.enter_context(self.finish())
                self._final = stack
        if self._conn is None:
            raise RuntimeError("the final transaction has no connection")
        return self._conn

    def discard(self) -> None:
        """Roll back what the handler wrote in ``transaction``."""
        self._close(psycopg.Rollback())

    def settle(self) -> None:
        """Record the kept outcome in the final transaction and commit (LeaseLost, rolled
        back, when reclaimed meanwhile); without one, roll the final transaction back."""
        if self._kept is None:
            self.discard()
            return
        self.transaction()
        try:
            self.complete(self._kept)
        except BaseException as exc:
            self._close(exc)
            raise
        self._close(None)

    def _close(self, exc: BaseException | None) -> None:
        stack, self._final = self._final, None
        if stack is None:
            return
        if exc is None:
            stack.close()
        else:
            stack.__exit__(type(exc), exc, exc.__traceback__)


def _claim(pool: ConnectionPool[Any], identity: Identity, params: dict[str, Any]) -> SyncClaim:
    with pool.connection() as conn:
        try:
            with conn.transaction():
                row = conn.execute(statements.CLAIM, params).fetchone()
        except psycopg.Error as exc:
            if malformed(exc):
                raise InvalidDelivery(exc.diag.message_primary or str(exc)) from exc
            raise
    return claimed(SyncClaim, identity, row, _pool=pool)


def _heartbeat(
    pool: ConnectionPool[Any], the_claim: SyncClaim, lease: timedelta, stop: threading.Event
) -> None:
    params = the_claim.fence(lease=lease)
    every, again, patience = beats(lease)
    wait = every
    while not stop.wait(wait):
        try:
            with pool.connection(timeout=patience) as conn:
                row = conn.execute(statements.RENEW, params).fetchone()
        except psycopg.Error:
            wait = again  # the database away or the pool exhausted: soon again
            continue
        if row is None or row[0] is not True:
            the_claim.lost = True
            return
        wait = every


def _stop(beat: threading.Thread, stop: threading.Event, lease: timedelta) -> None:
    """Stop the heartbeat: it ends after the renewal under way, if any, which waits at most a
    sixth of the lease for its connection. A renewal stuck past that (a database gone quiet)
    is left to its daemon thread rather than holding up the answer."""
    stop.set()
    beat.join(timeout=beats(lease)[2] + 1)


def _abort(pool: ConnectionPool[Any], the_claim: SyncClaim, exc: BaseException) -> None:
    """The block raised: its final transaction rolled back, the lease ended now."""
    with suppress(Exception):  # a broken connection: the pool discards it, nothing commits
        the_claim._close(exc)
    _fail(pool, the_claim, cause(exc))


def _fail(pool: ConnectionPool[Any], the_claim: SyncClaim, error: str) -> None:
    # Unrecorded, the lease expires instead.
    with suppress(psycopg.Error), pool.connection() as conn:
        conn.execute(statements.FAIL, the_claim.fence(error=error))

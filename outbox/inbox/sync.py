"""The inbox on threads: ``SyncInbox.deliver``, the twin of ``Inbox.deliver`` on a psycopg
``ConnectionPool``, for WSGI apps (outbox.inbox.wsgi) and any threaded worker.

The same SQL (statements.py) and the same three round trips (docs/design.md, "The inbox",
"Round trips"): BEGIN travels with ``inbox_begin`` and the outcome with COMMIT, each pair one
simple query through psycopg's ``ClientCursor``; while the inbox holds a pooled connection it
runs it in autocommit, and gives it back as it found it. Duplicates within the process wait on
the first's ``threading.Event``, holding no pooled connection, at most ``wait``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg_pool import ConnectionPool

from outbox.inbox import statements
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
)


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
    ) -> None:
        self.pool = pool
        self.retention = retention
        self.wait = wait
        # Deliveries under way in this process, by identity: a duplicate waits here on the first
        # instead of holding a pooled connection while it waits in PostgreSQL.
        self._flights: dict[Identity, threading.Event] = {}
        self._flights_lock = threading.Lock()

    @contextmanager
    def deliver(self, identity: Identity, body: bytes, *, is_json: bool) -> Iterator[SyncDelivery]:
        """Decide the delivery of ``body`` under ``identity`` and, when it is new, keep its
        transaction open for the handler until the block ends: then COMMIT if an outcome was
        recorded, ROLLBACK if ``roll_back`` was asked or the block raised. Raises
        ``InvalidDelivery`` for a malformed identity or body, ``NoOutcome`` for a new delivery
        that ended with neither."""
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

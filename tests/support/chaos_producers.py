"""What producers did: the chaos soak's producer threads, which enqueue the workload
(tests/support/chaos_workload.py) continuously, ride out the PostgreSQL crash and arm provider
faults in step with their commits; and their :class:`Ledger`, what they saw commit, roll back,
refused or left uncertain, against which tests/support/chaos_audit.py checks the table."""

from __future__ import annotations

import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg

import outbox
from outbox.core.model import EnqueueOutcome
from outbox.errors import SQLSTATE_OPERATION_CONFLICT
from tests.support.chaos_mayhem import FaultInjector
from tests.support.chaos_settings import HOOK, STRIPE, Settings, pick, random_source
from tests.support.chaos_workload import Intent, Workload, plant_poison

# How a producer's transaction ends, by weight: most commit; some roll back; some repeat an
# identity it committed (same payload: a duplicate; another payload: a conflict). The weights
# add up to 100; hostile_rate and poison_rate take their share of it.
PRODUCER_MOVES: Final = {"commit": 70, "rollback": 12, "duplicate": 12, "conflict": 6}


@dataclass
class Ledger:
    """What the producers know, shared by their threads under one lock."""

    committed: dict[str, int] = field(default_factory=dict)  # operation_key -> id
    intents: dict[str, Intent] = field(default_factory=dict)  # committed or uncertain ones
    rolled_back: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (id, idem key)
    uncertain: set[str] = field(default_factory=set)  # the COMMIT failed: outcome unknown
    poison: dict[str, str] = field(default_factory=dict)  # key -> kind, planted or uncertain
    refused: dict[str, str] = field(default_factory=dict)  # key -> kind the door had to refuse
    duplicates: int = 0
    conflicts: int = 0
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Producer(threading.Thread):
    """Enqueues at its share of ``rate`` until stopped, riding out a database restart."""

    def __init__(
        self,
        index: int,
        url: str,
        settings: Settings,
        tenants: list[str],
        ledger: Ledger,
        faults: FaultInjector,
        stop: threading.Event,
    ) -> None:
        super().__init__(name=f"chaos-producer-{index}", daemon=True)
        self._index, self._url, self._ledger = index, url, ledger
        self._faults, self._halt = faults, stop
        self._interval = settings.producers / settings.rate
        self._rng = random_source(settings.seed, f"producer {index}")
        self._work = Workload(index, settings, tenants, self._rng)
        spare = 1 - settings.hostile_rate - settings.poison_rate
        self._moves = {move: weight * spare for move, weight in PRODUCER_MOVES.items()}
        self._moves |= {
            "hostile": 100 * settings.hostile_rate,
            "poison": 100 * settings.poison_rate,
        }
        self._mine: list[Intent] = []  # committed intents, for duplicates and conflicts
        self._seq = 0

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                conn = conn or psycopg.connect(self._url, connect_timeout=3)
                self._move(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                _discard(conn)
                conn = None
                self._halt.wait(0.5)  # the server is down or restarting
            except Exception as exc:  # noqa: BLE001 (not an outage: a finding; the run goes on)
                _discard(conn)
                conn = None
                with self._ledger.lock:
                    self._ledger.violations.append(f"producer error {type(exc).__name__}: {exc}")
            self._halt.wait(max(0.0, self._interval - (time.monotonic() - started)))
        _discard(conn)

    def _move(self, conn: psycopg.Connection[Any]) -> None:
        move = pick(self._rng, self._moves)
        if move == "duplicate" and self._mine:
            self._duplicate(conn, self._rng.choice(self._mine))
        elif move == "conflict" and self._mine:
            self._conflict(conn, self._rng.choice(self._mine))
        elif move == "hostile":
            self._hostile(conn)
        elif move == "poison":
            self._poison(conn)
        else:
            self._new(conn, commit=move != "rollback")

    def _new(self, conn: psycopg.Connection[Any], *, commit: bool) -> None:
        intents = [self._work.intent(self._next_key()) for _ in range(self._rng.randint(1, 3))]
        ids = [intent.enqueue(conn).operation_id for intent in intents]
        if commit:
            self._commit(conn, intents, ids)
        else:
            self._roll_back(conn, intents, ids, [_idempotency_key(conn, i) for i in ids])

    def _hostile(self, conn: psycopg.Connection[Any]) -> None:
        """Maybe a good operation, then one the door must refuse: as any SQL error, the refusal
        aborts the transaction, and the good one goes with it."""
        intents = [self._work.intent(self._next_key()) for _ in range(self._rng.randint(0, 1))]
        ids = [intent.enqueue(conn).operation_id for intent in intents]
        keys = [_idempotency_key(conn, i) for i in ids]
        kind, hostile, tenant = self._work.hostile()
        key = self._next_key()
        with self._ledger.lock:
            self._ledger.refused[key] = kind
        outcome = hostile.attempt(conn, tenant, key)
        if outcome is None:
            self._roll_back(conn, intents, ids, keys)
            return
        with self._ledger.lock:
            self._ledger.violations.append(
                f"the door let {kind} through (tenant {tenant!r}, key {key}): {outcome}"
            )
        if outcome == "accepted":  # as a producer would: the dispatchers must cope with it
            self._commit(conn, intents, ids)
        else:
            self._roll_back(conn, intents, ids, keys)

    def _poison(self, conn: psycopg.Connection[Any]) -> None:
        kind, provider, tenant, payload = self._work.poison()
        key = self._next_key()
        op_id = plant_poison(conn, tenant, key, provider, payload)
        with self._ledger.lock:
            self._ledger.poison[key] = kind
        try:
            conn.commit()
        except psycopg.OperationalError:
            with self._ledger.lock:
                self._ledger.uncertain.add(key)
            raise
        with self._ledger.lock:
            self._ledger.committed[key] = op_id

    def _commit(self, conn: psycopg.Connection[Any], intents: list[Intent], ids: list[int]) -> None:
        with self._ledger.lock:
            self._ledger.intents.update((i.key, i) for i in intents)
        try:
            conn.commit()
        except psycopg.OperationalError:
            with self._ledger.lock:
                self._ledger.uncertain.update(i.key for i in intents)
            raise
        with self._ledger.lock:
            for intent, op_id in zip(intents, ids, strict=True):
                self._ledger.committed[intent.key] = op_id
        self._mine += intents
        self._faults.arm_for(len(intents))

    def _roll_back(
        self, conn: psycopg.Connection[Any], intents: list[Intent], ids: list[int], keys: list[str]
    ) -> None:
        conn.rollback()
        with self._ledger.lock:
            for intent, op_id, key in zip(intents, ids, keys, strict=True):
                self._ledger.rolled_back[intent.key] = (op_id, key)

    def _duplicate(self, conn: psycopg.Connection[Any], intent: Intent) -> None:
        result = intent.enqueue(conn)
        conn.commit()
        with self._ledger.lock:
            expected = self._ledger.committed[intent.key]
            if result.outcome is EnqueueOutcome.DUPLICATE and result.operation_id == expected:
                self._ledger.duplicates += 1
            else:
                self._ledger.violations.append(
                    f"re-enqueue of {intent.key} gave {result.outcome} {result.operation_id}, "
                    f"not duplicate {expected}"
                )

    def _conflict(self, conn: psycopg.Connection[Any], intent: Intent) -> None:
        try:
            intent.enqueue(conn, {**intent.payload, "changed": True})
        except (outbox.OperationConflict, psycopg.Error) as exc:
            # OB001 from the SQL function itself (an intent enqueued as text) is the same refusal.
            if isinstance(exc, psycopg.Error) and exc.sqlstate != SQLSTATE_OPERATION_CONFLICT:
                raise
            conn.rollback()
            with self._ledger.lock:
                self._ledger.conflicts += 1
            return
        conn.rollback()
        with self._ledger.lock:
            self._ledger.violations.append(f"a changed payload for {intent.key} did not conflict")

    def _next_key(self) -> str:
        self._seq += 1
        return f"p{self._index}-{self._seq}"


def _idempotency_key(conn: psycopg.Connection[Any], op_id: int) -> str:
    row = conn.execute("SELECT idempotency_key FROM outbox.operations WHERE id = %s", (op_id,))
    found = row.fetchone()
    assert found is not None
    return str(found[0])


def _discard(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        with suppress(psycopg.Error):
            conn.close()


def schedule_far_ahead(url: str, settings: Settings, tenants: list[str], ledger: Ledger) -> None:
    """Before the run: each scheduled-only tenant's reminders, one per provider, hours ahead."""
    if not tenants:
        return
    work = Workload(-1, settings, tenants, random_source(settings.seed, "far ahead"))
    intents = [
        work.far_ahead(tenant, provider) for tenant in tenants for provider in (HOOK, STRIPE)
    ]
    with psycopg.connect(url) as conn:
        ids = [intent.enqueue(conn).operation_id for intent in intents]
    ledger.intents.update((i.key, i) for i in intents)
    ledger.committed.update((i.key, op_id) for i, op_id in zip(intents, ids, strict=True))

"""The chaos soak: producers, faults, killed and frozen dispatchers and a PostgreSQL crash at
once, under an adversarial workload; then every operation counted against every provider effect
and every invariant checked.

``bench/chaos.py`` runs it for ``--duration`` seconds. tests/integration/test_chaos.py runs a
bounded soak of the workload of before issue 17 (:data:`NARROW`), and
tests/integration/test_adversarial.py a short one of the whole workload. All call
:func:`run_chaos` and read :class:`Report`.

What runs: a private PostgreSQL cluster (restarted once with ``-m immediate``), the fake Stripe
and the fake webhook receiver on loopback (in this process, so their ledgers of effects outlive
every dispatcher), producer threads that enqueue continuously (some transactions rolled back,
some duplicates, some conflicts) and arm a random provider fault for about one operation in
``fault_rate``, and ``dispatchers`` real ``outbox run`` processes, one of which is SIGKILLed or
SIGSTOPped (then resumed or killed) every ``chaos_every`` seconds and brought back. The fakes
forget idempotency keys after ``key_retention`` seconds (30 by default, and the providers are
configured so), so the run reaches the point where a blind resend would duplicate an effect.

The workload (issue 17), every choice drawn from ``random.Random`` instances derived from
``seed`` (one per producer thread, one for the tenants, the faults, the monkey): the report
prints the seed and the command that replays the same choices (not the same interleaving of
threads and processes, which no seed fixes).

* ``tenants`` tenants with due work, some named with quotes, unicode, SQL or 128 characters,
  and ``scheduled_tenants`` more, sorting before them, with only operations due hours ahead:
  more (provider, tenant) groups than one claim visits, as issue 17's 200 tenants with
  tomorrow's reminders.
* Due times: ``soon_rate`` of the operations are due 1 to 5 s after their enqueue,
  ``later_rate`` 2 to 24 hours ahead.
* Ordering keys: ``ordered_rate`` of them go under one of each producer's ``lines`` keys.
* Payload shapes: random JSON trees (unicode, escapes, empty keys, nesting to the limit of 64
  levels), and for ``exact_rate`` of them numbers a float cannot hold, enqueued as SQL text
  (Python's json cannot write a Decimal).
* Hostile enqueues: ``hostile_rate`` of the producers' transactions try one the door must
  refuse with OB002, sometimes after good operations, which then roll back with it.
* Poison rows: ``poison_rate`` of them plant a row behind enqueue's back, as rows written before
  its checks (or by a superuser) are: 1e5000, a 200-digit integer, 1000 levels deep, an array, a
  payload stored past ``outbox.limits``.

What is checked (:func:`verify`), once producers stopped and dispatchers drained:

* no dispatcher exited unless the monkey killed it, and each exits 0 on the final SIGTERM;
* every operation a producer saw commit exists; it is final, unless it is due hours ahead or
  waits behind a set-aside operation of its ordering key (**lost** counts the others);
* a succeeded one has exactly one effect, the one its provider_ref names; a quarantined or
  reconciling one has its attempt history and at most one effect; no operation has two effects
  (**duplicates**); no effect belongs to no operation; no rolled-back operation exists or has
  an effect; every duplicate enqueue returned the original id and every conflicting one raised
  OperationConflict (OB001);
* no enqueue the door had to refuse left a row; every poison row is quarantined
  ``invalid_payload`` after one attempt marked not sent, and no provider saw its key;
* every due operation its line lets go was first attempted within ``due_bound`` seconds of
  becoming due; operations due hours ahead are pending and were never attempted, nor were
  those behind a set-aside operation of their ordering key;
* the operations of one ordering key reached the providers one at a time, in enqueue order;
* every effect carries its payload exactly: the webhook body is the stored JSON text, Stripe's
  form gives every number its exact value.
"""

from __future__ import annotations

import itertools
import json
import random
import signal
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from decimal import InvalidOperation as NotANumber
from pathlib import Path
from typing import Any, Final, TypeVar

import psycopg

import outbox
from outbox import payloads
from outbox.db import statements
from outbox.dispatcher import CLAIM_RETRY_MAX, ORDERING_REPAIR_INTERVAL
from outbox.errors import SQLSTATE_INVALID_OPERATION, SQLSTATE_OPERATION_CONFLICT
from outbox.model import EnqueueOutcome, EnqueueResult
from outbox.providers.fakes.stripe import FakeStripe
from outbox.providers.fakes.stripe import Fault as StripeFault
from outbox.providers.fakes.webhook import Effect, FakeWebhookReceiver
from outbox.providers.fakes.webhook import Fault as HookFault
from tests.support.cluster import PrivateCluster, private_cluster
from tests.support.daemon import OutboxProcess, write_config
from tests.support.producers import nested_payload, plant

STRIPE: Final = "stripe"
HOOK: Final = "hook"
STRIPE_KEY: Final = "sk_test_chaos"
FINAL: Final = frozenset({"succeeded", "quarantined", "reconciling", "cancelled"})
# Statuses that hold up the later operations of their ordering key (mode block, the default).
SET_ASIDE: Final = frozenset({"quarantined", "reconciling"})
# How a producer's transaction ends, by weight: most commit; some roll back; some repeat an
# identity it committed (same payload: a duplicate; another payload: a conflict). The weights
# add up to 100; hostile_rate and poison_rate take their share of it.
PRODUCER_MOVES: Final = {"commit": 70, "rollback": 12, "duplicate": 12, "conflict": 6}
# Provider faults by weight. "after" faults act and then fail to say so; their retries meet
# the providers' idempotency ledgers.
HOOK_FAULTS: Final = {
    "503_retry_after": 4, "429_retry_after": 4, "409_in_progress": 2, "500_before": 3,
    "reset_before": 3, "reset_after": 4, "slow_after": 2, "500_after_saved": 1, "422": 1,
}  # fmt: skip
STRIPE_FAULTS: Final = {
    "429_rate_limit": 4, "503": 3, "409_key_in_use": 2, "reset_before": 3, "500_before_saved": 1,
    "500_after_saved": 1, "slow_after": 2, "reset_after": 4, "402_card_declined": 1,
}  # fmt: skip
# A third of the operations may be tried this often instead of the dispatchers' 8 times: those
# that keep failing after their first send run into the key window (retention less margin) and
# must go to reconciliation rather than be sent once the provider may have forgotten the key.
PATIENT_ATTEMPTS: Final = 40
# The fakes delay a "slow" answer past the providers' timeout, so the call ends unknown.
PROVIDER_TIMEOUT: Final = 2.0
SLOW_ANSWER: Final = 3.0

# The dispatchers' settings (_config). Short everything: rows of a killed dispatcher come back
# within seconds, retries come due within a second, and the reconciler asks Stripe about saved
# 500s every RECONCILE_INTERVAL.
LEASE: Final = 2.0
POLL_INTERVAL: Final = 0.2
BATCH_SIZE: Final = 32
RECONCILE_INTERVAL: Final = 2.0
# The monkey's longest SIGSTOP (they last from half a second to this, often past the lease:
# another dispatcher rescues the rows while the frozen one sleeps), and how long PostgreSQL
# stays down after its crash.
LONGEST_STOP: Final = 4.0
PG_DOWN: Final = (1.0, 2.5)
# Crash recovery of the small cluster, until it accepts connections again: well under a second
# when measured (tests/support/cluster.py waits for it), counted at a second.
PG_RECOVERY: Final = 1.0
# CI runs the soak beside the rest of the suite (pytest -n auto): three dispatchers, PostgreSQL,
# the fakes and the producers share two cores with other tests' processes.
LOADED_MACHINE: Final = 3.0
# The longest a due operation may wait for its first attempt, in seconds from when it became due
# (its enqueue's commit, its available_at, or the settling of the operation before it under its
# ordering key). The waits one operation can meet, added up as if all struck it at once:
# - a poll interval for the stager to stage it once due, and another for a claim to find it
#   (NOTIFY is sooner, but a planted row, a staged one or a busy dispatcher wait for the poll);
# - ORDERING_REPAIR_INTERVAL: when a producer of its key was committing as the operation before
#   it settled, a dispatcher's repair, not the settler, promotes it;
# - LONGEST_STOP: a SIGSTOPped dispatcher keeps the row locks of a claim or a staging it had
#   open until it is resumed or killed (SKIP LOCKED makes the others pass the rows by);
# - the PostgreSQL crash: down for up to PG_DOWN[1], then PG_RECOVERY, then the claim loop's
#   retry, which doubles while claims fail, up to CLAIM_RETRY_MAX;
# - LOADED_MACHINE.
# Not the lease: an attempt is stamped (attempts.started_at) when its claim commits, and one
# rescued from a killed or frozen claimer keeps that stamp (statements.RESCUE): the lease delays
# the outcome of an attempt, never its start.
DUE_BOUND: Final = (
    2 * POLL_INTERVAL + ORDERING_REPAIR_INTERVAL + LONGEST_STOP + PG_DOWN[1] + PG_RECOVERY
    + CLAIM_RETRY_MAX + LOADED_MACHINE
)  # fmt: skip
# When "soon" operations are due after their enqueue (seconds), and "later" ones (hours). The
# drain leaves alone what is due more than half of LATER's least ahead: a run of up to an hour
# never sees a "later" operation come due.
SOON: Final = (1.0, 5.0)
LATER: Final = (2.0, 24.0)
# outbox.limits.max_payload_bytes in the run, lowered from 1 MiB (the least allowed is 4 KiB) so
# that a poison row stored past it and a refused payload past it cost 80 KB, not megabytes.
PAYLOAD_LIMIT: Final = 65536
# A reconciling operation the reconciler can settle does so at its first lookup, within one
# RECONCILE_INTERVAL, and lets the next of its ordering key go: the drain ends once nothing has
# changed for this long.
DRAIN_QUIET: Final = RECONCILE_INTERVAL + 1.0

_T = TypeVar("_T")


def _knob(default: _T, what: str) -> _T:
    """A Settings field and its help text, from which bench/chaos.py makes its options."""
    return field(default=default, metadata={"help": what})


@dataclass(frozen=True)
class Settings:
    """One soak's knobs. The defaults exercise the whole workload; :data:`NARROW` is the workload
    of before issue 17 (one kind of payload, no due times, no ordering keys, nothing hostile)."""

    duration: float = _knob(40.0, "seconds of chaos before the drain")
    dispatchers: int = _knob(3, "outbox run processes")
    producers: int = _knob(2, "producer threads")
    rate: float = _knob(40.0, "producer transactions a second, all producers together")
    fault_rate: float = _knob(0.12, "provider faults armed per operation committed")
    chaos_every: float = _knob(4.0, "mean seconds between two dispatcher kills or stops")
    pg_restarts: int = _knob(1, "PostgreSQL crashes (-m immediate), spread over the run")
    drain_timeout: float = _knob(60.0, "seconds the drain may take at most")
    seed: int = _knob(1, "the seed of every random choice of the run (the report prints it)")
    # How long the fakes remember an idempotency key, and what the providers are configured
    # with; retries stop `retention_margin` before. Short, so that the run reaches the point
    # where a blind resend would duplicate an effect, and outbox must reconcile instead. The
    # margin outlasts the longest SIGSTOP (4 s) plus a call's timeout (2 s) with room to spare:
    # a frozen process could otherwise send after its last check of the window.
    key_retention: float = _knob(30.0, "seconds the fakes remember an idempotency key (and "
                                       "the providers are configured with)")  # fmt: skip
    retention_margin: float = _knob(10.0, "seconds before that when retries stop")
    tenants: int = _knob(40, "tenants with due work")
    scheduled_tenants: int = _knob(
        80, "tenants with only operations due hours ahead, sorting before the others (more "
            f"than one claim visits: {2 * BATCH_SIZE} groups)"
    )  # fmt: skip
    soon_rate: float = _knob(0.1, "share of the operations due 1 to 5 s after their enqueue")
    later_rate: float = _knob(0.04, "share due 2 to 24 hours ahead (never attempted)")
    ordered_rate: float = _knob(0.25, "share under an ordering key")
    lines: int = _knob(4, "ordering keys a producer enqueues under at a time")
    exact_rate: float = _knob(0.2, "share of payloads with numbers a float cannot hold")
    hostile_rate: float = _knob(0.05, "share of transactions trying what the door must refuse")
    poison_rate: float = _knob(0.02, "share of transactions planting a poison row behind enqueue")
    due_bound: float = _knob(DUE_BOUND, "seconds within which a due operation must be first "
                                        "attempted (see DUE_BOUND)")  # fmt: skip

    def command(self) -> str:
        """The bench command that runs these settings again."""
        knobs = " ".join(f"--{f.name.replace('_', '-')} {getattr(self, f.name)}"
                         for f in fields(self))  # fmt: skip
        return f"python bench/chaos.py {knobs}"


NARROW: Final = Settings(
    tenants=1, scheduled_tenants=0, soon_rate=0.0, later_rate=0.0, ordered_rate=0.0,
    exact_rate=0.0, hostile_rate=0.0, poison_rate=0.0,
)  # fmt: skip


def _rng(seed: int, purpose: str) -> random.Random:
    """The random source of one part of the run, derived from the run's seed."""
    return random.Random(f"{seed}/{purpose}")


# --- the workload --------------------------------------------------------------------------

# Text as careless or hostile producers write it, for payloads, metadata and names.
ODD_TEXT: Final = (
    "plain", "ünïcødé", "テナント", "💳💸", 'quote"d', "back\\slash", "new\nline\ttab",
    "\u2028\u2029", "</script><script>alert(1)</script>", "'; DROP TABLE outbox.operations; --",
    "null", "${jndi:ldap://x/a}", "%s%n%x", "",
)  # fmt: skip
# Tenants of due work are "tenant-NNN" and a suffix; the scheduled-only ones are EARLY + NNN,
# which sort before them. The longest makes a 128-character id, the most enqueue takes.
EARLY: Final = "early-"
TENANT_SUFFIXES: Final = (
    "", "", "", " o'brien", '-"quoted"', "-ünïcødé-テナント", "-💳",
    "; DROP TABLE outbox.operations; --", "-back\\slash", "-" + "x" * 117,
)  # fmt: skip
# How many operations a producer enqueues under one ordering key before it moves on to a new
# one: a key held up for good behind a quarantined operation (mode block) stops growing, and
# the keys of a long run go on being tested.
LINE_LENGTH: Final = 20
# Webhook actions: mostly one, some of 80 generated ones (more than the 50 that keep their own
# metric label), some odd.
HOOK_ACTIONS: Final = ("invoice.päid", 'say "hi"', "a." + "b" * 126, "💳.charged")


@dataclass(frozen=True)
class Intent:
    """One operation's enqueue arguments, and when it is due: ``schedule`` is "now", "soon"
    (``available_at`` seconds ahead) or "later" (hours ahead)."""

    tenant: str
    key: str
    provider: str
    action: str
    payload: dict[str, Any]
    max_attempts: int | None
    schedule: str = "now"
    available_at: datetime | None = None
    ordering_key: str | None = None
    as_text: bool = False  # through the SQL function with the payload as text (exact numbers)

    @property
    def operation_type(self) -> str:
        return f"chaos.{self.provider}"

    def enqueue(self, conn: psycopg.Connection[Any],
                payload: dict[str, Any] | None = None) -> EnqueueResult:  # fmt: skip
        body = self.payload if payload is None else payload
        args: dict[str, Any] = {
            "tenant_id": self.tenant, "operation_type": self.operation_type,
            "operation_key": self.key, "provider": self.provider, "action": self.action,
            "max_attempts": self.max_attempts, "available_at": self.available_at,
            "ordering_key": self.ordering_key,
        }  # fmt: skip
        if self.as_text:
            return enqueue_text(conn, payload=payloads.encode(body), **args)
        return outbox.enqueue(conn, payload=body, **args)


def enqueue_text(conn: psycopg.Connection[Any], **args: Any) -> EnqueueResult:
    """``outbox.enqueue(...)`` in SQL with the payload as JSON text, as a producer in any other
    language calls it: the way to send what Python's json cannot write (a Decimal, 1e5000). Its
    errors are psycopg's, with the SQLSTATE (OB001, OB002)."""
    params = dict.fromkeys(("correlation_id", "idempotency_key", "available_at", "max_attempts",
                            "traceparent", "ordering_key")) | args  # fmt: skip
    row = conn.execute(statements.ENQUEUE, params).fetchone()
    assert row is not None
    return EnqueueResult(operation_id=row[0], outcome=EnqueueOutcome(row[1]))


@dataclass(frozen=True)
class Hostile:
    """An enqueue the door must refuse with OB002 naming ``column``, writing nothing.

    ``payload`` is JSON text; ``python``: through ``outbox.enqueue`` (which must raise
    InvalidOperation), else through the SQL function with the payload as text. ``available_at``
    is SQL text, or a time from now.
    """

    column: str
    payload: str = "{}"
    available_at: str | timedelta | None = None
    max_attempts: int | None = None
    python: bool = False

    def attempt(self, conn: psycopg.Connection[Any], tenant: str, key: str) -> str | None:
        """None if refused as it must be, else what happened instead; an outage propagates."""
        when: str | datetime | None
        if isinstance(self.available_at, timedelta):
            when = datetime.now(UTC) + self.available_at
        else:
            when = self.available_at
        args: dict[str, Any] = {
            "tenant_id": tenant, "operation_type": "chaos.hostile", "operation_key": key,
            "provider": HOOK, "action": "invoice.paid", "available_at": when,
            "max_attempts": self.max_attempts,
        }  # fmt: skip
        try:
            if self.python:
                outbox.enqueue(conn, payload=json.loads(self.payload), **args)
            else:
                enqueue_text(conn, payload=self.payload, **args)
        except outbox.InvalidOperation as exc:
            return None if self.python and exc.field == self.column else f"{exc.field}: {exc}"
        except (psycopg.OperationalError, psycopg.InterfaceError):
            raise
        except psycopg.Error as exc:
            column = exc.diag.column_name
            if (exc.sqlstate, column) == (SQLSTATE_INVALID_OPERATION, self.column):
                return None
            return f"{exc.sqlstate} ({column}): {exc.diag.message_primary}"
        return "accepted"


# What a hostile producer tries, and enqueue must refuse (issue 17; sql/0019, outbox.producer).
HOSTILE: Final = {
    "number 1e5000": Hostile("payload", '{"n": 1e5000}'),
    "number -1e100": Hostile("payload", '{"amount": -1e100}'),
    "integer of 101 digits": Hostile("payload", '{"n": [1, {"m": ' + "9" * 101 + "}]}"),
    "nested 65 levels": Hostile("payload", nested_payload(65), python=True),
    "nested 1000 levels": Hostile("payload", nested_payload(1000)),
    "an array": Hostile("payload", "[1, 2]"),
    "past the payload limit": Hostile("payload", '{"blob": "' + "x" * 70_000 + '"}', python=True),
    "a NUL character": Hostile("payload", '{"s": "a\\u0000b"}', python=True),
    "available_at infinity": Hostile("available_at", available_at="infinity"),
    "available_at -infinity": Hostile("available_at", available_at="-infinity"),
    "available_at 11 years ahead": Hostile(
        "available_at", available_at=timedelta(days=4018), python=True
    ),
    "max_attempts 1001": Hostile("max_attempts", max_attempts=1001, python=True),
    "max_attempts 2147483647": Hostile("max_attempts", max_attempts=2**31 - 1),
}


# The rows a poison row may be, by kind: the JSON text of what enqueue refuses now, written
# before it did (issue 17).
POISON: Final[dict[str, Callable[[random.Random], str]]] = {
    "number 1e5000": lambda _: '{"n": 1e5000}',
    "integer of 200 digits": lambda _: '{"n": ' + "7" * 200 + "}",
    "nested 1000 levels": lambda _: nested_payload(1000),
    "an array": lambda _: "[1, 2]",
    # Random hex does not compress: stored, it is past PAYLOAD_LIMIT.
    "stored past the limit": lambda rng: '{"blob": "' + rng.randbytes(40_000).hex() + '"}',
}


def plant_poison(conn: psycopg.Connection[Any], tenant: str, key: str, provider: str,
                 payload: str) -> int:  # fmt: skip
    """A poison row of ``provider`` (see tests.support.producers.plant); returns its id."""
    action = "payment_intents.create" if provider == STRIPE else "invoice.paid"
    return plant(conn, tenant=tenant, key=key, payload=payload, provider=provider,
                 action=action, operation_type="chaos.poison")  # fmt: skip


def tenant_names(settings: Settings) -> tuple[list[str], list[str]]:
    """The tenants with due work and the scheduled-only ones, which sort before them."""
    rng = _rng(settings.seed, "tenants")
    due = [f"tenant-{n:03d}{rng.choice(TENANT_SUFFIXES)}" for n in range(settings.tenants)]
    return due, [f"{EARLY}{n:03d}" for n in range(settings.scheduled_tenants)]


class Workload:
    """The random choices of one producer: what to enqueue, plant or try."""

    def __init__(self, index: int, settings: Settings, tenants: list[str],
                 rng: random.Random) -> None:  # fmt: skip
        self._settings, self._tenants, self._rng = settings, tenants, rng
        # The producer's ordering keys, each of one tenant: it enqueues in each line in order,
        # LINE_LENGTH operations, then goes on with a new key in its place.
        self._index = index
        self.lines = [(rng.choice(tenants), f"line-{index}-{n}") for n in range(settings.lines)]
        self._line_use = [0] * settings.lines
        # Hostile enqueues and poison rows of every kind in turn, in a random order: a short
        # run tries each.
        self._hostile = itertools.cycle(rng.sample(list(HOSTILE), len(HOSTILE)))
        self._poison = itertools.cycle(rng.sample(list(POISON), len(POISON)))

    def intent(self, key: str) -> Intent:
        rng, s = self._rng, self._settings
        patience = PATIENT_ATTEMPTS if rng.random() < 1 / 3 else None
        roll = rng.random()
        if roll < s.later_rate:
            schedule = "later"
        elif roll < s.later_rate + s.soon_rate:
            schedule = "soon"
        else:
            schedule = "now"
        tenant, line = rng.choice(self._tenants), None
        # Never hours ahead under a key: its line would wait for hours behind it.
        if schedule != "later" and self.lines and rng.random() < s.ordered_rate:
            tenant, line = self._line()
        exact = rng.random() < s.exact_rate
        if rng.random() < 0.5:
            provider, action, payload = STRIPE, "payment_intents.create", self._stripe(key, exact)
        else:
            provider, action, payload = HOOK, self._hook_action(), self._hook(key, exact)
        return Intent(tenant, key, provider, action, payload, patience, schedule,
                      self._due(schedule), line, exact)  # fmt: skip

    def _line(self) -> tuple[str, str]:
        """One of the producer's ordering keys (and its tenant), renewed once used up."""
        n = self._rng.randrange(len(self.lines))
        self._line_use[n] += 1
        line = self.lines[n]
        if self._line_use[n] % LINE_LENGTH == 0:
            turn = self._line_use[n] // LINE_LENGTH
            self.lines[n] = (self._rng.choice(self._tenants), f"line-{self._index}-{n}.{turn}")
        return line

    def far_ahead(self, tenant: str, provider: str) -> Intent:
        """A scheduled-only tenant's reminder: hours ahead, never attempted in the run."""
        key = f"{tenant}-{provider}"
        payload = self._stripe(key, exact=False) if provider == STRIPE else self._hook(key, False)
        action = "payment_intents.create" if provider == STRIPE else "reminder.due"
        return Intent(tenant, key, provider, action, payload, None, "later", self._due("later"))

    def hostile(self) -> tuple[str, Hostile, str]:
        kind = next(self._hostile)
        return kind, HOSTILE[kind], self._rng.choice(self._tenants)

    def poison(self) -> tuple[str, str, str, str]:
        """A poison row's kind, provider, tenant and payload."""
        kind = next(self._poison)
        provider = self._rng.choice((HOOK, STRIPE))
        return kind, provider, self._rng.choice(self._tenants), POISON[kind](self._rng)

    def _due(self, schedule: str) -> datetime | None:
        if schedule == "soon":
            return datetime.now(UTC) + timedelta(seconds=self._rng.uniform(*SOON))
        if schedule == "later":
            return datetime.now(UTC) + timedelta(hours=self._rng.uniform(*LATER))
        return None

    def _stripe(self, key: str, exact: bool) -> dict[str, Any]:
        rng = self._rng
        amount = rng.randint(100, 99_999)
        metadata: dict[str, Any] = {"chaos_key": key, "note": rng.choice(ODD_TEXT)}
        if exact:
            # An amount of up to 99 digits, and a decimal only its own text carries.
            amount = rng.choice((amount, 10 ** rng.randint(20, 98) + rng.randrange(10**15)))
            metadata["exact"] = self._exact_number()
        return {"amount": amount, "currency": "usd", "customer": "cus_chaos",
                "metadata": metadata}  # fmt: skip

    def _hook(self, key: str, exact: bool) -> dict[str, Any]:
        rng = self._rng
        payload: dict[str, Any] = {"invoice": key, "cents": rng.randint(1, 10_000),
                                   "shape": self._shape(0)}  # fmt: skip
        if exact:
            payload["exact"] = [self._exact_number() for _ in range(rng.randint(1, 4))]
        if rng.random() < 0.02:
            # The deepest payload enqueue takes: 64 levels, the payload object being the first.
            deepest: list[Any] = []
            for _ in range(62):
                deepest = [deepest]
            payload["deepest"] = deepest
        return payload

    def _hook_action(self) -> str:
        roll = self._rng.random()
        if roll < 0.7:
            return "invoice.paid"
        if roll < 0.9:
            return f"event.{self._rng.randrange(80)}"
        return self._rng.choice(HOOK_ACTIONS)

    def _exact_number(self) -> Decimal | int:
        """A number that a float would round: many digits, tiny, or near the limit of 1e100."""
        rng = self._rng
        match rng.randrange(5):
            case 0:
                return Decimal("19.999999999999999999")
            case 1:
                return Decimal(f"{rng.randrange(10 ** rng.randint(1, 40))}E-{rng.randint(1, 40)}")
            case 2:
                return Decimal(f"-{rng.randint(1, 9)}.{rng.randrange(10**30):030d}"
                               f"E+{rng.randint(20, 98)}")  # fmt: skip
            case 3:
                return int(10 ** rng.randint(17, 98)) + rng.randrange(10**17)
            case _:
                return Decimal("-9.99E+99")

    def _shape(self, depth: int) -> Any:
        """A random JSON value: text of every sort, numbers, containers a few levels deep."""
        rng = self._rng
        kind = rng.randrange(8 if depth < 4 else 5)
        if kind == 7:
            return [self._shape(depth + 1) for _ in range(rng.randint(0, 3))]
        if kind >= 5:
            return {rng.choice(ODD_TEXT): self._shape(depth + 1) for _ in range(rng.randint(0, 3))}
        scalars: tuple[Callable[[], Any], ...] = (
            lambda: rng.choice(ODD_TEXT) + str(rng.randrange(100)),
            lambda: rng.randint(-(10**12), 10**12),
            lambda: rng.choice((True, False, None)),
            lambda: round(rng.uniform(-1e6, 1e6), rng.randint(0, 6)),
            lambda: "x" * rng.choice((0, 1, 500, 3000)),
        )
        return scalars[kind]()


# --- what producers did --------------------------------------------------------------------


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

    def __init__(self, index: int, url: str, settings: Settings, tenants: list[str],
                 ledger: Ledger, faults: FaultInjector,
                 stop: threading.Event) -> None:  # fmt: skip
        super().__init__(name=f"chaos-producer-{index}", daemon=True)
        self._index, self._url, self._ledger = index, url, ledger
        self._faults, self._halt = faults, stop
        self._interval = settings.producers / settings.rate
        self._rng = _rng(settings.seed, f"producer {index}")
        self._work = Workload(index, settings, tenants, self._rng)
        spare = 1 - settings.hostile_rate - settings.poison_rate
        self._moves = {move: weight * spare for move, weight in PRODUCER_MOVES.items()}
        self._moves |= {"hostile": 100 * settings.hostile_rate,
                        "poison": 100 * settings.poison_rate}  # fmt: skip
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
        move = _pick(self._rng, self._moves)
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

    def _commit(self, conn: psycopg.Connection[Any], intents: list[Intent],
                ids: list[int]) -> None:  # fmt: skip
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

    def _roll_back(self, conn: psycopg.Connection[Any], intents: list[Intent], ids: list[int],
                   keys: list[str]) -> None:  # fmt: skip
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


def _schedule_far_ahead(url: str, settings: Settings, tenants: list[str], ledger: Ledger) -> None:
    """Before the run: each scheduled-only tenant's reminders, one per provider, hours ahead."""
    if not tenants:
        return
    work = Workload(-1, settings, tenants, _rng(settings.seed, "far ahead"))
    intents = [
        work.far_ahead(tenant, provider) for tenant in tenants for provider in (HOOK, STRIPE)
    ]
    with psycopg.connect(url) as conn:
        ids = [intent.enqueue(conn).operation_id for intent in intents]
    ledger.intents.update((i.key, i) for i in intents)
    ledger.committed.update((i.key, op_id) for i, op_id in zip(intents, ids, strict=True))


# --- provider faults -----------------------------------------------------------------------


def _hook_fault(name: str) -> HookFault:
    makers: dict[str, Callable[[], HookFault]] = {
        "503_retry_after": lambda: HookFault.status(503, retry_after=1),
        "429_retry_after": lambda: HookFault.status(429, retry_after=1),
        "409_in_progress": lambda: HookFault.status(409),
        "500_before": HookFault.error_500_before_apply,
        "reset_before": HookFault.reset_before_apply,
        "reset_after": HookFault.reset_after_apply,
        "slow_after": lambda: HookFault.delay_after_apply(SLOW_ANSWER),
        "500_after_saved": HookFault.error_500_after_apply,
        "422": lambda: HookFault.status(422),
    }
    return makers[name]()


def _stripe_fault(name: str) -> StripeFault:
    status = StripeFault.status
    makers: dict[str, Callable[[], StripeFault]] = {
        "429_rate_limit": lambda: status(429, error_type="invalid_request_error",
                                         code_str="rate_limit", retry_after=1),
        "503": lambda: status(503, error_type="api_error"),
        "409_key_in_use": lambda: status(409, error_type="invalid_request_error",
                                         code_str="idempotency_key_in_use"),
        "reset_before": StripeFault.reset_before_apply,
        "500_before_saved": StripeFault.error_500_before_apply,
        "500_after_saved": StripeFault.error_500_after_apply,
        "slow_after": lambda: StripeFault.delay_after_apply(SLOW_ANSWER),
        "reset_after": StripeFault.reset_after_apply,
        "402_card_declined": lambda: status(402, error_type="card_error",
                                            code_str="card_declined"),
    }  # fmt: skip
    return makers[name]()


class FaultInjector:
    """Arms faults on the fakes in step with the operations committed, so a database outage
    (no commits) does not pile faults up for the moment it ends."""

    def __init__(self, stripe: FakeStripe, hook: FakeWebhookReceiver, rate: float,
                 seed: int) -> None:  # fmt: skip
        self._stripe, self._hook, self._rate = stripe, hook, rate
        self._rng = _rng(seed, "faults")
        self._lock = threading.Lock()
        self.armed: Counter[str] = Counter()

    def arm_for(self, operations: int) -> None:
        with self._lock:
            for _ in range(operations):
                if self._rng.random() < self._rate:
                    self._arm_one()

    def _arm_one(self) -> None:
        if self._rng.random() < 0.5:
            name = _pick(self._rng, HOOK_FAULTS)
            self._hook.inject(_hook_fault(name))
            self.armed[f"hook {name}"] += 1
        else:
            name = _pick(self._rng, STRIPE_FAULTS)
            self._stripe.inject(_stripe_fault(name))
            self.armed[f"stripe {name}"] += 1


def _pick(rng: random.Random, weights: Mapping[str, float]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


# --- dispatchers and the chaos monkey ------------------------------------------------------


class Dispatchers:
    """``count`` `outbox run` processes; a killed one is replaced at once. One that exits by
    itself is a crash: :meth:`reap` notes it in ``crashes`` and replaces it."""

    def __init__(self, count: int, url: str, config: Path, log_dir: Path) -> None:
        self._url, self._config, self._log_dir = url, config, log_dir
        self._generation = Counter[int]()
        self.procs = [self._spawn(slot) for slot in range(count)]
        self.crashes: list[str] = []

    def _spawn(self, slot: int) -> OutboxProcess:
        self._generation[slot] += 1
        log = self._log_dir / f"dispatcher-{slot}-{self._generation[slot]}.log"
        return OutboxProcess(self._url, self._config, log, env={"STRIPE_API_KEY": STRIPE_KEY})

    def kill(self, slot: int) -> None:
        """SIGKILL (stopped or not), then a fresh process in its place."""
        self.procs[slot].signal(signal.SIGKILL)
        self.procs[slot].stop()
        self.procs[slot] = self._spawn(slot)

    def reap(self) -> None:
        """Note and replace every process that exited although nobody killed it."""
        for slot, proc in enumerate(self.procs):
            code = proc.proc.poll()
            if code is None:
                continue
            last = proc.log_text().strip().splitlines()[-3:]
            self.crashes.append(f"{proc.log_path.name} exited by itself with code {code}: "
                                + " | ".join(last))  # fmt: skip
            proc.stop()
            self.procs[slot] = self._spawn(slot)

    def revive_all(self) -> None:
        """Resume stopped processes and replace crashed ones (the drain needs every one)."""
        self.reap()
        for proc in self.procs:
            proc.signal(signal.SIGCONT)

    def wait_started(self, timeout: float = 30.0) -> None:
        for proc in self.procs:
            proc.wait_started(timeout)

    def terminate(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM every process and collect exit codes (None: had to be killed)."""
        codes: list[int | None] = []
        for proc in self.procs:
            # A process revived just before the drain ended may still be starting up.
            proc.wait_started(timeout)
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except TimeoutError:
                codes.append(None)
            proc.stop()
        return codes

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop()

    def logs(self) -> Iterator[Path]:
        return iter(sorted(self._log_dir.glob("dispatcher-*.log")))


def _watch(dispatchers: Dispatchers, seconds: float) -> None:
    """Sleep ``seconds``, looking for crashed dispatchers meanwhile."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.25))
        dispatchers.reap()


@dataclass
class Mayhem:
    """What the monkey did."""

    kills: int = 0
    stops_resumed: int = 0
    stops_killed: int = 0
    pg_restarts: int = 0


def monkey(dispatchers: Dispatchers, cluster: PrivateCluster, settings: Settings,
           deadline: float, progress: Callable[[str], None]) -> Mayhem:  # fmt: skip
    """Every ``chaos_every`` seconds (jittered), kill or freeze one dispatcher; crash PostgreSQL
    ``pg_restarts`` times, spread over the run."""
    rng = _rng(settings.seed, "monkey")
    mayhem = Mayhem()
    start = time.monotonic()
    span = deadline - start
    crash_at = [
        start + span * (i + 1) / (settings.pg_restarts + 1) for i in range(settings.pg_restarts)
    ]
    while True:
        pause = settings.chaos_every * rng.uniform(0.5, 1.5)
        if time.monotonic() + pause >= deadline:
            break
        _watch(dispatchers, pause)
        if crash_at and time.monotonic() >= crash_at[0]:
            crash_at.pop(0)
            cluster.restart(down_for=rng.uniform(*PG_DOWN))
            mayhem.pg_restarts += 1
            progress("PostgreSQL crashed (-m immediate) and restarted")
            continue
        _strike(dispatchers, rng, mayhem)
    _watch(dispatchers, max(0.0, deadline - time.monotonic()))
    return mayhem


def _strike(dispatchers: Dispatchers, rng: random.Random, mayhem: Mayhem) -> None:
    slot = rng.randrange(len(dispatchers.procs))
    proc = dispatchers.procs[slot]
    move = rng.choice(("kill", "stop_resume", "stop_kill"))
    if move == "kill":
        dispatchers.kill(slot)
        mayhem.kills += 1
        return
    proc.signal(signal.SIGSTOP)
    # Sometimes past the lease: another dispatcher rescues the rows while this one sleeps.
    _watch(dispatchers, rng.uniform(0.5, LONGEST_STOP))
    if move == "stop_resume":
        proc.signal(signal.SIGCONT)
        mayhem.stops_resumed += 1
    else:
        dispatchers.kill(slot)
        mayhem.stops_killed += 1


# --- the run -------------------------------------------------------------------------------


@dataclass
class Report:
    """The soak's figures and every invariant that failed (``violations``)."""

    settings: Settings
    operations: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)  # "status: reason" of set-aside ones
    effects_stripe: int = 0
    effects_hook: int = 0
    duplicates: int = 0
    lost: int = 0
    rolled_back: int = 0
    rolled_back_with_effect: int = 0
    orphan_effects: int = 0
    duplicate_enqueues: int = 0
    conflicts: int = 0
    uncertain_commits: int = 0
    attempts: int = 0
    succeeded_by_reconciler: int = 0
    faults_armed: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    mayhem: Mayhem = field(default_factory=Mayhem)
    crashes: int = 0
    # The adversarial workload: what it did, and what came of it.
    tenants: int = 0  # tenants with an operation in the table
    scheduled_tenants: int = 0  # of them, those with only operations hours ahead
    soon: int = 0  # operations due seconds after their enqueue
    scheduled_ahead: int = 0  # operations due hours ahead: pending, never attempted
    ordered: int = 0  # operations under an ordering key
    lines: int = 0  # ordering keys with at least two operations that reached a provider
    blocked: int = 0  # pending behind a set-aside operation of their ordering key
    refused: dict[str, int] = field(default_factory=dict)  # enqueues refused, by kind
    poison: dict[str, int] = field(default_factory=dict)  # rows planted, by kind
    poison_quarantined: int = 0  # quarantined invalid_payload, unsent
    payloads_checked: int = 0  # effects whose payload was compared with what was enqueued
    exact_payloads: int = 0  # of them, payloads with numbers a float cannot hold
    waits: list[float] = field(default_factory=list)  # due to first attempt, seconds
    stale: list[str] = field(default_factory=list)  # late requests of frozen dispatchers (lines)
    drain_seconds: float = 0.0
    wall_seconds: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        """The figures as a Markdown table."""
        m, knobs = self.mayhem, self.settings
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(self.by_status.items()))
        lines = [
            ("seed", f"{knobs.seed}"),
            ("operations committed", f"{self.operations}"),
            ("by final status", statuses or "none"),
            ("why set aside", ", ".join(f"{r} {n}" for r, n in sorted(self.by_reason.items()))),
            ("provider effects", f"{self.effects_stripe + self.effects_hook} "
                                 f"(Stripe {self.effects_stripe}, webhook {self.effects_hook})"),
            ("duplicates (must be 0)", f"{self.duplicates}"),
            ("lost (must be 0)", f"{self.lost}"),
            ("effects without an operation (must be 0)", f"{self.orphan_effects}"),
            ("rolled back / with an effect (must be 0)",
             f"{self.rolled_back} / {self.rolled_back_with_effect}"),
            ("duplicate enqueues / conflicts refused",
             f"{self.duplicate_enqueues} / {self.conflicts}"),
            ("commits cut by the crash (resolved from the table)", f"{self.uncertain_commits}"),
            ("attempts", f"{self.attempts}"),
            ("succeeded by the reconciler's lookup", f"{self.succeeded_by_reconciler}"),
            ("tenants (of them with only operations hours ahead)",
             f"{self.tenants} ({self.scheduled_tenants})"),
            ("operations due seconds / hours ahead (never attempted)",
             f"{self.soon} / {self.scheduled_ahead}"),
            ("ordered operations / keys with 2+ sent / waiting behind a set-aside one",
             f"{self.ordered} / {self.lines} / {self.blocked}"),
            ("first attempt after due: median / 99th pct / max (bound)", self._waits()),
            ("requests late from a frozen dispatcher (the NOTE lines)", f"{len(self.stale)}"),
            ("enqueues the door must refuse (none may leave a row)", _counts(self.refused)),
            ("poison rows planted / quarantined unsent", f"{sum(self.poison.values())} / "
                                                         f"{self.poison_quarantined}"),
            ("payloads checked at the provider / with exact numbers",
             f"{self.payloads_checked} / {self.exact_payloads}"),
            ("provider faults armed", f"{self.faults_armed}"),
            ("dispatchers SIGKILLed / SIGSTOPped+resumed / SIGSTOPped+killed",
             f"{m.kills} / {m.stops_resumed} / {m.stops_killed}"),
            ("dispatchers that exited by themselves (must be 0)", f"{self.crashes}"),
            ("PostgreSQL crashes (-m immediate) and restarts", f"{m.pg_restarts}"),
            ("chaos / drain / wall time",
             f"{knobs.duration:.0f} s / {self.drain_seconds:.1f} s / {self.wall_seconds:.0f} s"),
            ("invariants", "all hold" if self.ok else f"{len(self.violations)} FAILED"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in lines)
        out = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        out += [f"| {k:<{width}} | {v} |" for k, v in lines]
        return "\n".join(out)

    def _waits(self) -> str:
        bound = f"({self.settings.due_bound:.1f} s)"
        if not self.waits:
            return f"none {bound}"
        ordered = sorted(self.waits)
        n = len(ordered)
        picked = (ordered[n // 2], ordered[min(n - 1, n * 99 // 100)], ordered[-1])
        return " / ".join(f"{w:.2f}" for w in picked) + f" s {bound}"


def _counts(counts: Mapping[str, int]) -> str:
    listed = ", ".join(f"{kind} {n}" for kind, n in sorted(counts.items()))
    return f"{sum(counts.values())}" + (f" ({listed})" if listed else "")


def run_chaos(settings: Settings, workdir: Path,
              progress: Callable[[str], None] = lambda _: None) -> Report:  # fmt: skip
    """Run the soak in ``workdir`` (dispatcher logs go there) and return its report."""
    wall = time.monotonic()
    ledger = Ledger()
    tenants, early = tenant_names(settings)
    with ExitStack() as stack:
        cluster = stack.enter_context(private_cluster())
        with psycopg.connect(cluster.url) as owner:
            owner.execute("UPDATE outbox.limits SET max_payload_bytes = %s", (PAYLOAD_LIMIT,))
        _schedule_far_ahead(cluster.url, settings, early, ledger)
        retention = settings.key_retention
        stripe = stack.enter_context(FakeStripe(api_key=STRIPE_KEY, key_retention=retention))
        hook = stack.enter_context(FakeWebhookReceiver(key_retention=retention))
        faults = FaultInjector(stripe, hook, settings.fault_rate, settings.seed)
        config = _config(workdir / "outbox.toml", stripe, hook, settings)
        dispatchers = Dispatchers(settings.dispatchers, cluster.url, config, workdir)
        stack.callback(dispatchers.stop_all)
        # Operations wait for no dispatcher's start: the bound on their first attempt holds from
        # the first enqueue.
        dispatchers.wait_started()
        mayhem, drain, codes = _storm(settings, cluster, dispatchers, tenants, ledger, faults,
                                      progress)  # fmt: skip
        report = verify(cluster.url, ledger, stripe, hook, settings)
    report.mayhem, report.exit_codes = mayhem, codes
    report.drain_seconds, report.faults_armed = drain, sum(faults.armed.values())
    report.faults_by_kind = dict(sorted(faults.armed.items()))
    report.wall_seconds = time.monotonic() - wall
    report.crashes = len(dispatchers.crashes)
    report.violations += [f"dispatcher {crash}" for crash in dispatchers.crashes]
    if any(code != 0 for code in codes):
        report.violations.append(f"dispatchers exited with {codes} after SIGTERM, not all 0")
    return report


def _config(path: Path, stripe: FakeStripe, hook: FakeWebhookReceiver,
            settings: Settings) -> Path:  # fmt: skip
    common = {"timeout": f"{PROVIDER_TIMEOUT:g}s", "key_retention": f"{settings.key_retention:g}s"}
    return write_config(
        path,
        providers={
            STRIPE: {"type": "stripe", "api_key_env": "STRIPE_API_KEY", "api_base": stripe.url,
                     **common},
            HOOK: {"type": "webhook", "url": hook.url, **common},
        },
        lease=f"{LEASE:g}s", poll_interval=f"{POLL_INTERVAL * 1000:g}ms", backoff_base="100ms",
        backoff_max="1s", shutdown_grace="5s", max_attempts=8, concurrency=32,
        batch_size=BATCH_SIZE, reconcile_interval=f"{RECONCILE_INTERVAL:g}s",
        retention_margin=f"{settings.retention_margin:g}s",
    )  # fmt: skip


def _storm(settings: Settings, cluster: PrivateCluster, dispatchers: Dispatchers,
           tenants: list[str], ledger: Ledger, faults: FaultInjector,
           progress: Callable[[str], None]) -> tuple[Mayhem, float, list[int | None]]:  # fmt: skip
    """Producers and the monkey for ``duration``, then the drain; returns what the monkey did,
    the drain's length and the dispatchers' exit codes."""
    stop = threading.Event()
    producers = [Producer(i, cluster.url, settings, tenants, ledger, faults, stop)
                 for i in range(settings.producers)]  # fmt: skip
    for p in producers:
        p.start()
    with _reporting(cluster.url, ledger, progress):
        mayhem = monkey(dispatchers, cluster, settings, time.monotonic() + settings.duration,
                        progress)  # fmt: skip
        stop.set()
        for p in producers:
            p.join(30)
        dispatchers.revive_all()
        progress("producers stopped; draining")
        started = time.monotonic()
        _wait_settled(cluster.url, settings.drain_timeout, dispatchers.reap)
        drain = time.monotonic() - started
        dispatchers.reap()
    return mayhem, drain, dispatchers.terminate()


@contextmanager
def _reporting(url: str, ledger: Ledger, progress: Callable[[str], None],
               every: float = 30.0) -> Iterator[None]:  # fmt: skip
    """A progress line every ``every`` seconds while the block runs."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(every):
            with ledger.lock:
                committed = len(ledger.committed)
            progress(f"committed {committed}; by status {_statuses(url)}")

    thread = threading.Thread(target=report, name="chaos-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _statuses(url: str) -> dict[str, int] | None:
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            found = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1")
            return dict(found.fetchall())
    except psycopg.OperationalError:
        return None


# Operations the drain waits for: in flight, or pending and free to go. Those due hours ahead and
# those behind a set-aside operation of their ordering key (mode block) wait for longer than
# any drain; verify() checks them.
_UNSETTLED: Final = """
SELECT count(*) FROM outbox.operations o
WHERE o.status = 'in_flight'
   OR (o.status = 'pending' AND o.available_at < now() + %(later)s::interval
       AND NOT EXISTS (SELECT 1 FROM outbox.operations h
                       WHERE h.tenant_id = o.tenant_id AND h.ordering_key = o.ordering_key
                         AND h.id < o.id AND h.status IN ('quarantined', 'reconciling')))
"""


def _settlement(url: str) -> tuple[int, dict[str, int]] | None:
    """How many operations may still move, and the count by status; None while down."""
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            row = conn.execute(_UNSETTLED, {"later": timedelta(hours=LATER[0] / 2)}).fetchone()
            found = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1")
            return (0 if row is None else int(row[0])), dict(found.fetchall())
    except psycopg.OperationalError:
        return None


def _wait_settled(url: str, timeout: float, watch: Callable[[], None]) -> None:
    """Until nothing may move and nothing has for DRAIN_QUIET, or ``timeout``: verify() names
    the rest. ``watch`` runs between looks."""
    deadline = time.monotonic() + timeout
    calm: tuple[float, dict[str, int]] | None = None
    while time.monotonic() < deadline:
        watch()
        state = _settlement(url)
        if state is None or state[0]:
            calm = None
        elif calm is None or calm[1] != state[1]:
            calm = (time.monotonic(), state[1])
        elif time.monotonic() - calm[0] >= DRAIN_QUIET:
            return
        time.sleep(0.5)


# --- the count -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: int
    tenant: str
    key: str
    idempotency_key: str
    status: str
    reason: str | None
    provider: str
    provider_ref: str | None
    attempts: int
    ordering_key: str | None
    ordering_blocked: bool
    scheduled: bool
    created_at: datetime
    settled_at: datetime  # when its status last changed: for a succeeded one, when it succeeded
    first_sent_at: datetime | None
    payload: str  # PostgreSQL's JSON text of it
    attempt_rows: int
    succeeded_attempts: int
    first_attempt_at: datetime | None
    history: list[str]  # "outcome sent" or "outcome unsent", one per attempt in order
    rescued: int  # attempts whose lease expired (a killed or frozen dispatcher's)


def _rows(url: str) -> list[Row]:
    with psycopg.connect(url) as conn:
        found = conn.execute("""
            SELECT o.id, o.tenant_id, o.operation_key, o.idempotency_key, o.status,
                   o.status_reason, o.provider, o.provider_ref, o.attempts, o.ordering_key,
                   o.ordering_blocked, o.scheduled, o.created_at,
                   coalesce(o.finished_at, o.status_changed_at), o.first_sent_at, o.payload::text,
                   count(a.attempt), count(a.attempt) FILTER (WHERE a.outcome = 'succeeded'),
                   min(a.started_at),
                   coalesce(array_agg(a.outcome || CASE WHEN a.sent THEN ' sent' ELSE ' unsent' END
                                      ORDER BY a.attempt) FILTER (WHERE a.attempt IS NOT NULL),
                            '{}'),
                   count(a.attempt) FILTER (WHERE a.error_class = 'lease_expired')
            FROM outbox.operations o LEFT JOIN outbox.attempts a ON a.operation_id = o.id
            GROUP BY o.id ORDER BY o.id
        """).fetchall()  # fmt: skip
    return [Row(*r) for r in found]


@dataclass(frozen=True)
class Carried:
    """What an effect carried: the idempotency key, the operation id, and its reference."""

    key: str
    operation_id: str
    ref: str


Matched = tuple[dict[int, list[str]], list[Carried], int, int]


def _effects(stripe: FakeStripe, hook: FakeWebhookReceiver, ops: dict[str, Row]) -> Matched:
    """Effects by operation id (their references), effects matching no operation, and the
    Stripe and webhook totals. An effect is matched by the idempotency key it carried, and must
    carry its operation's id too."""
    by_op: dict[int, list[str]] = {}
    orphans: list[Carried] = []
    objects = stripe.objects()
    effects = hook.effects
    carried = [Carried(str(o["metadata"].get("outbox_idempotency_key")),
                       str(o["metadata"].get("outbox_operation_id")), str(o["id"]))
               for o in objects]  # fmt: skip
    carried += [Carried(e.key, e.headers.get("outbox-operation-id", ""), e.effect_id)
                for e in effects]  # fmt: skip
    for effect in carried:
        row = ops.get(effect.key)
        if row is None or str(row.id) != effect.operation_id:
            orphans.append(effect)
            continue
        by_op.setdefault(row.id, []).append(effect.ref)
    return by_op, orphans, len(objects), len(effects)


@dataclass(frozen=True)
class Request:
    """One request a fake received with an operation's idempotency key: when it arrived, and
    the earliest moment the dispatcher may have stopped waiting for it (its answer, or, for an
    answer slower than the providers' timeout, the timeout); ``raw``: a webhook's body."""

    at: float
    end: float
    raw: bytes | None = None


def _requests(stripe: FakeStripe, hook: FakeWebhookReceiver) -> dict[str, list[Request]]:
    """Every request that carried an idempotency key (the reconciler's lists carry none)."""

    def end(at: float, answered_at: float | None) -> float:
        timeout = at + PROVIDER_TIMEOUT
        return timeout if answered_at is None else min(answered_at, timeout)

    found: dict[str, list[Request]] = defaultdict(list)
    for h in hook.received:
        if h.key is not None:
            found[h.key].append(Request(h.at, end(h.at, h.answered_at), h.raw))
    for s in stripe.received:
        if s.method == "POST" and s.idempotency_key is not None:
            found[s.idempotency_key].append(Request(s.at, end(s.at, s.answered_at)))
    return found


def verify(url: str, ledger: Ledger, stripe: FakeStripe, hook: FakeWebhookReceiver,
           settings: Settings) -> Report:  # fmt: skip
    """Count every operation against every effect and check every invariant; see the module's
    docstring."""
    report = Report(settings)
    rows = _rows(url)
    with ledger.lock:
        audit = _Audit(report, rows, ledger, _requests(stripe, hook))
        matched = _effects(stripe, hook, audit.ops)
        by_op, orphans, report.effects_stripe, report.effects_hook = matched
        report.violations += ledger.violations
        report.duplicate_enqueues, report.conflicts = ledger.duplicates, ledger.conflicts
        report.operations, report.attempts = len(rows), sum(r.attempts for r in rows)
        report.by_status = dict(Counter(r.status for r in rows))
        report.by_reason = dict(Counter(f"{r.status} {r.reason}" for r in rows
                                        if r.status in SET_ASIDE))  # fmt: skip
        report.uncertain_commits = len(ledger.uncertain)
        audit.producers(orphans)
        for row in rows:
            audit.row(row, by_op.get(row.id, []))
        audit.door()
        audit.poison()
        audit.waiting()
        audit.lines()
        audit.first_attempts(settings.due_bound, datetime.now(UTC))
        audit.payloads(stripe.objects(), hook.effects)
    return report


class _Audit:
    """One verification: the table, the fakes' requests and the ledger, each read once, and a
    method per invariant, each adding to the report what it counted and what failed."""

    def __init__(self, report: Report, rows: list[Row], ledger: Ledger,
                 requests: dict[str, list[Request]]) -> None:  # fmt: skip
        self.report, self.rows, self.ledger, self.requests = report, rows, ledger, requests
        self.ops = {r.idempotency_key: r for r in rows}
        self.by_key = {r.key: r for r in rows}
        self.by_line: dict[tuple[str, str], list[Row]] = defaultdict(list)
        for row in rows:  # in id order: the order of a line
            if row.ordering_key is not None:
                self.by_line[row.tenant, row.ordering_key].append(row)
        intents = ledger.intents
        # Operations that may stay pending, and why.
        self.waits_for: dict[int, str] = {
            r.id: "due hours ahead" for r in rows
            if r.key in intents and intents[r.key].schedule == "later"
        }  # fmt: skip
        for line in self.by_line.values():
            aside = False
            for row in line:
                if aside:
                    self.waits_for.setdefault(row.id, "behind a set-aside operation of its key")
                aside = aside or row.status in SET_ASIDE

    def violation(self, text: str) -> None:
        self.report.violations.append(text)

    def producers(self, orphans: list[Carried]) -> None:
        """The table against what producers saw: commits kept, rollbacks gone without effect."""
        report, ledger = self.report, self.ledger
        for key, op_id in ledger.committed.items():
            row = self.by_key.get(key)
            if row is None or row.id != op_id:
                report.lost += 1
                self.violation(f"committed {key} (id {op_id}) is not in the table")
        known = set(ledger.committed) | ledger.uncertain | set(ledger.refused)
        for key in set(self.by_key) - known:
            self.violation(f"{key} is in the table but no producer committed it")
        report.rolled_back = len(ledger.rolled_back)
        rolled_keys = {key for _, key in ledger.rolled_back.values()}
        rolled_ids = {str(op_id) for op_id, _ in ledger.rolled_back.values()}
        for key in ledger.rolled_back:
            if key in self.by_key:
                self.violation(f"rolled-back {key} is in the table")
        report.orphan_effects = len(orphans)
        for o in orphans:
            if o.key in rolled_keys or o.operation_id in rolled_ids:
                report.rolled_back_with_effect += 1
            self.violation(
                f"effect {o.ref} (key {o.key}, operation {o.operation_id}) belongs to no operation"
            )

    def row(self, row: Row, refs: list[str]) -> None:
        """One operation's invariants."""
        report = self.report
        name = _name(row)
        report.duplicates += max(0, len(refs) - 1)
        if len(refs) > 1:
            self.violation(f"{name} has {len(refs)} effects: {refs}")
        if row.status not in FINAL:
            if row.id not in self.waits_for:
                report.lost += 1
                self.violation(f"{name} is not final after the drain")
            return
        if row.attempts != row.attempt_rows:
            self.violation(f"{name}: attempts {row.attempts} but {row.attempt_rows} rows")
        if row.status == "succeeded":
            if refs != [row.provider_ref]:
                self.violation(f"{name}: provider_ref {row.provider_ref}, effects {refs}")
            if row.succeeded_attempts == 0:
                report.succeeded_by_reconciler += 1
            elif row.succeeded_attempts > 1:
                self.violation(f"{name} succeeded {row.succeeded_attempts} times")
        elif row.attempt_rows == 0:
            self.violation(f"{name} has no attempt history")

    def door(self) -> None:
        """No enqueue the door had to refuse left a row."""
        self.report.refused = dict(Counter(self.ledger.refused.values()))
        for key, kind in self.ledger.refused.items():
            if key in self.by_key:
                self.violation(f"{_name(self.by_key[key])}: enqueue must have refused it ({kind})")

    def poison(self) -> None:
        """Every poison row quarantined invalid_payload, one attempt marked unsent, unseen."""
        report = self.report
        report.poison = dict(Counter(self.ledger.poison.values()))
        for key, kind in self.ledger.poison.items():
            row = self.by_key.get(key)
            if row is None:
                continue  # an uncertain commit that did not happen (a lost one is counted)
            sent = "never sent" if row.first_sent_at is None else "sent"
            got = (row.status, row.reason, row.history, sent)
            if got != ("quarantined", "invalid_payload", ["permanent unsent"], "never sent"):
                self.violation(f"{_name(row)}, poison ({kind}): status, reason, attempts and "
                               f"whether sent are {got}")  # fmt: skip
            elif not self.requests.get(row.idempotency_key):
                report.poison_quarantined += 1
            if self.requests.get(row.idempotency_key):
                self.violation(f"{_name(row)}, poison ({kind}), reached a provider")

    def waiting(self) -> None:
        """Those that may wait never left: pending (out of the claim index: scheduled, or
        blocked by their key), never attempted, never seen by a provider."""
        report = self.report
        tenants = {r.tenant for r in self.rows}
        report.tenants = len(tenants)
        report.scheduled_tenants = sum(t.startswith(EARLY) for t in tenants)
        for row in self.rows:
            why = self.waits_for.get(row.id)
            if why is None:
                continue
            if why == "due hours ahead":
                report.scheduled_ahead += 1
                got = (row.status, "scheduled" if row.scheduled else "in the claim index")
            else:
                report.blocked += 1
                got = (row.status, "blocked" if row.ordering_blocked else "its key's head")
            if got != ("pending", "scheduled" if why == "due hours ahead" else "blocked"):
                self.violation(f"{_name(row)}, {why}, is {', '.join(got)}")
            if row.attempt_rows or self.requests.get(row.idempotency_key):
                self.violation(f"{_name(row)}, {why}, was attempted or reached a provider")

    def lines(self) -> None:
        """The operations of one ordering key reached the providers one at a time, in order:
        each one's first request after the one before it had been sent and every request of it
        sent until then had ended.

        A request of the one before that arrives later still is allowed only as a frozen
        dispatcher's: one of that operation's attempts lost its lease (rescued as
        lease_expired). A dispatcher SIGSTOPped between its claim and its send starts the call
        when it resumes, its lease long gone, while another settled the operation meanwhile and
        the next of its key went on: the provider replays the key, so the effect stays single
        and in order, but the request is late. Counted in ``report.stale`` and printed, not a
        violation: outbox does not look at its lease before it starts a call."""
        report = self.report
        for (tenant, key), line in self.by_line.items():
            report.ordered += len(line)
            sent = [(row, self.requests.get(row.idempotency_key, [])) for row in line]
            report.lines += sum(1 for _, requests in sent if requests) >= 2
            for (before, earlier), (after, later) in itertools.pairwise(sent):
                if not later:
                    continue
                where = f"key {key!r} of {tenant!r}: {_name(after)} reached a provider"
                first = min(r.at for r in later)
                until = [r for r in earlier if r.at <= first]
                if not until:
                    self.violation(f"{where} before {_name(before)} did")
                elif max(r.end for r in until) > first:
                    self.violation(f"{where} before {_name(before)} was done")
                late = len(earlier) - len(until)
                if not late:
                    continue
                what = f"{where}; {late} request(s) of {_name(before)} came after it"
                if before.rescued:
                    report.stale.append(f"{what} (a frozen dispatcher's, its lease lost)")
                else:
                    self.violation(what)

    def first_attempts(self, bound: float, now: datetime) -> None:
        """Every due operation its line let go was first attempted within ``bound`` seconds of
        becoming due: its commit, its available_at, or its line's previous one succeeding. One
        never attempted has waited until ``now``."""
        previous = {after.id: before for line in self.by_line.values()
                    for before, after in itertools.pairwise(line)}  # fmt: skip
        for row in self.rows:
            intent = self.ledger.intents.get(row.key)
            if row.id in self.waits_for or (intent is None and row.key not in self.ledger.poison):
                continue  # free to wait, or none of ours (checked by producers())
            due = row.created_at
            if intent is not None and intent.available_at is not None:
                due = max(due, intent.available_at)
                self.report.soon += intent.schedule == "soon"
            before = previous.get(row.id)
            if before is not None:
                if before.status != "succeeded":
                    continue  # it waits behind it (checked by waiting())
                due = max(due, before.settled_at)
            if row.first_attempt_at is None:
                waited = (now - due).total_seconds()
                if waited > bound:
                    self.violation(f"{_name(row)} was never attempted, due for {waited:.1f} s; "
                                   f"the bound is {bound:.1f} s")  # fmt: skip
                continue
            waited = (row.first_attempt_at - due).total_seconds()
            self.report.waits.append(waited)
            if waited > bound:
                self.violation(f"{_name(row)} was first attempted {waited:.1f} s after it became "
                               f"due; the bound is {bound:.1f} s")  # fmt: skip

    def payloads(self, objects: list[dict[str, Any]], effects: list[Effect]) -> None:
        """Every effect carries its payload exactly; the webhook's body is the stored text."""
        report = self.report
        for obj in objects:
            row = self.ops.get(str(obj["metadata"].get("outbox_idempotency_key")))
            intent = self.ledger.intents.get(row.key) if row else None
            if row is None or intent is None:
                continue
            report.payloads_checked += 1
            report.exact_payloads += intent.as_text
            if not _carried(intent.payload, obj):
                self.violation(f"{_name(row)}: the Stripe object does not carry its payload "
                               f"exactly ({_differences(intent.payload, obj)})")  # fmt: skip
        for effect in effects:
            row = self.ops.get(effect.key)
            intent = self.ledger.intents.get(row.key) if row else None
            if row is None or intent is None:
                continue
            report.payloads_checked += 1
            report.exact_payloads += intent.as_text
            if effect.body != _as_received(intent.payload):
                self.violation(f"{_name(row)}: the webhook body is not its payload")
        for row in self.rows:
            raws = {r.raw for r in self.requests.get(row.idempotency_key, []) if r.raw is not None}
            if raws - {row.payload.encode()}:
                self.violation(f"{_name(row)}: a webhook body differs from the stored JSON text")


def _name(row: Row) -> str:
    return f"operation {row.id} ({row.key}, {row.status})"


def _as_received(payload: Any) -> Any:
    """``payload`` as a careful receiver parses its JSON: decimals as Decimal."""
    return json.loads(payloads.encode(payload), parse_float=Decimal)


def _carried(expected: Any, got: Any) -> bool:
    """Whether ``got`` (a Stripe object, its fields echoing the form's strings) holds every
    field of ``expected``, each number at its exact value."""
    if isinstance(expected, Mapping):
        return isinstance(got, Mapping) and all(
            k in got and _carried(v, got[k]) for k, v in expected.items()
        )
    if isinstance(expected, list):
        return (isinstance(got, list) and len(got) == len(expected)
                and all(map(_carried, expected, got)))  # fmt: skip
    if isinstance(expected, int | float | Decimal) and not isinstance(expected, bool):
        try:
            return Decimal(str(got)) == Decimal(str(expected))
        except NotANumber:
            return False
    return bool(got == expected)


def _differences(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """The fields that differ, by name only: payloads are never printed."""
    return ", ".join(k for k, v in expected.items() if not _carried(v, got.get(k))) or "?"


def print_report(report: Report, out: Any = sys.stdout, limit: int = 50) -> None:
    print(report.table(), file=out)
    kinds = ", ".join(f"{kind} {n}" for kind, n in report.faults_by_kind.items())
    print(f"\nfaults armed: {kinds}", file=out)
    print(f"poison rows by kind: {_counts(report.poison)}", file=out)
    print(f"replay this run's choices: {report.settings.command()}", file=out)
    for note in report.stale[:limit]:
        print(f"NOTE: {note}", file=out)
    for violation in report.violations[:limit]:
        print(f"VIOLATION: {violation}", file=out)
    if len(report.violations) > limit:
        print(f"... and {len(report.violations) - limit} more", file=out)

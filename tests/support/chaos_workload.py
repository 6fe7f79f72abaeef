"""The chaos soak's workload: what a producer enqueues, tries or plants (:class:`Workload`), the
enqueues the door must refuse (:data:`HOSTILE`) and the poison rows (:data:`POISON`). The
producer threads that carry it out are in tests/support/chaos_producers.py.

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
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

import psycopg

import outbox
from outbox.core import payloads
from outbox.core.model import EnqueueOutcome, EnqueueResult
from outbox.db import statements
from outbox.errors import SQLSTATE_INVALID_OPERATION
from tests.support.chaos_settings import HOOK, LATER, SOON, STRIPE, Settings, random_source
from tests.support.producers import nested_payload, plant

# Text as careless or hostile producers write it, for payloads, metadata and names.
ODD_TEXT: Final = (
    "plain",
    "ünïcødé",
    "テナント",
    "💳💸",
    'quote"d',
    "back\\slash",
    "new\nline\ttab",
    "\u2028\u2029",
    "</script><script>alert(1)</script>",
    "'; DROP TABLE outbox.operations; --",
    "null",
    "${jndi:ldap://x/a}",
    "%s%n%x",
    "",
)
# Tenants of due work are "tenant-NNN" and a suffix; the scheduled-only ones are EARLY + NNN,
# which sort before them. The longest makes a 128-character id, the most enqueue takes.
EARLY: Final = "early-"
TENANT_SUFFIXES: Final = (
    "",
    "",
    "",
    " o'brien",
    '-"quoted"',
    "-ünïcødé-テナント",
    "-💳",
    "; DROP TABLE outbox.operations; --",
    "-back\\slash",
    "-" + "x" * 117,
)
# How many operations a producer enqueues under one ordering key before it moves on to a new
# one: a key held up for good behind a quarantined operation (mode block) stops growing, and
# the keys of a long run go on being tested.
LINE_LENGTH: Final = 20
# Webhook actions: mostly one, some of 80 generated ones (more than the 50 that keep their own
# metric label), some odd.
HOOK_ACTIONS: Final = ("invoice.päid", 'say "hi"', "a." + "b" * 126, "💳.charged")
# A third of the operations may be tried this often instead of the dispatchers' 8 times: those
# that keep failing after their first send run into the key window (retention less margin) and
# must go to reconciliation rather than be sent once the provider may have forgotten the key.
PATIENT_ATTEMPTS: Final = 40


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

    def enqueue(
        self, conn: psycopg.Connection[Any], payload: dict[str, Any] | None = None
    ) -> EnqueueResult:
        body = self.payload if payload is None else payload
        args: dict[str, Any] = {
            "tenant_id": self.tenant,
            "operation_type": self.operation_type,
            "operation_key": self.key,
            "provider": self.provider,
            "action": self.action,
            "max_attempts": self.max_attempts,
            "available_at": self.available_at,
            "ordering_key": self.ordering_key,
        }
        if self.as_text:
            return enqueue_text(conn, payload=payloads.encode(body), **args)
        return outbox.enqueue(conn, payload=body, **args)


def enqueue_text(conn: psycopg.Connection[Any], **args: Any) -> EnqueueResult:
    """``outbox.enqueue(...)`` in SQL with the payload as JSON text, as a producer in any other
    language calls it: the way to send what Python's json cannot write (a Decimal, 1e5000). Its
    errors are psycopg's, with the SQLSTATE (OB001, OB002)."""
    params = (
        dict.fromkeys(
            (
                "correlation_id",
                "idempotency_key",
                "available_at",
                "max_attempts",
                "traceparent",
                "ordering_key",
            )
        )
        | args
    )
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
            "tenant_id": tenant,
            "operation_type": "chaos.hostile",
            "operation_key": key,
            "provider": HOOK,
            "action": "invoice.paid",
            "available_at": when,
            "max_attempts": self.max_attempts,
        }
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


def plant_poison(
    conn: psycopg.Connection[Any], tenant: str, key: str, provider: str, payload: str
) -> int:
    """A poison row of ``provider`` (see tests.support.producers.plant); returns its id."""
    action = "payment_intents.create" if provider == STRIPE else "invoice.paid"
    return plant(
        conn,
        tenant=tenant,
        key=key,
        payload=payload,
        provider=provider,
        action=action,
        operation_type="chaos.poison",
    )


def tenant_names(settings: Settings) -> tuple[list[str], list[str]]:
    """The tenants with due work and the scheduled-only ones, which sort before them."""
    rng = random_source(settings.seed, "tenants")
    due = [f"tenant-{n:03d}{rng.choice(TENANT_SUFFIXES)}" for n in range(settings.tenants)]
    return due, [f"{EARLY}{n:03d}" for n in range(settings.scheduled_tenants)]


class Workload:
    """The random choices of one producer: what to enqueue, plant or try."""

    def __init__(
        self, index: int, settings: Settings, tenants: list[str], rng: random.Random
    ) -> None:
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
        return Intent(
            tenant,
            key,
            provider,
            action,
            payload,
            patience,
            schedule,
            self._due(schedule),
            line,
            exact,
        )

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
        return {"amount": amount, "currency": "usd", "customer": "cus_chaos", "metadata": metadata}

    def _hook(self, key: str, exact: bool) -> dict[str, Any]:
        rng = self._rng
        payload: dict[str, Any] = {
            "invoice": key,
            "cents": rng.randint(1, 10_000),
            "shape": self._shape(0),
        }
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
                return Decimal(
                    f"-{rng.randint(1, 9)}.{rng.randrange(10**30):030d}E+{rng.randint(20, 98)}"
                )
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

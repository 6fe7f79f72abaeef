"""The count: the chaos soak's table, the fakes' effects and requests read back, and every
invariant checked against them and the producers' ledger.

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
from collections import Counter, defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from decimal import InvalidOperation as NotANumber
from typing import Any, Final

import psycopg

from outbox.core import payloads
from outbox.testing.stripe import FakeStripe
from outbox.testing.webhook import Effect, FakeWebhookReceiver
from tests.support.chaos_producers import Ledger
from tests.support.chaos_report import Report
from tests.support.chaos_settings import PROVIDER_TIMEOUT, Settings
from tests.support.chaos_workload import EARLY

FINAL: Final = frozenset({"succeeded", "quarantined", "reconciling", "cancelled"})
# Statuses that hold up the later operations of their ordering key (mode block, the default).
SET_ASIDE: Final = frozenset({"quarantined", "reconciling"})


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
        """).fetchall()
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
    carried = [
        Carried(
            str(o["metadata"].get("outbox_idempotency_key")),
            str(o["metadata"].get("outbox_operation_id")),
            str(o["id"]),
        )
        for o in objects
    ]
    carried += [
        Carried(e.key, e.headers.get("outbox-operation-id", ""), e.effect_id) for e in effects
    ]
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


def verify(
    url: str, ledger: Ledger, stripe: FakeStripe, hook: FakeWebhookReceiver, settings: Settings
) -> Report:
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
        report.by_reason = dict(
            Counter(f"{r.status} {r.reason}" for r in rows if r.status in SET_ASIDE)
        )
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

    def __init__(
        self, report: Report, rows: list[Row], ledger: Ledger, requests: dict[str, list[Request]]
    ) -> None:
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
            r.id: "due hours ahead"
            for r in rows
            if r.key in intents and intents[r.key].schedule == "later"
        }
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
                self.violation(
                    f"{_name(row)}, poison ({kind}): status, reason, attempts and "
                    f"whether sent are {got}"
                )
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
        previous = {
            after.id: before
            for line in self.by_line.values()
            for before, after in itertools.pairwise(line)
        }
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
                    self.violation(
                        f"{_name(row)} was never attempted, due for {waited:.1f} s; "
                        f"the bound is {bound:.1f} s"
                    )
                continue
            waited = (row.first_attempt_at - due).total_seconds()
            self.report.waits.append(waited)
            if waited > bound:
                self.violation(
                    f"{_name(row)} was first attempted {waited:.1f} s after it became "
                    f"due; the bound is {bound:.1f} s"
                )

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
                self.violation(
                    f"{_name(row)}: the Stripe object does not carry its payload "
                    f"exactly ({_differences(intent.payload, obj)})"
                )
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
        return (
            isinstance(got, list)
            and len(got) == len(expected)
            and all(map(_carried, expected, got))
        )
    if isinstance(expected, int | float | Decimal) and not isinstance(expected, bool):
        try:
            return Decimal(str(got)) == Decimal(str(expected))
        except NotANumber:
            return False
    return bool(got == expected)


def _differences(expected: Mapping[str, Any], got: Mapping[str, Any]) -> str:
    """The fields that differ, by name only: payloads are never printed."""
    return ", ".join(k for k, v in expected.items() if not _carried(v, got.get(k))) or "?"

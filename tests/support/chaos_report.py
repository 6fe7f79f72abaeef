"""The chaos soak's report: its figures and every invariant that failed (:class:`Report`), as
run_chaos (tests/support/chaos.py) and verify (tests/support/chaos_audit.py) fill it in, and
how it prints (:func:`print_report`)."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from tests.support.chaos_mayhem import Mayhem
from tests.support.chaos_settings import Settings


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
            (
                "provider effects",
                f"{self.effects_stripe + self.effects_hook} "
                f"(Stripe {self.effects_stripe}, webhook {self.effects_hook})",
            ),
            ("duplicates (must be 0)", f"{self.duplicates}"),
            ("lost (must be 0)", f"{self.lost}"),
            ("effects without an operation (must be 0)", f"{self.orphan_effects}"),
            (
                "rolled back / with an effect (must be 0)",
                f"{self.rolled_back} / {self.rolled_back_with_effect}",
            ),
            (
                "duplicate enqueues / conflicts refused",
                f"{self.duplicate_enqueues} / {self.conflicts}",
            ),
            ("commits cut by the crash (resolved from the table)", f"{self.uncertain_commits}"),
            ("attempts", f"{self.attempts}"),
            ("succeeded by the reconciler's lookup", f"{self.succeeded_by_reconciler}"),
            (
                "tenants (of them with only operations hours ahead)",
                f"{self.tenants} ({self.scheduled_tenants})",
            ),
            (
                "operations due seconds / hours ahead (never attempted)",
                f"{self.soon} / {self.scheduled_ahead}",
            ),
            (
                "ordered operations / keys with 2+ sent / waiting behind a set-aside one",
                f"{self.ordered} / {self.lines} / {self.blocked}",
            ),
            ("first attempt after due: median / 99th pct / max (bound)", self._waits()),
            ("requests late from a frozen dispatcher (the NOTE lines)", f"{len(self.stale)}"),
            ("enqueues the door must refuse (none may leave a row)", _counts(self.refused)),
            (
                "poison rows planted / quarantined unsent",
                f"{sum(self.poison.values())} / {self.poison_quarantined}",
            ),
            (
                "payloads checked at the provider / with exact numbers",
                f"{self.payloads_checked} / {self.exact_payloads}",
            ),
            ("provider faults armed", f"{self.faults_armed}"),
            (
                "dispatchers SIGKILLed / SIGSTOPped+resumed / SIGSTOPped+killed",
                f"{m.kills} / {m.stops_resumed} / {m.stops_killed}",
            ),
            ("dispatchers that exited by themselves (must be 0)", f"{self.crashes}"),
            ("PostgreSQL crashes (-m immediate) and restarts", f"{m.pg_restarts}"),
            (
                "chaos / drain / wall time",
                f"{knobs.duration:.0f} s / {self.drain_seconds:.1f} s / {self.wall_seconds:.0f} s",
            ),
            ("invariants", "all hold" if self.ok else f"{len(self.violations)} FAILED"),
        ]
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

"""What the queue benchmarks (bench/queue_*.py, issue 25) share: a phase's figures, the drain to
the noop provider that stands beside each (outbox's own ceiling at that moment), and the table
they print."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from _support import (
    bulk_enqueue,
    drain_window,
    fmt_rate,
    fmt_ratio,
    fresh_database,
    outbox_runs,
    print_table,
    wait_drained,
)

ACTION = "bench.event"
PAYLOAD: dict[str, Any] = {"amount": 1000, "currency": "usd", "customer": "cus_bench"}
NOOP_PHASE = "outbox run, noop provider (outbox's own ceiling)"


@dataclass(frozen=True)
class Phase:
    name: str
    messages: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else float("nan")


def run_noop(count: int, concurrency: int, batch: int) -> float:
    """The same drain to the noop provider: outbox's own ceiling on this machine, now."""
    with fresh_database(prefix="queue_noop_") as db_url:
        bulk_enqueue(db_url, count, provider="noop", action=ACTION, payload=PAYLOAD)
        providers = {"noop": {"type": "noop"}}
        with outbox_runs(
            db_url, providers=providers, concurrency=concurrency, batch_size=batch
        ) as runs:
            wait_drained(db_url, count, timeout=600, runs=runs)
        return drain_window(db_url).seconds


def print_phases(title: str, phases: list[Phase]) -> None:
    """The bare loop, outbox, and the noop drain, each against outbox (the second phase)."""
    outbox = phases[1].per_second
    print_table(
        ["", "messages", "seconds (median)", "msg/s", "outbox / this"],
        [
            (
                p.name,
                f"{p.messages:,}",
                f"{p.seconds:.2f}",
                fmt_rate(p.per_second),
                fmt_ratio(outbox / p.per_second),
            )
            for p in phases
        ],
        title=title,
    )
    print_table(["ratio outbox / bare loop"], [(fmt_ratio(outbox / phases[0].per_second),)])

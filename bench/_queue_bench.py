"""What the queue benchmarks (bench/queue_*.py, issue 25) share: a phase's figures, the drain to
the noop provider that stands beside each (outbox's own ceiling at that moment), and the table
they print."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _support import (
    bulk_enqueue,
    count_by_status,
    drain_window,
    fmt_rate,
    fmt_ratio,
    fresh_database,
    median,
    outbox_runs,
    print_table,
    progress,
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


def drain_through(
    providers: dict[str, dict[str, Any]],
    count: int,
    concurrency: int,
    batch: int,
    env: dict[str, str] | None = None,
) -> float:
    """``count`` operations of ACTION enqueued to the one provider of ``providers``, drained by
    `outbox run` in a fresh database: the seconds from the first claim to the last recorded
    success, by the database's clock. Raises unless every operation succeeded."""
    (provider,) = providers
    with fresh_database(prefix=f"queue_{providers[provider]['type']}_") as db_url:
        bulk_enqueue(db_url, count, provider=provider, action=ACTION, payload=PAYLOAD)
        with outbox_runs(
            db_url, providers=providers, env=env, concurrency=concurrency, batch_size=batch
        ) as runs:
            wait_drained(db_url, count, timeout=600, runs=runs)
        statuses = count_by_status(db_url)
        if statuses.get("succeeded", 0) != count:
            raise RuntimeError(f"not every operation succeeded: {statuses}")
        return drain_window(db_url).seconds


def run_noop(count: int, concurrency: int, batch: int) -> float:
    """The same drain to the noop provider: outbox's own ceiling on this machine, now."""
    return drain_through({"noop": {"type": "noop"}}, count, concurrency, batch)


def run_phases(
    count: int,
    runs: int,
    bare: tuple[str, Callable[[], float]],
    outbox: tuple[str, Callable[[], float]],
    noop: Callable[[], float],
) -> list[Phase]:
    """Each of the three phases ``runs`` times, interleaved so that each run of one sits beside
    a run of the others; the median of each, as Phases (bare, outbox, noop)."""
    seconds: list[list[float]] = [[], [], []]
    phases = [bare, outbox, (NOOP_PHASE, noop)]
    for i in range(runs):
        for (name, run), taken in zip(phases, seconds, strict=True):
            progress(f"run {i + 1}/{runs}: {name}, {count:,}")
            taken.append(run())
    return [Phase(name, count, median(t)) for (name, _), t in zip(phases, seconds, strict=True)]


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

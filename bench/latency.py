"""Latency (issue 7, part 4): from a producer's COMMIT to the provider receiving the request,
over loopback HTTP, at a steady rate; with NOTIFY wake-ups and with polling only.

    python bench/latency.py [--seconds 60] [--rate 200]

A producer in this process commits one `outbox.enqueue` per transaction on a fixed schedule
and reads ``time.monotonic()`` right after each COMMIT returns; the receiver
(bench/_http_receiver.py, its own process) reads ``time.monotonic()`` when each request's first
bytes arrive and files it under the request's ``Outbox-Operation-Id``. CLOCK_MONOTONIC is one
clock for every process of a Linux host, so the two readings subtract. One `outbox run`
(webhook provider, concurrency 64) per mode:

* NOTIFY: LISTEN on the database URL (the default), poll_interval 1 s as the fallback;
* polling only, at the default poll_interval (1 s) and at 100 ms: ``[database] listen = false``
  (OUTBOX_DATABASE__LISTEN=false), so the daemon opens no LISTEN connection and producers never
  notify;
* a bare LISTEN/NOTIFY claimer (bench/_bare_claimer.py) in place of `outbox run`: the same
  producer, trigger and receiver, and nothing of the daemon but a claim and a POST. What it
  measures is this machine's own floor for the NOTIFY figures, in the same run.

Targets with NOTIFY: p50 at most 3 ms, p99 at most 15 ms. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import psycopg
from _bare_claimer import BareClaimer
from _http_receiver import ReceiverProcess
from _support import (
    OutboxRun,
    fresh_database,
    outbox_runs,
    print_machine,
    print_table,
    progress,
    wait_drained,
    wait_until,
)

import outbox

PROVIDER = "hook"
ACTION = "bench.latency"
P50_TARGET_MS = 3.0
P99_TARGET_MS = 15.0
# Time for `outbox run` to start and LISTEN before the first measured commit.
SETTLE_S = 2.0


@dataclass(frozen=True)
class Mode:
    name: str
    poll_interval: str
    listen: bool
    bare: bool = False  # the bare claimer instead of `outbox run`


@dataclass(frozen=True)
class Result:
    mode: Mode
    latencies_ms: list[float]
    sent: int
    behind_ms: float  # how late the producer's last commit was against its schedule

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def produce(
    db_url: str, rate: float, seconds: float, key_prefix: str
) -> tuple[dict[str, float], float]:
    """Commit one operation per transaction at ``rate`` a second; returns each operation's
    post-COMMIT monotonic time by id, and how far behind schedule the last commit was (ms)."""
    committed: dict[str, float] = {}
    total = round(rate * seconds)
    behind = 0.0
    with psycopg.connect(db_url) as conn:
        start = time.monotonic() + 0.05
        for i in range(total):
            due = start + i / rate
            pause = due - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            result = outbox.enqueue(
                conn,
                tenant_id="bench",
                operation_type="bench.latency",
                operation_key=f"{key_prefix}{i}",
                provider=PROVIDER,
                action=ACTION,
                payload={"n": i, "amount": 1000, "currency": "usd"},
            )
            conn.commit()
            now = time.monotonic()
            committed[str(result.operation_id)] = now
            behind = (now - due) * 1000
    return committed, behind


def run_mode(mode: Mode, rate: float, seconds: float) -> Result:
    with fresh_database(prefix="latency_") as db_url, ReceiverProcess(stamp=True) as receiver:
        if mode.bare:
            with BareClaimer(db_url, receiver.url):
                committed, behind = _measure(
                    mode, db_url, receiver, rate=rate, seconds=seconds, runs=()
                )
        else:
            env = {} if mode.listen else {"OUTBOX_DATABASE__LISTEN": "false"}
            providers = {PROVIDER: {"type": "webhook", "url": receiver.url, "timeout": "10s"}}
            with outbox_runs(
                db_url,
                providers=providers,
                env=env,
                concurrency=64,
                poll_interval=mode.poll_interval,
            ) as runs:
                time.sleep(SETTLE_S)
                committed, behind = _measure(
                    mode, db_url, receiver, rate=rate, seconds=seconds, runs=runs
                )
        arrivals = receiver.stats()["arrivals"]
    missing = [op for op in committed if op not in arrivals]
    if missing:
        raise RuntimeError(f"{len(missing)} operations never reached the receiver")
    latencies = [(arrivals[op] - at) * 1000 for op, at in committed.items()]
    return Result(mode, latencies, len(committed), behind)


def _measure(
    mode: Mode,
    db_url: str,
    receiver: ReceiverProcess,
    *,
    rate: float,
    seconds: float,
    runs: Sequence[OutboxRun],
) -> tuple[dict[str, float], float]:
    """The warm-up operation, then the measured ones, drained."""
    # One operation end to end first: the dispatcher is up and its pool is warm.
    produce(db_url, 1.0, 1.0, "warm-")
    wait_until(
        lambda: receiver.stats()["requests"] >= 1,
        timeout=30,
        what="the warm-up request",
        alive=runs,
    )
    progress(f"{mode.name}: {rate:g} operations/s for {seconds:g} s")
    committed, behind = produce(db_url, rate, seconds, "op-")
    wait_drained(db_url, len(committed) + 1, timeout=120, runs=runs)
    return committed, behind


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=200.0, help="operations per second")
    parser.add_argument(
        "--modes",
        default="notify,bare,poll,poll100",
        help="comma-separated: notify, bare (the bare claimer), poll (1 s), poll100 (100 ms)",
    )
    args = parser.parse_args(argv)
    os.environ.pop("OUTBOX_LISTEN_DATABASE_URL", None)
    all_modes = {
        "notify": Mode("NOTIFY (LISTEN on), poll 1 s", "1s", listen=True),
        "bare": Mode("NOTIFY, bare claimer (no outbox run)", "1s", listen=True, bare=True),
        "poll": Mode("polling only, poll 1 s", "1s", listen=False),
        "poll100": Mode("polling only, poll 100 ms", "100ms", listen=False),
    }
    modes = [all_modes[name.strip()] for name in args.modes.split(",") if name.strip()]

    print_machine()
    results = [run_mode(mode, args.rate, args.seconds) for mode in modes]
    rows = [
        (
            r.mode.name,
            f"{r.sent:,}",
            f"{r.pct(0.5):.2f}",
            f"{r.pct(0.9):.2f}",
            f"{r.pct(0.99):.2f}",
            f"{max(r.latencies_ms):.2f}",
            f"{statistics.fmean(r.latencies_ms):.2f}",
            f"{r.behind_ms:.1f}",
        )
        for r in results
    ]
    print_table(
        [
            "wake-up",
            "operations",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "max ms",
            "mean ms",
            "producer late ms",
        ],
        rows,
        title=f"COMMIT to request received, {args.rate:g} operations/s for {args.seconds:g} s",
    )
    for r in results:
        if r.mode.listen and not r.mode.bare:
            met = r.pct(0.5) <= P50_TARGET_MS and r.pct(0.99) <= P99_TARGET_MS
            print_table(
                ["target (NOTIFY)", "p50", "p99", "verdict"],
                [
                    (
                        f"p50 ≤ {P50_TARGET_MS:g} ms, p99 ≤ {P99_TARGET_MS:g} ms",
                        f"{r.pct(0.5):.2f}",
                        f"{r.pct(0.99):.2f}",
                        "met" if met else "missed",
                    )
                ],
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

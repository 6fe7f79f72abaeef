"""Enqueue under synchronous replication (issue 23): producer commits with a dispatcher waiting
idle and LISTENing, against the same run with ``[database] listen = false``, and commit-to-send
latency, in one run.

    python bench/sync_replication.py                       # 150 operations/s, 20 s, 3 rounds
    python bench/sync_replication.py --quick               # 8 s, one round
    python bench/sync_replication.py --delay-ms 5 --rate 150 --producers 8 --seconds 20

A private primary and a streaming standby (tests/support/replication.py), the standby named in
``synchronous_standby_names`` and reached through a TCP relay that delays each direction by
--delay-ms (a standby in another zone): every commit on the primary waits a round trip for the
standby's flush. --producers processes, each with its own connection, together commit --rate
single-operation transactions a second on a fixed schedule, and time each COMMIT. One `outbox
run` (webhook provider, the receiver of bench/latency.py) waits idle between arrivals, which is
when producers are asked to wake it. The variants are taken round-robin, and each figure is the
median over --repeat rounds.

Targets: producer commits with LISTEN within 1.2 x of listen = false (rate and median commit
time); commit-to-send with LISTEN p50 at most 3 ms and p99 at most 15 ms beyond the replication
round trip the producer's own commit already waited (bench/README.md, Latency). Exits non-zero
only on errors.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from typing import Any

import psycopg
from _http_receiver import ReceiverProcess
from _support import median, outbox_runs, print_machine, print_table, progress, wait_until

import outbox
from tests.support.replication import ReplicatedPair, replicated_pair

PROVIDER = "hook"
ACTION = "bench.sync"
RATIO_TARGET = 1.2
P50_TARGET_MS = 3.0
P99_TARGET_MS = 15.0
SETTLE_S = 2.0


@dataclass(frozen=True)
class Variant:
    name: str
    listen: bool


VARIANTS = (Variant("LISTEN, dispatcher idle", True), Variant("listen = false", False))


@dataclass
class Round:
    """One variant's run: each commit's duration, and COMMIT-to-request latency."""

    variant: Variant
    commit_ms: list[float]
    latency_ms: list[float]
    seconds: float
    notified: int  # commits that sent a notification, read by a bare LISTEN

    @property
    def rate(self) -> float:
        return len(self.commit_ms) / self.seconds


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def produce(
    url: str, start: float, rate: float, count: int, prefix: str, *, out: Queue[Any]
) -> None:
    """``count`` enqueues at ``rate``/s from ``start`` (CLOCK_MONOTONIC, one clock for every
    process of the host); puts (operation id, COMMIT duration, time COMMIT returned) each."""
    rows: list[tuple[str, float, float]] = []
    with psycopg.connect(url) as conn:
        for i in range(count):
            pause = start + i / rate - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            result = outbox.enqueue(
                conn,
                tenant_id="bench",
                operation_type="bench.sync",
                operation_key=f"{prefix}{i}",
                provider=PROVIDER,
                action=ACTION,
                payload={"n": i, "amount": 1000, "currency": "usd"},
            )
            began = time.monotonic()
            conn.commit()
            done = time.monotonic()
            rows.append((str(result.operation_id), (done - began) * 1000, done))
    out.put(rows)


def produce_all(
    url: str, rate: float, seconds: float, producers: int, tag: str
) -> list[tuple[str, float, float]]:
    out: Queue[Any] = multiprocessing.Queue()
    start = time.monotonic() + 0.5
    each = round(rate * seconds / producers)
    procs = [
        multiprocessing.Process(
            target=produce,
            args=(url, start + n / rate, rate / producers, each, f"{tag}-{n}-"),
            kwargs={"out": out},
        )
        for n in range(producers)
    ]
    for proc in procs:
        proc.start()
    rows = [row for _ in procs for row in out.get(timeout=seconds + 120)]
    for proc in procs:
        proc.join()
    return rows


def run_variant(
    pair: ReplicatedPair, variant: Variant, args: argparse.Namespace, tag: str
) -> Round:
    with psycopg.connect(pair.url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox.operations CASCADE")
    env = {} if variant.listen else {"OUTBOX_DATABASE__LISTEN": "false"}
    with ReceiverProcess(stamp=True) as receiver:
        providers = {PROVIDER: {"type": "webhook", "url": receiver.url, "timeout": "10s"}}
        with outbox_runs(
            pair.url, providers=providers, env=env, concurrency=64, poll_interval="1s"
        ) as runs:
            time.sleep(SETTLE_S)
            progress(f"{variant.name}: {args.rate:g}/s for {args.seconds:g} s")
            with psycopg.connect(pair.url, autocommit=True) as listener:
                listener.execute("LISTEN outbox_enqueue")
                rows = produce_all(pair.url, args.rate, args.seconds, args.producers, tag)
                notified = len(list(listener.notifies(timeout=0.5)))
            wait_until(
                lambda: len(receiver.stats()["arrivals"]) >= len(rows),
                timeout=120,
                what="every operation at the receiver",
                alive=runs,
            )
            arrivals = receiver.stats()["arrivals"]
    latency = [(arrivals[op] - at) * 1000 for op, _, at in rows]
    return Round(variant, [ms for _, ms, _ in rows], latency, args.seconds, notified)


def report(rounds: list[Round], args: argparse.Namespace) -> None:
    by = {v: [r for r in rounds if r.variant == v] for v in VARIANTS}

    def med(variant: Variant, figure: Any) -> float:
        return median([figure(r) for r in by[variant]])

    def each(variant: Variant, figure: Any, fmt: str) -> str:
        return " · ".join(format(figure(r), fmt) for r in by[variant])

    figures = [
        ("producer commits/s", lambda r: r.rate, ",.0f"),
        ("COMMIT p50 ms", lambda r: pct(r.commit_ms, 0.5), ".2f"),
        ("COMMIT p99 ms", lambda r: pct(r.commit_ms, 0.99), ".2f"),
        ("COMMIT to request p50 ms", lambda r: pct(r.latency_ms, 0.5), ".2f"),
        ("COMMIT to request p99 ms", lambda r: pct(r.latency_ms, 0.99), ".2f"),
        ("commits that notified", lambda r: r.notified / len(r.commit_ms), ".0%"),
    ]
    listen, off = VARIANTS
    print_table(
        ["figure", f"{listen.name}, per round", f"{off.name}, per round", "medians"],
        [
            (
                name,
                each(listen, f, fmt),
                each(off, f, fmt),
                f"{med(listen, f):{fmt}} / {med(off, f):{fmt}}",
            )
            for name, f, fmt in figures
        ],
        title=(
            f"synchronous standby {args.delay_ms:g} ms away each way, {args.producers} "
            f"producers, {args.rate:g} operations/s, {args.seconds:g} s, {args.repeat} rounds"
        ),
    )
    rate_ratio = med(off, figures[0][1]) / med(listen, figures[0][1])
    commit_ratio = med(listen, figures[1][1]) / med(off, figures[1][1])
    p50, p99 = med(listen, figures[3][1]), med(listen, figures[4][1])
    print_table(
        ["target", "this run", "verdict"],
        [
            (
                f"commits/s and COMMIT p50 with LISTEN within {RATIO_TARGET:g} x listen = false",
                f"{rate_ratio:.2f} x, {commit_ratio:.2f} x",
                "met" if max(rate_ratio, commit_ratio) <= RATIO_TARGET else "missed",
            ),
            (
                f"COMMIT to request with LISTEN: p50 ≤ {P50_TARGET_MS:g}, p99 ≤ "
                f"{P99_TARGET_MS:g} ms",
                f"p50 {p50:.2f}, p99 {p99:.2f}",
                "met" if p50 <= P50_TARGET_MS and p99 <= P99_TARGET_MS else "missed",
            ),
        ],
    )
    mean = statistics.fmean(x for r in by[off] for x in r.commit_ms)
    print(f"mean COMMIT with listen = false (the replication round trip and more): {mean:.2f} ms")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=150.0, help="operations per second")
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--delay-ms", type=float, default=5.0, help="each way, to the standby")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="8 s, one round")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.repeat = 8.0, 1
    os.environ.pop("OUTBOX_LISTEN_DATABASE_URL", None)
    print_machine()
    rounds: list[Round] = []
    with replicated_pair(synchronous=True, delay=args.delay_ms / 1000) as pair:
        for n in range(args.repeat):
            for variant in VARIANTS:
                rounds.append(run_variant(pair, variant, args, f"r{n}-{variant.listen}"))
    report(rounds, args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

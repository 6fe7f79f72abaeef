"""Throughput, dispatcher overhead: `outbox run` draining no-op operations, against the raw
PostgreSQL limit measured in the same run.

    python bench/throughput.py               # 100,000 operations, concurrency 64/256 x batch 10/100
    python bench/throughput.py --quick       # 10,000 operations
    python bench/throughput.py --processes 2 # two `outbox run` processes per configuration
    python bench/throughput.py --profile DIR # py-spy each outbox run; top self-time functions

The raw limit is a minimal psycopg loop in worker processes: one autocommit statement claims
100 due rows with FOR UPDATE SKIP LOCKED and marks them succeeded (and, for comparison, one row
at a time). `outbox run` uses the `noop` provider (succeeds at once, in process) with the attempt
history, metrics listener and info logs on, as in production. Every rate is measured on the
database's clock, from the first claim to the last row finished (the rows' own timestamps), so
process start-up does not count. See bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from _support import (
    OutboxRun,
    bulk_enqueue,
    drain_window,
    fmt_rate,
    fmt_ratio,
    fresh_database,
    median,
    outbox_runs,
    print_machine,
    print_table,
    progress,
    unfinished,
)
from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db.connect import configure_session
from outbox.db.store import Record, Store

DEFAULT_COUNT = 100_000
QUICK_COUNT = 10_000
# The target: the dispatcher drains no-op operations at half the raw limit or better.
TARGET_RATIO = 0.5
CONFIGS = ((64, 10), (64, 100), (256, 10), (256, 100))
RAW_WORKERS = (4, 8)
# One-row claims are ~30 times slower than 100-row ones; a tenth of the count keeps them short.
SINGLE_ROW_SHARE = 10
# Issue 8: a third of the operations ordered, over 100 ordering keys, against none ordered, at
# this configuration; the claim must stay within 1.5 x.
ORDERED_EVERY = 3
ORDERING_KEYS = 100
ORDERED_CONFIG = (256, 100)
ORDERED_TARGET = 1.5

# The raw loop's only statement: claim a batch and finish it, in one autocommit transaction,
# against the same table and partial index the dispatcher's claim uses.
RAW_CLAIM_AND_FINISH = """
WITH due AS MATERIALIZED (
    SELECT id FROM outbox.operations
    WHERE provider = 'noop' AND tenant_id = 'bench'
      AND status = 'pending' AND NOT ordering_blocked AND NOT scheduled AND available_at <= now()
    ORDER BY available_at, id
    LIMIT %s
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox.operations AS o
SET status = 'succeeded', provider_ref = 'raw', attempts = o.attempts + 1,
    last_attempt_at = now(), finished_at = now(), updated_at = now(), status_changed_at = now()
FROM due WHERE o.id = due.id
"""


BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
"""


def _raw_worker(
    db_url: str,
    batch: int,
    start: multiprocessing.synchronize.Event,
    done: multiprocessing.synchronize.Barrier,
    release: multiprocessing.synchronize.Event,
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT 1")
        start.wait()
        while True:
            cur = conn.execute(RAW_CLAIM_AND_FINISH, (batch,), prepare=True)
            if cur.rowcount == 0:
                break
        done.wait()
        release.wait()  # connected until the parent has read its backend's CPU time


def _floor_worker(
    db_url: str,
    batch: int,
    start: multiprocessing.synchronize.Event,
    done: multiprocessing.synchronize.Barrier,
    release: multiprocessing.synchronize.Event,
) -> None:
    asyncio.run(_floor_loop(db_url, batch, start, done, release))


async def _floor_loop(
    db_url: str,
    batch: int,
    start: multiprocessing.synchronize.Event,
    done: multiprocessing.synchronize.Barrier,
    release: multiprocessing.synchronize.Event,
) -> None:
    """outbox's own claim and record statements, through its Store, with nothing between them:
    no provider call, no task per operation. What the protocol costs the database, at most."""
    worker = f"floor-{os.getpid()}"
    lease = timedelta(seconds=60)
    # The session settings of `outbox run`'s own connections (generic plans among them).
    async with AsyncConnectionPool(
        db_url,
        min_size=1,
        max_size=1,
        open=False,
        kwargs={"autocommit": True},
        configure=configure_session,
    ) as pool:
        store = Store(pool)
        await asyncio.to_thread(start.wait)
        while claimed := await store.claim(worker, batch, lease):
            await store.record_many(
                [
                    Record(
                        c.id,
                        c.lease_token,
                        c.attempts,
                        worker,
                        Status.SUCCEEDED,
                        "succeeded",
                        sent=True,
                        provider_ref="floor",
                    )
                    for c in claimed
                ]
            )
        await asyncio.to_thread(done.wait)
        await asyncio.to_thread(release.wait)


@dataclass(frozen=True)
class Raw:
    """One run of the raw loop."""

    per_second: float
    pg_cpu_per_row: float  # seconds of CPU in the workers' backends, per row


def raw_limit(count: int, workers: int, batch: int, *, floor: bool = False) -> Raw:
    """The minimal claim-and-finish loop over ``count`` fresh rows; ``floor``: outbox's claim
    and record statements in the same bare loop (two transactions and an attempt row per
    operation, where the raw loop has one statement)."""
    with fresh_database(prefix="raw_") as db_url:
        bulk_enqueue(db_url, count)
        ctx = multiprocessing.get_context("fork")
        start = ctx.Event()
        done = ctx.Barrier(workers + 1)
        release = ctx.Event()
        target = _floor_worker if floor else _raw_worker
        procs = [
            ctx.Process(target=target, args=(db_url, batch, start, done, release))
            for _ in range(workers)
        ]
        for p in procs:
            p.start()
        time.sleep(0.5)  # every worker connected
        with psycopg.connect(db_url, autocommit=True) as conn:
            before = {int(r[0]): _cpu_seconds(int(r[0])) for r in conn.execute(BACKENDS)}
            start.set()
            done.wait()
            after = {int(r[0]): _cpu_seconds(int(r[0])) for r in conn.execute(BACKENDS)}
            release.set()
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise RuntimeError(f"a raw worker exited {p.exitcode}")
        window = drain_window(db_url)
        if window.succeeded != count:
            raise RuntimeError(f"the raw loop finished {window.succeeded} of {count} rows")
        pg_cpu = sum(cpu - before.get(pid, 0.0) for pid, cpu in after.items())
        return Raw(window.per_second, pg_cpu / count)


@dataclass(frozen=True)
class Drain:
    """One `outbox run` drain of no-op operations."""

    count: int
    concurrency: int
    batch_size: int
    processes: int
    seconds: float  # database clock, first claim to last finish
    per_second: float
    attempts: int  # attempt rows written
    cpu_seconds: float  # user + system of every outbox run process
    pg_cpu_seconds: float  # user + system of their PostgreSQL backends
    claims: float  # claim statements (outbox_claim_duration_seconds_count), all processes
    claim_seconds: float  # their summed duration

    @property
    def claim_ceiling(self) -> float:
        """Operations per second if every claim took its mean time and each process had one
        claim in flight at a time: rows per claim over the mean claim time, times the
        processes. A dispatcher with several claim loops can pass it."""
        if not self.claims or not self.claim_seconds:
            return float("nan")
        rows_per_claim = self.count / self.claims
        return self.processes * rows_per_claim / (self.claim_seconds / self.claims)

    profile: Path | None = None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def outbox_drain(
    count: int,
    concurrency: int,
    batch_size: int,
    *,
    processes: int = 1,
    log_level: str = "info",
    profile_dir: Path | None = None,
    native: bool = False,
    ordered_every: int = 0,
    timeout: float | None = None,
) -> Drain:
    """`outbox run` (``processes`` of them) draining ``count`` pre-enqueued no-op operations.

    ``profile_dir``: record the first process with py-spy (collapsed stacks) while it drains.
    """
    limit = timeout if timeout is not None else 120.0 + count / 100
    with fresh_database(prefix="thr_") as db_url:
        bulk_enqueue(db_url, count, ordered_every=ordered_every, ordering_keys=ORDERING_KEYS)
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE outbox.operations")
        env = {"OUTBOX_LOG_LEVEL": log_level}
        with outbox_runs(
            db_url, processes=processes, env=env, concurrency=concurrency, batch_size=batch_size
        ) as runs:
            spy = None
            profile = None
            if profile_dir is not None:
                profile_dir.mkdir(parents=True, exist_ok=True)
                suffix = "-native" if native else ""
                profile = profile_dir / f"outbox-c{concurrency}-b{batch_size}{suffix}.txt"
                spy = _start_py_spy(runs[0].pid, profile, native=native)
            try:
                meter = _wait_drained(db_url, count, limit, runs)
                claims, claim_seconds = _claim_stats(runs)
            finally:
                if spy is not None:
                    _stop_py_spy(spy)
        window = drain_window(db_url)
        with psycopg.connect(db_url, autocommit=True) as conn:
            row = conn.execute("SELECT count(*) FROM outbox.attempts").fetchone()
        attempts = int(row[0]) if row else 0
    if window.succeeded != count:
        raise RuntimeError(f"outbox run succeeded {window.succeeded} of {count} operations")
    return Drain(
        count,
        concurrency,
        batch_size,
        processes,
        window.seconds,
        window.per_second,
        attempts,
        meter.outbox,
        meter.postgres,
        claims,
        claim_seconds,
        profile,
    )


class _CpuMeter:
    """CPU seconds of the outbox run processes and of their PostgreSQL backends (same host)."""

    def __init__(self, runs: list[OutboxRun]) -> None:
        self._runs = runs
        self._outbox0: float | None = None
        self._backends0: dict[int, float] = {}
        self.outbox = 0.0
        self.postgres = 0.0

    def _backends(self, conn: psycopg.Connection[Any]) -> dict[int, float]:
        pids = [int(row[0]) for row in conn.execute(BACKENDS).fetchall()]
        return {pid: _cpu_seconds(pid) for pid in pids}

    def start(self, conn: psycopg.Connection[Any]) -> None:
        self._outbox0 = sum(_cpu_seconds(r.pid) for r in self._runs)
        self._backends0 = self._backends(conn)

    @property
    def started(self) -> bool:
        return self._outbox0 is not None

    def stop(self, conn: psycopg.Connection[Any]) -> None:
        if self._outbox0 is None:
            return
        self.outbox = sum(_cpu_seconds(r.pid) for r in self._runs) - self._outbox0
        # A backend that started during the drain counts from zero.
        self.postgres = sum(
            cpu - self._backends0.get(pid, 0.0) for pid, cpu in self._backends(conn).items()
        )


def _wait_drained(db_url: str, count: int, timeout: float, runs: list[OutboxRun]) -> _CpuMeter:
    """Wait until nothing is pending or in flight; returns the CPU the drain took, counted from
    when the first row left `pending` (start-up and imports are no cost per row)."""
    deadline = time.monotonic() + timeout
    meter = _CpuMeter(runs)
    started = False
    with psycopg.connect(db_url, autocommit=True) as conn:
        meter.start(conn)  # again below, until the first claim is seen
        while True:
            if not started:
                # Counting reads every pending row, but only until the drain begins.
                row = conn.execute(
                    "SELECT count(*) FROM outbox.operations WHERE status = 'pending'"
                ).fetchone()
                assert row is not None
                started = int(row[0]) < count
                if not started:
                    meter.start(conn)
            if started and not any(unfinished(conn)):
                meter.stop(conn)
                return meter
            for run in runs:
                if not run.alive():
                    raise RuntimeError(f"outbox run exited:\n{run.log_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} operations not drained in {timeout:.0f} s")
            time.sleep(0.1)


def _mean_claim_ms(drain: Drain) -> float:
    return 1000 * drain.claim_seconds / drain.claims if drain.claims else float("nan")


def _claim_stats(runs: list[OutboxRun]) -> tuple[float, float]:
    """Claims made and their summed duration, from every process's /metrics."""
    claims = seconds = 0.0
    for run in runs:
        try:
            samples = run.metrics()
        except OSError:
            continue
        claims += samples.get("outbox_claim_duration_seconds_count", 0.0)
        seconds += samples.get("outbox_claim_duration_seconds_sum", 0.0)
    return claims, seconds


def _start_py_spy(pid: int, out: Path, *, native: bool = False) -> subprocess.Popen[bytes]:
    spy = Path(sys.executable).parent / "py-spy"
    command = str(spy) if spy.exists() else "py-spy"
    # --native shows C frames (the garbage collector, libpq, system calls) but must pause the
    # process for each sample; without it py-spy reads the process without stopping it.
    mode = ["--native"] if native else ["--nonblocking"]
    return subprocess.Popen(  # noqa: S603 (a fixed command line)
        [
            command,
            "record",
            "--pid",
            str(pid),
            "--format",
            "raw",
            "--rate",
            "250",
            "--output",
            str(out),
            *mode,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _stop_py_spy(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(signal.SIGINT)
    try:
        spy.wait(timeout=60)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()


# Stacks of threads that only wait: the metrics listener's serve_forever (seen in --native
# profiles, which sample idle threads too).
IDLE_STACK_MARKERS = ("serve_forever",)


def top_self_time(
    collapsed: Path, top: int = 20, *, by_function: bool = False
) -> list[tuple[str, float]]:
    """The frames with the most self time in py-spy's collapsed stacks, as shares of all
    samples (idle helper threads left out). ``by_function`` adds up a function's lines."""
    counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        if any(marker in stack for marker in IDLE_STACK_MARKERS):
            continue
        leaf = stack.rsplit(";", 1)[-1]
        if by_function:
            leaf = re.sub(r":\d+\)$", ")", leaf)
        counts[leaf] += int(number)
        total += int(number)
    return [(name, n / total) for name, n in counts.most_common(top)] if total else []


def top_inclusive(collapsed: Path, needle: str, top: int = 20) -> list[tuple[str, float]]:
    """Frames whose text contains ``needle`` (e.g. "outbox/"), by inclusive share of samples."""
    counts: Counter[str] = Counter()
    total = 0
    for line in collapsed.read_text(errors="replace").splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        total += int(number)
        for frame in set(stack.split(";")):
            if needle in frame:
                counts[frame] += int(number)
    return [(name, n / total) for name, n in counts.most_common(top)] if total else []


def raw_table(count: int, repeat: int) -> float:
    """Measure and print the raw limit; returns the best median of the 100-row claims.

    Beside it, the protocol floor: outbox's own claim and record statements in the same bare
    loop, which no dispatcher using them can beat on this database."""
    raw_rows: list[list[str]] = []
    best_raw = 0.0
    loops = [
        (False, batch, rows, workers)
        for batch, rows in ((100, count), (1, max(count // SINGLE_ROW_SHARE, 1000)))
        for workers in RAW_WORKERS
    ]
    loops += [(True, 100, count, workers) for workers in RAW_WORKERS]
    for floor, batch, rows, workers in loops:
        name = "outbox's claim + record" if floor else "raw: one statement"
        progress(f"{name}: {workers} workers x {batch} rows, {rows:,} rows, x{repeat}")
        runs = [raw_limit(rows, workers, batch, floor=floor) for _ in range(repeat)]
        rate = median([r.per_second for r in runs])
        if batch == 100 and not floor:
            best_raw = max(best_raw, rate)
        raw_rows.append(
            [
                name,
                f"{workers}",
                f"{batch}",
                f"{rows:,}",
                fmt_rate(rate),
                fmt_ratio(rate / best_raw) if floor and best_raw else "",
                f"{median([1000 * r.pg_cpu_per_row for r in runs]):.3f} ms",
                " / ".join(fmt_rate(r.per_second) for r in runs),
            ]
        )
    print_table(
        [
            "loop",
            "workers",
            "rows per claim",
            "rows",
            "rows/s (median)",
            "x raw",
            "CPU/row backends",
            "runs",
        ],
        raw_rows,
        title="Raw PostgreSQL limit: claim + finish in one statement; and outbox's "
        "statements in the same loop",
    )
    return best_raw


def _config(pair: str) -> tuple[int, int]:
    """Concurrency and batch_size from "256x100"."""
    concurrency, batch_size = pair.lower().split("x")
    return int(concurrency), int(batch_size)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--count", type=int, default=None, help=f"operations per drain (default {DEFAULT_COUNT:,})"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"--count {QUICK_COUNT:,} and one repeat of the raw loop",
    )
    parser.add_argument("--processes", type=int, default=1, help="`outbox run` processes")
    parser.add_argument("--repeat", type=int, default=3, help="raw-loop runs; the median counts")
    parser.add_argument(
        "--drain-repeat",
        type=int,
        default=1,
        help="drains per configuration, round-robin; median counts",
    )
    parser.add_argument(
        "--configs",
        default=",".join(f"{c}x{b}" for c, b in CONFIGS),
        help="concurrency x batch_size pairs, e.g. 64x10,256x100",
    )
    parser.add_argument(
        "--log-level", default="info", help="outbox run's log level (info, the production default)"
    )
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="record each outbox run with py-spy into DIR",
    )
    parser.add_argument(
        "--native", action="store_true", help="with --profile: C frames too (pauses it per sample)"
    )
    parser.add_argument(
        "--no-ordered",
        dest="ordered",
        action="store_false",
        help="skip the drain with ordering keys in the mix",
    )
    parser.add_argument(
        "--ordered-only",
        action="store_true",
        help="only the ordered comparison (and its unordered twin)",
    )
    args = parser.parse_args(argv)
    if args.ordered_only:
        print_machine()
        ordered_table(
            QUICK_COUNT if args.quick else (args.count or DEFAULT_COUNT),
            args.processes,
            max(args.drain_repeat, 1),
            [],
        )
        return 0
    count = args.count or (QUICK_COUNT if args.quick else DEFAULT_COUNT)
    repeat = 1 if args.quick else args.repeat
    configs = [_config(pair) for pair in args.configs.split(",")]

    print_machine()
    best_raw = raw_table(count, repeat)

    # Round-robin over the configurations, so that a burst of other work on a shared machine
    # hits every configuration alike rather than one of them.
    drains: dict[tuple[int, int], list[Drain]] = {config: [] for config in configs}
    profiles: list[Path] = []
    for round_number in range(args.drain_repeat):
        for concurrency, batch_size in configs:
            progress(
                f"outbox run: concurrency {concurrency}, batch {batch_size}, "
                f"{args.processes} process(es), {count:,} operations, "
                f"round {round_number + 1} of {args.drain_repeat}"
            )
            profile_dir = args.profile if round_number == 0 else None
            drain = outbox_drain(
                count,
                concurrency,
                batch_size,
                processes=args.processes,
                log_level=args.log_level,
                profile_dir=profile_dir,
                native=args.native,
            )
            if drain.profile is not None:
                profiles.append(drain.profile)
            if drain.attempts != count:
                progress(f"note: {drain.attempts} attempt rows for {count} operations")
            drains[concurrency, batch_size].append(drain)
    rows_out: list[list[str]] = []
    claim_rows: list[list[str]] = []
    for (concurrency, batch_size), done in drains.items():
        rate = median([d.per_second for d in done])
        ratio = rate / best_raw if best_raw else float("nan")
        rows_out.append(
            [
                f"{concurrency}",
                f"{batch_size}",
                f"{args.processes}",
                f"{count:,}",
                f"{median([d.seconds for d in done]):.1f} s",
                fmt_rate(rate),
                fmt_ratio(ratio),
                f"{median([1000 * d.cpu_seconds / count for d in done]):.3f} ms",
                f"{median([1000 * d.pg_cpu_seconds / count for d in done]):.3f} ms",
                "yes" if ratio >= TARGET_RATIO else "no",
                " / ".join(fmt_rate(d.per_second) for d in done),
            ]
        )
        claim_rows.append(
            [
                f"{concurrency}",
                f"{batch_size}",
                f"{median([d.claims for d in done]):,.0f}",
                f"{median([d.count / d.claims if d.claims else float('nan') for d in done]):.1f}",
                f"{median([_mean_claim_ms(d) for d in done]):.2f} ms",
                fmt_rate(median([d.claim_ceiling for d in done])),
                fmt_rate(rate),
            ]
        )
    print_table(
        [
            "concurrency",
            "batch_size",
            "processes",
            "operations",
            "drain",
            "ops/s",
            "x raw",
            "CPU/op outbox",
            "CPU/op backends",
            f">= {TARGET_RATIO} x raw",
            "runs (ops/s)",
        ],
        rows_out,
        title=f"outbox run, noop provider (raw limit: {fmt_rate(best_raw)} rows/s)",
    )
    # What one claim at a time per process would allow: a drain at this ceiling is bound by the
    # claim loop; a drain above it has claims overlapping (several claim loops).
    print_table(
        [
            "concurrency",
            "batch_size",
            "claims",
            "rows/claim",
            "mean claim",
            "one-claim-at-a-time ceiling",
            "ops/s",
        ],
        claim_rows,
        title="Claims (outbox_claim_duration_seconds), medians",
    )
    for profile in profiles:
        if profile.exists():
            print_profile(profile)
    if args.ordered:
        ordered_table(count, args.processes, args.drain_repeat, drains.get(ORDERED_CONFIG, []))
    return 0


def ordered_table(count: int, processes: int, repeat: int, unordered: list[Drain]) -> None:
    """A third of the operations ordered over 100 keys, against none, at ORDERED_CONFIG; the
    unordered drains of the main table are reused when they ran that configuration."""
    concurrency, batch_size = ORDERED_CONFIG
    unordered = list(unordered)
    ordered: list[Drain] = []
    for round_number in range(repeat):
        progress(
            f"ordering keys: a third of {count:,} ordered over {ORDERING_KEYS} keys, "
            f"round {round_number + 1} of {repeat}"
        )
        if len(unordered) <= round_number:
            unordered.append(outbox_drain(count, concurrency, batch_size, processes=processes))
        ordered.append(
            outbox_drain(
                count, concurrency, batch_size, processes=processes, ordered_every=ORDERED_EVERY
            )
        )
    claim_u = median([_mean_claim_ms(d) for d in unordered])
    claim_o = median([_mean_claim_ms(d) for d in ordered])
    rate_u = median([d.per_second for d in unordered])
    rate_o = median([d.per_second for d in ordered])
    print_table(
        [
            "operations",
            "ordered",
            "mean claim",
            "claim x unordered",
            "ops/s",
            f"claim <= {ORDERED_TARGET} x",
        ],
        [
            [f"{count:,}", "none", f"{claim_u:.2f} ms", "1.00", fmt_rate(rate_u), ""],
            [
                f"{count:,}",
                f"1 in {ORDERED_EVERY}, {ORDERING_KEYS} keys",
                f"{claim_o:.2f} ms",
                fmt_ratio(claim_o / claim_u),
                fmt_rate(rate_o),
                "yes" if claim_o <= ORDERED_TARGET * claim_u else "no",
            ],
        ],
        title=f"Ordering keys in the mix: concurrency {concurrency}, batch {batch_size}, "
        f"{processes} process(es), medians of {repeat}",
    )


def print_profile(profile: Path) -> None:
    """The top self-time frames of one py-spy recording, by line and by function."""
    by_line = top_self_time(profile)
    by_function = top_self_time(profile, by_function=True)
    pairs = zip(by_line, by_function, strict=False)
    rows = [
        [name, f"{100 * share:.1f}", fname, f"{100 * fshare:.1f}"]
        for (name, share), (fname, fshare) in pairs
    ]
    print_table(
        ["frame (file:line)", "self %", "function (its lines added up)", "self %"],
        rows,
        title=f"py-spy, top self time: {profile.name}",
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

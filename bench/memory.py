"""Memory (issue 7, part 6): peak RSS of `outbox run` draining a backlog at concurrency 64, and
holding 1,024 slow calls in flight.

    python bench/memory.py [--backlog 50000] [--slow-hold 3] [--slow-seconds 30]

Both use the webhook provider against bench/_http_receiver.py in its own process: answering at
once for the drain, holding each request ``--slow-hold`` seconds for the slow case. Peak RSS is
the kernel's high-water mark, VmHWM in /proc/<pid>/status, read just before the process is
stopped; "idle" is VmRSS three seconds after start with nothing to do. Target: peak at most
150 MB at concurrency 64. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from _http_receiver import ReceiverProcess
from _support import (
    bulk_enqueue,
    count_by_status,
    fresh_database,
    outbox_runs,
    print_machine,
    print_table,
    progress,
    wait_until,
)

PROVIDER = "hook"
TARGET_MB = 150.0
IDLE_S = 3.0


@dataclass(frozen=True)
class Result:
    name: str
    concurrency: int
    operations: int
    max_in_flight: int  # outbox_in_flight, sampled
    max_at_receiver: int  # requests the receiver held at once (or connections, for the drain)
    idle_mb: float
    peak_mb: float


def status_kb(pid: int, field: str) -> int:
    """A ``kB`` field (VmRSS, VmHWM) of /proc/<pid>/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def in_flight(metrics_port: int) -> int:
    """The process's outbox_in_flight gauge."""
    try:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    for line in text.splitlines():
        if line.startswith("outbox_in_flight "):
            return int(float(line.split()[1]))
    return 0


def run(
    name: str,
    *,
    concurrency: int,
    operations: int,
    hold: float,
    timeout: str,
    drain: bool,
    seconds: float,
) -> Result:
    """One `outbox run`: idle first, then ``operations`` enqueued; either drained (``drain``)
    or left to run ``seconds`` with the receiver holding every request ``hold`` seconds."""
    port = free_port()
    with fresh_database(prefix="memory_") as db_url, ReceiverProcess(hold=hold) as receiver:
        providers = {PROVIDER: {"type": "webhook", "url": receiver.url, "timeout": timeout}}
        with outbox_runs(
            db_url,
            providers=providers,
            metrics_addr=f"127.0.0.1:{port}",
            concurrency=concurrency,
            shutdown_grace="1s",
        ) as runs:
            pid = runs[0].pid
            time.sleep(IDLE_S)
            idle_kb = status_kb(pid, "VmRSS")
            progress(f"{name}: enqueueing {operations:,} operations")
            bulk_enqueue(db_url, operations, provider=PROVIDER, action="bench.memory")
            peak_in_flight = 0

            def sampled_until_drained() -> bool:
                nonlocal peak_in_flight
                peak_in_flight = max(peak_in_flight, in_flight(port))
                statuses = count_by_status(db_url)
                return statuses.get("pending", 0) + statuses.get("in_flight", 0) == 0

            if drain:
                wait_until(
                    sampled_until_drained, timeout=900, what="the drain", interval=0.25, alive=runs
                )
            else:
                started = time.monotonic()
                while time.monotonic() - started < seconds:
                    peak_in_flight = max(peak_in_flight, in_flight(port))
                    time.sleep(0.5)
                if not runs[0].alive():
                    raise RuntimeError(f"outbox run exited:\n{runs[0].log_text()[-2000:]}")
            peak_kb = status_kb(pid, "VmHWM")
        stats = receiver.stats()
        if drain:
            statuses = count_by_status(db_url)
            if statuses.get("succeeded", 0) != operations:
                raise RuntimeError(f"not every operation succeeded: {statuses}")
    at_receiver = stats["max_holding"] if hold > 0 else stats["max_open_connections"]
    return Result(
        name,
        concurrency,
        operations,
        peak_in_flight,
        int(at_receiver),
        idle_kb / 1024,
        peak_kb / 1024,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backlog", type=int, default=50_000)
    parser.add_argument("--slow-concurrency", type=int, default=1024)
    parser.add_argument(
        "--slow-hold",
        type=float,
        default=3.0,
        help="seconds the receiver holds each request in the slow case",
    )
    parser.add_argument("--slow-seconds", type=float, default=30.0)
    args = parser.parse_args(argv)

    print_machine()
    drain = run(
        "drain a backlog",
        concurrency=64,
        operations=args.backlog,
        hold=0.0,
        timeout="10s",
        drain=True,
        seconds=0,
    )
    # The calls wait in httpx's connection pool beyond its 100 connections: the timeout (which
    # includes the wait for a pool connection) must outlast the queue.
    slow = run(
        f"slow calls, held {args.slow_hold:g} s",
        concurrency=args.slow_concurrency,
        operations=args.slow_concurrency * 3,
        hold=args.slow_hold,
        timeout="120s",
        drain=False,
        seconds=args.slow_seconds,
    )
    rows = [
        (
            r.name,
            r.concurrency,
            f"{r.operations:,}",
            r.max_in_flight,
            r.max_at_receiver,
            f"{r.idle_mb:.1f}",
            f"{r.peak_mb:.1f}",
        )
        for r in (drain, slow)
    ]
    print_table(
        [
            "case",
            "concurrency",
            "operations",
            "in flight (max)",
            "at the receiver at once (max)",
            "idle RSS MB",
            "peak RSS MB (VmHWM)",
        ],
        rows,
        title="Memory of one `outbox run`",
    )
    verdict = "met" if drain.peak_mb <= TARGET_MB else "missed"
    print_table(
        ["target", "peak at concurrency 64", "verdict"],
        [(f"≤ {TARGET_MB:g} MB", f"{drain.peak_mb:.1f} MB", verdict)],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

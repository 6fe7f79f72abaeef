"""Throughput over HTTP (issue 7, part 2): the webhook provider through `outbox run`, against a
bare httpx.AsyncClient loop sending as many requests, as concurrently, to the same kind of
receiver, in the same run.

    python bench/http_webhook.py [--count 20000] [--concurrency 64]

(Not bench/http.py: run as a script, that name would shadow the standard library's `http`
package, which httpx imports.) The receiver is bench/_http_receiver.py, a minimal asyncio
HTTP/1.1 keep-alive server in its own process that answers ``200 {}`` at once; each phase gets a
fresh one. The outbox figure runs from the first claim to the last recorded success by the
database's clock; the bare loop's from its first request to its last answer. The bare loop
shares one AsyncClient between its tasks, as the provider does; a second bare loop gives each
task a client of its own, which shows what httpcore's connection pool costs (its bookkeeping
walks every connection and queued request on each request). Target: outbox at least 0.7 times
the bare loop with one AsyncClient. Exits non-zero only on errors, never on a missed target.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx
from _http_receiver import ReceiverProcess, cpu_seconds
from _support import (
    bulk_enqueue,
    count_by_status,
    drain_window,
    fmt_rate,
    fmt_ratio,
    fresh_database,
    outbox_runs,
    print_machine,
    print_table,
    progress,
    wait_drained,
)

PROVIDER = "hook"
ACTION = "bench.event"
PAYLOAD: dict[str, Any] = {"amount": 1000, "currency": "usd", "customer": "cus_bench"}
TIMEOUT_S = 10.0
TARGET = 0.7
# outbox run imports and connects in well under this; its CPU time is counted from here.
STARTUP_S = 3.0


@dataclass(frozen=True)
class Phase:
    name: str
    requests: int
    seconds: float
    receiver_seconds: float  # first to last arrival, by the receiver's clock
    client_cpu: float  # CPU seconds of the sending process (outbox run, or the bare loop)
    receiver_cpu: float  # CPU seconds of the receiver

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("nan")

    @property
    def receiver_per_second(self) -> float:
        if self.receiver_seconds <= 0:
            return float("nan")
        return (self.requests - 1) / self.receiver_seconds


def _receiver_window(stats: dict[str, Any]) -> float:
    first, last = stats.get("first_at"), stats.get("last_at")
    return float(last - first) if first is not None and last is not None else 0.0


def _client() -> httpx.AsyncClient:
    # As outbox/providers/http/webhook.py builds its client: the same timeout, limits and redirect
    # policy, so the two phases differ only in what outbox does around each request.
    return httpx.AsyncClient(
        timeout=httpx.Timeout(TIMEOUT_S),
        follow_redirects=False,
        limits=httpx.Limits(max_connections=100, max_keepalive_connections=100),
    )


async def _bare_loop(url: str, count: int, concurrency: int, *, shared: bool = True) -> float:
    """``count`` POSTs from ``concurrency`` tasks through one AsyncClient configured as the
    webhook provider configures its own (``shared``), or through one such client per task;
    each answer is read and its JSON parsed, as the provider does. Returns the seconds from the
    first request to the last answer."""
    numbers = itertools.count()
    failures = 0
    clients = [_client() for _ in range(1 if shared else concurrency)]

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal failures
        for n in numbers:
            if n >= count:
                return
            headers = {
                "Idempotency-Key": f'"bare-{n}"',
                "Outbox-Operation-Id": str(n),
                "Outbox-Action": ACTION,
                "Outbox-Attempt": "1",
            }
            request = client.build_request("POST", url, json={"n": n, **PAYLOAD}, headers=headers)
            response = await client.send(request)
            response.json()
            if response.status_code != 200:
                failures += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    elapsed = time.perf_counter() - started
    for client in clients:
        await client.aclose()
    if failures:
        raise RuntimeError(f"{failures} bare requests failed")
    return elapsed


def run_bare(count: int, concurrency: int, *, shared: bool) -> Phase:
    name = "bare httpx loop, one AsyncClient" if shared else "bare httpx loop, a client per task"
    with ReceiverProcess() as receiver:
        progress(f"{name}: {count:,} requests, concurrency {concurrency}")
        cpu, receiver_cpu = time.process_time(), cpu_seconds(receiver.pid)
        elapsed = asyncio.run(_bare_loop(receiver.url, count, concurrency, shared=shared))
        cpu, receiver_cpu = time.process_time() - cpu, cpu_seconds(receiver.pid) - receiver_cpu
        stats = receiver.stats()
    if stats["requests"] != count:
        raise RuntimeError(f"the receiver saw {stats['requests']} requests, not {count}")
    return Phase(name, count, elapsed, _receiver_window(stats), cpu, receiver_cpu)


def run_outbox(count: int, concurrency: int, batch: int) -> Phase:
    with fresh_database(prefix="http_") as db_url, ReceiverProcess() as receiver:
        providers = {PROVIDER: {"type": "webhook", "url": receiver.url, "timeout": "10s"}}
        progress(f"outbox run: concurrency {concurrency}, batch {batch}")
        with outbox_runs(
            db_url, providers=providers, concurrency=concurrency, batch_size=batch
        ) as runs:
            # Started on an empty table, so its CPU time counts the work and not the start.
            time.sleep(STARTUP_S)
            cpu, receiver_cpu = cpu_seconds(runs[0].pid), cpu_seconds(receiver.pid)
            progress(f"enqueueing {count:,} webhook operations")
            bulk_enqueue(db_url, count, provider=PROVIDER, action=ACTION, payload=PAYLOAD)
            wait_drained(db_url, count, timeout=600, runs=runs)
            cpu = cpu_seconds(runs[0].pid) - cpu
            receiver_cpu = cpu_seconds(receiver.pid) - receiver_cpu
        statuses = count_by_status(db_url)
        if statuses.get("succeeded", 0) != count:
            raise RuntimeError(f"not every operation succeeded: {statuses}")
        window = drain_window(db_url)
        stats = receiver.stats()
    if stats["requests"] != count:
        raise RuntimeError(f"the receiver saw {stats['requests']} requests, not {count}")
    return Phase(
        "outbox run, webhook provider",
        count,
        window.seconds,
        _receiver_window(stats),
        cpu,
        receiver_cpu,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args(argv)

    print_machine()
    bare = run_bare(args.count, args.concurrency, shared=True)
    unpooled = run_bare(args.count, args.concurrency, shared=False)
    outbox = run_outbox(args.count, args.concurrency, args.batch_size)
    ratio = outbox.per_second / bare.per_second
    rows = [
        (
            p.name,
            f"{p.requests:,}",
            f"{p.seconds:.2f}",
            fmt_rate(p.per_second),
            fmt_rate(p.receiver_per_second),
            fmt_ratio(outbox.per_second / p.per_second),
            f"{p.client_cpu / p.requests * 1000:.3f}",
            f"{p.receiver_cpu / p.requests * 1000:.3f}",
        )
        for p in (bare, unpooled, outbox)
    ]
    print_table(
        [
            "",
            "requests",
            "seconds",
            "ops/s",
            "ops/s at the receiver",
            "outbox / this",
            "sender CPU ms/op",
            "receiver CPU ms/op",
        ],
        rows,
        title=f"HTTP throughput, concurrency {args.concurrency}",
    )
    verdict = "met" if ratio >= TARGET else "missed"
    print_table(
        ["ratio outbox / bare loop (one AsyncClient)", "target", "verdict"],
        [(fmt_ratio(ratio), f"≥ {TARGET}", verdict)],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Throughput to NATS JetStream (issue 25): `type = "nats"` through `outbox run`, against a bare
nats-py loop publishing as many messages, as concurrently, to the same kind of stream, in the
same run.

    python bench/queue_nats.py [--count 20000] [--concurrency 64] [--runs 3] [--quick]

Both publish to a fresh stream of their own (file storage, a 2-minute duplicate_window) on the
machine's server (127.0.0.1:4222, or --servers), each message with a Nats-Msg-Id and the
Outbox-* headers, each awaiting its PubAck (the same confirmation): the bare loop runs
``concurrency`` tasks over one connection with ``js.publish``, as the provider does. The outbox
figure runs from the first claim to the last recorded success by the database's clock; the bare
loop's from its first publish to its last PubAck. A third phase drains as many operations to the
noop provider: the dispatcher's own ceiling at that moment (on a busy machine it, not the
broker, bounds the ratio). Each phase is run ``--runs`` times and the median shown. Exits
non-zero only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
import uuid

import nats
from _queue_bench import ACTION, drain_through, print_phases, run_noop, run_phases
from _support import (
    print_machine,
)
from nats.js.api import StorageType, StreamConfig

PROVIDER = "jets"
WINDOW_S = 120.0
TIMEOUT_S = 10.0


async def _stream(servers: str, create: bool, name: str) -> int:
    """Create the stream ``name`` (``create``) or delete it; returns its message count."""
    nc = await nats.connect(servers)
    try:
        js = nc.jetstream()
        if create:
            await js.add_stream(
                StreamConfig(
                    name=name,
                    subjects=[f"bench.{name}"],
                    duplicate_window=WINDOW_S,
                    storage=StorageType.FILE,
                )
            )
            return 0
        count = int((await js.stream_info(name)).state.messages)
        await js.delete_stream(name)
        return count
    finally:
        await nc.close()


async def _bare_loop(servers: str, subject: str, count: int, concurrency: int) -> float:
    nc = await nats.connect(servers)
    js = nc.jetstream(timeout=TIMEOUT_S)
    numbers = itertools.count()
    body = b'{"amount": 1000, "currency": "usd", "customer": "cus_bench", "n": 0}'

    async def worker() -> None:
        for n in numbers:
            if n >= count:
                return
            headers = {
                "Outbox-Operation-Id": str(n),
                "Outbox-Action": ACTION,
                "Outbox-Attempt": "1",
                "Outbox-Tenant-Id": "bench",
                "Nats-Msg-Id": f"ob1_{uuid.uuid4().hex}{uuid.uuid4().hex}",
                "Content-Type": "application/json",
            }
            ack = await js.publish(subject, body, stream=subject[6:], headers=headers)
            if ack.duplicate:
                raise RuntimeError("a bare publish was a duplicate")

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started
    finally:
        await nc.close()


def run_bare(servers: str, count: int, concurrency: int) -> float:
    name = f"BENCH_{uuid.uuid4().hex[:8]}"
    asyncio.run(_stream(servers, True, name))
    try:
        seconds = asyncio.run(_bare_loop(servers, f"bench.{name}", count, concurrency))
    finally:
        stored = asyncio.run(_stream(servers, False, name))
    if stored != count:
        raise RuntimeError(f"the bare loop's stream holds {stored} messages, not {count}")
    return seconds


def run_outbox(servers: str, count: int, concurrency: int, batch: int) -> float:
    name = f"BENCH_{uuid.uuid4().hex[:8]}"
    asyncio.run(_stream(servers, True, name))
    stored = -1
    try:
        providers = {
            PROVIDER: {
                "type": "nats",
                "servers": servers,
                "key_retention": "2m",
                "retention_margin": "30s",
                "timeout": f"{TIMEOUT_S:.0f}s",
                "actions": {ACTION: {"subject": f"bench.{name}", "stream": name}},
            }
        }
        seconds = drain_through(providers, count, concurrency, batch)
    finally:
        stored = asyncio.run(_stream(servers, False, name))
    if stored != count:
        raise RuntimeError(f"outbox's stream holds {stored} messages, not {count}")
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--servers", default="nats://127.0.0.1:4222")
    parser.add_argument("--quick", action="store_true", help="2,000 messages, one run each")
    args = parser.parse_args(argv)
    count, runs = (2_000, 1) if args.quick else (args.count, args.runs)

    print_machine()
    phases = run_phases(
        count,
        runs,
        (
            "bare nats-py loop (js.publish, one connection)",
            lambda: run_bare(args.servers, count, args.concurrency),
        ),
        (
            "outbox run, nats provider",
            lambda: run_outbox(args.servers, count, args.concurrency, args.batch_size),
        ),
        lambda: run_noop(count, args.concurrency, args.batch_size),
    )
    print_phases(
        f"NATS JetStream throughput, concurrency {args.concurrency}, {runs} run(s)", phases
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

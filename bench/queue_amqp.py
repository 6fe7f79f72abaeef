"""Throughput to RabbitMQ (issue 25): `type = "amqp"` through `outbox run`, against a bare
aio-pika loop publishing as many messages, as concurrently, to the same kind of queue, in the
same run.

    python bench/queue_amqp.py [--count 20000] [--concurrency 64] [--runs 3] [--quick]

Both publish through the default exchange to a fresh durable queue of their own on the machine's
broker (127.0.0.1:5672, guest/guest, or --url), persistent and mandatory, each message with a
message_id and the Outbox-* headers, each awaiting its publisher confirm (the same
confirmation): the bare loop runs ``concurrency`` tasks over one connection and as many
channels as the provider's default, as the provider does. The outbox figure runs from the first
claim to the last recorded success by the database's clock; the bare loop's from its first
publish to its last confirm. A third phase drains as many operations to the noop provider: the
dispatcher's own ceiling at that moment. Each phase is run ``--runs`` times and the median
shown. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
import uuid

import aio_pika
from _queue_bench import ACTION, drain_through, print_phases, run_noop, run_phases
from _support import (
    print_machine,
)

from outbox.providers.amqp.options import DEFAULT_CHANNELS

PROVIDER = "rabbit"
TIMEOUT_S = 10.0


async def _queue(url: str, name: str, *, create: bool) -> int:
    """Declare the durable queue ``name`` (``create``) or delete it; returns its message count."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        if create:
            await channel.declare_queue(name, durable=True)
            return 0
        queue = await channel.declare_queue(name, passive=True)
        count = int(queue.declaration_result.message_count or 0)
        await queue.delete(if_unused=False, if_empty=False)
        return count
    finally:
        await connection.close()


async def _bare_loop(url: str, queue: str, count: int, concurrency: int) -> float:
    connection = await aio_pika.connect(url)
    channels = [await connection.channel(publisher_confirms=True) for _ in range(DEFAULT_CHANNELS)]
    numbers = itertools.count()
    body = b'{"amount": 1000, "currency": "usd", "customer": "cus_bench", "n": 0}'

    async def worker(slot: int) -> None:
        exchange = channels[slot % len(channels)].default_exchange
        for n in numbers:
            if n >= count:
                return
            message = aio_pika.Message(
                body,
                message_id=f"ob1_{uuid.uuid4().hex}{uuid.uuid4().hex}",
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={
                    "Outbox-Operation-Id": str(n),
                    "Outbox-Action": ACTION,
                    "Outbox-Attempt": "1",
                    "Outbox-Tenant-Id": "bench",
                },
            )
            await exchange.publish(message, routing_key=queue, mandatory=True, timeout=TIMEOUT_S)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        return time.perf_counter() - started
    finally:
        await connection.close()


def run_bare(url: str, count: int, concurrency: int) -> float:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    asyncio.run(_queue(url, name, create=True))
    try:
        seconds = asyncio.run(_bare_loop(url, name, count, concurrency))
    finally:
        stored = asyncio.run(_queue(url, name, create=False))
    if stored != count:
        raise RuntimeError(f"the bare loop's queue holds {stored} messages, not {count}")
    return seconds


def run_outbox(url: str, count: int, concurrency: int, batch: int) -> float:
    name = f"bench-{uuid.uuid4().hex[:8]}"
    asyncio.run(_queue(url, name, create=True))
    try:
        providers = {
            PROVIDER: {
                "type": "amqp",
                "url": url,
                "key_retention": "24h",
                "timeout": f"{TIMEOUT_S:.0f}s",
                "actions": {ACTION: {"exchange": "", "routing_key": name}},
            }
        }
        seconds = drain_through(providers, count, concurrency, batch)
    finally:
        stored = asyncio.run(_queue(url, name, create=False))
    if stored != count:
        raise RuntimeError(f"outbox's queue holds {stored} messages, not {count}")
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--url", default="amqp://127.0.0.1:5672/")
    parser.add_argument("--quick", action="store_true", help="2,000 messages, one run each")
    args = parser.parse_args(argv)
    count, runs = (2_000, 1) if args.quick else (args.count, args.runs)

    print_machine()
    phases = run_phases(
        count,
        runs,
        (
            f"bare aio-pika loop (confirms, one connection, {DEFAULT_CHANNELS} channels)",
            lambda: run_bare(args.url, count, args.concurrency),
        ),
        (
            "outbox run, amqp provider",
            lambda: run_outbox(args.url, count, args.concurrency, args.batch_size),
        ),
        lambda: run_noop(count, args.concurrency, args.batch_size),
    )
    print_phases(f"RabbitMQ throughput, concurrency {args.concurrency}, {runs} run(s)", phases)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

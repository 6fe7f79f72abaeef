"""Throughput with Stripe (issue 7, part 3): `outbox run` creating PaymentIntents through the
Stripe provider and the real SDK, against the same SDK called in a bare asyncio loop with the
same concurrency, both against the fake Stripe. The bare loop runs twice: with one SDK client,
as the SDK comes (the target's reference), and with the provider's clients of eight connections
each (outbox/providers/shards.py), which shows what is left of outbox's own overhead.

    python bench/stripe_sdk.py [--count 5000] [--concurrency 64]

(Not bench/stripe.py: that would shadow the `stripe` package.) The fake Stripe
(outbox/testing/stripe.py, a ThreadingHTTPServer that keeps Stripe's idempotency
semantics) runs in a process of its own, a fresh one per phase. Its own ceiling is measured
first, by a bare httpx loop posting the same form-encoded creates: neither SDK figure can beat
it. Target: outbox at least 0.7 times the bare SDK loop. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import time
import warnings
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import httpx
import stripe
from _http_receiver import cpu_seconds
from _stripe_sdk_fake import FakeStripeProcess
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

from outbox.providers.shards import Shards, shard_sizes
from outbox.testing.stripe import DEFAULT_API_KEY

PROVIDER = "stripe"
ACTION = "payment_intents.create"
PAYLOAD: dict[str, Any] = {"amount": 1000, "currency": "usd", "customer": "cus_bench"}
TIMEOUT_S = 20.0
TARGET = 0.7
# outbox run imports and connects in well under this; its CPU time is counted from here.
STARTUP_S = 3.0

# stripe 16's HTTPXClient posts form bodies as data=<str>, which httpx 0.28 deprecates.
warnings.filterwarnings("ignore", "Use 'content=<...>'", DeprecationWarning)


@dataclass(frozen=True)
class Phase:
    name: str
    requests: int
    seconds: float
    client_cpu: float  # CPU seconds of the calling process (outbox run, or the bare loop)
    fake_cpu: float  # CPU seconds of the fake Stripe

    @property
    def per_second(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else float("nan")


async def _loop(count: int, concurrency: int, one: Callable[[int], Awaitable[None]]) -> float:
    numbers = itertools.count()

    async def worker() -> None:
        for n in numbers:
            if n >= count:
                return
            await one(n)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - started


async def _bare_sdk(url: str, count: int, concurrency: int, *, sharded: bool = False) -> float:
    """The SDK called as it comes: one StripeClient on one HTTPXClient with the provider's
    timeout, no SDK retries; the same metadata outbox adds, an idempotency key per request, and
    the answer turned into a dict as the provider does. ``sharded``: one client per eight
    connections, picked as outbox/providers/shards.py picks them, as the provider does."""
    sizes = shard_sizes(concurrency) if sharded else [concurrency]
    https = [stripe.HTTPXClient(timeout=TIMEOUT_S) for _ in sizes]
    shards = Shards(
        [
            stripe.StripeClient(
                DEFAULT_API_KEY,
                base_addresses={"api": url},
                http_client=http,
                max_network_retries=0,
            )
            for http in https
        ],
        sizes,
    )

    async def one(n: int) -> None:
        key = f"bare-sdk-{n}"
        params = {
            **PAYLOAD,
            "metadata": {"n": str(n), "outbox_operation_id": str(n), "outbox_idempotency_key": key},
        }
        with shards.take() as client:
            created = await client.v1.payment_intents.create_async(
                params=params,  # type: ignore[arg-type]
                options={"idempotency_key": key},
            )
        created.to_dict()

    try:
        return await _loop(count, concurrency, one)
    finally:
        for http in https:
            await http.close_async()  # type: ignore[no-untyped-call]


async def _bare_sdk_sharded(url: str, count: int, concurrency: int) -> float:
    return await _bare_sdk(url, count, concurrency, sharded=True)


async def _bare_httpx(url: str, count: int, concurrency: int) -> float:
    """The fake's ceiling: the same creates as form posts from a plain httpx client."""
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        headers = {
            "Authorization": f"Bearer {DEFAULT_API_KEY}",
            "Content-Type": "application/x-www-form-urlencoded",
        }

        async def one(n: int) -> None:
            key = f"bare-httpx-{n}"
            body = (
                f"amount=1000&currency=usd&customer=cus_bench&metadata[n]={n}"
                f"&metadata[outbox_operation_id]={n}&metadata[outbox_idempotency_key]={key}"
            )
            response = await client.post(
                f"{url}/v1/payment_intents",
                content=body,
                headers={**headers, "Idempotency-Key": key},
            )
            if response.status_code != 200:
                raise RuntimeError(f"the fake answered {response.status_code}: {response.text}")
            response.json()

        return await _loop(count, concurrency, one)


def run_bare(
    name: str,
    loop: Callable[[str, int, int], Coroutine[Any, Any, float]],
    count: int,
    concurrency: int,
) -> Phase:
    with FakeStripeProcess() as fake:
        progress(f"{name}: {count:,} creates, concurrency {concurrency}")
        cpu, fake_cpu = time.process_time(), cpu_seconds(fake.pid)
        elapsed = asyncio.run(loop(fake.url, count, concurrency))
        cpu, fake_cpu = time.process_time() - cpu, cpu_seconds(fake.pid) - fake_cpu
        created = fake.object_count()
    if created != count:
        raise RuntimeError(f"the fake created {created} objects, not {count}")
    return Phase(name, count, elapsed, cpu, fake_cpu)


def run_outbox(count: int, concurrency: int, batch: int) -> Phase:
    with fresh_database(prefix="stripe_") as db_url, FakeStripeProcess() as fake:
        providers = {
            PROVIDER: {
                "type": "stripe",
                "api_key_env": "STRIPE_API_KEY",
                "api_base": fake.url,
                "timeout": "20s",
            }
        }
        progress(f"outbox run: concurrency {concurrency}, batch {batch}")
        env = {"STRIPE_API_KEY": DEFAULT_API_KEY, "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        with outbox_runs(
            db_url, providers=providers, env=env, concurrency=concurrency, batch_size=batch
        ) as runs:
            # Started on an empty table, so its CPU time counts the work and not the start.
            time.sleep(STARTUP_S)
            cpu, fake_cpu = cpu_seconds(runs[0].pid), cpu_seconds(fake.pid)
            progress(f"enqueueing {count:,} payment_intents.create operations")
            bulk_enqueue(db_url, count, provider=PROVIDER, action=ACTION, payload=PAYLOAD)
            wait_drained(db_url, count, timeout=900, runs=runs)
            cpu, fake_cpu = cpu_seconds(runs[0].pid) - cpu, cpu_seconds(fake.pid) - fake_cpu
        statuses = count_by_status(db_url)
        if statuses.get("succeeded", 0) != count:
            raise RuntimeError(f"not every operation succeeded: {statuses}")
        window = drain_window(db_url)
        created = fake.object_count()
    if created != count:
        raise RuntimeError(f"the fake created {created} objects, not {count}")
    return Phase("outbox run, Stripe provider (SDK)", count, window.seconds, cpu, fake_cpu)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    args = parser.parse_args(argv)
    os.environ.pop("STRIPE_LOG", None)

    print_machine()
    ceiling = run_bare(
        "fake's ceiling: bare httpx form posts", _bare_httpx, args.count, args.concurrency
    )
    bare = run_bare("bare stripe SDK loop (create_async)", _bare_sdk, args.count, args.concurrency)
    sharded = run_bare(
        "bare SDK loop, a client per 8 connections", _bare_sdk_sharded, args.count, args.concurrency
    )
    outbox = run_outbox(args.count, args.concurrency, args.batch_size)
    rows = [
        (
            p.name,
            f"{p.requests:,}",
            f"{p.seconds:.2f}",
            fmt_rate(p.per_second),
            fmt_ratio(p.per_second / ceiling.per_second),
            f"{p.client_cpu / p.requests * 1000:.3f}",
            f"{p.fake_cpu / p.requests * 1000:.3f}",
        )
        for p in (ceiling, bare, sharded, outbox)
    ]
    print_table(
        [
            "",
            "creates",
            "seconds",
            "ops/s",
            "of the fake's ceiling",
            "caller CPU ms/op",
            "fake CPU ms/op",
        ],
        rows,
        title=f"Stripe throughput, concurrency {args.concurrency}",
    )
    ratio = outbox.per_second / bare.per_second
    verdict = "met" if ratio >= TARGET else "missed"
    print_table(
        [
            "ratio outbox / bare SDK",
            "target",
            "verdict",
            "outbox / bare SDK with the provider's clients",
        ],
        [
            (
                fmt_ratio(ratio),
                f"≥ {TARGET}",
                verdict,
                fmt_ratio(outbox.per_second / sharded.per_second),
            )
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

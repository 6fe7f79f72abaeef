"""Payload decoding at the door's limits (issue 38, item 2): what one payload dense with brackets
costs the dispatcher's event loop, and what a claim of them does to the loop's other work.

    python bench/payload_decode.py [--runs 9] [--batch 64] [--quick]

Each payload is as costly as outbox.enqueue lets through (1 MiB, 100,000 values, depth 64),
enqueued through the real door into a fresh database and read back as the claim reads it
(``payload::text``). Per payload, medians of ``--runs``: the CPU time of the verdict alone
(``payloads.carried``: all a provider that sends the stored text pays), of decoding it
(``payloads.decode``; a provider that reads the object pays the verdict and a decoding without
its checks), and the peak of memory that decoding allocates (tracemalloc).

Then ``--batch`` such payloads are worked on as a claim's rows are, beside a ticker asking to run
every millisecond on the same loop (outbox run's, uvloop where installed): its longest wait past
its time is how long the loop read no socket, which is what delays other calls' answers and
made the call guard cut answered calls off. Variants: each row's verdict alone (a webhook), and
the verdict and a read of the object (Stripe, an http action with a template), all started in one
turn of the loop; the same in the pipeline's turns (``pipeline.Turns``); and the read in a
thread (asyncio.to_thread), since the json scanner does not release the GIL. Exits non-zero only
on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import time
import tracemalloc
from collections.abc import Callable, Coroutine
from decimal import Decimal
from typing import Any

import psycopg
from _support import fresh_database, median, print_machine, print_table, progress

import outbox
from outbox.core import payloads
from outbox.dispatch.pipeline import TURN_BYTES, Turns
from outbox.runtime.event_loop import run

# A claim's worth of work, and one row's.
Work = Callable[[], Coroutine[Any, Any, None]]
Row = Callable[[str], Coroutine[Any, Any, None]]


def _levels(depth: int) -> list[Any]:
    nested: list[Any] = []
    for _ in range(depth - 1):
        nested = [nested]
    return nested


# The costliest payloads the door lets through, each in its own way.
SHAPES: dict[str, dict[str, Any]] = {
    "100,000 empty arrays": {"a": [[] for _ in range(99_998)]},
    "100,000 empty objects": {"a": [{} for _ in range(99_998)]},
    "depth 64, 99,946 arrays": {"a": [_levels(62)] * 1_612},
    "100,000 decimals": {"a": [Decimal("0.1")] * 99_998},
    "1 MiB: brackets and digits in a string, 60,000 arrays": {
        "a": [[] for _ in range(60_000)],
        "s": ('[{"\\' + "9" * 120 + "]}") * 6_000,
    },
}


def stored_texts() -> dict[str, str]:
    """Each shape enqueued through outbox.enqueue, read back as the claim reads it."""
    texts = {}
    with fresh_database(prefix="payload_") as db_url, psycopg.connect(db_url) as conn:
        for n, (name, payload) in enumerate(SHAPES.items()):
            outbox.enqueue(
                conn,
                tenant_id="bench",
                operation_type="decode",
                operation_key=f"shape-{n}",
                provider="hook",
                action="x",
                payload=payload,
            )
            ((text,),) = conn.execute(
                "SELECT payload::text FROM outbox.operations WHERE operation_key = %s",
                (f"shape-{n}",),
            ).fetchall()
            texts[name] = text
    return texts


def cpu_ms(fn: Callable[[], object], runs: int) -> float:
    """The median CPU time of ``fn``, in ms (this thread's: the loop's own time, not a wall
    clock that other work on a shared machine stretches)."""
    times = []
    for _ in range(runs):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return median(times) * 1000


def peak_mb(fn: Callable[[], object]) -> float:
    tracemalloc.start()
    try:
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak / 1e6


def read(text: str) -> int:
    """What a provider that reads the object does: the verdict, a read, then the release."""
    payload = payloads.carried(text)
    size = len(payload)
    if isinstance(payload, payloads.Decoded):
        payload.release()
    return size


def per_payload(texts: dict[str, str], runs: int) -> None:
    rows = []
    for name, text in texts.items():
        progress(f"decoding {name}")
        verdict = functools.partial(payloads.carried, text)
        decode = functools.partial(payloads.decode, text)
        rows.append(
            [
                name,
                f"{len(text):,}",
                f"{cpu_ms(verdict, runs):.1f}",
                f"{cpu_ms(functools.partial(read, text), runs):.1f}",
                f"{cpu_ms(decode, runs):.1f}",
                f"{peak_mb(verdict):.2f}",
                f"{peak_mb(decode):.1f}",
            ]
        )
    print_table(
        [
            "payload",
            "bytes",
            "verdict ms",
            "verdict + read ms",
            "decode() ms",
            "verdict MB",
            "decode() MB",
        ],
        rows,
        title=f"One payload: CPU time, median of {runs}; peak memory allocated",
    )


async def beside_a_ticker(work: Work) -> tuple[float, float]:
    """Runs ``work`` beside a ticker that asks to run every millisecond; returns its longest
    wait past its time (ms) and the work's wall time (s)."""
    loop = asyncio.get_running_loop()
    lags: list[float] = []
    done = False

    async def tick() -> None:
        while not done:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            lags.append(loop.time() - due)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    lags.clear()
    start = time.perf_counter()
    await work()
    wall = time.perf_counter() - start
    done = True
    await ticker
    return max(lags, default=0.0) * 1000, wall


def batch_variants(text: str, batch: int) -> dict[str, Work]:
    async def rows(one: Row) -> None:
        # A claim's rows: every task created in one turn, as Dispatcher._start does.
        await asyncio.gather(*(asyncio.create_task(one(text)) for _ in range(batch)))

    async def verdict(t: str) -> None:
        payloads.carried(t)

    async def verdict_and_read(t: str) -> None:
        read(t)

    def in_turns(step: Row) -> Row:
        turns = Turns(asyncio.get_running_loop, TURN_BYTES)

        async def one(t: str) -> None:
            if not turns.take(len(t)):
                await turns.wait(len(t))
            await step(t)

        return one

    async def in_a_thread(t: str) -> None:
        await asyncio.to_thread(read, t)

    return {
        "verdict (a webhook), one turn": lambda: rows(verdict),
        "verdict (a webhook), in turns": lambda: rows(in_turns(verdict)),
        "verdict + read (Stripe), one turn": lambda: rows(verdict_and_read),
        "verdict + read (Stripe), in turns": lambda: rows(in_turns(verdict_and_read)),
        "verdict + read (Stripe), in a thread": lambda: rows(in_a_thread),
    }


async def the_loop(texts: dict[str, str], batch: int) -> None:
    results = []
    for name in ("100,000 empty arrays", "100,000 decimals"):
        for variant, work in batch_variants(texts[name], batch).items():
            progress(f"{batch} x {name}: {variant}")
            longest, wall = await beside_a_ticker(work)
            results.append([name, variant, f"{longest:.0f}", f"{wall:.2f}"])
    print_table(
        ["payloads", "worked on", "longest wait ms", "wall s"],
        results,
        title=f"A claim of {batch} such payloads, beside a ticker due every ms",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9, help="runs per figure (median)")
    parser.add_argument("--batch", type=int, default=64, help="payloads in the claim")
    parser.add_argument("--quick", action="store_true", help="3 runs, a claim of 8")
    args = parser.parse_args()
    runs, batch = (3, 8) if args.quick else (args.runs, args.batch)
    print_machine()
    texts = stored_texts()
    per_payload(texts, runs)
    run(the_loop(texts, batch), "auto")


if __name__ == "__main__":
    main()

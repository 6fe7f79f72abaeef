"""Throughput to Google Cloud Tasks (issue 25): `type = "cloudtasks"` through `outbox run`, against
a bare google-cloud-tasks loop creating as many tasks, as concurrently, on the same kind of
emulator, in the same run.

    python bench/queue_cloudtasks.py [--count 5000] [--concurrency 64] [--runs 3] [--quick]

Each phase gets a fresh gcloud-tasks-emulator (tests/support/tasks_emulator.py) with one queue,
paused, so that the emulator spends its time on CreateTask rather than on calling targets. Both
create named tasks (``<queue>/tasks/<sha256 hex>``, the provider's form) with the payload as body
and the Outbox-* headers, each awaiting CreateTask's answer (the same confirmation), the bare
loop from ``concurrency`` tasks over one CloudTasksAsyncClient (one gRPC channel), as the
provider does. The outbox figure runs from the first claim to the last recorded success by the
database's clock; the bare loop's from its first CreateTask to its last answer. Each phase is run
``--runs`` times and the median shown; a third phase drains as many operations to the noop
provider, the dispatcher's own ceiling at that moment. The emulator, a Python gRPC server with
two worker threads, is the bottleneck of both, so the ratio says what outbox costs around each
call, not what Cloud Tasks takes (its default queue rate is 500 dispatches a second; creation
is bounded by the API's quotas). Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import sys
import tempfile
import time
import uuid
from pathlib import Path

from _queue_bench import ACTION, drain_through, print_phases, run_noop, run_phases
from _support import (
    print_machine,
)

from outbox.providers.cloudtasks.client import build_client, tasks_v2
from tests.support.tasks_emulator import LOCATION, PROJECT, TasksEmulator, queue_name

PROVIDER = "tasks"
QUEUE = "bench"
TIMEOUT_S = 10.0
TARGET_URL = "http://127.0.0.1:9/never-called"  # the queue is paused


async def _pause(endpoint: str) -> None:
    client = build_client(endpoint, emulator=True)
    try:
        await client.pause_queue(name=queue_name(QUEUE), retry=None, timeout=TIMEOUT_S)
    finally:
        await client.transport.close()  # type: ignore[no-untyped-call]


async def _bare_loop(endpoint: str, count: int, concurrency: int) -> float:
    client = build_client(endpoint, emulator=True)
    parent = queue_name(QUEUE)
    numbers = itertools.count()
    body = b'{"amount": 1000, "currency": "usd", "customer": "cus_bench", "n": 0}'

    async def worker() -> None:
        for n in numbers:
            if n >= count:
                return
            task_id = hashlib.sha256(f"bare-{n}".encode()).hexdigest()
            task = tasks_v2.Task(
                name=f"{parent}/tasks/{task_id}",
                http_request=tasks_v2.HttpRequest(
                    url=TARGET_URL,
                    http_method=tasks_v2.HttpMethod.POST,
                    headers={
                        "Content-Type": "application/json",
                        "Outbox-Operation-Id": str(n),
                        "Outbox-Action": ACTION,
                        "Outbox-Attempt": "1",
                        "Outbox-Tenant-Id": "bench",
                        "Outbox-Idempotency-Key": task_id,
                    },
                    body=body,
                ),
            )
            await client.create_task(parent=parent, task=task, retry=None, timeout=TIMEOUT_S)

    started = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started
    finally:
        await client.transport.close()  # type: ignore[no-untyped-call]


def _emulator(directory: Path, name: str) -> TasksEmulator:
    emulator = TasksEmulator([QUEUE], directory / f"{name}-{uuid.uuid4().hex[:8]}.log").start()
    asyncio.run(_pause(emulator.endpoint))
    return emulator


def run_bare(directory: Path, count: int, concurrency: int) -> float:
    emulator = _emulator(directory, "bare")
    try:
        seconds = asyncio.run(_bare_loop(emulator.endpoint, count, concurrency))
        created = sum(emulator.created().values())
    finally:
        emulator.kill()
    if created != count:
        raise RuntimeError(f"the bare loop created {created} tasks, not {count}")
    return seconds


def run_outbox(directory: Path, count: int, concurrency: int, batch: int) -> float:
    emulator = _emulator(directory, "outbox")
    try:
        providers = {
            PROVIDER: {
                "type": "cloudtasks",
                "project": PROJECT,
                "location": LOCATION,
                "endpoint": emulator.endpoint,
                "key_retention": "1h",
                "retention_margin": "10m",
                "timeout": f"{TIMEOUT_S:.0f}s",
                "actions": {ACTION: {"queue": QUEUE, "url": TARGET_URL}},
            }
        }
        seconds = drain_through(providers, count, concurrency, batch)
        created = sum(emulator.created().values())
    finally:
        emulator.kill()
    if created != count:
        raise RuntimeError(f"outbox created {created} tasks, not {count}")
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=5_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1,000 tasks, one run each")
    args = parser.parse_args(argv)
    count, runs = (1_000, 1) if args.quick else (args.count, args.runs)

    print_machine()
    with tempfile.TemporaryDirectory(prefix="outbox-bench-tasks-") as tmp:
        directory = Path(tmp)
        phases = run_phases(
            count,
            runs,
            (
                "bare google-cloud-tasks loop (CreateTask, one channel)",
                lambda: run_bare(directory, count, args.concurrency),
            ),
            (
                "outbox run, cloudtasks provider",
                lambda: run_outbox(directory, count, args.concurrency, args.batch_size),
            ),
            lambda: run_noop(count, args.concurrency, args.batch_size),
        )
    title = "Cloud Tasks (gcloud-tasks-emulator) throughput"
    print_phases(f"{title}, concurrency {args.concurrency}, {runs} run(s)", phases)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

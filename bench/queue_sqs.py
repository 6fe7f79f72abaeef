"""Throughput to an SQS FIFO queue (issue 25): `type = "sqs"` through `outbox run`, against a
bare aiobotocore loop sending as many messages, as concurrently, to the same kind of queue, in
the same run, both to moto's server mode on loopback (a Python server: it, not SQS, bounds both).

    python bench/queue_sqs.py [--count 20000] [--concurrency 64] [--runs 3] [--quick]

moto_server is started on a free port for the run. Both send to a fresh FIFO queue of their own,
each message with a MessageDeduplicationId (a SHA-256 in hex, as the provider's default), its own
message group and the Outbox-* attributes, each awaiting SendMessage's answer: the bare loop runs
``concurrency`` tasks over one client. The outbox figure runs from the first claim to the last
recorded success by the database's clock; the bare loop's from its first send to its last
answer. A third phase drains as many operations to the noop provider: the dispatcher's own
ceiling at that moment. Each phase is run ``--runs`` times and the median shown. Exits non-zero
only on errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _queue_bench import ACTION, drain_through, print_phases, run_noop, run_phases
from _support import (
    print_machine,
)
from aiobotocore.session import AioSession

PROVIDER = "sqs"
TIMEOUT_S = 10.0
REGION = "us-east-1"
# moto takes any credentials; nothing of a developer's own AWS setup is read.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": REGION,
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    binary = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen(  # noqa: S603 (our own venv's binary, fixed arguments)
        [binary, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/", timeout=1).close()  # noqa: S310
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.kill()
        proc.wait()


def _client(endpoint: str) -> Any:
    return AioSession().create_client("sqs", region_name=REGION, endpoint_url=endpoint)


async def _queue(endpoint: str, name: str, *, create: bool) -> int:
    """Create the FIFO queue ``name`` (``create``) or delete it; returns its message count."""
    async with _client(endpoint) as sqs:
        if create:
            await sqs.create_queue(QueueName=name, Attributes={"FifoQueue": "true"})
            return 0
        url = (await sqs.get_queue_url(QueueName=name))["QueueUrl"]
        attributes = await sqs.get_queue_attributes(
            QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"]
        )
        await sqs.delete_queue(QueueUrl=url)
        return int(attributes["Attributes"]["ApproximateNumberOfMessages"])


async def _bare_loop(endpoint: str, name: str, count: int, concurrency: int) -> float:
    numbers = itertools.count()
    body = '{"amount": 1000, "currency": "usd", "customer": "cus_bench", "n": 0}'
    async with _client(endpoint) as sqs:
        url = (await sqs.get_queue_url(QueueName=name))["QueueUrl"]

        async def worker() -> None:
            for n in numbers:
                if n >= count:
                    return
                key = f"ob1_{uuid.uuid4().hex}{uuid.uuid4().hex}"
                attributes = {
                    name: {"DataType": "String", "StringValue": value}
                    for name, value in (
                        ("Outbox-Operation-Id", str(n)),
                        ("Outbox-Action", ACTION),
                        ("Outbox-Attempt", "1"),
                        ("Outbox-Tenant-Id", "bench"),
                    )
                }
                await sqs.send_message(
                    QueueUrl=url,
                    MessageBody=body,
                    MessageGroupId=f"op-{n}",
                    MessageDeduplicationId=hashlib.sha256(key.encode()).hexdigest(),
                    MessageAttributes=attributes,
                )

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def run_bare(endpoint: str, count: int, concurrency: int) -> float:
    name = f"bench-{uuid.uuid4().hex[:8]}.fifo"
    asyncio.run(_queue(endpoint, name, create=True))
    try:
        seconds = asyncio.run(_bare_loop(endpoint, name, count, concurrency))
    finally:
        stored = asyncio.run(_queue(endpoint, name, create=False))
    if stored != count:
        raise RuntimeError(f"the bare loop's queue holds {stored} messages, not {count}")
    return seconds


def run_outbox(endpoint: str, count: int, concurrency: int, batch: int) -> float:
    name = f"bench-{uuid.uuid4().hex[:8]}.fifo"
    asyncio.run(_queue(endpoint, name, create=True))
    try:
        providers = {
            PROVIDER: {
                "type": "sqs",
                "region": REGION,
                "endpoint_url": endpoint,
                "key_retention": "5m",
                "retention_margin": "1m",
                "timeout": f"{TIMEOUT_S:.0f}s",
                "actions": {
                    ACTION: {
                        "queue_url": f"{endpoint}/123456789012/{name}",
                        "message_group": "{operation_key}",
                    }
                },
            }
        }
        seconds = drain_through(providers, count, concurrency, batch, env=CREDENTIALS)
    finally:
        stored = asyncio.run(_queue(endpoint, name, create=False))
    if stored != count:
        raise RuntimeError(f"outbox's queue holds {stored} messages, not {count}")
    return seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="300 messages, one run each (moto slows as its queue fills)",
    )
    args = parser.parse_args(argv)
    count, runs = (300, 1) if args.quick else (args.count, args.runs)

    os.environ.update(CREDENTIALS)
    print_machine()
    with moto_server() as endpoint:
        phases = run_phases(
            count,
            runs,
            (
                "bare aiobotocore loop (SendMessage, one client)",
                lambda: run_bare(endpoint, count, args.concurrency),
            ),
            (
                "outbox run, sqs provider",
                lambda: run_outbox(endpoint, count, args.concurrency, args.batch_size),
            ),
            lambda: run_noop(count, args.concurrency, args.batch_size),
        )
    print_phases(
        f"SQS FIFO (moto) throughput, concurrency {args.concurrency}, {runs} run(s)", phases
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

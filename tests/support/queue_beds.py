"""The three brokers an inbox consumer takes messages from, as a queue of a test's own: NATS
JetStream, RabbitMQ and SQS (moto). Each bed says how the consumer program
(tests/support/queue_consumer.py) is told to consume it, how a test publishes to it, how many
messages it still holds, and the provider table with which `outbox run` publishes to it. Shared
by tests/integration/test_inbox_queue_stop.py and test_inbox_chain_queues.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aio_pika
import nats
import pytest
from aiobotocore.session import get_session
from nats.js.api import StorageType, StreamConfig

from tests.support.dispatch import rows
from tests.support.moto_server import REGION, MotoServer
from tests.support.queue_consumer import AMQP_URL, NATS_URL, ConsumerProcess, read_journal
from tests.support.queues import require_service

GRACE: Final = 2.5  # the consumer's, in seconds
# What every bed's provider table shares: a short timeout, a breaker that probes within a second.
PROVIDER: Final = {"timeout": "3s", "breaker_open_for": "1s"}


@dataclass
class Bed:
    """One broker's queue for one test: what the consumer program is told to consume, how to
    publish to it and how many messages it still holds (ready, or taken and not settled)."""

    broker: str
    args: list[str]
    publish: Callable[[list[dict[str, Any]]], Awaitable[None]]
    held: Callable[[], Awaitable[int]]
    provider: dict[str, Any]  # `outbox run`'s table that publishes every action here


def headers(n: int) -> dict[str, Any]:
    return {"Outbox-Operation-Id": str(n), "Outbox-Tenant-Id": "acme"}


@pytest.fixture
def redeliver_after() -> int:
    """Seconds before a message taken and never settled comes again: the JetStream durable's ack
    wait and the SQS queue's visibility timeout (RabbitMQ takes back what a dead consumer's
    connection held at once). Short where a test waits for it; long where it must not."""
    return 2


@pytest.fixture(params=["jetstream", "rabbitmq", "sqs"])
async def bed(request: pytest.FixtureRequest, redeliver_after: int) -> AsyncIterator[Bed]:
    """A stream, a queue or a queue on moto of its own, deleted after."""
    beds = {"jetstream": _jetstream, "rabbitmq": _rabbitmq, "sqs": _sqs}
    async for made in beds[request.param](request, redeliver_after):
        yield made


@asynccontextmanager
async def memory_stream(prefix: str, **config: Any) -> AsyncIterator[tuple[Any, str, str]]:
    """A JetStream stream in memory of one test's own, ``(jetstream, name, subject)``, named
    after ``prefix`` (``inbox.stop``: INBOX_STOP_<random>, inbox.stop.<random>) and deleted
    after; ``config``: more of its StreamConfig."""
    require_service("NATS", 4222, "see .ci/run")
    suffix = uuid.uuid4().hex[:10]
    name = f"{prefix.replace('.', '_').upper()}_{suffix}"
    subject = f"{prefix}.{suffix}"
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    stream = StreamConfig(name=name, subjects=[subject], storage=StorageType.MEMORY, **config)
    await js.add_stream(stream)
    try:
        yield js, name, subject
    finally:
        await js.delete_stream(name)
        await nc.close()


async def _jetstream(request: pytest.FixtureRequest, redeliver_after: int) -> AsyncIterator[Bed]:
    async with memory_stream("inbox.stop") as (js, name, subject):
        async for made in _jetstream_bed(js, name, subject, redeliver_after):
            yield made


async def _jetstream_bed(
    js: Any, name: str, subject: str, redeliver_after: int
) -> AsyncIterator[Bed]:
    async def publish(messages: list[dict[str, Any]]) -> None:
        for m in messages:
            await js.publish(subject, json.dumps(m).encode(), headers=headers(m["n"]))

    async def held() -> int:
        info = await js.consumer_info(name, "workers")
        return int(info.num_pending + info.num_ack_pending)

    args = ["jetstream", "--target", name, "--ack-wait", str(redeliver_after)]
    provider = {
        "type": "nats",
        "servers": NATS_URL,
        "key_retention": "2m",
        "retention_margin": "30s",
        **PROVIDER,
        "actions": {"*": {"subject": subject, "stream": name}},
    }
    yield Bed("jetstream", args, publish, held, provider)


async def _rabbitmq(request: pytest.FixtureRequest, _: int) -> AsyncIterator[Bed]:
    require_service("RabbitMQ", 5672, "see .ci/run")
    name = f"inbox-stop-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect_robust(AMQP_URL)
    channel = await connection.channel()
    await channel.declare_queue(name, auto_delete=False)

    async def publish(messages: list[dict[str, Any]]) -> None:
        for m in messages:
            message = aio_pika.Message(json.dumps(m).encode(), headers=headers(m["n"]))
            await channel.default_exchange.publish(message, routing_key=name)

    async def held() -> int:
        # Ready messages only: a live consumer's unacknowledged ones are not counted. A channel
        # of its own: a robust channel answers a passive declaration of its queue from a cache.
        asking = await connection.channel()
        declared = await asking.declare_queue(name, passive=True)
        await asking.close()
        return int(declared.declaration_result.message_count or 0)

    provider = {
        "type": "amqp",
        "url": "amqp://127.0.0.1:5672/",  # guest/guest, the broker's default login
        "key_retention": "24h",
        **PROVIDER,
        "actions": {"*": {"exchange": "", "routing_key": name}},
    }
    try:
        yield Bed("rabbitmq", ["rabbitmq", "--target", name], publish, held, provider)
    finally:
        await channel.queue_delete(name)
        await connection.close()


async def _sqs(request: pytest.FixtureRequest, redeliver_after: int) -> AsyncIterator[Bed]:
    server: MotoServer = request.getfixturevalue("moto")
    session = get_session()
    async with session.create_client("sqs", region_name=REGION, endpoint_url=server.url) as client:
        name = f"inbox-stop-{uuid.uuid4().hex[:10]}"
        attributes = {"VisibilityTimeout": str(redeliver_after)}
        url = (await client.create_queue(QueueName=name, Attributes=attributes))["QueueUrl"]

        async def publish(messages: list[dict[str, Any]]) -> None:
            for m in messages:
                attributes = {
                    k: {"DataType": "String", "StringValue": v} for k, v in headers(m["n"]).items()
                }
                await client.send_message(
                    QueueUrl=url, MessageBody=json.dumps(m), MessageAttributes=attributes
                )

        async def held() -> int:
            names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
            found = await client.get_queue_attributes(QueueUrl=url, AttributeNames=names)
            return sum(int(found["Attributes"][n]) for n in names)

        provider = {
            "type": "sqs",
            "region": REGION,
            "endpoint_url": server.url,
            "key_retention": "5m",
            "retention_margin": "1m",
            **PROVIDER,
            "actions": {"*": {"queue_url": url}},
        }
        args = ["sqs", "--target", url, "--endpoint", server.url]
        yield Bed("sqs", args, publish, held, provider)
        await client.delete_queue(QueueUrl=url)


def start(
    bed: Bed, db_url: str, tmp_path: Path, name: str, *more: str, **env: str
) -> ConsumerProcess:
    """A consumer process of ``bed``'s queue, journaling to the test's one journal, with the
    grace GRACE unless ``more`` says another."""
    journal = tmp_path / "journal.jsonl"
    args = [*bed.args, "--db", db_url, "--journal", str(journal), "--grace", str(GRACE), *more]
    return ConsumerProcess(args, tmp_path / f"{name}.log", env)


def settled(tmp_path: Path, pid: int | None = None) -> list[tuple[int, str, str]]:
    """How each settle of process ``pid`` (of any) ended: (message, decision, verdict)."""
    found = [(e["n"], e["decision"], e["verdict"]) for e in events(tmp_path, "settled", pid)]
    return sorted(found)


def events(tmp_path: Path, event: str, pid: int | None = None) -> list[dict[str, Any]]:
    found = read_journal(tmp_path / "journal.jsonl")
    return [e for e in found if e["event"] == event and (pid is None or e["pid"] == pid)]


async def wait_until(check: Callable[[], bool], what: str, process: ConsumerProcess) -> None:
    deadline = time.monotonic() + 15
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{process.said()}")
        await asyncio.sleep(0.02)


async def wait_held(bed: Bed, count: int, process: ConsumerProcess) -> None:
    """Wait until the broker holds ``count`` messages (RabbitMQ requeues a dead consumer's a
    moment after it died)."""
    deadline = time.monotonic() + 5
    while (held := await bed.held()) != count:
        if time.monotonic() > deadline:
            raise AssertionError(f"the broker holds {held}, not {count}:\n{process.said()}")
        await asyncio.sleep(0.05)


def active_sessions(db_url: str) -> int:
    """Sessions of the test's database running a statement, other than this one's."""
    query = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND state = 'active' AND pid <> pg_backend_pid()"
    )
    return int(rows(db_url, query)[0][0])


def rows_by_message(db_url: str) -> dict[int, list[int]]:
    """The pids that wrote each message's business rows."""
    found: dict[int, list[int]] = {}
    for n, pid in rows(db_url, "SELECT n, pid FROM stop_rows ORDER BY n"):
        found.setdefault(int(n), []).append(int(pid))
    return found

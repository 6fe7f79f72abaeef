"""A queue consumer stopped during its work (issue 40), on NATS JetStream, RabbitMQ and SQS
(moto): a real consumer process (tests/support/queue_consumer.py) is stopped with SIGTERM while
its handlers sleep mid-transaction, or SIGKILLed between a COMMIT and its ack; then a second
process takes over. Whatever happened, each message ends as exactly one business row, written
by one run of the handler that committed (docs/design.md, "Queue consumers", "A stop drains").
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import aio_pika
import nats
import psycopg
import pytest
from aiobotocore.session import get_session
from nats.js.api import StorageType, StreamConfig

from tests.support.dispatch import rows
from tests.support.moto_server import REGION, MotoServer, aws_env, moto
from tests.support.queue_consumer import AMQP_URL, NATS_URL, ConsumerProcess, prepare, read_journal
from tests.support.queues import require_service

__all__ = ["aws_env", "moto"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("aws_env")

GRACE: Final = 2.5  # the consumer's, in seconds
# How long handlers go on after the stop. A short one outlasts the fetch under way at the stop
# (0.5 s on JetStream, 1 s on SQS here), after which a stop without grace would cut it, and ends
# well within the grace; the grace cuts a long one short.
SHORT: Final = 1.5
LONG: Final = 60.0
# Every COMMIT of a transaction that wrote a business row sleeps a while in a deferred trigger.
SLOW_COMMIT: Final = """
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(1.5);
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON stop_rows DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION slow_commit();
"""


@dataclass
class Bed:
    """One broker's queue for one test: what the consumer program is told to consume, how to
    publish to it and how many messages it still holds (ready, or taken and not settled)."""

    broker: str
    args: list[str]
    publish: Callable[[list[dict[str, Any]]], Awaitable[None]]
    held: Callable[[], Awaitable[int]]


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


async def _jetstream(request: pytest.FixtureRequest, redeliver_after: int) -> AsyncIterator[Bed]:
    require_service("NATS", 4222, "see .ci/run")
    suffix = uuid.uuid4().hex[:10]
    name, subject = f"INBOX_STOP_{suffix}", f"inbox.stop.{suffix}"
    nc = await nats.connect(NATS_URL)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=name, subjects=[subject], storage=StorageType.MEMORY))

    async def publish(messages: list[dict[str, Any]]) -> None:
        for m in messages:
            await js.publish(subject, json.dumps(m).encode(), headers=headers(m["n"]))

    async def held() -> int:
        info = await js.consumer_info(name, "workers")
        return int(info.num_pending + info.num_ack_pending)

    args = ["jetstream", "--target", name, "--ack-wait", str(redeliver_after)]
    try:
        yield Bed("jetstream", args, publish, held)
    finally:
        await js.delete_stream(name)
        await nc.close()


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

    try:
        yield Bed("rabbitmq", ["rabbitmq", "--target", name], publish, held)
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

        yield Bed("sqs", ["sqs", "--target", url, "--endpoint", server.url], publish, held)
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


# Long: what was cut short comes again because it was given back, not because it was left.
@pytest.mark.parametrize("redeliver_after", [30])
async def test_a_sigterm_drains_acks_what_committed_and_gives_back_what_it_cut_short(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    prepare(db_url)
    short, long = [0, 1, 2], [3, 4, 5]
    await bed.publish([{"n": n, "sleep": SHORT if n in short else LONG} for n in short + long])
    with start(bed, db_url, tmp_path, "first", "--sleep") as first:
        await wait_until(
            lambda: len(events(tmp_path, "began")) == 6, "every handler to begin", first
        )
        stopped = time.monotonic()
        assert first.terminate(timeout=GRACE + 10) == 0, first.said()
        took = time.monotonic() - stopped
    in_grace = [(n, "new", "ack") for n in short]
    assert settled(tmp_path) == in_grace, "the short ones finished within the grace"
    # It waited for the grace (the long ones), and no longer than the grace and a give-back.
    assert GRACE <= took < GRACE + 5, took
    assert sorted(e["n"] for e in events(tmp_path, "cut_short")) == long
    assert rows_by_message(db_url) == {n: [first.pid] for n in short}, "cut short: rolled back"
    await wait_held(bed, len(long), first)  # given back, never acknowledged

    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(
            lambda: len(events(tmp_path, "settled", second.pid)) == len(long),
            "the cut-short messages to come again",
            second,
        )
        await asyncio.sleep(0.3)  # an acknowledged message that came again would be here by now
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(n, "new", "ack") for n in long]
    assert rows_by_message(db_url) == {
        **{n: [first.pid] for n in short},
        **{n: [second.pid] for n in long},
    }
    assert await bed.held() == 0


async def test_a_sigkill_between_commit_and_ack_is_replayed_by_the_redelivery(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    prepare(db_url)
    messages = [0, 1, 2]
    await bed.publish([{"n": n, "sleep": 0} for n in messages])
    env = {"OUTBOX_FAILPOINTS": "inbox_before_ack=60"}
    with start(bed, db_url, tmp_path, "first", **env) as first:
        await wait_until(
            lambda: len(events(tmp_path, "settled")) == len(messages), "every COMMIT", first
        )
        first.kill()
    assert rows_by_message(db_url) == {n: [first.pid] for n in messages}
    await wait_held(bed, len(messages), first)  # committed, never acknowledged
    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(
            lambda: len(events(tmp_path, "settled", second.pid)) == len(messages),
            "the redeliveries",
            second,
        )
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(n, "replayed", "ack") for n in messages]
    began = Counter(e["n"] for e in events(tmp_path, "began"))
    assert began == Counter(messages), "the handler ran once for each message"
    assert rows_by_message(db_url) == {n: [first.pid] for n in messages}
    assert await bed.held() == 0


@pytest.mark.parametrize("redeliver_after", [30])
async def test_a_stop_that_cuts_a_commit_under_way_gives_it_back_and_it_replays(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    # A COMMIT that takes longer than the grace: a deferred trigger sleeps in it. The cut cannot
    # stop it (it is shielded) and settle cannot know how it ended, so the message goes back;
    # after the COMMIT ended, so that the redelivery replays at once, never "in progress".
    prepare(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(SLOW_COMMIT)
    await bed.publish([{"n": 0, "sleep": 0}])
    with start(bed, db_url, tmp_path, "first", "--grace", "0.3") as first:
        await wait_until(lambda: len(events(tmp_path, "began")) == 1, "the handler", first)
        assert first.terminate(timeout=15) == 0, first.said()
    assert active_sessions(db_url) == 0, "it let go of a COMMIT under way"
    assert [e["n"] for e in events(tmp_path, "cut_short")] == [0]
    assert settled(tmp_path) == []
    assert rows_by_message(db_url) == {0: [first.pid]}, "the COMMIT went on after the cut"
    await wait_held(bed, 1, first)  # given back, never acknowledged
    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(lambda: len(settled(tmp_path)) == 1, "the redelivery", second)
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(0, "replayed", "ack")]
    assert len(events(tmp_path, "began")) == 1
    assert await bed.held() == 0

"""The whole chain through each broker, with kills (issue 40): an application enqueues with its
business write, a real `outbox run` publishes to NATS JetStream, RabbitMQ or SQS (moto), and a
real consumer process (tests/support/queue_consumer.py) records each message through the inbox.
Both processes are SIGKILLed at seeded moments and started again. Counted in rows at the end:
every operation succeeded, and each is exactly one business row and one completed inbox
record, none lost, none doubled, however often the broker delivered it. The seed is printed on
failure.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import psycopg
import pytest

import outbox
from tests.support.daemon import OutboxProcess, write_config
from tests.support.invoice_worker import count
from tests.support.moto_server import aws_env, moto
from tests.support.queue_beds import Bed, bed, redeliver_after, rows_by_message, start
from tests.support.queue_consumer import ConsumerProcess, prepare
from tests.support.queues import FAST_RUN, wait_settled

__all__ = ["aws_env", "bed", "moto", "redeliver_after"]  # the fixtures, used by name
pytestmark = [pytest.mark.usefixtures("aws_env"), pytest.mark.slow]

OPERATIONS = 60


def enqueue(db_url: str) -> None:
    """Each operation in the transaction of its order; its payload is the message's body."""
    prepare(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (n int PRIMARY KEY)")
    with psycopg.connect(db_url) as conn:
        for n in range(OPERATIONS):
            conn.execute("INSERT INTO orders VALUES (%s)", (n,))
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="order.ship",
                operation_key=f"order-{n}",
                provider="broker",
                action="order.ship",
                payload={"n": n, "sleep": 0},
            )
            conn.commit()


async def test_a_seeded_chain_through_each_broker_with_kills_loses_and_doubles_nothing(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    said = f"seed {seed}, {bed.broker}"
    enqueue(db_url)
    config = write_config(tmp_path / "outbox.toml", providers={"broker": bed.provider}, **FAST_RUN)
    consumers = [start(bed, db_url, tmp_path, "consumer-0")]
    run = OutboxProcess(db_url, config, tmp_path / "run.log")
    try:
        for i in range(4):
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            if rng.random() < 0.5:
                consumers[-1].kill()
                await asyncio.sleep(rng.uniform(0, 0.3))
                consumers.append(start(bed, db_url, tmp_path, f"consumer-{i + 1}"))
            else:
                run.stop()
                await asyncio.sleep(rng.uniform(0, 0.3))
                run = OutboxProcess(db_url, config, tmp_path / "run.log")
        settled = await asyncio.to_thread(wait_settled, db_url, OPERATIONS, timeout=90, process=run)
        await all_recorded(db_url, bed, consumers[-1], said)
    finally:
        run.stop()
        for consumer in consumers:
            consumer.kill()
    assert settled.get("succeeded") == OPERATIONS, (said, settled)
    written = rows_by_message(db_url)
    assert sorted(written) == list(range(OPERATIONS)), said
    doubled = {n: pids for n, pids in written.items() if len(pids) != 1}
    assert doubled == {}, said
    # One record per operation, known by the sending database and the operation, with the
    # fingerprint enqueue stored: the consumer checked each body against it.
    completed = (
        "SELECT count(*) FROM outbox.operations o JOIN outbox.inbox i"
        " ON i.key = 'op:' || o.id AND i.origin = outbox.origin() AND i.tenant_id = o.tenant_id"
        " AND i.state = 'completed' AND i.fingerprint = o.fingerprint"
    )
    assert count(db_url, completed) == OPERATIONS, said


async def all_recorded(db_url: str, bed: Bed, consumer: ConsumerProcess, said: str) -> None:
    """Wait until every message wrote its row and the broker holds none (all acknowledged),
    then a moment more: a copy delivered again would have written a second row by then."""
    deadline = time.monotonic() + 60
    while True:
        written = count(db_url, "SELECT count(DISTINCT n) FROM stop_rows")
        if written == OPERATIONS and await bed.held() == 0:
            break
        if time.monotonic() > deadline:
            raise AssertionError(f"{said}: {written} of {OPERATIONS} written\n{consumer.said()}")
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)

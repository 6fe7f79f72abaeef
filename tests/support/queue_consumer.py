"""A queue consumer of the inbox as a process of its own, for tests that stop it with a signal
(tests/integration/test_inbox_queue_stop.py): ``python -m tests.support.queue_consumer BROKER``.

Its handler inserts one ``stop_rows`` row per message it runs (no unique key: a second run of
one message would show as a second row), then, with ``--sleep``, waits in its transaction for
the stop and sleeps the message's ``sleep`` seconds after it: past any fetch under way at the
stop, so that only the grace can let it finish.

It journals, one JSON line each, what it did: ``began`` (the handler ran and wrote its row),
``settled`` (settle returned, after COMMIT: the verdict and the decision), ``cut_short`` (settle
was cancelled by the stop's grace), ``exited``. The journal outlives a SIGKILL: each line is
written with one ``write`` as it happens. SIGTERM drains the consumer through
:func:`outbox.inbox.draining.stop_on_signals`; it exits 0 once drained.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Delivery, Inbox
from outbox.inbox.draining import stop_on_signals
from outbox.inbox.queues import Consumer, Settled
from outbox.observability import logs

ROOT: Final = Path(__file__).resolve().parents[2]
NATS_URL: Final = "nats://127.0.0.1:4222"
AMQP_URL: Final = "amqp://guest:guest@127.0.0.1:5672/"
HANDLER: Final = "stop.test"
CREATE: Final = "CREATE TABLE stop_rows (n int NOT NULL, pid int NOT NULL)"
BATCH: Final = 10  # messages under way at once: every test's whole workload


class ConsumerProcess:
    """One run of this program, started with ``args`` (after the module), its output appended to
    ``log_path``; SIGKILLed by ``kill`` or on the way out of a ``with``."""

    def __init__(self, args: list[str], log_path: Path, env: Mapping[str, str]) -> None:
        command = [sys.executable, "-m", "tests.support.queue_consumer", *args]
        # PYTHONPATH carries over: under the mutation runner, the scratch tree's code runs.
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
            )
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.process.pid

    def terminate(self, timeout: float) -> int:
        """SIGTERM, and its exit status once it drained (at most ``timeout`` seconds)."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def said(self) -> str:
        """The end of its log, for assertion messages."""
        return self.log_path.read_text(errors="replace")[-3000:]

    def __enter__(self) -> ConsumerProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.kill()


class Journal:
    """Lines appended to ``path``, each in one write, so a SIGKILL cuts none in half."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, event: str, **fields_: Any) -> None:
        line = json.dumps({"pid": os.getpid(), "event": event, **fields_}) + "\n"
        os.write(self._fd, line.encode())


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every line the consumers wrote to ``path`` (none when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def prepare(db_url: str) -> None:
    """The table the handler writes to, in the test's database."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(CREATE)


@dataclass(frozen=True)
class Journaled(Consumer):
    """The Consumer the test runs, journaling how each settle ended."""

    journal: Journal = field(kw_only=True)

    async def settle(self, headers: Mapping[str, str], body: bytes) -> Settled:
        n = json.loads(body)["n"]
        try:
            settled = await super().settle(headers, body)
        except asyncio.CancelledError:
            self.journal.write("cut_short", n=n)
            raise
        self.journal.write("settled", n=n, verdict=settled.verdict.value, decision=settled.decision)
        return settled


def consumer(
    broker: str, inbox: Inbox, journal: Journal, stop: asyncio.Event, *, sleep: bool
) -> Journaled:
    async def handle(d: Delivery, body: bytes) -> None:
        message = json.loads(body)
        assert d.conn is not None
        await d.conn.execute(
            "INSERT INTO stop_rows (n, pid) VALUES (%s, %s)", (message["n"], os.getpid())
        )
        journal.write("began", n=message["n"])
        if sleep:  # mid-transaction, where the stop finds it
            await stop.wait()
            await asyncio.sleep(message["sleep"])

    if broker == "jetstream":
        from outbox.inbox.jetstream import consumer_of  # noqa: PLC0415 (one broker's extra)
    elif broker == "rabbitmq":
        from outbox.inbox.rabbitmq import consumer_of  # noqa: PLC0415
    else:
        from outbox.inbox.sqs import consumer_of  # noqa: PLC0415
    base = consumer_of(inbox, HANDLER, handle, retry_after=0.2)
    return Journaled(
        **{f.name: getattr(base, f.name) for f in fields(base) if f.init}, journal=journal
    )


async def _jetstream(args: argparse.Namespace, made: Journaled, stop: asyncio.Event) -> None:
    import nats  # noqa: PLC0415 (each broker's client only where it runs)

    from outbox.inbox import jetstream  # noqa: PLC0415

    nc = await nats.connect(NATS_URL)
    try:
        js = nc.jetstream()
        await jetstream.consume(
            js,
            made,
            stream=args.target,
            durable="workers",
            stop=stop,
            batch=BATCH,
            ack_wait=args.ack_wait,
            grace=args.grace,
        )
    finally:
        await nc.close()  # sends the acks still buffered


async def _rabbitmq(args: argparse.Namespace, made: Journaled, stop: asyncio.Event) -> None:
    import aio_pika  # noqa: PLC0415

    from outbox.inbox import rabbitmq  # noqa: PLC0415

    connection = await aio_pika.connect_robust(AMQP_URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=BATCH)
        queue = await channel.get_queue(args.target)
        await rabbitmq.consume(queue, made, stop=stop, grace=args.grace)
    finally:
        await connection.close()


async def _sqs(args: argparse.Namespace, made: Journaled, stop: asyncio.Event) -> None:
    from aiobotocore.session import get_session  # noqa: PLC0415

    from outbox.inbox import sqs  # noqa: PLC0415

    client_of = get_session().create_client(
        "sqs", region_name="us-east-1", endpoint_url=args.endpoint
    )
    async with client_of as client:
        await sqs.consume(client, args.target, made, stop=stop, batch=BATCH, grace=args.grace)


CONSUME: Final = {"jetstream": _jetstream, "rabbitmq": _rabbitmq, "sqs": _sqs}


async def main(args: argparse.Namespace) -> int:
    journal = Journal(args.journal)
    stop = stop_on_signals()
    async with AsyncConnectionPool(args.db, min_size=1, max_size=BATCH + 2, open=False) as pool:
        made = consumer(args.broker, Inbox(pool), journal, stop, sleep=args.sleep)
        await CONSUME[args.broker](args, made, stop)  # until SIGTERM drains it
    journal.write("exited")
    return 0


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.support.queue_consumer")
    parser.add_argument("broker", choices=["jetstream", "rabbitmq", "sqs"])
    parser.add_argument("--db", required=True, help="the test's database URL")
    parser.add_argument("--journal", type=Path, required=True)
    parser.add_argument("--target", required=True, help="the stream, queue name or queue URL")
    parser.add_argument("--endpoint", help="SQS: moto's URL")
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--ack-wait", type=float, default=30.0, help="JetStream: the durable's")
    parser.add_argument("--sleep", action="store_true", help="after the stop, as each message says")
    return parser.parse_args(argv)


if __name__ == "__main__":
    logs.configure(json=True)
    sys.exit(asyncio.run(main(parse(sys.argv[1:]))))

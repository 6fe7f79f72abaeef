"""`type = "amqp"` against a real RabbitMQ (issue 25): the machine's broker on 127.0.0.1:5672
(guest/guest) for the runs that leave it be, each test with its own exchange and queue, deleted
after; a private node (tests.support.rabbitmq) for the run that restarts the broker.

RabbitMQ does not deduplicate: its consumers do, by message_id. So where a publish's answer
was lost (the SIGKILL, the restart) the tests count the copies at the broker: each operation
arrives once or twice, every copy with the operation's stored key as its message_id, and the
distinct message ids are as many as the operations.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import aio_pika
import psycopg
import pytest

import outbox
from outbox.config.settings import ProviderSettings
from outbox.providers.base import Failed, SendRequest, Succeeded
from outbox.providers.registry import build_providers
from tests.support.daemon import wait_until
from tests.support.dispatch import enqueue_many, rows, statuses
from tests.support.queues import (
    crash_between_publish_and_record,
    outbox_run,
    references,
    require_service,
    wait_settled,
)
from tests.support.rabbitmq import private_rabbitmq

SHARED: str = "amqp://127.0.0.1:5672/"
PROVIDER = "rabbit"
ACTION = "invoice.paid"  # what tests.support.dispatch.enqueue_many enqueues
ROUTING_KEY = "ops"


@dataclass(frozen=True)
class Got:
    """One message as a consumer received it."""

    message_id: str | None
    headers: dict[str, Any]
    content_type: str | None
    delivery_mode: int | None
    correlation_id: str | None
    app_id: str | None
    body: bytes

    @property
    def operation_id(self) -> int:
        return int(self.headers["Outbox-Operation-Id"])


@dataclass(frozen=True)
class Topology:
    url: str
    exchange: str
    queue: str


def _name(what: str) -> str:
    return f"outbox-test-{what}-{uuid.uuid4().hex[:10]}"


async def _declare(
    url: str, *, arguments: dict[str, Any] | None = None, exchange: bool = True
) -> Topology:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(_name("q"), durable=True, arguments=arguments)
        if not exchange:
            return Topology(url, "", queue.name)
        ex = await channel.declare_exchange(_name("x"), aio_pika.ExchangeType.DIRECT, durable=True)
        await queue.bind(ex, ROUTING_KEY)
        return Topology(url, ex.name, queue.name)


async def _delete(topology: Topology) -> None:
    connection = await aio_pika.connect(topology.url)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(topology.queue)
        if topology.exchange:
            await channel.exchange_delete(topology.exchange)


@pytest.fixture
def shared_broker() -> None:
    require_service("RabbitMQ", 5672, "rabbitmq-server -detached")


@pytest.fixture
def topology(shared_broker: None) -> Iterator[Topology]:
    """An exchange and a durable queue bound to it by ROUTING_KEY, deleted after the test."""
    made = asyncio.run(_declare(SHARED))
    yield made
    asyncio.run(_delete(made))


def _provider(
    topology: Topology, actions: dict[str, Any] | None = None, **options: Any
) -> dict[str, Any]:
    route = {"exchange": topology.exchange, "routing_key": ROUTING_KEY}
    if not topology.exchange:
        route["routing_key"] = topology.queue
    return {
        "type": "amqp",
        "url": topology.url,
        "key_retention": "24h",
        "timeout": "3s",
        "breaker_open_for": "1s",
        "actions": actions or {ACTION: route},
        **options,
    }


async def _drain(
    url: str, queue: str, *, at_least: int, idle: float = 1.0, give_up: float = 60.0
) -> list[Got]:
    """What a consumer receives: every message until ``at_least`` have come and then none for
    ``idle`` seconds (so that a copy too many is counted too), or ``give_up`` seconds."""
    got: list[Got] = []
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1000)
        q = await channel.get_queue(queue, ensure=True)

        async def receive(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            got.append(
                Got(
                    message.message_id,
                    dict(message.headers),
                    message.content_type,
                    int(message.delivery_mode) if message.delivery_mode is not None else None,
                    message.correlation_id,
                    message.app_id,
                    message.body,
                )
            )

        tag = await q.consume(receive, no_ack=True)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + give_up
        seen, quiet_since = 0, loop.time()
        while loop.time() < deadline:
            await asyncio.sleep(0.1)
            if len(got) != seen:
                seen, quiet_since = len(got), loop.time()
            elif len(got) >= at_least and loop.time() - quiet_since >= idle:
                break
        await q.cancel(tag)
    return got


def drain(url: str, queue: str, *, at_least: int, idle: float = 1.0) -> list[Got]:
    return asyncio.run(_drain(url, queue, at_least=at_least, idle=idle))


async def _depth(url: str, queue: str) -> int:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


def depth(url: str, queue: str) -> int:
    """The messages ready in ``queue``."""
    return asyncio.run(_depth(url, queue))


def stored_keys(db_url: str) -> dict[int, str]:
    return {
        int(i): str(k) for i, k in rows(db_url, "SELECT id, idempotency_key FROM outbox.operations")
    }


def assert_copies(got: list[Got], keys: dict[int, str], *, most: int) -> Counter[int]:
    """Every operation arrived at least once and at most ``most`` times, each copy carrying its
    stored key as message_id; the distinct message ids are as many as the operations. Returns
    the copies per operation."""
    copies = Counter(g.operation_id for g in got)
    assert set(copies) == set(keys), f"missing: {sorted(set(keys) - set(copies))[:10]}"
    assert max(copies.values()) <= most, copies.most_common(3)
    for g in got:
        assert g.message_id == keys[g.operation_id]
    assert len({g.message_id for g in got}) == len(keys)
    return copies


def test_a_thousand_operations_arrive_once_each(
    db_url: str, tmp_path: Path, topology: Topology
) -> None:
    ids = enqueue_many(db_url, 1000, provider=PROVIDER, correlation_id="corr-\u00e9")
    with outbox_run(db_url, tmp_path, {PROVIDER: _provider(topology)}, concurrency=64) as run:
        assert wait_settled(db_url, 1000, timeout=60, process=run) == {"succeeded": 1000}
    got = drain(topology.url, topology.queue, at_least=1000)
    keys = stored_keys(db_url)
    copies = assert_copies(got, keys, most=1)
    assert sorted(copies) == sorted(ids) and set(copies.values()) == {1}
    # The reference names the message: the exchange, the routing key and the message_id.
    refs = references(db_url)
    assert refs == {i: f"{topology.exchange}/{ROUTING_KEY}/{keys[i]}" for i in ids}
    sample = got[0]
    assert sample.content_type == "application/json"
    assert sample.delivery_mode == 2
    assert sample.app_id == "outbox"
    assert sample.headers["Outbox-Action"] == ACTION
    assert sample.headers["Outbox-Attempt"] == "1"
    assert sample.headers["Outbox-Tenant-Id"] == "acme"
    # Non-ASCII arrives percent-encoded, in the header and in the property alike.
    assert sample.headers["Outbox-Correlation-Id"] == "corr-%C3%A9"
    assert sample.correlation_id == "corr-%C3%A9"
    assert sample.body == f'{{"n": {sample.operation_id - ids[0]}}}'.encode()


def test_a_kill_between_publish_and_record_gives_copies_consumers_can_drop(
    db_url: str, tmp_path: Path, topology: Topology
) -> None:
    """RabbitMQ keeps both publishes: the count is what consumers deduplicate, by message_id."""
    count = 200
    enqueue_many(db_url, count, provider=PROVIDER)
    second = crash_between_publish_and_record(
        db_url,
        tmp_path,
        {PROVIDER: _provider(topology)},
        count=count,
        published=lambda: depth(topology.url, topology.queue),
        concurrency=count,  # every publish answered and held before its record at once
    )
    second.stop()
    assert statuses(db_url) == {"succeeded": count}
    got = drain(topology.url, topology.queue, at_least=count)
    copies = assert_copies(got, stored_keys(db_url), most=2)
    # Every publish of the killed process reached the queue, and the second one sent each
    # again with the same message_id (the answer was never recorded).
    assert sum(copies.values()) == len(got) >= count
    assert Counter(copies.values())[2] == count, Counter(copies.values())


def test_an_unroutable_message_is_quarantined_and_the_others_delivered(
    db_url: str, tmp_path: Path, topology: Topology
) -> None:
    missing = _name("missing")
    actions = {
        ACTION: {"exchange": topology.exchange, "routing_key": ROUTING_KEY},
        "nowhere": {"exchange": topology.exchange, "routing_key": "nobody-binds-this"},
        "gone": {"exchange": missing, "routing_key": ROUTING_KEY},
        "fanout.none": {
            "exchange": topology.exchange,
            "routing_key": "nobody-either",
            "unroutable": "succeed",
        },
    }
    with psycopg.connect(db_url) as conn:
        odd = {
            action: outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="invoice.charge",
                operation_key=f"odd-{action}",
                provider=PROVIDER,
                action=action,
                payload={"secret_marker": "PAYLOAD-MUST-NOT-LEAK"},
            ).operation_id
            for action in ("nowhere", "gone", "fanout.none")
        }
    ids = enqueue_many(db_url, 100, provider=PROVIDER)
    with outbox_run(db_url, tmp_path, {PROVIDER: _provider(topology, actions)}) as run:
        wait_settled(db_url, 102, timeout=60, process=run)
    assert statuses(db_url) == {"succeeded": 101, "quarantined": 2}
    quarantined = {
        int(i): (reason, error)
        for i, reason, error in rows(
            db_url,
            "SELECT id, status_reason, last_error FROM outbox.operations "
            "WHERE status = 'quarantined'",
        )
    }
    reason, error = quarantined[odd["nowhere"]]
    assert reason == "unroutable"
    assert "312 NO_ROUTE" in error and topology.exchange in error
    assert "nobody-binds-this" in error
    reason, error = quarantined[odd["gone"]]
    assert reason == "unroutable" and missing in error and "404" in error
    assert all("PAYLOAD-MUST-NOT-LEAK" not in e for _, e in quarantined.values())
    # unroutable = "succeed": the broker returned it, and that was fine.
    assert rows(
        db_url, "SELECT result FROM outbox.operations WHERE id = %s", (odd["fanout.none"],)
    ) == [({"routed": False},)]
    got = drain(topology.url, topology.queue, at_least=100)
    assert sorted(g.operation_id for g in got) == ids


def test_a_full_reject_publish_queue_is_backpressure_until_drained(
    db_url: str, tmp_path: Path, shared_broker: None
) -> None:
    """x-overflow = reject-publish: RabbitMQ nacks what a full queue refuses; nothing of it is
    in the queue, so each retry is the only copy."""
    topology = asyncio.run(
        _declare(SHARED, arguments={"x-max-length": 10, "x-overflow": "reject-publish"})
    )
    try:
        enqueue_many(db_url, 40, provider=PROVIDER)
        with outbox_run(db_url, tmp_path, {PROVIDER: _provider(topology)}) as run:
            wait_until(
                lambda: (
                    statuses(db_url).get("succeeded", 0) == 10
                    and bool(
                        rows(db_url, "SELECT 1 FROM outbox.attempts WHERE error_class = 'nack'")
                    )
                ),
                timeout=30,
                what="the queue full and its publishes nacked",
            )
            assert depth(topology.url, topology.queue) == 10
            nacked = rows(
                db_url,
                "SELECT DISTINCT outcome, sent FROM outbox.attempts WHERE error_class = 'nack'",
            )
            assert nacked == [("transient", False)]
            got: list[Got] = []
            while statuses(db_url).get("succeeded", 0) < 40:
                got += drain(topology.url, topology.queue, at_least=1, idle=0.3)
                assert len(got) <= 40
            wait_settled(db_url, 40, timeout=30, process=run)
        got += drain(topology.url, topology.queue, at_least=40 - len(got), idle=0.5)
        assert_copies(got, stored_keys(db_url), most=1)
        # The refusals did not spend the operations' attempts.
        assert rows(db_url, "SELECT max(attempts - attempt_base) FROM outbox.operations")[0][0] == 1
    finally:
        asyncio.run(_delete(topology))


def test_a_broker_restart_mid_run_loses_nothing(db_url: str, tmp_path: Path) -> None:
    """A private node, stopped and started while `outbox run` publishes: every operation
    arrives, copies only where a confirmation was lost (same message_id), and the durable queue
    keeps what it had across the restart."""
    count = 300
    with private_rabbitmq(tmp_path / "rabbit") as node:
        topology = asyncio.run(_declare(node.url, exchange=False))
        enqueue_many(db_url, count, provider=PROVIDER)
        # 10 s of publishing; no breaker, whose probes back off past the restart.
        provider = _provider(topology, rate_limit="30/s", breaker_failures=100_000)
        with outbox_run(db_url, tmp_path, {PROVIDER: provider}) as run:
            wait_until(
                lambda: depth(node.url, topology.queue) >= count // 4,
                timeout=30,
                what="a quarter published",
            )
            node.stop_app()
            before = statuses(db_url).get("succeeded", 0)
            assert before < count, "all published before the restart: nothing was tested"
            node.start_app()
            kept = depth(node.url, topology.queue)
            assert kept >= before, f"{before} confirmed before the restart, {kept} kept"
            assert wait_settled(db_url, count, timeout=90, process=run) == {"succeeded": count}
        got = asyncio.run(_drain(node.url, topology.queue, at_least=count))
    copies = assert_copies(got, stored_keys(db_url), most=2)
    assert len(got) == sum(copies.values())
    # The restart was felt: sends failed while the broker was away.
    failed = rows(
        db_url, "SELECT DISTINCT error_class FROM outbox.attempts WHERE outcome <> 'succeeded'"
    )
    assert failed, "no send failed: the broker was not restarted mid-run"


def _request(key: str, **fields: Any) -> SendRequest:
    base: dict[str, Any] = {
        "operation_id": 1,
        "tenant_id": "acme",
        "operation_type": "t",
        "operation_key": "k",
        "action": ACTION,
        "payload": {},
        "idempotency_key": key,
        "correlation_id": None,
        "attempt": 1,
        "payload_json": "{}",
    }
    return SendRequest(**{**base, **fields})


async def test_hostile_values_arrive_intact_or_encoded(topology: Topology) -> None:
    """A payload of NUL, unicode and a megabyte; a tenant id and correlation id with CR, LF and
    non-ASCII; a 255-character key of odd characters: the body arrives byte for byte, headers
    percent-encoded, the key whole as message_id."""
    route = {"exchange": topology.exchange, "routing_key": ROUTING_KEY}
    ps = ProviderSettings(
        PROVIDER,
        type="amqp",
        timeout=timedelta(seconds=5),
        options={"url": topology.url, "actions": {ACTION: route}},
    )
    provider = build_providers({PROVIDER: ps}, concurrency=8)[PROVIDER]
    key = ("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~" * 10)[:255]
    huge = '{"blob": "' + "\u00e9\\u0000\u2603" * 200_000 + '"}'
    try:
        first = await provider.send(
            _request(
                key,
                tenant_id="t\r\nX-Injected: 1",
                correlation_id="\u00e9\n" * 200,
                payload_json=huge,
            )
        )
        too_long = await provider.send(_request("k" * 256))
    finally:
        await provider.aclose()
    assert isinstance(first, Succeeded), first
    assert isinstance(too_long, Failed) and too_long.not_sent
    (got,) = await _drain(topology.url, topology.queue, at_least=1, idle=0.3)
    assert got.message_id == key
    assert got.body == huge.encode()
    assert got.headers["Outbox-Tenant-Id"] == "t%0D%0AX-Injected:%201"
    assert got.correlation_id is None  # 600 bytes encoded: the property is a short string
    assert got.headers["Outbox-Correlation-Id"].startswith("%C3%A9%0A")

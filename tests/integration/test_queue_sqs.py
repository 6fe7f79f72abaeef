"""`type = "sqs"` against moto's server mode (tests/support/moto_server.py), started by the tests
as a subprocess: three hundred operations to a FIFO queue, counted by a consumer per
Outbox-Operation-Id; a SIGKILL between publish and record; an endpoint outage mid-run (a TCP
proxy cut and healed: moto keeps its queues in memory, so a real restart would lose them); a
queue that does not exist; hostile identities and payloads; a standard queue.

Where moto departs from SQS the test asserts what moto gives and says so (docs/providers.md,
"Amazon SQS"): moto answers a deduplicated repeat with a fresh MessageId (SQS, as emulators
checked against it describe, with the original's), and forgets a deduplication id once its
message is deleted (SQS keeps it the whole 5 minutes). So the consumers here count what the
queue holds and delete only after the dispatcher settled.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import psycopg
import pytest

import outbox
from outbox.config.settings import ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.base import Intent, SendRequest, Succeeded
from outbox.providers.sqs.provider import SqsProvider, build
from tests.support.daemon import wait_until
from tests.support.dispatch import enqueue_many, rows, statuses
from tests.support.intent import assert_carries_intent
from tests.support.moto_server import REGION, MotoServer, aws_env, free_port, moto
from tests.support.queues import (
    crash_between_publish_and_record,
    outbox_run,
    references,
    wait_settled,
)
from tests.support.tcp_proxy import TcpProxy

__all__ = ["aws_env", "moto"]  # the fixtures, used by name

pytestmark = pytest.mark.usefixtures("aws_env")


@dataclass
class Received:
    """What a consumer took off a queue, per Outbox-Operation-Id."""

    counts: Counter[int] = field(default_factory=Counter)
    message_ids: dict[int, str] = field(default_factory=dict)
    messages: dict[int, dict[str, Any]] = field(default_factory=dict)


def client(endpoint: str) -> Any:
    return boto3.client("sqs", region_name=REGION, endpoint_url=endpoint)


def new_queue(moto: MotoServer, *, fifo: bool = True) -> str:
    """A queue of this test's own, by its URL on moto itself."""
    name = f"t{uuid.uuid4().hex[:12]}" + (".fifo" if fifo else "")
    attributes = {"FifoQueue": "true"} if fifo else {}
    url: str = client(moto.url).create_queue(QueueName=name, Attributes=attributes)["QueueUrl"]
    return url


def held(moto: MotoServer, url: str) -> int:
    """Messages the queue holds, none taken off it."""
    answer = client(moto.url).get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"]
    )
    return int(answer["Attributes"]["ApproximateNumberOfMessages"])


def drain(moto: MotoServer, url: str, expect: int, timeout: float = 60) -> Received:
    """Receive and delete until ``expect`` messages came and one more empty poll."""
    sqs = client(moto.url)
    got = Received()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        answer = sqs.receive_message(
            QueueUrl=url,
            MaxNumberOfMessages=10,
            WaitTimeSeconds=0 if sum(got.counts.values()) < expect else 1,
            MessageAttributeNames=["All"],
            AttributeNames=["All"],
        )
        batch = answer.get("Messages", [])
        if not batch and sum(got.counts.values()) >= expect:
            break
        for message in batch:
            op = int(message["MessageAttributes"]["Outbox-Operation-Id"]["StringValue"])
            got.counts[op] += 1
            got.message_ids[op] = message["MessageId"]
            got.messages[op] = message
        if batch:
            sqs.delete_message_batch(
                QueueUrl=url,
                Entries=[
                    {"Id": str(n), "ReceiptHandle": m["ReceiptHandle"]} for n, m in enumerate(batch)
                ],
            )
    return got


class Consumer:
    """Receives and deletes in a thread while the dispatcher runs, as a real consumer would: moto
    slows with every message its queue holds (each send scans them all), so a queue of a
    few hundred is drained as it fills. Deleting makes moto forget their deduplication ids, so
    only a run whose every send was answered may count on it."""

    def __init__(self, moto: MotoServer, url: str) -> None:
        self._moto, self._url = moto, url
        self._stop = threading.Event()
        self.received = Received()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Consumer:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            got = drain(self._moto, self._url, 0, timeout=0.5)
            self.received.counts.update(got.counts)
            self.received.message_ids.update(got.message_ids)
            self.received.messages.update(got.messages)


def table(endpoint: str, actions: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "type": "sqs",
        "region": REGION,
        "endpoint_url": endpoint,
        "key_retention": "5m",
        "retention_margin": "1m",
        "timeout": "10s",
        "breaker_open_for": "1s",
        "actions": actions,
        **extra,
    }


def fifo_table(endpoint: str, url: str, **extra: Any) -> dict[str, Any]:
    return table(endpoint, {"*": {"queue_url": url, "message_group": "{operation_key}"}}, **extra)


def wire_keys(db_url: str) -> dict[int, str]:
    found = rows(db_url, "SELECT id, idempotency_key FROM outbox.operations")
    return {int(i): hashlib.sha256(str(k).encode()).hexdigest() for i, k in found}


def test_three_hundred_operations_arrive_once_each_with_their_message_id(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    url = new_queue(moto)
    count = 300  # 37 rounds of the 8 concurrent sends: the volume the other queues get a
    # thousand for would take moto 25 s at the pace below, and teach nothing more
    ids = enqueue_many(db_url, count, provider="sqs")
    # moto is the bottleneck, at a few tens of sends a second on this machine: paced, the
    # consumer keeps its queue short and no send waits past its timeout.
    providers = {"sqs": fifo_table(moto.url, url, rate_limit="40/s")}
    with (
        Consumer(moto, url) as consumer,
        outbox_run(db_url, tmp_path, providers, concurrency=8) as run,
    ):
        assert wait_settled(db_url, count, timeout=120, process=run) == {"succeeded": count}
        wait_until(
            lambda: sum(consumer.received.counts.values()) >= count, timeout=60, what="consumed"
        )
        time.sleep(1.0)  # a duplicate would be received by now
    got = consumer.received
    assert max(a for (a,) in rows(db_url, "SELECT attempts FROM outbox.operations")) == 1
    assert got.counts == Counter(dict.fromkeys(ids, 1))  # exactly one message per operation
    assert references(db_url) == got.message_ids  # provider_ref is the MessageId
    keys = wire_keys(db_url)
    sample = got.messages[ids[7]]
    assert sample["Body"] == '{"n": 7}'
    assert sample["Attributes"]["MessageDeduplicationId"] == keys[ids[7]]
    assert sample["Attributes"]["MessageGroupId"] == "op-7"
    attributes = {k: v["StringValue"] for k, v in sample["MessageAttributes"].items()}
    assert_carries_intent(db_url, ids[7], attributes)
    assert attributes.keys() - {"Outbox-Origin", "Outbox-Fingerprint"} == {
        "Outbox-Operation-Id",
        "Outbox-Action",
        "Outbox-Attempt",
        "Outbox-Tenant-Id",
        "Outbox-Idempotency-Key",
    }
    assert (attributes["Outbox-Operation-Id"], attributes["Outbox-Idempotency-Key"]) == (
        str(ids[7]),
        keys[ids[7]],
    )
    assert attributes["Outbox-Action"] == "invoice.paid"
    assert (attributes["Outbox-Attempt"], attributes["Outbox-Tenant-Id"]) == ("1", "acme")
    ((result,),) = rows(db_url, "SELECT result FROM outbox.operations WHERE id = %s", (ids[7],))
    assert result["message_id"] == got.message_ids[ids[7]]
    assert result["sequence_number"].isdigit()


def test_a_kill_between_publish_and_record_is_deduplicated_by_the_queue(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    count = 100
    url = new_queue(moto)
    ids = enqueue_many(db_url, count, provider="sqs")
    second = crash_between_publish_and_record(
        db_url,
        tmp_path,
        {"sqs": fifo_table(moto.url, url)},
        count=count,
        published=lambda: held(moto, url),
        concurrency=count,
    )
    try:
        assert statuses(db_url) == {"succeeded": count}
    finally:
        second.stop()
    attempts = dict(rows(db_url, "SELECT id, attempts FROM outbox.operations"))
    assert all(attempts[i] >= 2 for i in ids)  # every operation was sent again
    got = drain(moto, url, count)
    # moto honours MessageDeduplicationId while the first message is still in the queue (its
    # only memory of the id): the second process's sends are accepted and dropped.
    assert got.counts == Counter(dict.fromkeys(ids, 1))
    # moto answers each dropped repeat with a fresh MessageId, which no message carries; SQS
    # answers with the original's, which would make every provider_ref a delivered id.
    assert not set(references(db_url).values()) & set(got.message_ids.values())


def test_an_endpoint_outage_mid_run_loses_nothing_and_duplicates_nothing(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    count = 300
    url = new_queue(moto)
    ids = enqueue_many(db_url, count, provider="sqs")
    with TcpProxy(f"host=127.0.0.1 port={moto.port}") as proxy:
        endpoint = f"http://127.0.0.1:{proxy.port}"
        via_proxy = url.replace(f":{moto.port}/", f":{proxy.port}/")
        providers = {"sqs": fifo_table(endpoint, via_proxy)}
        with outbox_run(db_url, tmp_path, providers, concurrency=8) as run:
            wait_until(lambda: held(moto, url) >= count // 3, timeout=60, what="a third sent")
            proxy.cut()  # every connection dropped, in flight or idle; new ones refused
            time.sleep(2.0)
            proxy.heal()
            assert wait_settled(db_url, count, timeout=90, process=run) == {"succeeded": count}
    errors = dict(
        rows(db_url, "SELECT last_error_class, count(*) FROM outbox.operations GROUP BY 1")
    )
    got = drain(moto, url, count)
    assert got.counts == Counter(dict.fromkeys(ids, 1)), errors  # none lost, none twice
    attempts = dict(rows(db_url, "SELECT id, attempts FROM outbox.operations"))
    refs = references(db_url)
    # An operation sent once has the MessageId of its message. One retried after the cut may
    # have been stored by its first attempt: moto then answers the repeat with a fresh id.
    assert all(refs[i] == got.message_ids[i] for i in ids if attempts[i] == 1)
    assert sum(1 for a in attempts.values() if a > 1) > 0, "the cut cost no attempt"
    print(f"outage: {sum(1 for a in attempts.values() if a > 1)} retried; errors {errors}")  # noqa: T201 (the figures, for -s)


def enqueue_actions(db_url: str, actions: list[str], **fields: Any) -> list[int]:
    ids = []
    with psycopg.connect(db_url) as conn:
        for n, action in enumerate(actions):
            result = outbox.enqueue(
                conn,
                tenant_id=fields.get("tenant_id", "acme"),
                operation_type="invoice.charge",
                operation_key=f"{action}-{n}-{uuid.uuid4().hex[:6]}",
                provider="sqs",
                action=action,
                payload=fields.get("payload", {"n": n}),
                idempotency_key=fields.get("idempotency_key"),
            )
            ids.append(result.operation_id)
    return ids


def test_a_missing_queue_is_quarantined_while_the_others_deliver(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    url = new_queue(moto)
    ghost = moto.queue_url(f"ghost{uuid.uuid4().hex[:8]}.fifo")
    actions = {
        "ghost": {"queue_url": ghost, "message_group": "g"},
        "*": {"queue_url": url, "message_group": "{tenant_id}"},
    }
    ids = enqueue_actions(db_url, ["paid", "ghost"] * 20)
    with outbox_run(db_url, tmp_path, {"sqs": table(moto.url, actions)}) as run:
        wait_settled(db_url, 40, timeout=60, process=run)
    found = rows(
        db_url,
        "SELECT action, status, status_reason, last_error_class, last_error FROM outbox.operations",
    )
    assert Counter((a, s) for a, s, *_ in found) == {
        ("paid", "succeeded"): 20,
        ("ghost", "quarantined"): 20,
    }
    for action, _, reason, error_class, error in found:
        if action == "ghost":
            assert (reason, error_class) == ("unroutable", "permanent")
            assert "unroutable, the queue does not exist" in error
    got = drain(moto, url, 20)
    assert sorted(got.counts) == sorted(ids[0::2])
    assert set(got.counts.values()) == {1}


def test_hostile_identities_keys_and_payloads(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    url = new_queue(moto)
    odd_key = "".join(chr(c) for c in range(0x21, 0x7F)) * 3  # every visible ASCII character
    fine = enqueue_actions(
        db_url,
        ["a"],
        tenant_id="caf\u00e9 \u2603 %41",
        idempotency_key=odd_key[:255],
        payload={"text": "\u00e9\U0001f600\u2028\x1f", "quote": '"}\\'},
    )
    fine += enqueue_actions(db_url, ["d"], payload={"big": "x" * 500_000})
    refused = enqueue_actions(db_url, ["e"], payload={"text": "\uffff"})
    # Fits max_payload_bytes and SQS's 1 MiB alone, not with its attributes.
    refused += enqueue_actions(db_url, ["f"], payload={"big": "y" * 1_048_400})
    with outbox_run(db_url, tmp_path, {"sqs": fifo_table(moto.url, url)}) as run:
        wait_settled(db_url, 4, timeout=60, process=run)
    found = {
        int(i): (s, r)
        for i, s, r in rows(db_url, "SELECT id, status, status_reason FROM outbox.operations")
    }
    assert {found[i][0] for i in fine} == {"succeeded"}
    assert [found[i] for i in refused] == [
        ("quarantined", "permanent_failure"),  # check() refused it before any send
        ("quarantined", "unencodable_request"),  # the exact size, attributes counted
    ]
    got = drain(moto, url, 2)
    first = got.messages[fine[0]]
    tenant = first["MessageAttributes"]["Outbox-Tenant-Id"]["StringValue"]
    assert tenant == "caf%C3%A9%20%E2%98%83%20%2541"
    assert (
        first["Attributes"]["MessageDeduplicationId"]
        == hashlib.sha256(odd_key[:255].encode()).hexdigest()
    )
    ((stored,),) = rows(
        db_url, "SELECT payload::text FROM outbox.operations WHERE id = %s", (fine[0],)
    )
    assert first["Body"] == stored  # the payload exactly as stored
    assert not set(got.counts) & set(refused)


def test_a_standard_queue_carries_the_identity_and_no_key(
    db_url: str, tmp_path: Path, moto: MotoServer
) -> None:
    url = new_queue(moto, fifo=False)
    ids = enqueue_many(db_url, 50, provider="sqs")
    providers = {"sqs": table(moto.url, {"*": {"queue_url": url}}, key_retention="24h",
                              retention_margin="1h", key_form="stored")}  # fmt: skip
    with outbox_run(db_url, tmp_path, providers) as run:
        assert wait_settled(db_url, 50, timeout=60, process=run) == {"succeeded": 50}
    got = drain(moto, url, 50)
    assert got.counts == Counter(dict.fromkeys(ids, 1))
    assert references(db_url) == got.message_ids
    sample = got.messages[ids[0]]
    assert "MessageDeduplicationId" not in sample["Attributes"]
    key = rows(db_url, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (ids[0],))
    assert sample["MessageAttributes"]["Outbox-Idempotency-Key"]["StringValue"] == key[0][0]


def request(n: int = 1) -> SendRequest:
    return SendRequest(
        operation_id=n,
        tenant_id="acme",
        operation_type="t",
        operation_key=f"k{n}",
        action="a",
        payload={"n": n},
        idempotency_key=f"ob1_{n:064x}",
        correlation_id=None,
        attempt=1,
        payload_json=f'{{"n": {n}}}',
    )


def direct(endpoint: str, url: str, timeout: str = "5s") -> SqsProvider:
    ps = ProviderSettings(
        name="sqs",
        type="sqs",
        key_retention=outbox_duration("5m"),
        timeout=outbox_duration(timeout),
        options={
            "region": REGION,
            "endpoint_url": endpoint,
            "actions": {"*": {"queue_url": url, "message_group": "g"}},
        },
    )
    return build(ps, None, concurrency=4)


def outbox_duration(text: str) -> Any:
    from outbox.core.durations import parse_duration  # noqa: PLC0415

    return parse_duration(text)


async def test_nothing_listening_is_transient_and_a_silent_endpoint_unknown(
    moto: MotoServer,
) -> None:
    port = free_port()
    closed = direct(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/1/q.fifo")
    try:
        await closed.start()  # down at start: logged, no refusal
        result = await closed.send(request())
    finally:
        await closed.aclose()
    assert not isinstance(result, Succeeded)
    assert (result.failure, result.error_class) == (FailureClass.TRANSIENT, "connect_refused")
    url = new_queue(moto)
    with TcpProxy(f"host=127.0.0.1 port={moto.port}") as proxy:
        via = url.replace(f":{moto.port}/", f":{proxy.port}/")
        slow = direct(f"http://127.0.0.1:{proxy.port}", via, timeout="1s")
        try:
            first = await slow.send(request(1))
            assert isinstance(first, Succeeded)
            proxy.mute("down")  # SQS stores the message; its answer never comes back
            lost = await slow.send(request(2))
        finally:
            await slow.aclose()
    assert not isinstance(lost, Succeeded)
    assert lost.failure is FailureClass.UNKNOWN
    await asyncio.sleep(0)
    assert held(moto, url) == 2  # the second was stored: unknown was the right answer


async def test_a_message_with_every_attribute_outbox_sends_stays_within_sqss_ten(
    moto: MotoServer,
) -> None:
    """SQS takes at most 10 message attributes (AWS's quota; moto takes more, so they are
    counted here). A message with all of outbox's (a correlation id, a traceparent, the key,
    the origin, the fingerprint and the contract among them) has 10, and the consumer reads the
    contract the payload was enqueued under."""
    url = new_queue(moto)
    provider = direct(moto.url, url)
    full = dataclasses.replace(
        request(3),
        correlation_id="req-3",
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        intent=Intent(str(uuid.uuid4()), b"\x01" * 32, "sqs", "acct 1", "payments/charge/v2"),
    )
    try:
        result = await provider.send(full)
    finally:
        await provider.aclose()
    assert isinstance(result, Succeeded), result
    got = drain(moto, url, 1)
    attributes = got.messages[3]["MessageAttributes"]
    assert len(attributes) == 10
    assert attributes["Outbox-Contract"]["StringValue"] == "payments/charge/v2"

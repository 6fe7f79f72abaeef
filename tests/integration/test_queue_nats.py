"""`type = "nats"` against a real NATS JetStream (issue 25): the machine's server on
127.0.0.1:4222 for the runs that leave it be, each test with its own stream and subject, deleted
after; a private nats-server (its own port and store directory) for the runs that kill it or
need users.

JetStream deduplicates by Nats-Msg-Id inside the stream's duplicate_window, so wherever a
publish's answer was lost (the SIGKILL, the restart) the tests assert one message per operation
in the stream, each carrying its Outbox-Operation-Id, and the operation's provider_ref naming
that message ("<stream>:<seq>").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import urllib.parse
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

import outbox
from outbox.config.settings import ProviderSettings
from outbox.providers.base import Failed, SendRequest, Succeeded
from outbox.providers.nats.provider import NatsProvider, build
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import enqueue_many, key_of, rows, statuses
from tests.support.queues import (
    FAST_RUN,
    crash_between_publish_and_record,
    outbox_run,
    references,
    require_service,
    wait_for_port,
    wait_settled,
)
from tests.support.tcp_proxy import TcpProxy

SHARED = "nats://127.0.0.1:4222"
NATS_SERVER = "/usr/sbin/nats-server"
HOW_TO_START = (
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- "
    "-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log"
)
PROVIDER = "jets"
ACTION = "invoice.paid"  # what tests.support.dispatch.enqueue_many enqueues


@pytest.fixture(autouse=True)
def _shared_nats() -> None:
    require_service("NATS", 4222, HOW_TO_START)


@dataclass(frozen=True)
class Stream:
    url: str
    name: str
    subject: str


@dataclass(frozen=True)
class Got:
    """One stored message, as a consumer reads it."""

    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes

    @property
    def operation_id(self) -> int:
        return int(self.headers["Outbox-Operation-Id"])


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _create(url: str, window: float, **config: Any) -> Stream:
    suffix = uuid.uuid4().hex[:10]
    stream = Stream(url, f"OUTBOX_TEST_{suffix}", f"outbox.test.{suffix}.ops")
    nc = await nats.connect(url)
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=stream.name,
                subjects=[stream.subject],
                duplicate_window=window,
                storage=StorageType.FILE,
                **config,
            )
        )
    finally:
        await nc.close()
    return stream


async def _delete(stream: Stream) -> None:
    with contextlib.suppress(Exception):
        nc = await nats.connect(stream.url, allow_reconnect=False)
        try:
            await nc.jetstream().delete_stream(stream.name)
        finally:
            await nc.close()


@contextlib.contextmanager
def a_stream(url: str = SHARED, window: float = 120, **config: Any) -> Iterator[Stream]:
    """A stream of its own (file storage, ``window`` seconds of duplicate_window), deleted
    after."""
    stream = run(_create(url, window, **config))
    try:
        yield stream
    finally:
        run(_delete(stream))


async def _messages(stream: Stream) -> list[Got]:
    """Every message of the stream, read by sequence, as a consumer would see them."""
    nc = await nats.connect(stream.url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream.name)
        got = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(stream.name, seq)
            got.append(Got(seq, str(msg.subject), dict(msg.headers or {}), msg.data or b""))
        return got
    finally:
        await nc.close()


def messages(stream: Stream) -> list[Got]:
    return list(run(_messages(stream)))


async def _count(stream: Stream) -> int:
    nc = await nats.connect(stream.url)
    try:
        return int((await nc.jetstream().stream_info(stream.name)).state.messages)
    finally:
        await nc.close()


def count(stream: Stream) -> int:
    try:
        return int(run(_count(stream)))
    except Exception:  # noqa: BLE001 (a broker being restarted: nothing counted yet)
        return -1


def provider(stream: Stream, **options: Any) -> dict[str, Any]:
    """The provider table `outbox run` gets: its window JetStream's 2 minutes, its margin 30 s,
    a breaker that probes again after a second."""
    return {
        "type": "nats",
        "servers": stream.url,
        "key_retention": "2m",
        "retention_margin": "30s",
        "timeout": "3s",
        "breaker_open_for": "1s",
        "actions": {ACTION: {"subject": stream.subject, "stream": stream.name}},
        **options,
    }


def assert_once_each(stream: Stream, db_url: str, ids: list[int]) -> list[Got]:
    """One message per operation, each with its identity, and each operation's provider_ref
    naming its message."""
    got = messages(stream)
    per_op = Counter(m.operation_id for m in got)
    assert sorted(per_op) == sorted(ids), f"missing: {sorted(set(ids) - set(per_op))[:10]}"
    assert set(per_op.values()) == {1}, f"copies: {[o for o, n in per_op.items() if n > 1][:10]}"
    refs = references(db_url)
    assert refs == {m.operation_id: f"{stream.name}:{m.seq}" for m in got}
    return got


# --- the runs issue 25 asks for --------------------------------------------------------------


def test_a_thousand_operations_arrive_once_each_with_their_identity(
    db_url: str, tmp_path: Path
) -> None:
    with a_stream() as stream:
        ids = enqueue_many(db_url, 1000, provider=PROVIDER, correlation_id="corr-1")
        with outbox_run(db_url, tmp_path, {PROVIDER: provider(stream)}) as process:
            assert wait_settled(db_url, 1000, timeout=60, process=process) == {"succeeded": 1000}
        got = assert_once_each(stream, db_url, ids)
        keys = dict(rows(db_url, "SELECT id, idempotency_key FROM outbox.operations"))
        for m in got[:50]:
            assert m.subject == stream.subject
            assert m.headers["Nats-Msg-Id"] == keys[m.operation_id]
            assert m.headers["Outbox-Action"] == ACTION
            assert m.headers["Outbox-Tenant-Id"] == "acme"
            assert m.headers["Outbox-Correlation-Id"] == "corr-1"
            assert m.headers["Content-Type"] == "application/json"
            assert m.data == b'{"n": %d}' % (m.operation_id - ids[0])


def test_a_dispatcher_killed_between_publish_and_record_makes_no_second_message(
    db_url: str, tmp_path: Path
) -> None:
    with a_stream() as stream:
        ids = enqueue_many(db_url, 200, provider=PROVIDER)
        second = crash_between_publish_and_record(
            db_url,
            tmp_path,
            {PROVIDER: provider(stream)},
            count=200,
            published=lambda: count(stream),
            concurrency=200,  # every publish answered and held before its record at once
        )
        try:
            assert statuses(db_url) == {"succeeded": 200}
        finally:
            second.stop()
        # Every operation was published twice, and JetStream kept one of each: the second
        # process's PubAck said duplicate, with the first message's sequence.
        assert count(stream) == 200
        assert_once_each(stream, db_url, ids)
        attempts = rows(db_url, "SELECT min(attempts) FROM outbox.operations")
        assert attempts[0][0] >= 2


@dataclass
class PrivateNats:
    """A nats-server of this test's own: its port, store and optional config file."""

    port: int
    store: Path
    config: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = ["-c", str(self.config)] if self.config else ["-js", "-sd", str(self.store)]
        log = (self.store.parent / "nats.log").open("ab")
        self.proc = subprocess.Popen(
            [NATS_SERVER, "-a", "127.0.0.1", "-p", str(self.port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        wait_for_port(self.port, timeout=20, what="the private nats-server")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[PrivateNats]:
    if not shutil.which(NATS_SERVER):
        if os.environ.get("OUTBOX_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{NATS_SERVER} is not installed")
        pytest.skip(f"{NATS_SERVER} is not installed")
    server = PrivateNats(_free_port(), tmp_path / "jetstream")
    server.start()
    try:
        yield server
    finally:
        server.kill()


def test_a_broker_killed_and_restarted_mid_run_loses_nothing_and_repeats_nothing(
    db_url: str, tmp_path: Path, private_nats: PrivateNats
) -> None:
    """kill -9 of nats-server mid-run, restarted on the same port and store: the publishes in
    flight are unknown, retried with their Nats-Msg-Id, and JetStream (which rebuilds its
    duplicate tracking from the stored messages on restart) keeps one of each."""
    stream = run(_create(private_nats.url, 120))
    ids = enqueue_many(db_url, 300, provider=PROVIDER)
    # 60/s: 300 take 5 s, so the kill after 100 lands mid-run even on a fast machine (unthrottled,
    # all 300 were sent between two polls of the count once, and the test proved nothing).
    table = provider(stream, rate_limit="60/s")
    with outbox_run(db_url, tmp_path, {PROVIDER: table}) as process:
        wait_until(lambda: count(stream) >= 100, timeout=30, what="100 messages published")
        private_nats.kill()
        before = statuses(db_url).get("succeeded", 0)
        private_nats.start()
        assert wait_settled(db_url, 300, timeout=90, process=process) == {"succeeded": 300}
    assert before < 300, "the run ended before the broker was killed"
    assert_once_each(stream, db_url, ids)


def test_start_is_refused_when_key_retention_outlasts_the_duplicate_window(
    db_url: str, tmp_path: Path
) -> None:
    with a_stream(window=60) as stream:
        config = write_config(
            tmp_path / "refused.toml", providers={PROVIDER: provider(stream)}, **FAST_RUN
        )
        process = OutboxProcess(db_url, config, tmp_path / "refused.log")
        try:
            # Refused before it starts: one that says it started has taken the setting.
            assert not process.wait_started(timeout=30), process.log_text()[-2000:]
            assert process.wait(timeout=30) == 2
        finally:
            process.stop()
        log = process.log_text()
        assert f"providers.{PROVIDER}.key_retention (2m) is longer than the stream" in log
        assert f"{stream.name}'s duplicate_window (1m)" in log


def test_an_unroutable_subject_is_quarantined_and_the_others_delivered(
    db_url: str, tmp_path: Path
) -> None:
    with a_stream() as stream:
        nowhere = f"outbox.nowhere.{uuid.uuid4().hex[:10]}"
        table = provider(stream)
        table["actions"] = {
            "good": {"subject": stream.subject, "stream": stream.name},
            "lost": {"subject": nowhere, "stream": stream.name},
        }
        good: list[int] = []
        lost: list[int] = []
        with psycopg.connect(db_url) as conn:
            for i in range(60):
                action = "lost" if i % 3 == 0 else "good"
                op = outbox.enqueue(
                    conn,
                    tenant_id="acme",
                    operation_type="invoice.charge",
                    operation_key=f"op-{i}",
                    provider=PROVIDER,
                    action=action,
                    payload={"n": i},
                )
                (lost if action == "lost" else good).append(op.operation_id)
        with outbox_run(db_url, tmp_path, {PROVIDER: table}) as process:
            settled = wait_settled(db_url, 60, timeout=60, process=process)
        assert settled == {"succeeded": 40, "quarantined": 20}
        assert sorted(m.operation_id for m in messages(stream)) == sorted(good)
        quarantined = rows(
            db_url,
            "SELECT id, status_reason, last_error FROM outbox.operations "
            "WHERE status = 'quarantined'",
        )
        assert sorted(i for i, _, _ in quarantined) == sorted(lost)
        for _, reason, error in quarantined:
            assert reason == "unroutable"
            assert nowhere in str(error)


async def _publish_foreign(stream: Stream, msg_id: str) -> None:
    nc = await nats.connect(stream.url)
    try:
        headers = {"Nats-Msg-Id": msg_id, "Outbox-Operation-Id": "1"}
        await nc.jetstream().publish(stream.subject, b'{"other": "app"}', headers=headers)
    finally:
        await nc.close()


def test_a_message_id_another_producer_holds_is_quarantined_not_taken_as_ours(
    db_url: str, tmp_path: Path
) -> None:
    """A second outbox database (its derived keys the same hash of the same identity) or any
    client publishing to the stream may hold one of our Nats-Msg-Ids: JetStream answers
    ``duplicate``, and taking that for a success would record a message never published. The
    operation is quarantined as a key collision; every other one is delivered once."""
    with a_stream() as stream:
        ids = enqueue_many(db_url, 20, provider=PROVIDER)
        victim = ids[7]
        run(_publish_foreign(stream, key_of(db_url, victim)))
        with outbox_run(db_url, tmp_path, {PROVIDER: provider(stream)}) as process:
            settled = wait_settled(db_url, 20, timeout=60, process=process)
        assert settled == {"succeeded": 19, "quarantined": 1}
        ((status, reason),) = rows(
            db_url, "SELECT status, status_reason FROM outbox.operations WHERE id = %s", (victim,)
        )
        assert (status, reason) == ("quarantined", "key_collision")
        got = messages(stream)
        assert len(got) == 20 and got[0].data == b'{"other": "app"}'
        assert sorted(m.operation_id for m in got[1:]) == sorted(set(ids) - {victim})


ENQUEUE_LIMIT = 1 << 20  # enqueue's default payload limit (sql/0004, outbox.limits)
_HOSTILE = "aZ9 %'\"\\;-_.:/\u00e9\U0001f600\u4e2d\u00a0"


def _hostile(rng: random.Random, longest: int) -> str:
    return "".join(rng.choice(_HOSTILE) for _ in range(rng.randint(1, longest)))


def _enqueue_hostile(db_url: str, rng: random.Random) -> tuple[dict[int, str], set[int]]:
    """2,000 operations, each of its own tenant (any text enqueue takes), a seventh of them
    scheduled, every 400th a payload exactly at enqueue's 1 MiB limit (its headers then take it
    past JetStream's max_payload); the tenant by operation id, and the oversized ones."""
    tenants, oversized = {}, set()
    soon = datetime.now(UTC) + timedelta(seconds=2)
    with psycopg.connect(db_url) as conn:
        for i in range(2000):
            payload: dict[str, Any] = {
                "n": i,
                "s": _hostile(rng, 50) + "x" * rng.choice([0, 9, 999]),
            }
            if i % 400 == 0:
                payload["s"] = ""
                payload["s"] = "x" * (ENQUEUE_LIMIT - len(json.dumps(payload)))
            # Ends in "-": enqueue refuses a space at either end of an identity (sql/0036).
            tenant = f"t{i}-{_hostile(rng, 100)}-"
            op = outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="reminder.send",
                operation_key=str(i),
                provider=PROVIDER,
                action=ACTION,
                payload=payload,
                correlation_id="c" + _hostile(rng, 200) + "c" if rng.random() < 0.5 else None,
                available_at=soon if i % 7 == 0 else None,
            )
            tenants[op.operation_id] = tenant
            if i % 400 == 0:
                oversized.add(op.operation_id)
    return tenants, oversized


def test_a_seeded_hostile_workload_is_delivered_once_each_and_the_unsendable_quarantined(
    db_url: str, tmp_path: Path
) -> None:
    """Thousands of tenants with identities built to hurt headers, scheduled work, payloads at
    the limit and one key another producer holds: every sendable operation arrives once with its
    tenant intact (percent-decoded), each unsendable one is quarantined with its reason, and none
    holds up the rest."""
    seed = int(os.environ.get("OUTBOX_TEST_SEED", random.randrange(1 << 30)))
    with a_stream() as stream:
        tenants, oversized = _enqueue_hostile(db_url, random.Random(seed))
        victim = min(set(tenants) - oversized)
        run(_publish_foreign(stream, key_of(db_url, victim)))
        sendable = set(tenants) - oversized - {victim}
        with outbox_run(db_url, tmp_path, {PROVIDER: provider(stream)}) as process:
            settled = wait_settled(db_url, len(sendable), timeout=120, process=process)
        unsendable = len(oversized) + 1  # and the victim
        assert settled == {"succeeded": len(sendable), "quarantined": unsendable}, f"seed {seed}"
        got = messages(stream)[1:]
        assert sorted(m.operation_id for m in got) == sorted(sendable), f"seed {seed}"
        for m in got:
            assert urllib.parse.unquote(m.headers["Outbox-Tenant-Id"]) == tenants[m.operation_id]
        reasons = rows(
            db_url, "SELECT id, status_reason FROM outbox.operations WHERE status = 'quarantined'"
        )
        assert dict(reasons) == {
            **dict.fromkeys(oversized, "message_too_large"),
            victim: "key_collision",
        }


# --- answers, straight from the provider -----------------------------------------------------


def _settings(stream: Stream, **options: Any) -> ProviderSettings:
    return ProviderSettings(
        PROVIDER,
        type="nats",
        key_retention=timedelta(minutes=2),
        timeout=timedelta(seconds=3),
        options={
            "servers": [stream.url],
            "actions": {ACTION: {"subject": stream.subject, "stream": stream.name}},
            **options,
        },
    )


def request(i: int, *, key: str | None = None, **fields: Any) -> SendRequest:
    values: dict[str, Any] = {
        "operation_id": i,
        "tenant_id": "acme",
        "operation_type": "invoice.charge",
        "operation_key": f"op-{i}",
        "action": ACTION,
        "payload": {"n": i},
        "idempotency_key": key or f"ob1_{i:064x}",
        "correlation_id": None,
        "attempt": 1,
        "payload_json": f'{{"n": {i}}}',
        **fields,
    }
    return SendRequest(**values)


async def _send_all(p: NatsProvider, requests: list[SendRequest]) -> list[Any]:
    try:
        await p.start()
        return list(await asyncio.gather(*(p.send(r) for r in requests)))
    finally:
        await p.aclose()


def test_a_repeat_is_a_success_with_the_original_sequence() -> None:
    with a_stream() as stream:
        p = build(_settings(stream))
        first, again, other = run(_send_all(p, [request(1), request(1), request(2)]))
        assert isinstance(first, Succeeded) and isinstance(again, Succeeded)
        assert again.reference == first.reference == f"{stream.name}:1"
        assert again.result == {"stream": stream.name, "seq": 1, "duplicate": True}
        assert other == Succeeded(
            f"{stream.name}:2", result={"stream": stream.name, "seq": 2, "duplicate": False}
        )
        assert count(stream) == 2


async def _delete_message(stream: Stream, seq: int) -> None:
    nc = await nats.connect(stream.url)
    try:
        await nc.jetstream().delete_msg(stream.name, seq)
    finally:
        await nc.close()


def test_a_repeat_whose_original_was_removed_is_still_the_original() -> None:
    """A work-queue stream deletes a message once it is acked; the id stays in the duplicate
    window. The repeat's read-back finds nothing at the sequence, and the stream did reach it:
    accepted as the original, not resent and not sent to reconciliation."""
    with a_stream() as stream:
        p = build(_settings(stream))
        (first,) = run(_send_all(p, [request(1)]))
        run(_delete_message(stream, 1))
        (again,) = run(_send_all(build(_settings(stream)), [request(1)]))
        assert isinstance(first, Succeeded) and isinstance(again, Succeeded), again
        assert again.reference == first.reference == f"{stream.name}:1"
        assert count(stream) == 0  # nothing stored again


def test_hostile_identities_and_keys_arrive_as_sent_and_header_safe() -> None:
    odd_key = "".join(chr(c) for c in range(33, 127)) * 3  # 282 visible ASCII: cut to 255
    odd_key = odd_key[:255]
    hostile = request(
        1,
        key=odd_key,
        tenant_id="acme\r\nNats-Msg-Id: forged",
        correlation_id="caf\u00e9 \u202e",
        payload_json='{"s": "\\u0000 nul \u00e9 \U0001f600"}',
    )
    with a_stream() as stream:
        (answer,) = run(_send_all(build(_settings(stream)), [hostile]))
        assert isinstance(answer, Succeeded), answer
        (got,) = messages(stream)
        assert got.headers["Nats-Msg-Id"] == odd_key
        assert got.headers["Outbox-Tenant-Id"] == "acme%0D%0ANats-Msg-Id:%20forged"
        assert got.headers["Outbox-Correlation-Id"] == "caf%C3%A9%20%E2%80%AE"
        assert got.data == hostile.payload_json.encode()  # type: ignore[union-attr]


def test_the_sha256_form_carries_any_key_and_a_repeat_is_still_recognised() -> None:
    with a_stream() as stream:
        p = build(_settings(stream, key_form="sha256"))
        first, again = run(_send_all(p, [request(1, key="k"), request(1, key="k")]))
        assert isinstance(again, Succeeded) and again.reference == first.reference
        (got,) = messages(stream)
        assert len(got.headers["Nats-Msg-Id"]) == 64


def test_answers_lost_after_the_publish_are_unknown_and_the_retry_is_recognised() -> None:
    """A broker whose answers stop (the proxy relays nothing back) then whose connection drops:
    the publishes stored but unanswered are unknown at once, and their retries on a new
    connection are JetStream's duplicates, with the first messages' sequences."""
    with a_stream() as stream, TcpProxy("host=127.0.0.1 port=4222") as proxy:
        p = build(
            _settings(
                stream,
                servers=[f"nats://127.0.0.1:{proxy.port}"],
            )
        )

        async def scenario() -> tuple[list[Any], list[Any]]:
            await p.start()
            proxy.mute("down")
            sends = [asyncio.ensure_future(p.send(request(i))) for i in range(20)]
            for _ in range(100):
                if await _count(stream) == 20:
                    break
                await asyncio.sleep(0.05)
            proxy.cut()
            lost = list(await asyncio.gather(*sends))
            proxy.heal()
            again = list(await asyncio.gather(*(p.send(request(i)) for i in range(20))))
            await p.aclose()
            return lost, again

        lost, again = run(scenario())
        assert {(a.failure.value, a.error_class) for a in lost} == {("unknown", "connection_lost")}
        assert all(isinstance(a, Succeeded) and (a.result or {})["duplicate"] for a in again)
        by_op = {m.operation_id: f"{stream.name}:{m.seq}" for m in messages(stream)}
        assert {i: a.reference for i, a in enumerate(again)} == by_op


def test_a_broker_that_stops_answering_is_a_timeout_and_unknown() -> None:
    with a_stream() as stream, TcpProxy("host=127.0.0.1 port=4222") as proxy:
        table = _settings(stream, servers=[f"nats://127.0.0.1:{proxy.port}"])
        p = build(ProviderSettings(**{**_fields(table), "timeout": timedelta(seconds=1)}))

        async def scenario() -> Any:
            await p.start()
            proxy.deafen()
            try:
                return await p.send(request(1))
            finally:
                proxy.cut()
                await p.aclose()

        answer = run(scenario())
        assert isinstance(answer, Failed) and answer.error_class == "timeout"
        assert answer.failure.value == "unknown"


def _fields(ps: ProviderSettings) -> dict[str, Any]:
    return {
        "name": ps.name,
        "type": ps.type,
        "key_retention": ps.key_retention,
        "timeout": ps.timeout,
        "options": dict(ps.options),
    }


def test_a_subject_of_another_stream_is_refused_not_stored_there() -> None:
    with a_stream() as ours, a_stream() as theirs:
        table = {ACTION: {"subject": theirs.subject, "stream": ours.name}}
        (answer,) = run(_send_all(build(_settings(ours, actions=table)), [request(1)]))
        assert isinstance(answer, Failed) and answer.error_class == "wrong_stream"
        assert answer.failure.value == "permanent" and answer.reason == "unroutable"
        assert count(ours) == 0 and count(theirs) == 0


def test_a_full_stream_that_discards_new_is_backpressure() -> None:
    with a_stream(max_msgs=2, discard=DiscardPolicy.NEW) as stream:
        answers = run(_send_all(build(_settings(stream)), [request(i) for i in range(3)]))
        full = [a for a in answers if isinstance(a, Failed)]
        assert len(full) == 1 and full[0].error_class == "stream_full"
        assert full[0].failure.value == "transient" and full[0].spends_attempt is False
        assert full[0].retry_after == timedelta(seconds=1)


def test_a_message_over_max_payload_is_refused_before_sending() -> None:
    with a_stream() as stream:
        big = request(1, payload_json='"' + "x" * (1 << 20) + '"')
        (answer,) = run(_send_all(build(_settings(stream)), [big]))
        assert isinstance(answer, Failed) and answer.error_class == "message_too_large"
        assert answer.not_sent and "max_payload" in answer.message
        assert count(stream) == 0


def test_a_broker_that_is_down_is_transient_and_nothing_is_checked_or_sent() -> None:
    stream = Stream(f"nats://127.0.0.1:{_free_port()}", "NOWHERE", "outbox.nowhere")
    (answer,) = run(_send_all(build(_settings(stream)), [request(1)]))
    assert isinstance(answer, Failed) and answer.error_class == "connect_refused"
    assert answer.failure.value == "transient"


def test_refused_credentials_pause_and_a_denied_subject_pauses_its_action(
    tmp_path: Path,
) -> None:
    port = _free_port()
    config = tmp_path / "auth.conf"
    config.write_text(
        f"listen: 127.0.0.1:{port}\njetstream {{ store_dir: {tmp_path / 'store'} }}\n"
        "authorization { users = [ { user: outbox, password: s3cret, permissions: {"
        ' publish: { allow: [">"], deny: ["outbox.denied"] } } } ] }\n'
    )
    server = PrivateNats(port, tmp_path / "store", config)
    server.start()
    try:
        nc_url = f"nats://outbox:s3cret@127.0.0.1:{port}"
        stream = run(_create(nc_url, 120))
        stream = Stream(f"nats://127.0.0.1:{port}", stream.name, stream.subject)
        env = {"NATS_PASSWORD": "s3cret", "WRONG": "nope"}
        auth = {"user": "outbox", "password": {"env": "NATS_PASSWORD"}}
        actions = {
            ACTION: {"subject": stream.subject, "stream": stream.name},
            "denied": {"subject": "outbox.denied", "stream": stream.name},
        }
        p = build(_settings(stream, actions=actions, **auth), env)
        ok, denied = run(_send_all(p, [request(1), request(2, action="denied")]))
        assert isinstance(ok, Succeeded)
        assert isinstance(denied, Failed) and denied.error_class == "permission_denied"
        assert denied.pause_action and denied.failure.value == "transient"
        wrong = build(_settings(stream, user="outbox", password={"env": "WRONG"}), env)
        (refused,) = run(_send_all(wrong, [request(3)]))
        assert isinstance(refused, Failed) and refused.error_class == "credentials"
        assert refused.pause
    finally:
        server.kill()

"""Ordering keys (sql/0015): operations with the same key reach the provider one at a time, in
enqueue order; other keys run in parallel; a quarantined operation holds its key (mode block)
or lets it go on (mode skip)."""

from __future__ import annotations

import itertools
import json
import random
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.core.model import Status
from outbox.daemon import gauges
from outbox.db.store import Store
from outbox.observability import metrics
from outbox.oncall import operators
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault, WebhookRequest
from tests.support.cli import outbox_cli
from tests.support.daemon import outbox_processes, wait_until, write_config
from tests.support.dispatch import dispatcher, key_of, rows, statuses


def enqueue_ordered(
    url: str,
    keys: list[str],
    per_key: int,
    *,
    tenant: str = "acme",
    operation_type: str = "ledger.post",
) -> dict[str, list[int]]:
    """``per_key`` operations for each ordering key, interleaved across keys as an application
    would enqueue them, one transaction per operation; returns each key's ids in enqueue order."""
    ids: dict[str, list[int]] = defaultdict(list)
    with psycopg.connect(url, autocommit=True) as conn:
        for seq in range(per_key):
            for key in keys:
                with conn.transaction():
                    result = outbox.enqueue(
                        conn,
                        tenant_id=tenant,
                        operation_type=operation_type,
                        operation_key=f"{key}-{seq}",
                        provider="hook",
                        action="ledger.post",
                        payload={"ordering_key": key, "seq": seq},
                        ordering_key=key,
                    )
                ids[key].append(result.operation_id)
    return ids


def by_key(received: list[WebhookRequest]) -> dict[str, list[WebhookRequest]]:
    requests: dict[str, list[WebhookRequest]] = defaultdict(list)
    for r in sorted(received, key=lambda r: r.at):
        requests[r.body["ordering_key"]].append(r)
    return requests


def assert_one_at_a_time_in_order(received: list[WebhookRequest], per_key: int) -> None:
    for key, requests in by_key(received).items():
        seqs = [r.body["seq"] for r in requests]
        # Retries repeat a sequence number; it never goes back, and every one is there.
        assert seqs == sorted(seqs), f"{key}: out of order: {seqs}"
        assert sorted(set(seqs)) == list(range(per_key)), key
        for before, after in itertools.pairwise(requests):
            assert before.answered_at is not None and after.at >= before.answered_at, (
                f"{key}: seq {after.body['seq']} arrived while seq {before.body['seq']} "
                "was still in flight"
            )


def test_2000_operations_over_20_keys_with_4_dispatchers_keep_each_keys_order(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    keys = [f"account-{n}" for n in range(20)]
    ids = enqueue_ordered(db_url, keys, 100)
    # Transient failures and slow answers on 10% of the operations: a retried head keeps its
    # key waiting, and a slow one would let the next overtake it if the line were not kept.
    rng = random.Random(8)
    for op_id in rng.sample([i for key_ids in ids.values() for i in key_ids], 200):
        fault = rng.choice(
            [
                WebhookFault.status(503),
                WebhookFault.reset_before_apply(),
                WebhookFault.delay_after_apply(0.05),
            ]
        )
        receiver.inject(fault, key=key_of(db_url, op_id))
    # Unordered operations in the mix go in parallel with the lines.
    with psycopg.connect(db_url) as conn:
        for n in range(200):
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="free",
                operation_key=f"f{n}",
                provider="hook",
                action="a",
                payload={"ordering_key": None, "seq": n},
            )
    config = write_config(
        tmp_path / "outbox.toml",
        concurrency=32,
        batch_size=16,
        backoff_base="10ms",
        backoff_max="50ms",
        poll_interval="200ms",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "2s"}},
    )
    with outbox_processes(4, db_url, config, tmp_path):
        wait_until(
            lambda: statuses(db_url).get("succeeded") == 2200,
            timeout=120,
            what="2,200 operations to succeed",
        )
    assert statuses(db_url) == {"succeeded": 2200}
    ordered = [r for r in receiver.received if r.body.get("ordering_key") is not None]
    assert_one_at_a_time_in_order(ordered, 100)
    assert receiver.effect_count() == 2200  # each once, retries included
    retried = rows(db_url, "SELECT count(*) FROM outbox.operations WHERE attempts > 1")[0][0]
    assert retried >= 100  # the faults did strike
    assert rows(db_url, "SELECT count(*) FROM outbox.ordering_repairs") == [(0,)]


async def test_a_quarantined_operation_blocks_its_key_until_replayed_then_the_rest_follow(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_ordered(db_url, ["a", "b"], 4)
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids["a"][1]))  # permanent
    d = dispatcher(pool, {"hook": hook})
    while await d.run_once():
        pass
    assert rows(
        db_url, "SELECT id, status FROM outbox.operations WHERE ordering_key = 'a' ORDER BY id"
    ) == [
        (ids["a"][0], "succeeded"),
        (ids["a"][1], "quarantined"),
        (ids["a"][2], "pending"),
        (ids["a"][3], "pending"),
    ]
    assert statuses(db_url) == {"succeeded": 5, "quarantined": 1, "pending": 2}  # b went on
    assert [r.body["seq"] for r in by_key(receiver.received)["a"]] == [0, 1]
    # Still blocked on later passes: nothing of "a" is claimed.
    assert await d.run_once() == 0
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert operators.replay(conn, ids["a"][1], reason="fixed", actor="alice") is Status.PENDING
    while await d.run_once():
        pass
    assert statuses(db_url) == {"succeeded": 8}
    assert [r.body["seq"] for r in by_key(receiver.received)["a"]] == [0, 1, 1, 2, 3]
    assert_one_at_a_time_in_order(list(receiver.received), 4)


async def test_a_cancelled_head_lets_its_key_go_on(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_ordered(db_url, ["a"], 3)
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids["a"][0]))
    d = dispatcher(pool, {"hook": hook})
    while await d.run_once():
        pass
    assert statuses(db_url) == {"quarantined": 1, "pending": 2}
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.cancel(conn, ids["a"][0], reason="refunded by hand", actor="alice")
    while await d.run_once():
        pass
    assert statuses(db_url) == {"cancelled": 1, "succeeded": 2}
    assert [r.body["seq"] for r in by_key(receiver.received)["a"]] == [0, 1, 2]


async def test_in_mode_skip_the_key_goes_on_and_a_replay_rejoins_the_line(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT outbox.set_ordering_mode('ledger.post', 'skip', 'alice')")
    ids = enqueue_ordered(db_url, ["a"], 3)
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids["a"][0]))
    d = dispatcher(pool, {"hook": hook})
    assert await d.run_once() == 1  # seq 0, quarantined: seq 1 may go
    assert await d.run_once() == 1  # seq 1
    assert statuses(db_url) == {"quarantined": 1, "succeeded": 1, "pending": 1}
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.replay(conn, ids["a"][0], reason="fixed", actor="alice")
    blocked = rows(
        db_url,
        "SELECT id, ordering_blocked FROM outbox.operations WHERE status = 'pending' ORDER BY id",
    )
    assert blocked == [(ids["a"][0], True), (ids["a"][2], False)]  # behind the head, next
    while await d.run_once():
        pass
    assert statuses(db_url) == {"succeeded": 3}
    assert [r.body["seq"] for r in by_key(receiver.received)["a"]] == [0, 1, 2, 0]


def test_switching_a_type_to_skip_releases_the_keys_it_blocked(db_url: str) -> None:
    ids = enqueue_ordered(db_url, ["a", "b"], 2)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure' WHERE id = ANY(%s)",
            ([ids["a"][0], ids["b"][0]],),
        )
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE ordering_blocked") == [(2,)]
    with psycopg.connect(db_url) as conn:
        promoted = conn.execute(
            "SELECT outbox.set_ordering_mode('ledger.post', 'skip', 'alice')"
        ).fetchone()
    assert promoted == (2,)
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE ordering_blocked") == [(0,)]


def test_a_producer_enqueuing_several_of_one_key_in_one_transaction_makes_one_head(
    db_url: str,
) -> None:
    with psycopg.connect(db_url) as conn:
        for n in range(5):
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="t",
                operation_key=f"k{n}",
                provider="hook",
                action="a",
                payload={},
                ordering_key="same",
            )
        outbox.enqueue(
            conn,
            tenant_id="other",
            operation_type="t",
            operation_key="k0",
            provider="hook",
            action="a",
            payload={},
            ordering_key="same",
        )
    heads = rows(
        db_url,
        "SELECT tenant_id, operation_key FROM outbox.operations "
        "WHERE NOT ordering_blocked ORDER BY 1, 2",
    )
    assert heads == [("acme", "k0"), ("other", "k0")]  # per tenant: same key, separate lines


def test_a_different_ordering_key_for_the_same_identity_is_a_conflict(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        fields: dict[str, Any] = {
            "tenant_id": "acme",
            "operation_type": "t",
            "operation_key": "k",
            "provider": "hook",
            "action": "a",
            "payload": {},
        }
        outbox.enqueue(conn, **fields, ordering_key="x")
        assert outbox.enqueue(conn, **fields, ordering_key="x").outcome.value == "duplicate"
        with pytest.raises(outbox.OperationConflict):
            outbox.enqueue(conn, **fields, ordering_key="y")


def test_producers_enqueuing_while_dispatchers_run_never_overlap_or_strand_a_key(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    # The race the design is about: a producer commits an operation of a key at the moment that
    # key's head is settled. Each side must see the other, or the key stalls for good.
    keys = [f"k{n}" for n in range(5)]
    config = write_config(
        tmp_path / "outbox.toml",
        concurrency=16,
        batch_size=8,
        poll_interval="5s",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "2s"}},
    )
    per_producer = 60

    def produce(producer: int) -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            for seq in range(per_producer):
                key = keys[seq % len(keys)]
                with conn.transaction():
                    outbox.enqueue(
                        conn,
                        tenant_id="acme",
                        operation_type="ledger.post",
                        operation_key=f"p{producer}-{seq}",
                        provider="hook",
                        action="post",
                        payload={"ordering_key": key, "seq": seq, "producer": producer},
                        ordering_key=key,
                    )

    with outbox_processes(2, db_url, config, tmp_path):
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(produce, range(4)))
        # Polling every 5 s: a key left without a head would wait for the repair loop (1 s)
        # or stall; within 30 s every operation is through.
        wait_until(
            lambda: statuses(db_url).get("succeeded") == 4 * per_producer,
            timeout=30,
            what="every operation to succeed",
        )
    for key, requests in by_key(list(receiver.received)).items():
        for before, after in itertools.pairwise(requests):
            assert before.answered_at is not None and after.at >= before.answered_at, key
        for producer in range(4):
            mine = [r.body["seq"] for r in requests if r.body["producer"] == producer]
            assert mine == sorted(mine), f"{key}: producer {producer}'s order broken: {mine}"
    assert receiver.effect_count() == 4 * per_producer
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE ordering_blocked") == [(0,)]


async def test_a_head_settled_while_its_key_is_locked_is_repaired_by_the_dispatcher(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_ordered(db_url, ["a"], 2)
    with psycopg.connect(db_url) as committing_producer:
        # What a producer of the key holds while it commits (take_turn): the key's row lock.
        committing_producer.execute(
            "SELECT 1 FROM outbox.ordering_keys WHERE tenant_id = 'acme' AND ordering_key = 'a' "
            "FOR UPDATE"
        )
        assert await dispatcher(pool, {"hook": hook}).run_once() == 1
        # The record did not wait for the lock: it noted the key for repair instead.
        assert rows(db_url, "SELECT tenant_id, ordering_key FROM outbox.ordering_repairs") == [
            ("acme", "a")
        ]
        assert rows(
            db_url, "SELECT ordering_blocked FROM outbox.operations WHERE id = %s", (ids["a"][1],)
        ) == [(True,)]
    # The producer's session ends; the dispatcher's repair loop promotes the next one.
    assert await Store(pool).repair_ordering(10) == 1
    assert rows(db_url, "SELECT count(*) FROM outbox.ordering_repairs") == [(0,)]
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    assert statuses(db_url) == {"succeeded": 2}
    assert [r.body["seq"] for r in by_key(receiver.received)["a"]] == [0, 1]


async def test_status_and_the_gauge_say_how_many_wait_behind_what(
    db_url: str, pool: AsyncConnectionPool[Any], cli_env: dict[str, str]
) -> None:
    ids = enqueue_ordered(db_url, ["a", "b", "c"], 3)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure' WHERE id = %s",
            (ids["a"][0],),
        )
    await gauges.refresh(pool, {})
    assert {b: metrics.ORDERING_BLOCKED.labels(b)._value.get() for b in gauges.BEHIND} == {
        "pending": 4.0,
        "in_flight": 0.0,
        "quarantined": 2.0,
        "reconciling": 0.0,
        "none": 0.0,
    }
    done = outbox_cli(cli_env, "status", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ordering_blocked"] == [
        {"behind": "pending", "keys": 2, "waiting": 4},
        {"behind": "quarantined", "keys": 1, "waiting": 2},
    ]
    table = outbox_cli(cli_env, "status").stdout
    assert "waiting for their ordering key's turn" in table and "quarantined" in table
    # The pending count includes the waiting ones.
    assert json.loads(done.stdout)["operations"]["pending"] == 8


def test_the_ordering_commands_set_and_list_modes(db_url: str, cli_env: dict[str, str]) -> None:
    ids = enqueue_ordered(db_url, ["a"], 2)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure' WHERE id = %s",
            (ids["a"][0],),
        )
    done = outbox_cli(cli_env, "ordering", "set-mode", "ledger.post", "skip", "--actor", "alice")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ledger.post: skip; 1 ordering key(s) released"
    assert rows(
        db_url, "SELECT ordering_blocked FROM outbox.operations WHERE id = %s", (ids["a"][1],)
    ) == [(False,)]
    listed = json.loads(outbox_cli(cli_env, "ordering", "modes", "--json").stdout)
    assert [(m["operation_type"], m["on_failure"], m["updated_by"]) for m in listed] == [
        ("ledger.post", "skip", "alice")
    ]
    bad = outbox_cli(cli_env, "ordering", "set-mode", " ", "block")
    assert bad.returncode != 0 and "operation_type must not be empty" in bad.stderr
    assert "Traceback" not in bad.stderr
    wrong = outbox_cli(cli_env, "ordering", "set-mode", "ledger.post", "maybe")
    assert wrong.returncode == 2 and "'block', 'skip'" in wrong.stderr

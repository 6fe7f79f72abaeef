"""A success at the first attempt writes one row, not two (issue 41; sql/0050): it is kept on the
operation, and the view outbox.attempts shows it as the row attempt_log would have held, so that
every reader of the history (show, "was my record committed?", reconciliation's keys) reads what
it read before. Seeded workloads of refusals before a success, or before a permanent refusal,
check the history of every operation against what the receiver saw."""

from __future__ import annotations

import random
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.db.store import Store
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import dispatcher, enqueue_many, key_of, make_due, rows

WORKER = "ledger-worker"
# What the receiver answers before its success: answers that say it did not act, each retried
# (an answer that may have acted sends the operation toward reconciliation: tests of its own).
BEFORE = {
    "timeout": WebhookFault.status(408),
    "busy": WebhookFault.status(409),
}


def history(url: str, op: int) -> list[tuple[Any, ...]]:
    return rows(
        url,
        "SELECT attempt, outcome, sent, worker, idempotency_key, http_status, started_at,"
        " finished_at FROM outbox.attempts WHERE operation_id = %s ORDER BY attempt",
        (op,),
    )


def logged(url: str, op: int) -> int:
    ((count,),) = rows(
        url, "SELECT count(*) FROM outbox.attempt_log WHERE operation_id = %s", (op,)
    )
    return int(count)


async def test_a_first_attempt_success_is_one_row_of_the_view_and_none_of_the_log(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    d = dispatcher(pool, {"hook": hook}, worker=WORKER)
    assert await d.run_once() == 1
    ((status, attempts, worker, key, started, finished),) = rows(
        db_url,
        "SELECT status, attempts, success_worker, idempotency_key, last_attempt_at, finished_at"
        " FROM outbox.operations WHERE id = %s",
        (op,),
    )
    assert (status, attempts, worker) == ("succeeded", 1, WORKER)
    assert logged(db_url, op) == 0
    # Column for column what the log row held: the key sent, the attempt's start and end.
    assert history(db_url, op) == [(1, "succeeded", True, WORKER, key, 201, started, finished)]
    assert receiver.effect_count(key) == 1
    # A worker whose acknowledgement was lost asks whether its record committed: yes, for it.
    store = Store(pool)
    assert await store.attempt_recorded(op, 1, WORKER)
    assert not await store.attempt_recorded(op, 1, "another-worker")
    assert not await store.attempt_recorded(op, 2, WORKER)


async def test_a_success_after_a_failure_keeps_every_attempt_in_the_log(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    receiver.inject(WebhookFault.status(408), key=key)
    d = dispatcher(pool, {"hook": hook}, worker=WORKER)
    assert await d.run_once() == 1
    make_due(db_url)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT success_worker FROM outbox.operations") == [(None,)]
    assert logged(db_url, op) == 2
    assert [h[:3] for h in history(db_url, op)] == [
        (1, "transient", False),
        (2, "succeeded", True),
    ]


@pytest.mark.parametrize("seed", [3, 41])
async def test_every_operations_history_is_its_attempts_whatever_came_before_its_end(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    seed: int,
) -> None:
    rng = random.Random(seed)
    ids = enqueue_many(db_url, 60, max_attempts=6)
    plans: dict[int, list[str]] = {}
    for op in ids:
        plan = [rng.choice(list(BEFORE)) for _ in range(rng.choice([0, 0, 0, 1, 2, 3]))]
        if rng.random() < 0.1:
            plan.append("permanent")  # refused for good after whatever came first
        plans[op] = plan
        for kind in plan:
            fault = WebhookFault.status(422) if kind == "permanent" else BEFORE[kind]
            receiver.inject(fault, key=key_of(db_url, op))
    d = dispatcher(pool, {"hook": hook}, worker=WORKER)
    for _ in range(6):
        await d.run_once()
        make_due(db_url)
    final = {
        op: (status, attempts, worker)
        for op, status, attempts, worker in rows(
            db_url, "SELECT id, status, attempts, success_worker FROM outbox.operations"
        )
    }
    for op, plan in plans.items():
        status, attempts, inline_worker = final[op]
        expected_status = "quarantined" if "permanent" in plan else "succeeded"
        assert status == expected_status, (op, plan)
        assert attempts == len(plan) + (0 if "permanent" in plan else 1), (op, plan)
        seen = history(db_url, op)
        # Attempts 1..n, each once, whichever table holds them; a success is the last.
        assert [h[0] for h in seen] == list(range(1, attempts + 1)), (op, plan)
        outcomes = [h[1] for h in seen]
        assert outcomes.count("succeeded") == (status == "succeeded"), (op, plan)
        first_success = status == "succeeded" and attempts == 1
        assert (inline_worker is not None) == first_success, (op, plan)
        assert logged(db_url, op) == (0 if first_success else attempts), (op, plan)
    # One effect per operation that succeeded, none for the others.
    succeeded = [op for op, (status, _, _) in final.items() if status == "succeeded"]
    assert receiver.effect_count() == len(succeeded)
    ((view_rows, log_rows, inline_rows),) = rows(
        db_url,
        "SELECT (SELECT count(*) FROM outbox.attempts), (SELECT count(*) FROM"
        " outbox.attempt_log), (SELECT count(*) FROM outbox.operations"
        " WHERE success_worker IS NOT NULL)",
    )
    assert view_rows == log_rows + inline_rows == sum(a for _, a, _ in final.values())
    assert inline_rows == sum(1 for plan in plans.values() if not plan)

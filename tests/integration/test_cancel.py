"""Operators can stop anything (issue 17): `outbox cancel ID --reason`.

Pending, scheduled, waiting for its ordering key: cancelled at once. In flight: the attempt under
way is never interrupted nor given an outcome it did not have; when it ends the operation is
cancelled, unless it succeeded, or unless it (or an earlier attempt) may have reached the
provider: then "cancelled" would say an effect that may exist never happened, and it goes to
reconciliation instead. All of it is in the audit.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db.store import Store
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, key_of, rows, webhook

AUDIT = "SELECT actor, action, from_status, to_status FROM outbox.audit WHERE operation_id = %s "
AUDIT += "ORDER BY id"


def cancel(env: dict[str, str], op: int) -> Any:
    return outbox_cli(env, "cancel", str(op), "--reason", "customer asked", "--actor", "alice")


def status_of(url: str, op: int) -> tuple[str, str | None]:
    ((status, reason),) = rows(
        url, "SELECT status, status_reason FROM outbox.operations WHERE id = %s", (op,)
    )
    return status, reason


def test_pending_scheduled_and_waiting_operations_are_cancelled_at_once(
    db_url: str, cli_env: dict[str, str]
) -> None:
    (pending,) = enqueue_many(db_url, 1, prefix="p")
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'x', "
            "operation_key => 'later', provider => 'hook', action => 'a', payload => '{}', "
            "available_at => now() + interval '1 day')"
        )
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'x', "
            "operation_key => 'o' || g, provider => 'hook', action => 'a', payload => '{}', "
            "ordering_key => 'k') FROM generate_series(1, 3) g"
        )
    ids = dict(rows(db_url, "SELECT operation_key, id FROM outbox.operations"))
    for op in (pending, ids["later"], ids["o2"]):
        done = cancel(cli_env, op)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"operation {op}: cancelled"
        assert status_of(db_url, op) == ("cancelled", "cancelled by operator")
        assert rows(db_url, AUDIT, (op,)) == [("alice", "cancel", "pending", "cancelled")]
    # The waiting one left the line; the head is still the head, the third still behind it.
    assert rows(
        db_url,
        "SELECT operation_key, status, ordering_blocked FROM outbox.operations "
        "WHERE ordering_key = 'k' ORDER BY id",
    ) == [("o1", "pending", False), ("o2", "cancelled", False), ("o3", "pending", True)]
    # The head cancelled: the third is next.
    assert cancel(cli_env, ids["o1"]).returncode == 0
    assert rows(
        db_url, "SELECT ordering_blocked FROM outbox.operations WHERE id = %s", (ids["o3"],)
    ) == [(False,)]
    again = cancel(cli_env, pending)
    assert again.returncode == 2 and f"operation {pending} is cancelled" in again.stderr
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [(4,)]


async def _held_attempt(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    cli_env: dict[str, str],
    *,
    call_timeout: float,
) -> tuple[int, Any]:
    """One operation whose call is held at the receiver while an operator cancels it; returns
    its id and the hold (still held) once the cancel was requested."""
    (op,) = enqueue_many(db_url, 1)
    held = receiver.hold(key_of(db_url, op))
    hook = webhook("hook", receiver.url, timeout=call_timeout)
    run = asyncio.create_task(dispatcher(pool, {"hook": hook}).run_once())
    assert await asyncio.to_thread(held.arrived.wait, 10)
    done = await asyncio.to_thread(cancel, cli_env, op)
    assert done.returncode == 0, done.stderr
    assert "in_flight; cancel requested" in done.stdout
    assert status_of(db_url, op)[0] == "in_flight"  # the attempt goes on
    return op, (held, run, hook)


async def test_an_attempt_that_may_have_reached_the_provider_goes_to_reconciliation_not_cancelled(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    cli_env: dict[str, str],
) -> None:
    op, (held, run, hook) = await _held_attempt(db_url, pool, receiver, cli_env, call_timeout=5.0)
    try:
        assert await run == 1  # the call timed out: unknown, which would have been retried
    finally:
        held.release()
        await hook.aclose()
    # It did reach the receiver: reconciliation decides, and nothing more is sent meanwhile.
    assert status_of(db_url, op) == ("reconciling", "cancel_requested")
    # The attempt keeps its true outcome: unknown, and it may have reached the receiver.
    attempts = rows(
        db_url,
        "SELECT outcome, sent, error_class FROM outbox.attempts WHERE operation_id = %s",
        (op,),
    )
    assert attempts == [("unknown", True, "timeout")]
    assert rows(db_url, AUDIT, (op,)) == [
        ("alice", "cancel_requested", "in_flight", "in_flight"),
        ("outbox", "cancel_to_reconciliation", "in_flight", "reconciling"),
    ]
    ((details,),) = rows(
        db_url,
        "SELECT details FROM outbox.audit WHERE operation_id = %s "
        "AND action = 'cancel_to_reconciliation'",
        (op,),
    )
    assert details["instead_of"] == "pending"
    await asyncio.sleep(0.2)
    assert len(receiver.received) == 1  # nothing more was sent


async def test_a_cancel_that_comes_too_late_leaves_the_success_and_says_so(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    cli_env: dict[str, str],
) -> None:
    op, (held, run, hook) = await _held_attempt(db_url, pool, receiver, cli_env, call_timeout=30.0)
    held.release()
    try:
        assert await run == 1
    finally:
        await hook.aclose()
    ((status, ref),) = rows(
        db_url, "SELECT status, provider_ref FROM outbox.operations WHERE id = %s", (op,)
    )
    assert status == "succeeded" and ref
    assert receiver.effect_count() == 1
    assert rows(db_url, AUDIT, (op,)) == [
        ("alice", "cancel_requested", "in_flight", "in_flight"),
        ("outbox", "cancel_not_applied", "in_flight", "succeeded"),
    ]


async def test_a_dead_workers_operation_whose_cancel_was_requested_goes_to_reconciliation(
    db_url: str, pool: AsyncConnectionPool[Any], cli_env: dict[str, str]
) -> None:
    """Its worker may have sent it before it died: the rescue's attempt is unknown."""
    (op,) = enqueue_many(db_url, 1)
    assert [c.id for c in await Store(pool).claim("dead", 10, timedelta(seconds=30))] == [op]
    assert cancel(cli_env, op).returncode == 0
    with psycopg.connect(db_url) as conn:  # time moves in the data: the lease ran out
        conn.execute("UPDATE outbox.operations SET lease_expires_at = now() - interval '1 s'")
    assert await dispatcher(pool, {}).rescue_once() == 1
    assert status_of(db_url, op) == ("reconciling", "cancel_requested")
    attempts = rows(
        db_url, "SELECT outcome, error_class FROM outbox.attempts WHERE operation_id = %s", (op,)
    )
    assert attempts == [("unknown", "lease_expired")]


async def test_an_attempt_released_unsent_after_the_cancel_leaves_it_cancelled(
    db_url: str, pool: AsyncConnectionPool[Any], cli_env: dict[str, str]
) -> None:
    """Released at shutdown before its send: nothing reached the provider."""
    (op,) = enqueue_many(db_url, 1)
    store = Store(pool)
    (claimed,) = await store.claim("w", 10, timedelta(seconds=30))
    assert cancel(cli_env, op).returncode == 0
    assert await store.unclaim(claimed, Status.PENDING, None)
    assert status_of(db_url, op) == ("cancelled", "cancelled by operator")
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(0,)]


def test_a_pending_operation_an_earlier_attempt_of_which_may_have_reached_the_provider(
    db_url: str, cli_env: dict[str, str]
) -> None:
    """Waiting for a retry after an unknown outcome: cancelling it outright would say the effect
    never happened. It goes to reconciliation, where a check or a person decides."""
    (op,) = enqueue_many(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET first_sent_at = now() - interval '1 minute', "
            "attempts = 1 WHERE id = %s",
            (op,),
        )
    done = cancel(cli_env, op)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(f"operation {op}: reconciling")
    assert status_of(db_url, op) == ("reconciling", "cancel_requested")
    assert rows(db_url, AUDIT, (op,)) == [("alice", "cancel_requested", "pending", "reconciling")]

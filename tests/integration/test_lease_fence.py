"""The lease fence, in every path that writes after a provider call: a worker whose lease expired
while another worker holds the row in flight under a new lease changes nothing.

The case the fence exists for is not a zombie that wakes after the row was finished (then
``status = 'in_flight'`` alone refuses it) but one that wakes while the row is in flight again,
taken by another worker after the rescuer gave it back. Each test builds that case with real
claims, a real rescue and the real statements (outbox/dispatch/dispatcher.py says why the fence),
then makes the zombie write through one path and compares the rows, the attempts and the audit,
column by column, with what they were before; a positive control in each shows the same write
going through for a row the zombie still holds, so no test passes because nothing could be
written.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db.group_record import GroupRecorder
from outbox.db.store import Claimed, Record, Store
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import (
    dispatcher,
    enqueue_charges,
    enqueue_many,
    key_of,
    rows,
    stripe_provider,
)

ZOMBIE = "zombie"
HOLDER = "holder"


@dataclass(frozen=True)
class Fenced:
    """Rows the zombie lost to the holder, and rows the zombie still holds (the controls)."""

    lost: list[Claimed]  # the zombie's expired claims
    holders: list[Claimed]  # the holder's live claims of the same rows
    kept: list[Claimed]  # claims the zombie still holds


def snapshot(db_url: str) -> tuple[list[Any], ...]:
    """Every column of every operation, attempt and audit entry."""
    return (
        rows(db_url, "SELECT to_jsonb(o) FROM outbox.operations o ORDER BY id"),
        rows(db_url, "SELECT to_jsonb(a) FROM outbox.attempts a ORDER BY operation_id, attempt"),
        rows(db_url, "SELECT to_jsonb(a) FROM outbox.audit a ORDER BY id"),
    )


def only(db_url: str, ids: set[int]) -> tuple[list[Any], ...]:
    """The snapshot restricted to the operations ``ids``."""
    ops, attempts, audit = snapshot(db_url)
    return (
        [r for r in ops if r[0]["id"] in ids],
        [r for r in attempts if r[0]["operation_id"] in ids],
        [r for r in audit if r[0]["operation_id"] in ids],
    )


async def taken_over(
    db_url: str, pool: AsyncConnectionPool[Any], lost: int, kept: int = 0
) -> Fenced:
    """``lost + kept`` operations the zombie claims; the first ``lost`` of them its lease
    expires on, the rescuer takes back and the holder claims again, in flight under its own
    lease when the zombie wakes."""
    enqueue_many(db_url, lost + kept)
    store = Store(pool)
    claims = sorted(await store.claim(ZOMBIE, lost + kept, timedelta(minutes=5)))
    gone, still = claims[:lost], claims[lost:]
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET lease_expires_at = now() - interval '1 s' "
            "WHERE id = ANY(%s)",
            ([c.id for c in gone],),
        )
    assert len(await store.rescue(limit=1000, max_attempts=10)) == lost
    holders = sorted(await store.claim(HOLDER, lost, timedelta(minutes=5)))
    assert [h.id for h in holders] == [c.id for c in gone]
    assert all(h.attempts == c.attempts + 1 for h, c in zip(holders, gone, strict=True))
    return Fenced(gone, holders, still)


def outcome_of(rng: random.Random, claim: Claimed) -> Record:
    """Any outcome a worker could record for ``claim``: each next status the policy can pick."""
    base: dict[str, Any] = {
        "id": claim.id,
        "lease_token": claim.lease_token,
        "attempt": claim.attempts,
        "worker": ZOMBIE,
    }
    kind = rng.choice(["succeeded", "retry", "retry_now", "quarantined", "reconciling"])
    if kind == "succeeded":
        return Record(
            status=Status.SUCCEEDED,
            outcome="succeeded",
            sent=True,
            provider_ref=f"zombie-{claim.id}",
            result={"by": ZOMBIE},
            http_status=200,
            **base,
        )
    if kind in ("retry", "retry_now"):
        delay = timedelta(seconds=rng.choice([1, 60])) if kind == "retry" else None
        return Record(
            status=Status.PENDING,
            outcome="transient",
            sent=rng.random() < 0.5,
            retry_in=delay,
            error="503 from the zombie's call",
            error_class="http_503",
            http_status=503,
            **base,
        )
    if kind == "quarantined":
        return Record(
            status=Status.QUARANTINED,
            outcome="permanent",
            sent=True,
            reason="attempts_exhausted",
            error="400",
            error_class="http_400",
            **base,
        )
    return Record(
        status=Status.RECONCILING,
        outcome="unknown",
        sent=True,
        reason="key_window_passed",
        error="reset",
        error_class="timeout",
        **base,
    )


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_zombies_grouped_records_change_only_the_rows_it_still_holds(
    db_url: str, pool: AsyncConnectionPool[Any], seed: int
) -> None:
    rng = random.Random(seed)
    lost = rng.randint(1, 8)
    fenced = await taken_over(db_url, pool, lost=lost, kept=rng.randint(1, 8))
    lost_ids = {c.id for c in fenced.lost}
    before = only(db_url, lost_ids)
    claims = fenced.lost + fenced.kept
    rng.shuffle(claims)
    # One group commit: the recorder takes records arriving together into one statement.
    recorder = GroupRecorder(Store(pool))
    recorded = await asyncio.gather(*(recorder.record(outcome_of(rng, c)) for c in claims))
    assert {c.id for c, done in zip(claims, recorded, strict=True) if done} == {
        c.id for c in fenced.kept
    }
    assert only(db_url, lost_ids) == before
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.operations WHERE id = ANY(%s) "
        "AND status = 'in_flight' AND lease_owner = %s",
        ([*lost_ids], HOLDER),
    ) == [(lost,)]
    # The controls: each row the zombie still held has its record and one attempt row more.
    kept = [c.id for c in fenced.kept]
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.attempts WHERE operation_id = ANY(%s) AND worker = %s",
        (kept, ZOMBIE),
    ) == [(len(kept),)]
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.operations WHERE id = ANY(%s) AND status <> 'in_flight'",
        (kept,),
    ) == [(len(kept),)]


async def test_a_zombies_single_record_changes_nothing(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The statement-at-a-time path (an answer that cannot be stored in a batch)."""
    fenced = await taken_over(db_url, pool, lost=1, kept=1)
    before = only(db_url, {fenced.lost[0].id})
    store = Store(pool)
    rng = random.Random(5)
    for _ in range(5):
        assert await store.record(outcome_of(rng, fenced.lost[0])) is False
    assert only(db_url, {fenced.lost[0].id}) == before
    assert await store.record(outcome_of(rng, fenced.kept[0])) is True


async def test_a_zombies_heartbeat_renews_no_lease_it_lost(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    fenced = await taken_over(db_url, pool, lost=2, kept=1)
    lost_ids = {c.id for c in fenced.lost}
    before = only(db_url, lost_ids)
    store = Store(pool)
    # A lease long enough to outlast the holder's, if the zombie's renewal went through.
    alive = await store.heartbeat([*fenced.lost, *fenced.kept], timedelta(hours=2))
    assert alive == {fenced.kept[0].id}
    assert only(db_url, lost_ids) == before
    assert rows(
        db_url,
        "SELECT lease_expires_at > now() + interval '1 hour' FROM outbox.operations WHERE id = %s",
        (fenced.kept[0].id,),
    ) == [(True,)]


@pytest.mark.parametrize(
    ("status", "reason", "delay"),
    [
        (Status.PENDING, None, None),  # released at shutdown, or its breaker opened
        (Status.PENDING, None, timedelta(seconds=30)),  # refused credentials, unknown provider
        (Status.RECONCILING, "key_window_passed", None),  # the key window before the send
    ],
)
async def test_a_zombies_release_changes_nothing(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    status: Status,
    reason: str | None,
    delay: timedelta | None,
) -> None:
    fenced = await taken_over(db_url, pool, lost=1, kept=1)
    before = only(db_url, {fenced.lost[0].id})
    store = Store(pool)
    assert await store.unclaim(fenced.lost[0], status, reason, delay) is False
    assert only(db_url, {fenced.lost[0].id}) == before
    assert await store.unclaim(fenced.kept[0], status, reason, delay) is True
    assert rows(
        db_url, "SELECT status, attempts FROM outbox.operations WHERE id = %s", (fenced.kept[0].id,)
    ) == [(status.value, 0)]


async def test_the_rescuer_takes_no_lease_that_is_still_live(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    fenced = await taken_over(db_url, pool, lost=3)
    before = snapshot(db_url)
    assert await Store(pool).rescue(limit=1000, max_attempts=10) == []
    assert snapshot(db_url) == before
    # Not even a lease that ends within the second: only an expired one.
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET lease_expires_at = now() + interval '1 s' WHERE id = %s",
            (fenced.holders[0].id,),
        )
    assert await Store(pool).rescue(limit=1000, max_attempts=10) == []


async def test_the_attempt_the_rescuer_recorded_is_not_the_zombies_record(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """A zombie whose record's acknowledgement was lost asks whether its record committed. The
    rescuer's attempt row names the zombie as its worker; it is not the zombie's record."""
    fenced = await taken_over(db_url, pool, lost=1, kept=1)
    store = Store(pool)
    zombie = fenced.lost[0]
    assert await store.attempt_recorded(zombie.id, zombie.attempts, ZOMBIE) is False
    kept = fenced.kept[0]
    assert await store.record(outcome_of(random.Random(1), kept)) is True
    assert await store.attempt_recorded(kept.id, kept.attempts, ZOMBIE) is True


async def test_operator_actions_leave_a_row_in_flight_to_its_holder(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    fenced = await taken_over(db_url, pool, lost=1)
    op = fenced.lost[0].id
    before = snapshot(db_url)
    who = {"reason": "3 a.m. guess", "actor": "alice"}
    with psycopg.connect(db_url, autocommit=True) as conn:
        refused: list[Callable[[], Status]] = [
            lambda: operators.resolve(conn, op, provider_ref="pi_guess", **who),
            lambda: operators.cancel(conn, op, **who),
            lambda: operators.replay(conn, op, **who),
            lambda: operators.request_reconciliation(conn, op, **who),
            lambda: operators.retry(conn, op, force=True, **who),
        ]
        for action in refused:
            with pytest.raises(operators.ActionRefused, match="is in_flight"):
                action()
        assert snapshot(db_url) == before
        # A cancel is noted for when the holder's attempt ends; the lease stays the holder's.
        assert operators.request_cancel(conn, op, **who) is Status.IN_FLIGHT
    assert rows(db_url, "SELECT status, lease_owner, lease_token FROM outbox.operations") == [
        ("in_flight", HOLDER, fenced.holders[0].lease_token)
    ]
    # The zombie's record must not be the attempt that ends it either.
    noted = snapshot(db_url)
    assert await Store(pool).record(outcome_of(random.Random(2), fenced.lost[0])) is False
    assert snapshot(db_url) == noted
    holder = fenced.holders[0]
    failed = Record(
        id=op,
        lease_token=holder.lease_token,
        attempt=holder.attempts,
        worker=HOLDER,
        status=Status.PENDING,
        outcome="transient",
        sent=False,
        retry_in=timedelta(seconds=1),
        error="503",
    )
    assert await Store(pool).record(failed) is True
    # Cancelled, but the zombie's attempt may have reached the provider: a person checks first.
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "cancel_requested")
    ]


async def test_a_zombie_whose_call_returns_while_another_worker_holds_the_row_changes_nothing(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """The whole way, through a real dispatcher and a real call: the zombie's call reaches the
    receiver and its answer is held there until another worker holds the row."""
    (op,) = enqueue_many(db_url, 1)
    zombie = dispatcher(pool, {"hook": hook}, worker=ZOMBIE)
    with receiver.hold(key_of(db_url, op)) as held:
        call = asyncio.create_task(zombie.run_once())
        assert await asyncio.to_thread(held.arrived.wait, 10)
        with psycopg.connect(db_url) as conn:  # the zombie stalls past its lease
            conn.execute("UPDATE outbox.operations SET lease_expires_at = now() - interval '1 s'")
        assert await dispatcher(pool, {"hook": hook}, worker="rescuer").rescue_once() == 1
        (holder,) = await Store(pool).claim(HOLDER, 1, timedelta(minutes=5))
        before = snapshot(db_url)
        await zombie.heartbeat_once()
        assert snapshot(db_url) == before
        held.release()
        assert await asyncio.wait_for(call, timeout=30) == 1  # its success, recorded nowhere
    assert snapshot(db_url) == before
    assert rows(db_url, "SELECT status, lease_token, attempts FROM outbox.operations") == [
        ("in_flight", holder.lease_token, 2)
    ]
    # The holder stalls too; the next attempt sends the same key and the effect stays one.
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET lease_expires_at = now() - interval '1 s'")
    last = dispatcher(pool, {"hook": hook}, worker="last")
    assert await last.rescue_once() == 1
    assert await last.run_once() == 1
    history = rows(db_url, "SELECT attempt, worker, outcome FROM outbox.attempts ORDER BY 1")
    assert history == [(1, ZOMBIE, "unknown"), (2, HOLDER, "unknown"), (3, "last", "succeeded")]
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("succeeded",)]
    assert receiver.effect_count() == 1


@pytest.fixture
async def stripe(fake: FakeStripe) -> AsyncIterator[Provider]:
    p = stripe_provider("stripe", fake.url, timeout=2.0)
    yield p
    await p.aclose()


def reconciling(claim: Claimed, worker: str) -> Record:
    """An attempt whose outcome is unknown, past its key window: to reconciliation."""
    return Record(
        id=claim.id,
        lease_token=claim.lease_token,
        attempt=claim.attempts,
        worker=worker,
        status=Status.RECONCILING,
        outcome="unknown",
        sent=True,
        reason="key_window_passed",
        error="timeout",
    )


async def failed_look(fake: FakeStripe, reconciler: Reconciler, check: dict[str, Any]) -> str:
    fake.refuse_connections()
    try:
        return (await reconciler.check(check)).finding
    finally:
        fake.accept_connections()


async def test_a_reconcilers_late_finding_and_deferral_change_nothing(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """A check taken in one episode of an operation (reconciling under key generation 1) that
    answers in the next: retried by an operator and in flight, then back in reconciling."""
    (op,) = enqueue_charges(db_url, 1)
    store = Store(pool)
    (first,) = await store.claim(ZOMBIE, 1, timedelta(minutes=5))
    assert await store.record(reconciling(first, ZOMBIE)) is True
    reconciler = Reconciler(pool, {"stripe": stripe})
    (late,) = await reconciler.claim(recheck_after=timedelta(hours=1), limit=10)
    with psycopg.connect(db_url, autocommit=True) as conn:
        operators.retry(conn, op, reason="checked by hand", actor="alice", force=True)
    (second,) = await store.claim(HOLDER, 1, timedelta(minutes=5))
    for episode in ("in flight", "reconciling again"):
        before = snapshot(db_url)
        # Stripe has no effect of it: a finding of not_found, and a failed look's deferral.
        assert (await reconciler.check(late)).finding == "stale", episode
        assert await failed_look(fake, reconciler, late) == "error", episode
        assert snapshot(db_url) == before, episode
        if episode == "in flight":
            assert await store.record(reconciling(second, HOLDER)) is True
    # The controls: a check of the episode the operation is in is deferred, then recorded.
    (current,) = await reconciler.candidates(op)
    assert await failed_look(fake, reconciler, current) == "error"
    assert rows(db_url, "SELECT checked_at IS NOT NULL, check_finding FROM outbox.operations") == [
        (True, None)
    ]
    assert (await reconciler.check(current)).finding == "not_found"
    assert rows(db_url, "SELECT check_finding, key_generation FROM outbox.operations") == [
        ("not_found", 2)
    ]
    assert fake.object_count() == 0

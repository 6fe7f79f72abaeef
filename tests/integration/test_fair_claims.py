"""Fair claims: one tenant's or one provider's backlog does not fill every batch while another's
operations wait, and a provider capped at 0 is not claimed at all (statements.CLAIM); while one
group alone has rows, statements.CLAIM_ONE_GROUP claims them the same way for less."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.db import statements
from outbox.db.store import FAIR_ONLY_CLAIMS, Store, claim_params
from outbox.providers.base import Provider
from outbox.providers.noop import NoopProvider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, key_of, rows

LEASE = timedelta(seconds=30)


def backlog(url: str, count: int, *, tenant: str, provider: str = "hook") -> None:
    """``count`` pending operations of one tenant, through outbox.enqueue, in one statement."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => %(t)s, operation_type => 'bulk', "
            "operation_key => %(p)s || g, provider => %(p)s, action => 'bulk.sync', "
            "payload => jsonb_build_object('n', g)) FROM generate_series(1, %(n)s) g",
            {"t": tenant, "p": provider, "n": count},
        )


def enqueue_one(url: str, *, tenant: str, key: str, provider: str = "hook") -> int:
    with psycopg.connect(url) as conn:
        return outbox.enqueue(
            conn,
            tenant_id=tenant,
            operation_type="invoice.charge",
            operation_key=key,
            provider=provider,
            action="invoice.paid",
            payload={"key": key},
        ).operation_id


async def test_a_tenants_single_operation_is_sent_within_two_claims_of_another_tenants_50000(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    backlog(db_url, 50_000, tenant="whale")
    small = enqueue_one(db_url, tenant="minnow", key="the-one")
    d = dispatcher(pool, {"hook": hook}, batch_size=100, concurrency=100)
    claims = 0
    while not receiver.received_for(key_of(db_url, small)) and claims < 5:
        assert await d.run_once() == 100  # full batches: the whale's backlog is there
        claims += 1
    # The bound is two claims; with two groups every claim serves both, so it is one.
    assert claims == 1, f"the single operation waited {claims} claims"
    assert receiver.effect_count(key_of(db_url, small)) == 1
    assert rows(db_url, "SELECT status FROM outbox.operations WHERE id = %s", (small,)) == [
        ("succeeded",)
    ]
    # The whale lost nothing: everything not yet sent is still pending, nothing went twice.
    counts = dict(rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1"))
    assert counts == {"succeeded": 100 * claims, "pending": 50_001 - 100 * claims}
    assert receiver.effect_count() == 100 * claims


async def test_every_group_gets_a_share_and_the_rest_fills_the_batch(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    backlog(db_url, 300, tenant="a")
    backlog(db_url, 300, tenant="b")
    for n in range(3):
        enqueue_one(db_url, tenant="c", key=f"c{n}")
    store = Store(pool)
    claimed = await store.claim("w", 100, LEASE)
    per_tenant = Counter(row.tenant_id for row in claimed)
    assert len(claimed) == 100  # the batch is full although c had only 3
    assert per_tenant["c"] == 3
    assert per_tenant["a"] >= 34 and per_tenant["b"] >= 34
    assert len({row.id for row in claimed}) == 100


async def test_a_provider_capped_at_zero_is_not_claimed_and_a_cap_is_never_exceeded(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    backlog(db_url, 2_000, tenant="acme", provider="stripe")  # ahead of the others in line
    backlog(db_url, 50, tenant="acme", provider="hook")
    backlog(db_url, 50, tenant="other", provider="stripe")
    store = Store(pool)
    first = await store.claim("w", 100, LEASE, caps={"stripe": 0})
    assert Counter(row.provider for row in first) == {"hook": 50}
    second = await store.claim("w", 100, LEASE, caps={"stripe": 7, "hook": 0})
    assert Counter(row.provider for row in second) == {"stripe": 7}
    assert {row.tenant_id for row in second} == {"acme", "other"}  # the cap, shared fairly
    leased = rows(
        db_url,
        "SELECT provider, count(*) FROM outbox.operations "
        "WHERE status = 'in_flight' GROUP BY 1 ORDER BY 1",
    )
    assert leased == [("hook", 50), ("stripe", 7)]


async def test_past_the_groups_one_claim_visits_the_cursor_serves_every_group_in_turn(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    # 60 tenants of 3 operations each, batches of 10: a claim visits at most 20 groups, each
    # gets one row; the dispatcher's cursor carries the visit on, so every tenant is served
    # once before any is served twice.
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't' || lpad(t::text, 2, '0'), "
            "operation_type => 'x', operation_key => 'k' || n, provider => 'fast', "
            "action => 'a', payload => '{}') "
            "FROM generate_series(1, 60) t, generate_series(1, 3) n"
        )
    d = dispatcher(
        pool, {"fast": NoopProvider("fast", timedelta(hours=24))}, batch_size=10, concurrency=10
    )
    for _ in range(6):
        assert await d.run_once() == 10
    served = dict(
        rows(
            db_url,
            "SELECT tenant_id, count(*) FROM outbox.operations "
            "WHERE status = 'succeeded' GROUP BY 1",
        )
    )
    assert len(served) == 60 and set(served.values()) == {1}
    for _ in range(12):
        assert await d.run_once() == 10
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(180,)]
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("succeeded", 180)
    ]


def one_group_claim(url: str, limit: int, caps: dict[str, int] | None = None) -> list[int]:
    """statements.CLAIM_ONE_GROUP run directly: the ids it leased, sorted (oldest first)."""
    with psycopg.connect(url) as conn:
        leased = conn.execute(
            statements.CLAIM_ONE_GROUP, claim_params("w", limit, LEASE, caps)
        ).fetchall()
    return sorted(row[0] for row in leased)


def pending_ids(url: str, tenant: str) -> list[int]:
    query = "SELECT id FROM outbox.operations WHERE tenant_id = %s AND status = 'pending'"
    return sorted(row[0] for row in rows(url, query, (tenant,)))


async def test_one_group_alone_is_claimed_oldest_first_within_the_limit_and_its_cap(
    db_url: str,
) -> None:
    backlog(db_url, 30, tenant="a")
    with psycopg.connect(db_url) as conn:  # the oldest row, but not due yet
        conn.execute(
            "UPDATE outbox.operations SET available_at = now() + interval '1 hour' "
            "WHERE id = (SELECT min(id) FROM outbox.operations)"
        )
    waiting, *due = pending_ids(db_url, "a")
    assert one_group_claim(db_url, 10, {"hook": 0}) == []
    assert one_group_claim(db_url, 10, {"hook": 3}) == due[:3]
    assert one_group_claim(db_url, 10, {"other": 3}) == due[3:13]
    assert pending_ids(db_url, "a") == [waiting, *due[13:]]
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.operations WHERE status = 'in_flight' "
        "AND lease_owner = 'w' AND attempts = 1",
    ) == [(13,)]


async def test_with_a_second_group_the_one_group_claim_takes_nothing_and_the_fair_one_runs(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    backlog(db_url, 300, tenant="a")
    store = Store(pool)
    assert Counter(row.tenant_id for row in await store.claim("w", 10, LEASE)) == {"a": 10}
    backlog(db_url, 5, tenant="b")  # newer than every row of a, and after them in the index
    assert one_group_claim(db_url, 10) == []
    assert Counter(row.tenant_id for row in await store.claim("w", 10, LEASE)) == {"a": 5, "b": 5}
    # b has nothing left: one group again.
    assert Counter(row.tenant_id for row in await store.claim("w", 100, LEASE)) == {"a": 100}
    oldest = pending_ids(db_url, "a")[:10]
    assert one_group_claim(db_url, 10) == oldest
    assert rows(
        db_url,
        "SELECT tenant_id, status, count(*) FROM outbox.operations GROUP BY 1, 2 ORDER BY 1, 2",
    ) == [("a", "in_flight", 125), ("a", "pending", 175), ("b", "in_flight", 5)]


async def test_beside_a_capped_group_the_one_group_claim_is_tried_again_only_now_and_then(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    backlog(db_url, 500, tenant="a", provider="stripe")  # its breaker open: capped at 0
    backlog(db_url, 500, tenant="a", provider="hook")
    store = Store(pool)
    capped = {"stripe": 0}
    # The one-group claim takes nothing (two groups hold rows), the fair one takes hook's.
    assert Counter(row.provider for row in await store.claim("w", 10, LEASE, capped)) == {
        "hook": 10
    }
    assert store._fair_only == FAIR_ONLY_CLAIMS
    for _ in range(FAIR_ONLY_CLAIMS):  # straight to the fair claim
        assert len(await store.claim("w", 10, LEASE, capped)) == 10
    assert store._fair_only == 0
    assert len(await store.claim("w", 10, LEASE, capped)) == 10  # tried, took nothing, again
    assert store._fair_only == FAIR_ONLY_CLAIMS
    leased = rows(
        db_url,
        "SELECT provider, count(*) FROM outbox.operations WHERE status = 'in_flight' GROUP BY 1",
    )
    assert leased == [("hook", 10 * (FAIR_ONLY_CLAIMS + 2))]

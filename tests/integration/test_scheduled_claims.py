"""Claims that cannot be starved (issue 17, case 2).

Rows not due yet are `scheduled`, out of the claim index until a dispatcher stages them
(sql/0019); however many (provider, tenant) groups hold only such rows, or belong to a paused or
capped provider, the due rows of every other group are claimed by the claims a dispatcher makes
before it next sleeps.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

from outbox.db.store import Claimed, Store
from outbox.dispatch.dispatcher import next_cursor
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import dispatcher, rows, statuses

LEASE = timedelta(seconds=30)


def tomorrows(url: str, tenants: int, *, provider: str = "hook") -> None:
    """One operation scheduled for tomorrow for each of ``tenants`` tenants, a0000 onwards."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'a' || lpad(t::text, 4, '0'), "
            "operation_type => 'reminder', operation_key => 'r', provider => %s, "
            "action => 'remind', payload => '{}', available_at => now() + interval '1 day') "
            "FROM generate_series(0, %s - 1) t",
            (provider, tenants),
        )


def due_now(url: str, count: int, *, tenant: str = "zzz", provider: str = "hook") -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => %s, operation_type => 'invoice.paid', "
            "operation_key => 'k' || g, provider => %s, action => 'invoice.paid', "
            "payload => jsonb_build_object('n', g)) FROM generate_series(1, %s) g",
            (tenant, provider, count),
        )


async def test_a_due_tenant_sorting_after_1000_tenants_of_tomorrows_is_claimed_at_once(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    tomorrows(db_url, 1000)
    due_now(db_url, 20)
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE scheduled") == [(1000,)]
    d = dispatcher(pool, {"hook": hook}, batch_size=100, concurrency=100)
    assert await d.run_once() == 20
    assert receiver.effect_count() == 20
    assert statuses(db_url) == {"pending": 1000, "succeeded": 20}


@pytest.mark.parametrize("tenants", [1, 3])
async def test_a_row_not_due_is_not_claimed_even_if_it_is_not_marked_scheduled(
    db_url: str, pool: AsyncConnectionPool[Any], tenants: int
) -> None:
    """The claims check the time themselves: a row that missed its `scheduled` mark (written
    around the stager, say by a dispatcher of before sql/0019 during an upgrade) still waits.
    One tenant takes the one-group claim, several the fair claim."""
    tomorrows(db_url, tenants)
    due_now(db_url, 2, tenant="a0000")
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET scheduled = false")
    claimed = await Store(pool).claim("w", 10, LEASE)
    assert sorted(c.operation_key for c in claimed) == ["k1", "k2"]
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.operations WHERE status = 'pending' AND available_at > now()",
    ) == [(tenants,)]


def test_outbox_run_delivers_a_due_tenant_behind_200_tenants_of_tomorrows(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """The issue's case: before sql/0019, 0 of these 20 were delivered in 15 s."""
    tomorrows(db_url, 200)
    due_now(db_url, 20)
    cfg = write_config(
        tmp_path / "outbox.toml", providers={"hook": {"type": "webhook", "url": receiver.url}}
    )
    proc = OutboxProcess(db_url, cfg, tmp_path / "run.log")
    try:
        wait_until(lambda: receiver.effect_count() == 20, timeout=15, what="the 20 due ones")
    finally:
        proc.stop()
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE status = 'pending'") == [
        (200,)
    ]


async def test_a_scheduled_operation_is_staged_and_sent_when_due_without_waiting_a_poll(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't', operation_type => 'x', operation_key => 'k', "
            "provider => 'hook', action => 'a', payload => '{}', "
            "available_at => now() + interval '1.5 seconds')"
        )
    # Polls far apart: only the stager's own timer can make this quick.
    d = dispatcher(pool, {"hook": hook}, poll_interval=timedelta(seconds=30))
    runner = asyncio.create_task(d.run())
    try:
        for _ in range(100):
            if receiver.effect_count() == 1:
                break
            await asyncio.sleep(0.1)
    finally:
        d.request_stop()
        await runner
    assert receiver.effect_count() == 1
    assert statuses(db_url) == {"succeeded": 1}


async def test_a_provider_with_a_small_cap_and_many_tenants_leaves_room_for_the_next(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Capped at 2 (rate tokens, max_in_flight), provider "a" may give 2 rows a claim: its 300
    tenants must not fill the visit while provider "b", sorting after it, waits."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't' || lpad(t::text, 3, '0'), "
            "operation_type => 'x', operation_key => 'k', provider => 'a', action => 'a', "
            "payload => '{}') FROM generate_series(1, 300) t"
        )
    due_now(db_url, 5, tenant="t001", provider="b")
    claimed = await Store(pool).claim("w", 50, LEASE, caps={"a": 2})
    assert Counter(c.provider for c in claimed) == {"a": 2, "b": 5}


# --- the property ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    provider: str
    tenant: str
    due: int
    future: int
    ordered: int  # operations of one ordering key: only the first is claimable


PROVIDERS = ("p1", "p2", "p3")
groups_strategy = st.lists(
    st.builds(
        Group,
        provider=st.sampled_from(PROVIDERS),
        tenant=st.sampled_from([f"t{n:02d}" for n in range(12)]),
        due=st.integers(0, 6),
        future=st.integers(0, 4),
        ordered=st.integers(0, 3),
    ),
    max_size=30,
    unique_by=lambda g: (g.provider, g.tenant),
)
caps_strategy = st.fixed_dictionaries(
    {p: st.one_of(st.none(), st.integers(0, 4)) for p in PROVIDERS}
)


def populate(url: str, groups: list[Group]) -> None:
    with psycopg.connect(url) as conn:
        conn.execute(
            "TRUNCATE outbox.operations, outbox.attempt_log, outbox.ordering_keys, "
            "outbox.ordering_repairs"
        )
        for g in groups:
            args = {"p": g.provider, "t": g.tenant}
            for kind, n, extra in (
                ("due", g.due, ""),
                ("future", g.future, ", available_at => now() + interval '1 hour'"),
                ("ordered", g.ordered, ", ordering_key => 'o'"),
            ):
                if n:
                    conn.execute(
                        "SELECT outbox.enqueue(tenant_id => %(t)s, operation_type => 'x', "  # noqa: S608
                        f"operation_key => '{kind}' || %(p)s || i, provider => %(p)s, "
                        f"action => 'a', payload => '{{}}'{extra}) "
                        f"FROM generate_series(1, {n}) i",
                        args,
                    )


def claimable(url: str) -> Counter[str]:
    """Per provider, the rows a claim may take: due, the head of their key, not yet leased."""
    query = (
        "SELECT provider, count(*) FROM outbox.operations WHERE status = 'pending' "
        "AND NOT ordering_blocked AND NOT scheduled AND available_at <= now() GROUP BY 1"
    )
    return Counter(dict(rows(url, query)))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# Found by this test: a provider capped at 3 got 4 rows (the room of its busy groups divided as
# numeric and rounded up) ...
@example(
    groups=[
        Group("p1", "t01", 1, 0, 0),
        Group("p2", "t00", 0, 0, 1),
        Group("p1", "t02", 0, 0, 1),
        Group("p3", "t00", 3, 0, 0),
        Group("p3", "t01", 0, 0, 1),
    ],
    caps={"p1": None, "p2": None, "p3": 3},
    limit=7,
    seed=0,
)
# ... and rows of an uncapped provider were left behind by a short claim.
@example(
    groups=[
        Group("p1", "t02", 0, 0, 2),
        Group("p1", "t03", 0, 0, 1),
        Group("p2", "t00", 0, 0, 1),
        Group("p2", "t02", 0, 0, 3),
        Group("p3", "t01", 5, 0, 0),
        Group("p3", "t02", 1, 0, 0),
        Group("p3", "t04", 0, 0, 1),
    ],
    caps={"p1": None, "p2": 1, "p3": None},
    limit=9,
    seed=0,
)
@given(
    groups=groups_strategy,
    caps=caps_strategy,
    limit=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_claims_leave_nothing_claimable_behind_when_they_come_back_short(
    db_url: str, groups: list[Group], caps: dict[str, int | None], limit: int, seed: int
) -> None:
    """Claims go on while they come back full, as the dispatcher's loop does, then it would
    sleep: by then every due, unblocked row of every provider not held back by its cap has been
    claimed, within ceil(rows / limit) + 1 claims; nothing else ever is, and no row twice."""
    populate(db_url, groups)
    capped = {p: c for p, c in caps.items() if c is not None}
    asyncio.run(_claim_until_short(db_url, capped, limit, random.Random(seed)))


async def _claim_until_short(
    url: str, caps: dict[str, int], limit: int, rng: random.Random
) -> None:
    total = sum(claimable(url)[p] for p in PROVIDERS if caps.get(p) != 0)
    cursor: tuple[str, str] | None = None
    if rng.random() < 0.5:  # a dispatcher that claimed before starts somewhere in the middle
        cursor = (rng.choice(PROVIDERS), f"t{rng.randrange(12):02d}")
    seen: set[int] = set()
    async with AsyncConnectionPool(
        url, min_size=1, max_size=2, kwargs={"autocommit": True}
    ) as pool:
        store = Store(pool)
        for n in range(1, total // limit + 3):
            before = claimable(url)
            claimed: list[Claimed] = await store.claim("w", limit, LEASE, caps, cursor)
            ids = {c.id for c in claimed}
            assert not ids & seen, "a row claimed twice"
            seen |= ids
            per_provider = Counter(c.provider for c in claimed)
            for provider, taken in per_provider.items():
                assert taken <= caps.get(provider, limit), (provider, taken, caps)
            cursor = next_cursor(cursor, claimed)
            if len(claimed) == limit:
                continue
            # Short: the dispatcher would sleep now. Nothing claimable may be left but what a
            # provider's cap kept back in this very claim.
            left = claimable(url)
            for provider in PROVIDERS:
                if left[provider] and caps.get(provider) != 0:
                    assert per_provider[provider] == caps.get(provider), (
                        f"{left[provider]} of {provider} left behind by claim {n} "
                        f"({before[provider]} before, caps {caps}, limit {limit})"
                    )
            break
        else:
            raise AssertionError(f"no short claim within {total // limit + 2} claims")
    assert rows(
        url,
        "SELECT count(*) FROM outbox.operations WHERE status = 'in_flight' "
        "AND (scheduled OR ordering_blocked OR available_at > now())",
    ) == [(0,)]


async def test_a_claim_of_more_rows_than_200_groups_fills_from_more_groups(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """batch_size and concurrency above 200: the visit must reach as many groups as rows."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't' || lpad(t::text, 3, '0'), "
            "operation_type => 'x', operation_key => 'k', provider => 'a', action => 'a', "
            "payload => '{}') FROM generate_series(1, 300) t"
        )
    claimed = await Store(pool).claim("w", 500, LEASE)
    assert len(claimed) == 300

"""Ordering keys serialise on locks only outbox can take (issue 17, case 7).

Before sql/0019 a key's lock was an advisory lock: any role could take it (a producer bound to
its own tenant hung another tenant's COMMIT), two keys whose hashes collide shared one, and one
transaction could hold only a few thousand ("out of shared memory" at the COMMIT of 20,000
ordered operations). Each key's lock is now a row of outbox.ordering_keys.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.db.store import Store
from tests.integration.test_roles import APP, apply_roles, as_role
from tests.support.dispatch import rows

# Two keys of tenant acme whose old advisory locks were one: hashtext('acme' || E'\n' || key)
# is the same for both (found by a search of k1 to k300000).
COLLIDING = ("k2709", "k126979")


def enqueue_ordered(conn: psycopg.Connection[Any], tenant: str, key: str, n: int = 1) -> None:
    conn.execute(
        "SELECT outbox.enqueue(tenant_id => %(t)s, operation_type => 'ledger.post', "
        "operation_key => %(k)s || '-' || g, provider => 'hook', action => 'post', "
        "payload => '{}', ordering_key => %(k)s) FROM generate_series(1, %(n)s) g",
        {"t": tenant, "k": key, "n": n},
    )


def heads(url: str, key: str) -> list[tuple[Any, ...]]:
    return rows(
        url,
        "SELECT operation_key, ordering_blocked FROM outbox.operations "
        "WHERE ordering_key = %s ORDER BY id",
        (key,),
    )


def test_a_producer_of_one_tenant_cannot_hold_another_tenants_key(
    db_url: str, pg_server: str
) -> None:
    apply_roles(pg_server, db_url, tenant_rls=True)
    with psycopg.connect(as_role(db_url, APP), autocommit=True) as attacker:
        # What held the victim's key before 0019, and any role may take.
        attacker.execute(
            "SELECT pg_advisory_lock(hashtext('outbox.ordering'), "
            "hashtext('victim' || E'\\n' || 'order-7'))"
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            attacker.execute("SELECT 1 FROM outbox.ordering_keys FOR UPDATE")
        with psycopg.connect(as_role(db_url, APP)) as victim:
            victim.execute("SELECT outbox.bind_tenant('victim')")
            victim.execute("SET LOCAL lock_timeout = '3s'")  # a wait fails the test, not hangs it
            enqueue_ordered(victim, "victim", "order-7", 2)
            victim.commit()
    assert heads(db_url, "order-7") == [("order-7-1", False), ("order-7-2", True)]


def test_a_key_held_open_does_not_hold_another_key_even_where_their_hashes_collide(
    db_url: str,
) -> None:
    first, second = COLLIDING
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url) as other:
        # A producer that fires its turn early and keeps its transaction open holds its key.
        holder.execute("SET CONSTRAINTS ALL IMMEDIATE")
        enqueue_ordered(holder, "acme", first)
        other.execute("SET LOCAL lock_timeout = '3s'")
        enqueue_ordered(other, "acme", second, 2)
        other.commit()
        holder.commit()
    assert heads(db_url, second) == [(f"{second}-1", False), (f"{second}-2", True)]
    assert heads(db_url, first) == [(f"{first}-1", False)]


@pytest.mark.parametrize("keys", [20_000, 1], ids=["20000-keys", "one-key"])
def test_20000_ordered_operations_commit_in_one_transaction(db_url: str, keys: int) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'bulk', operation_type => 'ledger.post', "
            "operation_key => 'op-' || g, provider => 'hook', action => 'post', "
            "payload => '{}', ordering_key => 'key-' || (g %% %s)) "
            "FROM generate_series(1, 20000) g",
            (keys,),
        )
        # Before 0019: "out of shared memory" here, with 20,000 advisory locks to take.
        conn.commit()
    got = rows(db_url, "SELECT ordering_blocked, count(*) FROM outbox.operations GROUP BY 1")
    expected = {False: keys} | ({True: 20_000 - keys} if keys < 20_000 else {})
    assert dict(got) == expected  # one head per key, every other operation waiting its turn
    assert rows(db_url, "SELECT count(*) FROM outbox.ordering_turns") == [(0,)]
    assert rows(db_url, "SELECT count(*) FROM outbox.ordering_keys") == [(keys,)]


async def test_a_key_whose_lock_is_held_goes_to_the_back_and_the_other_keys_are_repaired(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    with psycopg.connect(db_url) as conn:
        enqueue_ordered(conn, "acme", "held", 2)
        enqueue_ordered(conn, "acme", "free", 2)
    with psycopg.connect(db_url) as holder, psycopg.connect(db_url) as settler:
        holder.execute(
            "SELECT 1 FROM outbox.ordering_keys WHERE ordering_key IN ('held', 'free') FOR UPDATE"
        )
        # Both heads settle while their keys are locked: each is noted for repair.
        settler.execute(
            "UPDATE outbox.operations SET status = 'cancelled', "
            "status_reason = 'x', finished_at = now() "
            "WHERE operation_key IN ('held-1', 'free-1')"
        )
        settler.commit()
        holder.rollback()
        holder.execute("SELECT 1 FROM outbox.ordering_keys WHERE ordering_key = 'held' FOR UPDATE")
        before = rows(db_url, "SELECT max(noted_at) FROM outbox.ordering_repairs")
        # The repair does not wait for the held key: it repairs the other and moves on.
        assert await Store(pool).repair_ordering(10) == 2
        assert heads(db_url, "free") == [("free-1", False), ("free-2", False)]
        assert heads(db_url, "held") == [("held-1", False), ("held-2", True)]
        ((key, noted),) = rows(db_url, "SELECT ordering_key, noted_at FROM outbox.ordering_repairs")
        assert key == "held" and noted > before[0][0]
    assert await Store(pool).repair_ordering(10) == 1
    assert heads(db_url, "held") == [("held-1", False), ("held-2", False)]
    assert rows(db_url, "SELECT count(*) FROM outbox.ordering_repairs") == [(0,)]


async def test_a_repeatable_read_producer_never_strands_its_key(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Its snapshot is older than its COMMIT: under the key's lock it would not see the head
    settled meanwhile, and leave the key without one. Its keys go to the repair instead."""
    with psycopg.connect(db_url) as conn:
        enqueue_ordered(conn, "acme", "rr")
    with psycopg.connect(db_url) as producer, psycopg.connect(db_url) as settler:
        producer.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        producer.execute("SELECT 1")  # the snapshot is taken here, the head still pending
        producer.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'ledger.post', "
            "operation_key => 'rr-2', provider => 'hook', action => 'post', payload => '{}', "
            "ordering_key => 'rr')"
        )
        settler.execute(
            "UPDATE outbox.operations SET status = 'cancelled', status_reason = 'x', "
            "finished_at = now() WHERE operation_key = 'rr-1'"
        )
        settler.commit()
        producer.commit()
    assert heads(db_url, "rr") == [("rr-1", False), ("rr-2", True)]
    assert await Store(pool).repair_ordering(10) == 1
    assert heads(db_url, "rr") == [("rr-1", False), ("rr-2", False)]


def test_two_serializable_producers_of_a_new_key_both_commit(db_url: str) -> None:
    """At READ COMMITTED a new key's row is made at COMMIT; at SERIALIZABLE that insert could
    fail the COMMIT (40001) when another producer made it meanwhile."""
    with psycopg.connect(db_url) as first, psycopg.connect(db_url) as second:
        for conn, n in ((first, 1), (second, 2)):
            conn.isolation_level = psycopg.IsolationLevel.SERIALIZABLE
            conn.execute(
                "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'x', "
                "operation_key => %s, provider => 'hook', action => 'a', payload => '{}', "
                "ordering_key => 'fresh')",
                (f"s{n}",),
            )
        first.commit()
        second.commit()
    assert rows(
        db_url, "SELECT count(*) FROM outbox.ordering_repairs WHERE ordering_key = 'fresh'"
    ) == [(2,)]

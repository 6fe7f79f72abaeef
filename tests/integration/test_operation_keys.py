"""An operation's identity and provider key live apart from its row (sql/0051, issue 41 step C),
and stay exact under every writer: enqueue, reconcile retry's next generation, prune, a hand's
DELETE or TRUNCATE, many producers at once, and tenant isolation.

The invariant each test checks is the same one: outbox.operation_keys holds exactly one row per
operation, naming its identity, its id, its provider and the key it sends now (none for a key
shared with older operations), so that no two operations share an identity or a provider key.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from datetime import timedelta

import psycopg
import pytest

import outbox
from outbox.oncall import prune
from tests.integration.test_key_namespace import enqueue
from tests.integration.test_rls import owned_db  # noqa: F401  (a fixture)
from tests.integration.test_roles import APP, as_role
from tests.support.dispatch import rows

# What the keys must be, computed from the operations themselves.
KEYS_FROM_OPERATIONS = """
SELECT tenant_id, operation_type, operation_key, id, provider,
       CASE WHEN NOT key_shared THEN idempotency_key END
FROM outbox.operations ORDER BY id
"""
KEYS = """
SELECT tenant_id, operation_type, operation_key, operation_id, provider, idempotency_key
FROM outbox.operation_keys ORDER BY operation_id
"""


def assert_keys_exact(url: str) -> None:
    """The keys table mirrors the operations, and no identity or provider key is taken twice."""
    expected = rows(url, KEYS_FROM_OPERATIONS)
    assert rows(url, KEYS) == expected
    identities = Counter(row[:3] for row in expected)
    provider_keys = Counter(row[4:] for row in expected if row[5] is not None)
    assert [i for i, n in identities.items() if n > 1] == []
    assert [k for k, n in provider_keys.items() if n > 1] == []


def test_a_claim_and_a_record_touch_no_unique_index_of_the_operation(db_url: str) -> None:
    """The point of the split: the operation's row carries no unique index but its id's."""
    unique = rows(
        db_url,
        "SELECT indexrelid::regclass::text FROM pg_index"
        " WHERE indrelid = 'outbox.operations'::regclass AND indisunique ORDER BY 1",
    )
    assert unique == [("outbox.operations_pkey",)]


def test_another_tenants_key_is_refused_under_forced_isolation(owned_db: str) -> None:  # noqa: F811
    """With a schema owner that is not a superuser, FORCE binds enqueue to the producer's
    tenant; the key's holder, another tenant's operation, was invisible to it and its loop of
    insert and look-up never ended (until sql/0051). Now the keys answer, across tenants."""
    app = as_role(owned_db, APP)
    for tenant, expect_conflict in (("tenant-a", False), ("tenant-b", True)):
        with psycopg.connect(app) as conn:
            conn.execute("SET statement_timeout = '10s'")
            outbox.bind_tenant(conn, tenant)
            if not expect_conflict:
                enqueue(conn, tenant, "ord-1", idempotency_key="order-1")
                continue
            with pytest.raises(outbox.OperationConflict) as refused:
                enqueue(conn, tenant, "ord-1", idempotency_key="order-1")
    assert refused.value.field == "idempotency_key"
    detail = refused.value.__cause__.diag.message_detail  # type: ignore[union-attr]
    assert detail == "it belongs to another tenant"
    assert rows(owned_db, "SELECT tenant_id FROM outbox.operations") == [("tenant-a",)]
    assert_keys_exact(owned_db)


def test_retry_moves_the_key_and_prune_frees_the_identity(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        retried = enqueue(conn, "acme", "retried", idempotency_key="caller-key").operation_id
        done = enqueue(conn, "acme", "done").operation_id
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', attempts = 1,"
            " last_attempt_at = now() - interval '1 hour' WHERE id = %s",
            (retried,),
        )
        conn.execute(
            "UPDATE outbox.operations SET status = 'succeeded', provider_ref = 'r',"
            " finished_at = now() - interval '2 days' WHERE id = %s",
            (done,),
        )
        conn.execute("SELECT outbox.retry_operation(%s, 'test', 'carol', true)", (retried,))
        conn.commit()
    derived = rows(db_url, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (done,))
    assert rows(db_url, "SELECT idempotency_key FROM outbox.operation_keys ORDER BY 1") == [
        ("caller-key:r2",),
        *derived,
    ]
    assert_keys_exact(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert prune.prune_finished(conn, older_than=timedelta(days=1)) == 1
    assert_keys_exact(db_url)
    with psycopg.connect(db_url) as conn:
        again = enqueue(conn, "acme", "done")
    assert again.outcome == "accepted" and again.operation_id != done
    assert_keys_exact(db_url)


def test_a_hand_delete_and_a_truncate_take_the_keys_along(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        ids = [enqueue(conn, "acme", f"k{n}").operation_id for n in range(5)]
        conn.commit()
        conn.execute("DELETE FROM outbox.operations WHERE id = ANY(%s)", (ids[:2],))
        conn.commit()
        assert_keys_exact(db_url)
        assert enqueue(conn, "acme", "k0").outcome == "accepted"
        conn.commit()
        conn.execute("TRUNCATE outbox.operations, outbox.attempt_log CASCADE")
        conn.commit()
    assert rows(db_url, "SELECT count(*) FROM outbox.operation_keys") == [(0,)]


def test_producers_at_once_with_colliding_identities_and_keys(db_url: str) -> None:
    """A seeded random workload: four producers enqueue from a small pool of identities and
    caller keys (so identities and keys collide, within a tenant and across), with a fifth
    deleting finished operations meanwhile. Every call is accepted, a duplicate of the operation
    that holds its identity, or refused as a conflict; and the keys stay exact."""
    seed = random.randrange(2**32)
    said = f"seed {seed}"
    outcomes: Counter[str] = Counter()
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def produce(worker: int) -> None:
        rng = random.Random(seed + worker)
        try:
            with psycopg.connect(db_url) as conn:
                for _ in range(150):
                    tenant = rng.choice(("a", "b"))
                    key = f"op-{rng.randrange(40)}"
                    caller = rng.choice((None, None, f"ck-{rng.randrange(15)}"))
                    payload = {"v": rng.randrange(2)}
                    try:
                        got = enqueue(conn, tenant, key, idempotency_key=caller, payload=payload)
                        seen = got.outcome.value
                    except outbox.OperationConflict:
                        seen = "conflict"
                    except psycopg.errors.SerializationFailure:
                        seen = "retry"
                    if rng.random() < 0.5:
                        conn.commit()
                    else:
                        conn.rollback()
                    with lock:
                        outcomes[seen] += 1
        except BaseException as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)

    def delete_some() -> None:
        rng = random.Random(seed)
        with psycopg.connect(db_url, autocommit=True) as conn:
            while not stop.is_set():
                conn.execute(
                    "DELETE FROM outbox.operations WHERE id IN (SELECT id FROM outbox.operations"
                    " ORDER BY random() LIMIT %s FOR UPDATE SKIP LOCKED)",
                    (rng.randrange(3),),
                )
                stop.wait(0.01)

    producers = [threading.Thread(target=produce, args=(n,)) for n in range(4)]
    deleter = threading.Thread(target=delete_some)
    for thread in (*producers, deleter):
        thread.start()
    for thread in producers:
        thread.join()
    stop.set()
    deleter.join()
    assert errors == [], said
    assert sum(outcomes.values()) == 600, said
    assert min(outcomes[o] for o in ("accepted", "duplicate", "conflict")) > 0, (said, outcomes)
    assert_keys_exact(db_url)

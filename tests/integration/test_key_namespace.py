"""A provider key names exactly one operation (issue 20, case 1).

A producer of tenant A could enqueue an operation carrying the derived key of tenant B's future
operation, or the same caller key as B: the provider then refused B's request (422, Stripe's
idempotency_error) or replayed A's answer to it. Keys are now unique per provider across every
tenant, refused at enqueue; the forms outbox makes (ob1_..., ob2_..., ...:rN) are its own.

Since sql/0041 a derived key mixes in a secret of the database (issue 38, 3i): no one who knows
only an identity can compute its key, and two databases derive different keys.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import psycopg
import pytest

import outbox
from outbox.db import migrations
from tests.support.dispatch import rows


def enqueue(
    conn: psycopg.Connection[Any],
    tenant: str,
    key: str,
    *,
    idempotency_key: str | None = None,
    provider: str = "hook",
    payload: dict[str, Any] | None = None,
) -> Any:
    return outbox.enqueue(
        conn,
        tenant_id=tenant,
        operation_type="order.ship",
        operation_key=key,
        provider=provider,
        action="ship",
        payload=payload if payload is not None else {"order": key},
        idempotency_key=idempotency_key,
    )


def installation_secret(url: str) -> bytes:
    """The database's key secret (sql/0041), read as the schema owner."""
    ((secret,),) = rows(url, "SELECT key_secret FROM outbox.installation")
    return bytes(secret)


def derived_key(secret: bytes, tenant: str, operation_type: str, key: str) -> str:
    """What enqueue derives: ob2_ and SHA-256(secret || SHA-256(secret || identity)), the
    identity as PostgreSQL's JSON text of [tenant, type, key]."""
    text = json.dumps([tenant, operation_type, key], ensure_ascii=False).encode()
    inner = hashlib.sha256(secret + text).digest()
    return "ob2_" + hashlib.sha256(secret + inner).hexdigest()


def test_nobody_can_occupy_another_tenants_derived_key_in_advance(db_url: str) -> None:
    victim = derived_key(installation_secret(db_url), "zz-victim", "order.ship", "ord-7")
    with psycopg.connect(db_url) as conn:
        with pytest.raises(outbox.InvalidOperation, match="ob<digits>_") as refused:
            enqueue(conn, "attacker", "mine", idempotency_key=victim)
        assert refused.value.field == "idempotency_key"
        conn.rollback()
        result = enqueue(conn, "zz-victim", "ord-7")
        conn.commit()
    assert result.outcome == "accepted"
    assert rows(db_url, "SELECT tenant_id, idempotency_key FROM outbox.operations") == [
        ("zz-victim", victim)
    ]  # derived as the test computed it: the attack was real


@pytest.mark.parametrize(
    "key", ["order-1:r2", "x:r10", "ob1_anything", "ob2_anything", "OB2_x", "Ob9_x", "ob10_x"]
)
def test_the_forms_outbox_makes_are_refused_as_caller_keys(db_url: str, key: str) -> None:
    with psycopg.connect(db_url) as conn, pytest.raises(outbox.InvalidOperation):
        enqueue(conn, "acme", "k", idempotency_key=key)
    assert rows(db_url, "SELECT count(*) FROM outbox.operations") == [(0,)]


def test_two_tenants_with_one_caller_key_are_told_at_enqueue(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        first = enqueue(conn, "tenant-a", "ord-1", idempotency_key="order-1")
        conn.commit()
        with pytest.raises(outbox.OperationConflict) as other_tenant:
            enqueue(conn, "tenant-b", "ord-1", idempotency_key="order-1")
        conn.rollback()
        with pytest.raises(outbox.OperationConflict) as same_tenant:
            enqueue(conn, "tenant-a", "ord-2", idempotency_key="order-1")
        conn.rollback()
        again = enqueue(conn, "tenant-a", "ord-1", idempotency_key="order-1")  # idempotent
        elsewhere = enqueue(
            conn, "tenant-b", "ord-1", idempotency_key="order-1", provider="other"
        )  # another provider: another namespace
        conn.commit()
    for refused in (other_tenant.value, same_tenant.value):
        assert refused.field == "idempotency_key"
    detail = other_tenant.value.__cause__.diag.message_detail  # type: ignore[union-attr]
    assert detail == "it belongs to another tenant"  # never the other tenant's id
    own = same_tenant.value.__cause__.diag.message_detail  # type: ignore[union-attr]
    assert own == f"existing operation id: {first.operation_id}"
    assert (again.outcome, again.operation_id) == ("duplicate", first.operation_id)
    assert elsewhere.outcome == "accepted"
    assert rows(db_url, "SELECT tenant_id, provider FROM outbox.operations ORDER BY id") == [
        ("tenant-a", "hook"),
        ("tenant-b", "other"),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_randomized_producers_never_share_a_providers_key(db_url: str, seed: int) -> None:
    """Seeded: tenants enqueue identities with keys from a small pool, some derived, on two
    providers. Every (provider, key) ends with exactly one operation, the first to take it, and
    every refusal is a conflict or an invalid key, never a quarantine later."""
    rng = random.Random(seed)
    secret = installation_secret(db_url)
    taken: dict[tuple[str, str], tuple[str, str]] = {}  # (provider, key) -> identity
    providers: dict[tuple[str, str], str] = {}  # identity -> its provider
    counts = {"accepted": 0, "duplicate": 0, "conflict": 0}
    with psycopg.connect(db_url) as conn:
        for _ in range(300):
            tenant, key = rng.choice(["a", "b", "c"]), f"ord-{rng.randint(1, 20)}"
            provider = rng.choice(["hook", "stripe"])
            given = None if rng.random() < 0.3 else f"k-{rng.randint(1, 15)}"
            sent = given or derived_key(secret, tenant, "order.ship", key)
            try:
                result = enqueue(conn, tenant, key, idempotency_key=given, provider=provider)
                conn.commit()
            except outbox.OperationConflict as exc:
                conn.rollback()
                counts["conflict"] += 1
                if exc.field == "idempotency_key":  # the key names another identity
                    assert taken[(provider, sent)] != (tenant, key), (seed, provider, sent)
                else:  # the identity exists, on the other provider
                    assert providers[(tenant, key)] != provider, (seed, tenant, key)
                continue
            counts[result.outcome] += 1
            if result.outcome == "accepted":
                assert (provider, sent) not in taken, (seed, provider, sent)
                taken[(provider, sent)] = (tenant, key)
                providers[(tenant, key)] = provider
    keys = rows(
        db_url, "SELECT provider, idempotency_key, tenant_id, operation_key FROM outbox.operations"
    )
    assert len(keys) == len({(p, k) for p, k, _, _ in keys}) == counts["accepted"]
    assert {(p, k): (t, o) for p, k, t, o in keys} == taken
    assert counts["conflict"] > 0 and counts["duplicate"] > 0  # both paths were walked


def test_operations_that_already_share_a_key_are_kept_and_the_oldest_holds_it(
    empty_db_url: str,
) -> None:
    """Upgrading a database where two operations already carry one key: migrate succeeds,
    both stay, the oldest keeps the key and a new operation cannot take it."""
    todo = migrations.load_migrations()
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, migrations=[m for m in todo if m.version < 24])
        for tenant in ("a", "b"):
            enqueue(conn, tenant, "ord-1", idempotency_key="order-1")
        migrations.migrate(conn, migrations=todo)
    assert rows(
        empty_db_url, "SELECT tenant_id, key_shared FROM outbox.operations ORDER BY id"
    ) == [("a", False), ("b", True)]
    with psycopg.connect(empty_db_url) as conn, pytest.raises(outbox.OperationConflict):
        enqueue(conn, "c", "ord-1", idempotency_key="order-1")


def test_two_databases_derive_different_keys_and_old_rows_keep_theirs(
    db_url: str, empty_db_url: str
) -> None:
    """A database migrated before 0041 holds ob1_ keys, kept as they are when 0041 comes; from
    then on each database derives with its own secret, which neither the identity nor the other
    database's keys give away."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=40)
    with psycopg.connect(empty_db_url) as conn:
        enqueue(conn, "acme", "before")
        conn.commit()
    ((old_key,),) = rows(empty_db_url, "SELECT idempotency_key FROM outbox.operations")
    plain = json.dumps(["acme", "order.ship", "before"]).encode()
    assert old_key == "ob1_" + hashlib.sha256(plain).hexdigest()
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn)
    keys = {}
    for url in (db_url, empty_db_url):
        with psycopg.connect(url) as conn:
            enqueue(conn, "acme", "before")  # a duplicate: the stored key stands
            enqueue(conn, "acme", "after")
            conn.commit()
        keys[url] = dict(rows(url, "SELECT operation_key, idempotency_key FROM outbox.operations"))
        secret = installation_secret(url)
        assert keys[url]["after"] == derived_key(secret, "acme", "order.ship", "after")
    assert keys[empty_db_url]["before"] == old_key
    assert keys[db_url]["after"] != keys[empty_db_url]["after"]
    assert installation_secret(db_url) != installation_secret(empty_db_url)
    assert len(installation_secret(db_url)) == 32

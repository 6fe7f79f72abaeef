"""The dispatcher checks a payload against its contract before the first send (issue 42): a row
that reached the table past the Python API's check (the SQL function, which has no JSON Schema
validator, or a hand INSERT) and breaks its contract is quarantined unsent as
``contract_violation``, naming the path and the rule, never the value; the rest of the backlog is
delivered. Every test runs the real dispatcher against the fake webhook receiver."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.contracts import Checker
from outbox.contracts.files import canonical_json
from outbox.core.model import Status
from outbox.db.store import Store
from outbox.dispatch.contracts import Contracts
from outbox.dispatch.flight import Aside
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_contracts_enqueue import CHARGE, publish
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, rows, statuses

MARKER = "4242-MARKER-VALUE"  # in refused payloads: must never appear in what outbox wrote

# Payloads the SQL function takes under charge/v1 and the contract refuses: (path, rule).
BROKEN: dict[str, tuple[dict[str, Any], str, str]] = {
    "type at depth 1": ({"amount": MARKER, "currency": "eur"}, "/amount", "type"),
    "missing member": ({"amount": 5, "note": MARKER}, "", "required"),
    "typo of a member": ({"ammount": 5, "currency": "eur", "amount": 1}, "", "additional"),
    "depth 3": (
        {"amount": 5, "currency": "eur", "lines": [{"sku": "a"}, {"sku": ""}]},
        "/lines/1/sku",
        "minLength",
    ),
    "enum": ({"amount": 5, "currency": MARKER}, "/currency", "enum"),
}
GOOD = [{"amount": n, "currency": "usd", "lines": [{"sku": f"s{n}"}]} for n in range(1, 4)]


def sql_enqueue(conn: psycopg.Connection[Any], key: str, payload: object, version: int) -> int:
    """Through the SQL function, as a producer in another language does: it checks the version
    and the size, not the schema (sql/0053)."""
    row = conn.execute(
        "SELECT operation_id FROM outbox.enqueue(tenant_id => 'acme', operation_type => 'charge',"
        " operation_key => %s, provider => 'hook', action => 'charge', payload => %s::jsonb,"
        " contract_version => %s)",
        (key, json.dumps(payload), version),
    ).fetchone()
    assert row is not None
    return int(row[0])


def hand_insert(conn: psycopg.Connection[Any], key: str, payload: object, version: int) -> int:
    """Past the SQL function too, as an owner or a restore may write a row."""
    row = conn.execute(
        "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint, "
        "provider, action, payload, idempotency_key, contract_version) VALUES ('acme', 'charge', "
        "%s, sha256(%s::bytea), 'hook', 'charge', %s::jsonb, %s, %s) RETURNING id",
        (key, key.encode(), json.dumps(payload), f"ob1_hand_{key}", version),
    ).fetchone()
    assert row is not None
    return int(row[0])


def assert_quarantined_unsent(db_url: str, ids: list[int]) -> list[str]:
    """One attempt each, not sent, permanent; the operation quarantined as contract_violation
    with no send time. Returns the errors, in the order of ``ids``."""
    attempts = rows(
        db_url,
        "SELECT operation_id, attempt, outcome, sent, error_class, error_message "
        "FROM outbox.attempts WHERE operation_id = ANY(%s) ORDER BY operation_id",
        (ids,),
    )
    assert [a[:5] for a in attempts] == [
        (i, 1, "permanent", False, "contract_violation") for i in sorted(ids)
    ]
    ops = rows(
        db_url,
        "SELECT status, status_reason, first_sent_at, last_error FROM outbox.operations "
        "WHERE id = ANY(%s) ORDER BY id",
        (ids,),
    )
    assert [o[:3] for o in ops] == [("quarantined", "contract_violation", None)] * len(ids)
    errors = {a[0]: a[5] for a in attempts}
    assert all(o[3] == errors[i] for i, o in zip(sorted(ids), ops, strict=True))
    return [str(errors[i]) for i in ids]


async def run(pool: AsyncConnectionPool[Any], hook: Provider) -> None:
    d = dispatcher(pool, {"hook": hook})
    for _ in range(3):
        await d.run_once()


async def test_a_row_forced_past_enqueues_check_is_quarantined_unsent_naming_path_and_rule(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    cli_env: dict[str, str],
) -> None:
    publish(db_url, "charge", 1, CHARGE)
    with psycopg.connect(db_url) as conn:
        broken = {
            name: (sql_enqueue(conn, f"bad-{i}", p, 1), path, rule)
            for i, (name, (p, path, rule)) in enumerate(BROKEN.items())
        }
        for n, payload in enumerate(GOOD):  # behind them, in the same line
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="charge",
                operation_key=f"good-{n}",
                provider="hook",
                action="charge",
                payload=payload,
                contract_version=1,
            )
    await run(pool, hook)
    assert statuses(db_url) == {"quarantined": len(BROKEN), "succeeded": len(GOOD)}
    assert receiver.effect_count() == len(GOOD)
    assert sorted(r.body["amount"] for r in receiver.received) == [1, 2, 3]
    # Each carries the contract it was enqueued under, for the receiver to check the body.
    assert {r.headers["outbox-contract"] for r in receiver.received} == {"charge/v1"}
    ids = [b[0] for b in broken.values()]
    errors = assert_quarantined_unsent(db_url, ids)
    for (name, (_, path, rule)), error in zip(broken.items(), errors, strict=True):
        assert f"charge/v1 at {path or '/'}: {rule}" in error, (name, error)
        assert MARKER not in error, name
    for table in ("outbox.audit", "outbox.attempts"):  # the value is in the payload alone
        assert not rows(db_url, f"SELECT FROM {table} t WHERE t::text LIKE %s", (f"%{MARKER}%",))
    # What the person on call reads of one.
    shown = outbox_cli(cli_env, "quarantine", "show", str(ids[0]))
    assert shown.returncode == 0, shown.stderr
    assert "contract     charge/v1\n" in shown.stdout
    assert "contract_violation" in shown.stdout and MARKER not in shown.stdout


async def test_a_hand_written_row_naming_an_unpublished_version_is_quarantined_unsent(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """A version no one published is refused by enqueue (OB009); a row written by hand with one
    never reaches the provider either. A version published later is checked, not refused: the
    refusal of the missing one is not kept."""
    publish(db_url, "charge", 1, CHARGE)
    with psycopg.connect(db_url) as conn:
        missing = hand_insert(conn, "v7", GOOD[0], 7)
    d = dispatcher(pool, {"hook": hook})
    await d.run_once()
    (error,) = assert_quarantined_unsent(db_url, [missing])
    assert error == "no contract charge/v7 is published"
    publish(db_url, "charge", 2, CHARGE)
    with psycopg.connect(db_url) as conn:
        later = hand_insert(conn, "v2", GOOD[1], 2)
    await d.run_once()
    assert rows(db_url, "SELECT status FROM outbox.operations WHERE id = %s", (later,)) == [
        ("succeeded",)
    ]
    assert receiver.effect_count() == 1


async def test_a_contract_published_past_the_bounds_refuses_every_row_of_it_unsent(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """`outbox contracts push` bounds what it publishes; the SQL function checks only the size.
    A schema past the bounds published through it is refused where it would be used: at
    enqueue in Python (ContractViolation), and by the dispatcher for every row of it."""
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(40):  # past MAX_SCHEMA_DEPTH
        deep = {"type": "object", "properties": {"a": deep}}
    canonical = canonical_json(deep)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.publish_contract('deep', 1, %s, 'test', 'past the bounds')", (canonical,)
        )
        rows_of_it = [
            conn.execute(
                "SELECT operation_id FROM outbox.enqueue(tenant_id => 'acme', operation_type => "
                "'deep', operation_key => %s, provider => 'hook', action => 'a', payload => "
                "'{\"a\": {}}', contract_version => 1)",
                (f"d{i}",),
            ).fetchone()[0]  # type: ignore[index]
            for i in range(3)
        ]
        with pytest.raises(outbox.ContractViolation, match="nests deeper"):
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="deep",
                operation_key="py",
                provider="hook",
                action="a",
                payload={"a": {}},
                contract_version=1,
            )
    await run(pool, hook)
    errors = assert_quarantined_unsent(db_url, rows_of_it)
    assert all(e.startswith("contract deep/v1: ") and "nests deeper" in e for e in errors), errors
    assert receiver.effect_count() == 0


async def test_a_row_that_may_have_reached_the_provider_is_not_checked_again(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """A row a dispatcher of the previous version sent once (it checked nothing) and that failed
    in a way worth retrying: its payload may have reached the provider. Quarantining it as "not
    sent" would be a lie; within its key window it is retried under the same key as before."""
    publish(db_url, "charge", 1, CHARGE)
    with psycopg.connect(db_url) as conn:
        op = sql_enqueue(conn, "sent-once", {"amount": "five", "currency": "eur"}, 1)
        conn.execute(
            "UPDATE outbox.operations SET attempts = 1, first_sent_at = now() - interval '1 min',"
            " last_attempt_at = now() - interval '1 min' WHERE id = %s",
            (op,),
        )
    await run(pool, hook)
    assert rows(db_url, "SELECT status, attempts FROM outbox.operations WHERE id = %s", (op,)) == [
        ("succeeded", 2)
    ]
    assert receiver.effect_count() == 1


async def test_a_contract_the_database_does_not_answer_for_hands_the_row_back_unsent(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Nothing is known of the payload: the row goes back to pending, its attempt unspent, and
    the failure is not kept (the next row asks again, and gets the contract once it answers)."""
    publish(db_url, "charge", 1, CHARGE)
    with psycopg.connect(db_url) as conn:
        op = sql_enqueue(conn, "k", GOOD[0], 1)
    (row,) = await Store(pool).claim("w", 1, timedelta(seconds=30))
    assert row.id == op
    down: AsyncConnectionPool[Any] = AsyncConnectionPool(
        "host=127.0.0.1 port=1 user=postgres connect_timeout=1", min_size=0, max_size=1,
        timeout=1.0,
        open=False,
    )  # fmt: skip
    await down.open(wait=False)
    try:
        contracts = Contracts(Store(down))
        assert contracts.needs_check(row)
        for _ in range(2):
            aside = await contracts.checker(row)
            assert isinstance(aside, Aside)
            assert (aside.status, aside.failure, aside.delay) == (
                Status.PENDING,
                None,
                timedelta(seconds=30),
            )
    finally:
        await down.close()
    assert isinstance(await Contracts(Store(pool)).checker(row), Checker)

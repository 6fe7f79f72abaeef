"""A renamed operation type keeps its contracts' history (sql/0055, issue 42): its old name
becomes an alias whose every look-up reads the new name's contracts, at enqueue (Python and
SQL), in the dispatcher's check and the inbox's, and for the version requirement. An alias is
refused while the old name has a version the new one lacks or holds with other content, and is
kept for ever."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox import ContractViolation
from outbox.contracts import parse_contract
from outbox.db import contracts as store
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_contracts_enqueue import CHARGE, publish
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, rows

V2 = {**CHARGE, "properties": {**CHARGE["properties"], "memo": {"type": "string"}}}


def alias(url: str, old: str, new: str) -> str:
    with psycopg.connect(url) as conn:
        return store.set_alias(conn, old, new, actor="test", reason="renamed")


def enqueue(url: str, operation_type: str, key: str, payload: Any, **kw: Any) -> Any:
    with psycopg.connect(url) as conn, conn.transaction():
        return outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type=operation_type,
            operation_key=key,
            provider="hook",
            action="charge",
            payload=payload,
            **kw,
        )


def sql_enqueue(url: str, operation_type: str, key: str, payload: Any, version: int | None) -> str:
    """The SQLSTATE the SQL function answers, or 'accepted'."""
    try:
        with psycopg.connect(url) as conn:
            conn.execute(
                "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => %s,"
                " operation_key => %s, provider => 'hook', action => 'charge',"
                " payload => %s::jsonb, contract_version => %s)",
                (operation_type, key, json.dumps(payload), version),
            )
    except psycopg.Error as exc:
        return str(exc.sqlstate)
    return "accepted"


@pytest.fixture
def renamed(db_url: str) -> str:
    """'charge' (v1) renamed to 'payments.charge' (v1 the same, then v2)."""
    publish(db_url, "charge", 1, CHARGE)
    publish(db_url, "payments.charge", 1, CHARGE)
    assert alias(db_url, "charge", "payments.charge") == "aliased"
    publish(db_url, "payments.charge", 2, V2)
    return db_url


def test_the_old_name_reads_the_new_names_contracts_everywhere_at_enqueue(renamed: str) -> None:
    # A version published only under the new name is the old name's too, checked alike.
    ok = {"amount": 5, "currency": "eur", "memo": "x"}
    assert enqueue(renamed, "charge", "k1", ok, contract_version=2).accepted
    with pytest.raises(ContractViolation) as refused:
        enqueue(renamed, "charge", "k2", {**ok, "memo": 7}, contract_version=2)
    assert (refused.value.path, refused.value.rule) == ("/memo", "type")
    # The SQL function: the version exists under the alias; the requirement is the new name's.
    assert sql_enqueue(renamed, "charge", "k3", ok, 2) == "accepted"
    assert sql_enqueue(renamed, "charge", "k4", ok, 3) == "OB009"
    assert sql_enqueue(renamed, "charge", "k5", ok, None) == "OB009"
    # The requirement follows the new name, both ways.
    with psycopg.connect(renamed) as conn:
        store.set_requirement(conn, "payments.charge", False, actor="test", reason="migrating")
    assert sql_enqueue(renamed, "charge", "k5", ok, None) == "accepted"
    with psycopg.connect(renamed) as conn:
        store.set_requirement(conn, "payments.charge", True, actor="test", reason="done")
    assert sql_enqueue(renamed, "charge", "k5b", ok, None) == "OB009"
    with psycopg.connect(renamed) as conn:
        store.set_state(conn, "payments.charge", 1, "retired", actor="test", reason="old")
    assert sql_enqueue(renamed, "charge", "k6", {"amount": 5, "currency": "eur"}, 1) == "OB009"
    # Operations keep the name they were enqueued under: their identity and history.
    assert rows(renamed, "SELECT DISTINCT operation_type FROM outbox.operations") == [("charge",)]


async def test_the_dispatcher_checks_an_old_names_row_against_the_new_names_contract(
    renamed: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    assert sql_enqueue(renamed, "charge", "good", {"amount": 5, "currency": "eur", "memo": "m"}, 2)
    assert sql_enqueue(renamed, "charge", "bad", {"amount": 5, "currency": "eur", "memo": 1}, 2)
    await dispatcher(pool, {"hook": hook}).run_once()
    assert rows(
        renamed, "SELECT operation_key, status, status_reason FROM outbox.operations ORDER BY id"
    ) == [("good", "succeeded", None), ("bad", "quarantined", "contract_violation")]
    (delivered,) = receiver.received
    assert delivered.headers["outbox-contract"] == "charge/v2"


def test_an_alias_is_refused_while_the_histories_differ_and_is_kept_for_ever(
    db_url: str, cli_env: dict[str, str]
) -> None:
    publish(db_url, "charge", 1, CHARGE)
    publish(db_url, "charge", 2, V2)
    publish(db_url, "payments.charge", 1, CHARGE)
    publish(db_url, "payments.charge", 2, CHARGE)  # other content under v2
    refused = outbox_cli(
        cli_env, "contracts", "alias", "charge", "payments.charge", "--reason", "renamed"
    )
    assert refused.returncode != 0 and "v2" in refused.stderr, refused
    publish(db_url, "billing.charge", 1, CHARGE)
    publish(db_url, "billing.charge", 2, V2)
    done = outbox_cli(
        cli_env, "contracts", "alias", "charge", "billing.charge", "--reason", "renamed"
    )
    assert done.returncode == 0 and "aliased" in done.stdout, done
    assert alias(db_url, "charge", "billing.charge") == "unchanged"
    listed = outbox_cli(cli_env, "contracts", "list")
    assert "alias charge reads the contracts of billing.charge" in listed.stdout
    with psycopg.connect(db_url) as conn:
        # No chain, no second target, no removal, no new version under the old name.
        for sql, params in (
            ("SELECT outbox.set_contract_alias('billing.charge', 'payments.charge', 'a', 'b')", ()),
            ("SELECT outbox.set_contract_alias('charge', 'payments.charge', 'a', 'b')", ()),
            ("DELETE FROM outbox.contract_aliases", ()),
            ("UPDATE outbox.contract_aliases SET operation_type = 'payments.charge'", ()),
        ):
            with pytest.raises(psycopg.Error), conn.transaction():
                conn.execute(sql, params)
        contract = parse_contract("charge", 3, json.dumps(V2))
        with pytest.raises(psycopg.Error, match=r"alias of billing\.charge"), conn.transaction():
            store.publish(conn, [contract], actor="test", reason="late")
        same = parse_contract("charge", 1, json.dumps(CHARGE))
        assert store.publish(conn, [same], actor="test", reason="again") == ["unchanged"]
    audit = rows(db_url, "SELECT details FROM outbox.audit WHERE action = 'contract_alias'")
    assert audit == [({"alias": "charge", "operation_type": "billing.charge"},)]


def test_get_operation_returns_the_contract_version(renamed: str) -> None:
    enqueue(renamed, "payments.charge", "v", {"amount": 5, "currency": "eur"}, contract_version=2)
    enqueue(renamed, "plain", "n", {"n": 1})
    with psycopg.connect(renamed) as conn:
        versioned = outbox.get_operation(conn, "acme", "payments.charge", "v")
        plain = outbox.get_operation(conn, "acme", "plain", "n")
    assert versioned is not None and versioned.contract_version == 2
    assert plain is not None and plain.contract_version is None

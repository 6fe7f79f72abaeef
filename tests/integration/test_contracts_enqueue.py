"""Contracts checked where work enters (issue 42, sql/0053): outbox.enqueue from Python (sync
and async), the SQL function itself, and `outbox enqueue`, under each outcome. Each test counts
the operations written afterwards: a refused enqueue writes none."""

from __future__ import annotations

import asyncio
import json
from decimal import Decimal
from typing import Any

import psycopg
import pytest
import structlog
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import outbox
from outbox import ContractViolation, OperationConflict
from outbox.contracts import checker_for, parse_contract
from outbox.contracts.codegen import Generator
from outbox.core import payloads
from outbox.db import contracts as store
from outbox.dispatch.contracts import verdict as dispatcher_verdict
from outbox.inbox.contracts import ContractBreach, check_body
from tests.support.cli import outbox_cli
from tests.support.dispatch import rows

CHARGE: dict[str, Any] = {
    "type": "object",
    "properties": {
        "amount": {"type": "integer", "minimum": 1},
        "currency": {"enum": ["eur", "usd"]},
        "price": {"type": "number", "maximum": 1000},
        "lines": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "minLength": 1}},
                "required": ["sku"],
            },
        },
    },
    "required": ["amount", "currency"],
    "additionalProperties": False,
}


def publish(
    db_url: str, operation_type: str, version: int, schema: dict[str, Any], **kw: Any
) -> None:
    contract = parse_contract(operation_type, version, json.dumps(schema))
    with psycopg.connect(db_url) as conn:
        store.publish(conn, [contract], actor="test", reason="test", **kw)


def enqueue(db_url: str, key: str, payload: Any, **kw: Any) -> outbox.EnqueueResult:
    with psycopg.connect(db_url) as conn, conn.transaction():
        args: dict[str, Any] = {
            "tenant_id": "acme",
            "operation_type": "charge",
            "operation_key": key,
            "provider": "stripe",
            "action": "payment_intents.create",
            "payload": payload,
            **kw,
        }
        return outbox.enqueue(conn, **args)


def written(db_url: str) -> list[tuple[Any, ...]]:
    return rows(db_url, "SELECT operation_key, contract_version FROM outbox.operations ORDER BY id")


@pytest.fixture
def charge_v1(db_url: str) -> str:
    publish(db_url, "charge", 1, CHARGE)
    return db_url


def test_a_payload_within_its_contract_is_written_with_its_version(charge_v1: str) -> None:
    ok = {"amount": 5, "currency": "eur", "lines": [{"sku": "a"}]}
    assert enqueue(charge_v1, "k1", ok, contract_version=1).accepted
    assert not enqueue(charge_v1, "k1", ok, contract_version=1).accepted  # duplicate
    assert written(charge_v1) == [("k1", 1)]


@pytest.mark.parametrize(
    ("payload", "path", "rule"),
    [
        ({"ammount": 5, "amount": 5, "currency": "eur"}, "", "additionalProperties"),
        ({"currency": "eur"}, "", "required"),
        ({"amount": 0, "currency": "eur"}, "/amount", "minimum"),
        ({"amount": 1, "currency": "gbp"}, "/currency", "enum"),
        ({"amount": 1, "currency": "eur", "lines": [{"sku": ""}]}, "/lines/0/sku", "minLength"),
        ({"amount": 1, "currency": "eur", "lines": [{}, {"sku": 3}]}, "/lines/0", "required"),
        ({"amount": 1, "currency": "eur", "price": Decimal("1000.0000001")}, "/price", "maximum"),
    ],
)
def test_a_violation_is_refused_before_the_row_exists_naming_path_and_rule(
    charge_v1: str, payload: dict[str, Any], path: str, rule: str
) -> None:
    with pytest.raises(ContractViolation) as caught:
        enqueue(charge_v1, "bad", payload, contract_version=1)
    assert (caught.value.field, caught.value.path, caught.value.rule) == ("payload", path, rule)
    assert "charge/v1" in str(caught.value)
    assert written(charge_v1) == []


def test_versions_are_checked_by_the_database_whoever_enqueues(charge_v1: str) -> None:
    ok = {"amount": 5, "currency": "eur"}
    refused = {
        "missing": ({}, "has contracts: name its contract_version"),
        "unknown": ({"contract_version": 9}, "no contract charge/v9 is published"),
    }
    for name, (kw, message) in refused.items():
        with pytest.raises(ContractViolation, match=message) as caught:
            enqueue(charge_v1, name, ok, **kw)
        assert caught.value.field == "contract_version"
    # The SQL function alone (another language's producer): the same refusals, OB009.
    with psycopg.connect(charge_v1, autocommit=True) as conn:
        for call in (
            "SELECT * FROM outbox.enqueue('acme', 'charge', 'sql', 'stripe', 'x', '{}')",
            "SELECT * FROM outbox.enqueue('acme', 'charge', 'sql', 'stripe', 'x', '{}',"
            " contract_version => 2)",
        ):
            with pytest.raises(psycopg.Error) as sql_caught:
                conn.execute(call)
            assert sql_caught.value.sqlstate == "OB009"
    with psycopg.connect(charge_v1) as conn:
        store.set_state(conn, "charge", 1, "retired", actor="t", reason="t")
    with pytest.raises(ContractViolation, match="charge/v1 is retired"):
        enqueue(charge_v1, "retired", ok, contract_version=1)
    store_deprecated = ("charge", 1, "deprecated")
    with psycopg.connect(charge_v1) as conn:
        store.set_state(conn, *store_deprecated, actor="t", reason="t")
    assert enqueue(charge_v1, "deprecated", ok, contract_version=1).accepted  # still taken
    assert written(charge_v1) == [("deprecated", 1)]


def test_a_deprecated_version_is_taken_and_its_producer_warned_once(charge_v1: str) -> None:
    with psycopg.connect(charge_v1) as conn:
        store.set_state(conn, "charge", 1, "deprecated", actor="t", reason="v2 is out")
    ok = {"amount": 5, "currency": "eur"}
    with structlog.testing.capture_logs() as logs:
        for key in ("d1", "d2"):
            assert enqueue(charge_v1, key, ok, contract_version=1).accepted
    warned = [e for e in logs if "deprecated contract version" in e["event"]]
    assert [(e["log_level"], e["contract"]) for e in warned] == [("warning", "charge/v1")]


@pytest.mark.parametrize("version", [0, -1, 2**31, True, "1", 1.0])
def test_a_version_that_is_no_version_is_refused_before_anything_is_sent(
    charge_v1: str, version: Any
) -> None:
    with pytest.raises(outbox.InvalidOperation) as caught:
        enqueue(charge_v1, "odd", {"amount": 5, "currency": "eur"}, contract_version=version)
    assert caught.value.field == "contract_version"
    assert not isinstance(caught.value, ContractViolation)
    assert written(charge_v1) == []


def test_the_same_identity_under_another_version_is_a_conflict(charge_v1: str) -> None:
    publish(charge_v1, "charge", 2, {**CHARGE, "required": ["amount"]})
    ok = {"amount": 5, "currency": "eur"}
    assert enqueue(charge_v1, "k", ok, contract_version=1).accepted
    with pytest.raises(OperationConflict) as caught:
        enqueue(charge_v1, "k", ok, contract_version=2)
    assert caught.value.field == "contract_version"
    assert written(charge_v1) == [("k", 1)]


def test_types_without_contracts_and_unrequired_types_take_unversioned_operations(
    db_url: str,
) -> None:
    assert enqueue(db_url, "plain", {"anything": True}).accepted
    publish(db_url, "charge", 1, CHARGE, require_version=False)
    assert enqueue(db_url, "old-producer", {"not": "checked"}).accepted
    assert enqueue(db_url, "new-producer", {"amount": 2, "currency": "usd"}, contract_version=1)
    with pytest.raises(ContractViolation):
        enqueue(db_url, "new-typo", {"amount": 2, "curency": "usd"}, contract_version=1)
    with psycopg.connect(db_url) as conn:
        assert store.set_requirement(conn, "charge", True, actor="t", reason="t") == "required"
    with pytest.raises(ContractViolation, match="name its contract_version"):
        enqueue(db_url, "old-producer-2", {"not": "checked"})
    assert written(db_url) == [("plain", None), ("old-producer", None), ("new-producer", 1)]
    audit = rows(
        db_url, "SELECT action FROM outbox.audit WHERE action LIKE 'contract_%' ORDER BY id"
    )
    assert audit == [("contract_publish",), ("contract_require",)]


def test_async_enqueue_checks_the_same(charge_v1: str) -> None:
    async def go() -> list[str]:
        outcomes = []
        async with await psycopg.AsyncConnection.connect(charge_v1) as conn:
            for key, payload in (("a1", {"amount": 1, "currency": "eur"}), ("a2", {"amount": -1})):
                try:
                    async with conn.transaction():
                        result = await outbox.enqueue_async(
                            conn, tenant_id="acme", operation_type="charge", operation_key=key,
                            provider="stripe", action="x", payload=payload, contract_version=1,
                        )  # fmt: skip
                    outcomes.append(result.outcome.value)
                except ContractViolation as exc:
                    outcomes.append(f"{exc.path} {exc.rule}")
        return outcomes

    assert asyncio.run(go()) == ["accepted", " required"]
    assert written(charge_v1) == [("a1", 1)]


def test_a_generated_class_is_enqueued_under_its_own_type_and_version(charge_v1: str) -> None:
    generator = Generator()
    generator.add("charge", 1, CHARGE)
    namespace: dict[str, Any] = {}
    exec(compile(generator.source(), "<generated>", "exec"), namespace)  # noqa: S102 (ours)
    order = namespace["ChargeV1"](
        amount=3, currency="usd", lines=[namespace["ChargeV1LinesItem"](sku="x")]
    )
    assert enqueue(charge_v1, "typed", order).accepted
    with pytest.raises(outbox.InvalidOperation, match="payload is a charge/v1"):
        enqueue(charge_v1, "typed-2", order, contract_version=2)
    assert written(charge_v1) == [("typed", 1)]
    stored = rows(charge_v1, "SELECT payload FROM outbox.operations")
    assert stored == [({"amount": 3, "currency": "usd", "lines": [{"sku": "x"}]},)]


def test_the_cli_enqueues_under_a_contract(charge_v1: str, cli_env: dict[str, str]) -> None:
    env = {**cli_env, "OUTBOX_DATABASE_URL": charge_v1}
    base = ("enqueue", "--tenant-id", "acme", "--operation-type", "charge", "--provider", "p",
            "--action", "a", "--contract-version", "1")  # fmt: skip
    done = outbox_cli(
        env, *base, "--operation-key", "c1", "--payload", '{"amount":1,"currency":"eur"}'
    )
    assert done.returncode == 0, done.stderr
    bad = outbox_cli(
        env, *base, "--operation-key", "c2", "--payload", '{"amount":"1","currency":"eur"}'
    )
    assert bad.returncode == 2
    assert "at /amount: type integer" in bad.stderr and '"1"' not in bad.stderr
    assert written(charge_v1) == [("c1", 1)]


VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-(10**20), 10**20), st.text(max_size=5),
        st.decimals(allow_nan=False, allow_infinity=False, places=3),
        st.floats(allow_nan=False, allow_infinity=False, width=32),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=12,
)  # fmt: skip


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    valid=st.sampled_from([True, True, True, False]),
    extra=st.fixed_dictionaries(
        {},
        optional={
            "amount": st.one_of(st.just(1), VALUES),
            "price": st.one_of(st.sampled_from([0, 999.5, Decimal("1000"), -3]), VALUES),
            "lines": st.one_of(st.sampled_from([[], [{"sku": "a"}, {"sku": "b"}]]), VALUES),
            "x": VALUES,
        },
    ),
)
def test_the_producers_check_and_the_dispatchers_check_always_agree(
    charge_v1: str, valid: bool, extra: dict[str, Any]
) -> None:
    """The verdict at enqueue is the dispatcher's and the inbox's verdict on what was stored: a
    payload the producer lets in is one the dispatcher's check of its stored row and the
    inbox's check of the body sent accept; a payload it refuses, written through the SQL
    function instead (which checks no schema), is one both refuse, at the same path and by the
    same rule."""
    payload = {**({"amount": 5, "currency": "eur"} if valid else {}), **extra}
    contract = parse_contract("charge", 1, json.dumps(CHARGE))
    check = checker_for(contract.label, contract.digest, contract.canonical)
    try:
        enqueue(charge_v1, "h", payload, contract_version=1)
    except ContractViolation as exc:
        verdict: tuple[str | None, str | None] | None = (exc.path, exc.rule)
    except outbox.InvalidOperation:
        event("not a payload enqueue takes")
        return  # not a payload enqueue takes at all (a NaN, 1e100): no contract question
    else:
        verdict = None
    event("accepted" if verdict is None else "refused")
    with psycopg.connect(charge_v1, autocommit=True) as conn:
        if verdict is not None:
            assert written(charge_v1) == []
            conn.execute(
                "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'charge', "
                "operation_key => 'h', provider => 'stripe', action => 'payment_intents.create', "
                "payload => %s::jsonb, contract_version => 1)",
                (payloads.encode(payload),),
            )
        ((stored,),) = conn.execute(
            "DELETE FROM outbox.operations WHERE operation_key = 'h' RETURNING payload::text"
        ).fetchall()
    refused = dispatcher_verdict(check, payloads.carried(stored))
    try:  # and the inbox's, on the body a provider sends: the stored text
        check_body(check, stored.encode(), is_json=True)
    except ContractBreach as breach:
        received: tuple[str | None, str | None] | None = (breach.path, breach.rule)
    else:
        received = None
    assert received == verdict, (payload, received, verdict)
    if verdict is None:
        assert refused is None, (payload, refused)
    else:
        assert refused is not None and refused.failure is not None, payload
        path, rule = verdict
        assert f"charge/v1 at {path or '/'}: {rule}" in refused.failure.message, (verdict, refused)


NAMES_ = st.sampled_from(["a", "b", "amount", "ammount", "é", "a b", "x/y", "~0"])
LEAF_SCHEMAS = st.one_of(
    st.just({}),
    st.builds(lambda m: {"type": "integer", "minimum": m}, st.integers(-3, 3)),
    st.builds(lambda m: {"type": "number", "maximum": m}, st.sampled_from([0, 1.5, 1000])),
    st.builds(lambda n: {"type": "string", "minLength": n}, st.integers(0, 2)),
    st.just({"type": "string", "pattern": "^[a-z]+$"}),
    st.just({"enum": ["eur", "usd", 1, None]}),
    st.just({"type": ["boolean", "null"]}),
    st.just({"const": 1}),
)
CONTRACT_SCHEMAS = st.recursive(
    LEAF_SCHEMAS,
    lambda inner: st.one_of(
        st.builds(
            lambda props, required, closed: {
                "type": "object",
                "properties": props,
                "required": sorted(set(required) & set(props)),
                "additionalProperties": not closed,
            },
            st.dictionaries(NAMES_, inner, max_size=4),
            st.lists(NAMES_, max_size=3),
            st.booleans(),
        ),
        st.builds(lambda item: {"type": "array", "items": item, "maxItems": 3}, inner),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=10,
)
PAYLOAD_VALUES = st.recursive(
    st.one_of(
        st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["eur", "usd", "", "A1"]),
        st.decimals(allow_nan=False, allow_infinity=False, places=1, min_value=-2, max_value=2000),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(NAMES_, inner, max_size=4)
    ),
    max_leaves=15,
)  # fmt: skip


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    schema=CONTRACT_SCHEMAS.map(lambda s: {"type": "object", "properties": {"p": s}}),
    payload=st.dictionaries(NAMES_ | st.just("p"), PAYLOAD_VALUES, max_size=4),
)
def test_over_schemas_and_payloads_the_three_checks_name_the_same_violation(
    db_url: str, schema: dict[str, Any], payload: dict[str, Any]
) -> None:
    """Generated contracts and payloads: the producer's check (of the JSON text it writes), the
    dispatcher's (of the stored row as PostgreSQL returns it) and the inbox's (of the body a
    provider sends, that same text) accept the same payloads and name the same path and rule."""
    contract = parse_contract("fuzz", 1, json.dumps(schema))
    check = checker_for(contract.label, contract.digest, contract.canonical)
    text = payloads.encode(payload)
    found = check.violation(payloads.decode(text))  # the producer's (_check_contract)
    producer = None if found is None else (found.path, found.rule)
    with psycopg.connect(db_url) as conn:
        ((stored,),) = conn.execute("SELECT %s::jsonb::text", (text,)).fetchall()
    refused = dispatcher_verdict(check, payloads.carried(stored))
    try:
        check_body(check, stored.encode(), is_json=True)
    except ContractBreach as breach:
        received: tuple[str, str] | None = (breach.path, breach.rule)
    else:
        received = None
    event("accepted" if producer is None else "refused")
    assert received == producer, (schema, payload)
    if producer is None:
        assert refused is None
    else:
        assert refused is not None and refused.failure is not None
        assert f"fuzz/v1 at {producer[0] or '/'}: {producer[1]}" in refused.failure.message

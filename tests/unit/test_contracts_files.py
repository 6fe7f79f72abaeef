"""Contracts read from files and bounded before they can be published (outbox.contracts)."""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.contracts import (
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    InvalidContract,
    checker_for,
    load_dir,
    parse_contract,
)
from outbox.contracts.codegen import Generator

CHARGE: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "properties": {
        "amount": {"type": "integer", "minimum": 1},
        "currency": {"enum": ["eur", "usd"]},
        "email": {"type": "string", "format": "email"},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
    },
    "required": ["amount", "currency"],
    "additionalProperties": False,
    "$defs": {"line": {"type": "object", "properties": {"sku": {"type": "string"}}}},
}


def refusal(schema: object, *, text: str | None = None) -> str:
    with pytest.raises(InvalidContract) as caught:
        parse_contract("charge", 1, json.dumps(schema) if text is None else text)
    return caught.value.reason


def test_a_contract_is_read_with_a_digest_that_ignores_layout() -> None:
    contract = parse_contract("charge", 3, json.dumps(CHARGE, indent=4))
    again = parse_contract("charge", 3, json.dumps(dict(reversed(list(CHARGE.items())))))
    assert contract.label == "charge/v3"
    assert contract.digest == again.digest
    assert contract.canonical == again.canonical
    changed = parse_contract("charge", 3, json.dumps({**CHARGE, "required": ["amount"]}))
    assert changed.digest != contract.digest


@pytest.mark.parametrize(
    ("schema", "text", "reason"),
    [
        (None, "{not json", "not JSON"),
        (None, '{"minimum": NaN}', "not JSON"),
        ([{"type": "object"}], None, "must be a JSON object"),
        ({"$schema": "http://json-schema.org/draft-07/schema#"}, None, "$schema must be"),
        ({"$ref": "https://example.com/charge.json"}, None, "leaves the document"),
        ({"properties": {"a": {"$ref": "other.json#/x"}}}, None, "leaves the document"),
        ({"$dynamicRef": "#node"}, None, "$dynamicRef is not supported"),
        ({"properties": {"a": {"$id": "https://x.example/a"}}}, None, "$id is allowed at the top"),
        ({"$ref": "#/$defs/missing"}, None, "points at nothing"),
        ({"type": "nope"}, None, "not a valid Draft 2020-12 schema"),
        # Look-behind: the linear-time engine has none, so no pattern can backtrack.
        ({"pattern": "(?<=a)b"}, None, "the schema does not compile"),
        # A cycle that never descends into the payload unfolds for ever.
        ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, None, "$ref cycle"),
    ],
)
def test_a_schema_out_of_bounds_is_refused_with_its_reason(
    schema: object, text: str | None, reason: str
) -> None:
    assert reason in refusal(schema, text=text)


def test_references_that_fan_out_are_refused_before_a_validator_meets_them() -> None:
    """Two references to the next level, twenty levels: a million subschemas on one value in a
    schema of 2 KiB; and the same when each level descends into the payload (2^64 along one
    path of members)."""
    defs: dict[str, Any] = {
        f"l{n}": {"anyOf": [{"$ref": f"#/$defs/l{n + 1}"}, {"$ref": f"#/$defs/l{n + 1}"}]}
        for n in range(20)
    }
    defs["l20"] = {"type": "string"}
    assert "unfolds to more than 100,000" in refusal({"$defs": defs, "$ref": "#/$defs/l0"})
    node = {
        "anyOf": [
            {"properties": {"a": {"$ref": "#/$defs/n"}}},
            {"properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["b"]},
        ]
    }
    assert "unfolds to more than 100,000" in refusal({"$defs": {"n": node}, "$ref": "#/$defs/n"})


def fanned(leaves: int, step: str = "items") -> dict[str, Any]:
    """Each value of the array meets 1 + 3 + 3 + 9 + 9 + 9 * leaves subschemas."""
    return {
        "properties": {"a": {step: {"$ref": "#/$defs/x"}}},
        "$defs": {
            "x": {"allOf": [{"$ref": "#/$defs/y"}] * 3},
            "y": {"allOf": [{"$ref": "#/$defs/z"}] * 3},
            "z": {"allOf": [{"minimum": 0}] * leaves},
        },
    }


def test_the_bound_counts_what_lands_on_one_value() -> None:
    parse_contract("fan", 1, json.dumps(fanned(8)))  # 97
    assert "more than 100 subschemas to one value of a payload (at level 2)" in refusal(
        fanned(9)  # 106
    )
    # Siblings do not add up: 300 members, each an object with its own "id", "name" and
    # "amount", is 3 subschemas per value, not 900.
    member = {
        "type": "object",
        "properties": {"id": {"type": "string"}, "name": {"type": "string"}, "amount": {}},
    }
    wide = {"properties": {f"m{i}": member for i in range(300)}}
    parse_contract("wide", 1, json.dumps(wide))
    # But a member named by one path and matched by another's "any" meets both: here item 0 of
    # /a meets prefixItems' 60 and items' 60.
    sixty = {"allOf": [{"minimum": 0}] * 59}
    both = {"properties": {"a": {"prefixItems": [sixty], "items": sixty}}}
    assert "more than 100 subschemas to one value" in refusal(both)
    # And a value whose path no single landing path names: /b/c meets {"b": any} and
    # {any: "c"} at once (patternProperties lands on any member).
    crossed = {
        "properties": {"b": {"additionalProperties": sixty}},
        "patternProperties": {"^x": {"properties": {"c": sixty}}},
    }
    assert "more than 100 subschemas to one value" in refusal(crossed)


def test_a_recursive_tree_within_the_payloads_depth_is_a_contract() -> None:
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "children": {"type": "array", "items": {"$ref": "#/$defs/node"}},
        },
    }
    contract = parse_contract(
        "tree", 1, json.dumps({"$defs": {"node": node}, "$ref": "#/$defs/node"})
    )
    check = checker_for(contract.label, contract.digest, contract.canonical)
    deep: dict[str, Any] = {"name": "leaf"}
    for _ in range(30):
        deep = {"name": "x", "children": [deep]}
    assert check.violation(deep) is None
    deep["children"][0]["children"][0]["name"] = 7
    found = check.violation(deep)
    assert found is not None
    assert (found.path, found.rule, found.expected) == (
        "/children/0/children/0/name",
        "type",
        "string",
    )


def test_size_and_depth_are_bounded() -> None:
    big = {"description": "x" * MAX_SCHEMA_BYTES}
    assert f"larger than {MAX_SCHEMA_BYTES} bytes" in refusal(big)
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"not": deep}
    assert f"nests deeper than {MAX_SCHEMA_DEPTH}" in refusal(deep)


def test_a_violation_names_the_path_and_the_rule_never_the_value() -> None:
    contract = parse_contract("charge", 1, json.dumps(CHARGE))
    check = checker_for(contract.label, contract.digest, contract.canonical)
    assert check.violation({"amount": 5, "currency": "eur", "lines": [{"sku": "a"}]}) is None
    cases = {
        "typo": ({"ammount": 5, "amount": 5, "currency": "eur"}, "", "additionalProperties"),
        "missing": ({"currency": "eur"}, "", "required"),
        "minimum": ({"amount": 0, "currency": "eur"}, "/amount", "minimum"),
        "enum": ({"amount": 1, "currency": "gbp"}, "/currency", "enum"),
        "format": ({"amount": 1, "currency": "eur", "email": "nope"}, "/email", "format"),
        "deep": ({"amount": 1, "currency": "eur", "lines": [{"sku": 4}]}, "/lines/0/sku", "type"),
    }
    shown = {}
    for name, (payload, path, rule) in cases.items():
        found = check.violation(payload)
        assert found is not None, name
        assert (found.path, found.rule) == (path, rule), name
        shown[name] = str(found)
    assert (
        shown["typo"]
        == "at /: additionalProperties false, found ammount (schema /additionalProperties)"
    )
    assert shown["missing"] == "at /: required amount (schema /required)"
    assert shown["minimum"] == "at /amount: minimum 1 (schema /properties/amount/minimum)"


@settings(max_examples=200, deadline=None)
@given(secret=st.text(string.ascii_letters + string.digits, min_size=12, max_size=40))
def test_no_violation_ever_shows_a_value_of_the_payload(secret: str) -> None:
    contract = parse_contract("charge", 1, json.dumps(CHARGE))
    check = checker_for(contract.label, contract.digest, contract.canonical)
    for payload in (
        {"amount": secret, "currency": "eur"},
        {"amount": 1, "currency": secret},
        {"amount": 1, "currency": "eur", "email": secret},
        {"amount": 1, "currency": "eur", "lines": [{"sku": [secret]}]},
        {"amount": 1, "currency": "eur", "lines": secret},
    ):
        found = check.violation(payload)
        assert found is not None
        assert secret not in str(found)


def test_a_directory_of_contracts_is_read_whole_or_refused(tmp_path: Path) -> None:
    (tmp_path / "payments" / "charge").mkdir(parents=True)
    (tmp_path / "refund").mkdir()
    (tmp_path / "payments" / "charge" / "v1.json").write_text(json.dumps(CHARGE))
    (tmp_path / "payments" / "charge" / "v2.json").write_text(json.dumps({"type": "object"}))
    (tmp_path / "refund" / "v1.json").write_text("{}")
    (tmp_path / "refund" / ".v3.json.swp").write_text("editor state")
    found = load_dir(tmp_path)
    assert [c.label for c in found] == ["payments/charge/v1", "payments/charge/v2", "refund/v1"]
    (tmp_path / "refund" / "V2.json").write_text("{}")
    with pytest.raises(InvalidContract, match=r"v<N>\.json"):
        load_dir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidContract, match="holds no contract"):
        load_dir(tmp_path / "empty")
    with pytest.raises(InvalidContract, match="no such directory"):
        load_dir(tmp_path / "none")


KEYWORDS = [
    "type", "properties", "items", "prefixItems", "allOf", "anyOf", "oneOf", "not", "if",
    "then", "else", "$ref", "$defs", "additionalProperties", "patternProperties", "required",
    "enum", "const", "minimum", "pattern", "$id", "$anchor", "$dynamicRef", "uniqueItems",
    "dependentSchemas", "contains", "propertyNames", "format", "unevaluatedProperties",
]  # fmt: skip
REFS = st.sampled_from(
    ["#", "#/$defs/a", "#/$defs/b", "#/properties/x", "#a", "#/%24defs/a", "x.json"]
)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 5), st.sampled_from(["string", "object", "a+", "("]),
    REFS,
)  # fmt: skip
SCHEMAS = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.sampled_from(KEYWORDS), st.sampled_from(["a", "b", "x"])),
            inner,
            max_size=5,
        ),
    ),
    max_leaves=40,
)


@settings(max_examples=400, deadline=None)
@given(schema=st.dictionaries(st.sampled_from(KEYWORDS), SCHEMAS, max_size=6))
def test_any_document_is_a_contract_or_refused_with_a_reason(schema: object) -> None:
    """Whatever the file holds, reading it ends in a contract or an InvalidContract: no other
    exception, whatever references, cycles or keywords it mixes."""
    reason = ""
    try:
        contract = parse_contract("fuzz", 1, json.dumps(schema))
    except InvalidContract as exc:
        reason = exc.reason
    else:
        check = checker_for(contract.label, contract.digest, contract.canonical)
        check.violation({"x": [1, "a", {"b": None}]})  # compiled, and checks without raising
        reason = "accepted"
    assert reason


NAMES = st.one_of(
    st.sampled_from(
        ["class", "str", "CONTRACT", "to_payload", "Any", "1st", "a-b", "a b", "é", ""]
    ),
    st.text(max_size=8),
)
OBJECTS = st.recursive(
    st.sampled_from([{"type": "string"}, {"enum": ["a'\"", 1, None, True]}, {"const": "\n"}, {}]),
    lambda inner: st.one_of(
        st.builds(
            lambda props, req: {"type": "object", "properties": props, "required": req},
            st.dictionaries(NAMES, inner, max_size=5),
            st.lists(NAMES, max_size=3),
        ),
        st.builds(lambda item: {"type": "array", "items": item}, inner),
        st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(props=st.dictionaries(NAMES, OBJECTS, max_size=6), names=st.lists(NAMES, max_size=3))
def test_codegen_writes_a_module_that_runs_for_any_member_names(
    props: dict[str, Any], names: list[str]
) -> None:
    """Whatever the members are called (keywords, the class's own names, no Python name at all,
    names that clash once made Python names), the module compiles and defines every class."""
    generator = Generator()
    for version, operation_type in enumerate(["a/b", "a b", "a.b", *names], start=1):
        schema = {"type": "object", "properties": props, "required": list(props)[:2]}
        generator.add(operation_type or "x", version, schema)
    source = generator.source()
    namespace: dict[str, Any] = {}
    exec(compile(source, "<generated>", "exec"), namespace)  # noqa: S102 (our own output)
    classes = [v for v in namespace.values() if isinstance(v, type) and hasattr(v, "to_payload")]
    assert len(classes) >= 3 + len(names)

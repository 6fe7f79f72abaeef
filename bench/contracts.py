"""Contracts (issue 42): what checking a payload against its contract costs, and the worst a
schema within outbox's bounds and a payload within enqueue's can make one check cost.

    python bench/contracts.py [--runs 7] [--quick]

First, a 1 KB payload against a 20-property contract, per check (median of ``--runs`` rounds of
2,000 checks): outbox's checker (jsonschema-rs, compiled once), the same after decoding the
stored JSON text (what a check of the stored row costs), and python-jsonschema's compiled
validator, the other well-kept choice. Then the worst cases we could build: a schema that fans
out to just under ``MAX_PER_LEVEL`` subschemas per payload value, against an array of 100,000
values (enqueue's bound); a recursive schema against a payload 64 levels deep; a pattern that a
backtracking engine takes exponential time on, against a 1 MiB string; ``uniqueItems`` over
100,000 strings; and publishing a 64 KiB schema. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import jsonschema
from _support import median, print_machine, print_table, progress

from outbox.contracts import MAX_PER_LEVEL, Checker, parse_contract


def contract_20() -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(20):
        if i % 4 == 0:
            props[f"field_{i}"] = {"type": "string", "maxLength": 200}
        elif i % 4 == 1:
            props[f"field_{i}"] = {"type": "integer", "minimum": 0}
        elif i % 4 == 2:
            props[f"field_{i}"] = {"type": "array", "items": {"type": "string"}, "maxItems": 10}
        else:
            props[f"field_{i}"] = {"enum": ["eur", "usd", "gbp", "chf"]}
    return {
        "type": "object",
        "properties": props,
        "required": list(props)[:10],
        "additionalProperties": False,
    }


def payload_1kb() -> dict[str, Any]:
    payload: dict[str, Any] = {}
    for i in range(20):
        if i % 4 == 0:
            payload[f"field_{i}"] = "x" * 60
        elif i % 4 == 1:
            payload[f"field_{i}"] = 123456 + i
        elif i % 4 == 2:
            payload[f"field_{i}"] = ["alpha", "bravo", "charlie", "delta"]
        else:
            payload[f"field_{i}"] = "eur"
    return payload


FAN_OUT = 97


def _fan_out() -> dict[str, Any]:
    """Per array item FAN_OUT subschemas as the bound counts them, each reference and its target
    (1 + 3 + 3 + 9 + 9 + 72), just under MAX_PER_LEVEL."""
    return {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"$ref": "#/$defs/x"}}},
        "$defs": {
            "x": {"allOf": [{"$ref": "#/$defs/y"}] * 3},
            "y": {"allOf": [{"$ref": "#/$defs/z"}] * 3},
            "z": {"allOf": [{"type": "integer", "minimum": 0}] * 8},
        },
    }


def _tree() -> tuple[dict[str, Any], dict[str, Any]]:
    node = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 50},
            "next": {"$ref": "#/$defs/node"},
            "tags": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name"],
    }
    payload: dict[str, Any] = {"name": "leaf", "tags": ["t"] * 1000}
    for _ in range(62):
        payload = {"name": "n", "next": payload, "tags": ["t"] * 1000}
    return {"$defs": {"node": node}, "$ref": "#/$defs/node"}, payload


def _wide() -> dict[str, Any]:
    """About 64 KiB of schema: 1,000 properties with a pattern each."""
    props = {f"p{i:04d}": {"type": "string", "pattern": "^[a-z]+$"} for i in range(1000)}
    return {"type": "object", "properties": props}


def per_call(check: Callable[[], object], calls: int, runs: int) -> float:
    """Median seconds per call over ``runs`` rounds of ``calls``."""
    rounds = []
    for _ in range(runs):
        started = time.perf_counter()
        for _ in range(calls):
            check()
        rounds.append((time.perf_counter() - started) / calls)
    return median(rounds)


def checker(name: str, schema: dict[str, Any]) -> Checker:
    contract = parse_contract(name, 1, json.dumps(schema))
    return Checker(contract.label, contract.schema)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="3 runs, 200 checks each")
    args = parser.parse_args(argv)
    runs, calls = (3, 200) if args.quick else (args.runs, 2000)
    print_machine()

    progress("a 1 KB payload against a 20-property contract")
    schema, payload = contract_20(), payload_1kb()
    text = json.dumps(payload, separators=(",", ":"))
    ours = checker("bench", schema)
    assert ours.violation(payload) is None
    reference = jsonschema.Draft202012Validator(schema)
    assert reference.is_valid(payload)
    rs = per_call(lambda: ours.violation(payload), calls, runs)
    rs_text = per_call(lambda: ours.violation(json.loads(text)), calls, runs)
    py = per_call(lambda: reference.is_valid(payload), max(calls // 20, 10), runs)
    rows = [
        ["outbox (jsonschema-rs), the object", f"{rs * 1e6:.1f} us", "1.00"],
        ["outbox, decoding the stored text", f"{rs_text * 1e6:.1f} us", f"{rs_text / rs:.2f}"],
        ["python-jsonschema, compiled", f"{py * 1e6:.1f} us", f"{py / rs:.1f}"],
    ]
    title = f"A {len(text):,}-byte payload, 20-property contract (medians of {runs} x {calls})"
    print_table(["checker", "per check", "x outbox's"], rows, title=title)

    progress("the worst cases within the bounds")
    fan = checker("fan", _fan_out())
    fan_payload = {"a": [1] * 99_998}
    tree_schema, tree_payload = _tree()
    tree = checker("tree", tree_schema)
    regex = checker("regex", {"type": "object", "properties": {"s": {"pattern": "^(a|aa)*$"}}})
    regex_payload = {"s": "a" * (1024 * 1024 - 16) + "b"}
    unique = checker("unique", {"properties": {"a": {"uniqueItems": True}}})
    unique_payload = {"a": [f"value-{i}" for i in range(99_998)]}
    wide_text = json.dumps(_wide())
    cases: list[tuple[str, Callable[[], object]]] = [
        (
            f"fan-out: {FAN_OUT} subschemas per value (bound {MAX_PER_LEVEL}), 99,998 values",
            lambda: fan.violation(fan_payload),
        ),
        (
            "recursive schema, payload 63 levels deep, 63,000 strings",
            lambda: tree.violation(tree_payload),
        ),
        (
            "pattern ^(a|aa)*$ against a 1 MiB string that fails",
            lambda: regex.violation(regex_payload),
        ),
        ("uniqueItems over 99,998 distinct strings", lambda: unique.violation(unique_payload)),
        (
            f"publish: read and bound a {len(wide_text):,}-byte schema (1,000 properties)",
            lambda: parse_contract("wide", 1, wide_text),
        ),
    ]
    rows = []
    for name, work in cases:
        seconds = per_call(work, 1, runs)
        rows.append([name, f"{seconds * 1000:.1f} ms"])
    print_table(["case", "per check (median)"], rows, title=f"Worst cases (medians of {runs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

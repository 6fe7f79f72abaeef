"""Checking a payload against a published contract: compiled once per schema and cached, with
jsonschema-rs (Draft 2020-12; about 150x python-jsonschema on a 20-property contract,
bench/contracts.py). A violation names where in the payload and which rule, never the value:
payloads hold what logs must not."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import jsonschema_rs

from outbox.contracts.bounds import InvalidContract

# Compiled schemas kept per process: a deploy's contracts, many times over.
CACHED: Final = 1024
# Of a rule's value shown in a violation (an enum of a thousand names is cut).
MAX_SHOWN: Final = 80


@dataclass(frozen=True)
class Violation:
    """Where a payload breaks its contract: ``path`` a JSON pointer into the payload ("" is the
    payload itself), ``rule`` the keyword, ``schema_path`` where the rule is in the schema, and
    ``expected`` what the rule asks, read from the schema (never from the payload)."""

    path: str
    rule: str
    schema_path: str
    expected: str = ""

    def __str__(self) -> str:
        asked = f" {self.expected}" if self.expected else ""
        return f"at {self.path or '/'}: {self.rule}{asked} (schema {self.schema_path or '/'})"


class Checker:
    """One contract's compiled schema."""

    def __init__(self, label: str, schema: Mapping[str, Any]) -> None:
        self.label = label
        self._schema = schema
        self._validator = compile_schema(label, schema)

    def violation(self, payload: object) -> Violation | None:
        """The payload's first violation of the contract, or None."""
        if self._validator.is_valid(payload):  # the common case: no error objects built
            return None
        for error in self._validator.iter_errors(payload):
            return _violation(self._schema, error)
        return None  # pragma: no cover (is_valid said there is one)


def compile_schema(where: str, schema: Mapping[str, Any]) -> jsonschema_rs.Validator:
    """A validator that fetches nothing (offline), matches patterns in linear time (no
    backtracking regex: a pattern cannot make a check exponential) and asserts ``format``."""
    try:
        return jsonschema_rs.Draft202012Validator(
            dict(schema),
            validate_formats=True,
            offline=True,
            pattern_options=jsonschema_rs.RegexOptions(),
        )
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        first = str(exc).split("\n", 1)[0]
        raise InvalidContract(where, f"the schema does not compile: {first}") from None


@functools.lru_cache(maxsize=CACHED)
def _cached(label: str, digest: str, canonical: str) -> Checker:
    return Checker(label, json.loads(canonical))


def checker_for(label: str, digest: str, canonical: str) -> Checker:
    """The compiled checker of a published schema, by its digest: a published version never
    changes, so a compiled one is good for the life of the process."""
    return _cached(label, digest, canonical)


def _violation(schema: Mapping[str, Any], error: jsonschema_rs.ValidationError) -> Violation:
    path = _pointer(error.instance_path)
    schema_path = _pointer(error.schema_path)
    rule = error.kind.name
    detail = error.kind.as_dict()
    if rule == "required":
        return Violation(path, rule, schema_path, f"{_short(detail.get('property'))}")
    if rule in ("additionalProperties", "unevaluatedProperties"):
        # The unexpected members' names: the typo ("ammount") a producer needs to see. Names,
        # as in every path; no value.
        names = ", ".join(_short(n) for n in list(detail.get("unexpected", ()))[:5])
        return Violation(path, rule, schema_path, f"false, found {names}")
    return Violation(path, rule, schema_path, _short(_at(schema, error.schema_path)))


def _at(schema: object, path: Sequence[str | int]) -> object:
    node = schema
    for token in path:
        if isinstance(node, Mapping) and token in node:
            node = node[token]
            continue
        if not (isinstance(node, list) and isinstance(token, int) and token < len(node)):
            return ""
        node = node[token]
    return "" if isinstance(node, (Mapping, bool)) else node


def _pointer(parts: Sequence[str | int]) -> str:
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _short(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."

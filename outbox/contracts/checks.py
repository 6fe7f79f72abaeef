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

from outbox.contracts.bounds import InvalidContract, check_bounds

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
        """The payload's first violation of the contract, or None. The first in the order
        PostgreSQL keeps an object's members: the producer (members in the order it wrote them),
        the dispatcher (the stored jsonb's order) and the inbox name the same one."""
        if self._validator.is_valid(payload):  # the common case: no error objects built
            return None
        for error in self._validator.iter_errors(_jsonb_order(payload)):
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
    try:
        schema = json.loads(canonical)
    except (ValueError, RecursionError):
        raise InvalidContract(label, "the published schema is not JSON outbox can read") from None
    # Bounded again where it is used: `outbox contracts push` bounds what it publishes, but the
    # SQL function (an operator's grant) checks only the size, and a schema past the bounds may
    # cost any check seconds (outbox.contracts.bounds).
    check_bounds(label, schema)
    return Checker(label, schema)


def checker_for(label: str, digest: str, canonical: str) -> Checker:
    """The compiled checker of a published schema, by its digest: a published version never
    changes, so a compiled one is good for the life of the process. Raises InvalidContract if
    the schema is past outbox's bounds or does not compile."""
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


def _jsonb_order(value: object) -> object:
    """``value`` with every object's members in jsonb's order: the shorter name first, names
    of one length by their UTF-8 bytes. The error jsonschema-rs finds first follows the
    members' order."""
    if isinstance(value, Mapping):
        names = sorted(value, key=lambda name: (len(name.encode()), name.encode()))
        return {name: _jsonb_order(value[name]) for name in names}
    if isinstance(value, list):
        return [_jsonb_order(item) for item in value]
    return value


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

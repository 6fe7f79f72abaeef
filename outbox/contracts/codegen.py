"""Typed producers (issue 42): Python dataclasses written from published contracts, so that an
application's type checker finds a misspelt or missing field before a test or a provider does.

One frozen, keyword-only dataclass per version (``payments/charge`` v2 is ``PaymentsChargeV2``),
one per nested object schema, ``Literal`` for enums and consts; a member the schema does not
require is ``T | None = None`` and left out of the payload while None. ``to_payload()`` gives
the JSON object to enqueue; ``CONTRACT`` names the type and version it was written from. What
the generator cannot say in Python's types (``allOf``, patterns, bounds) is ``Any`` or left to
the check at enqueue, which stays the authority.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

_SIMPLE: Final = {"string": "str", "integer": "int", "number": "float", "boolean": "bool",
                  "null": "None"}  # fmt: skip
# Names a field may not take: the class's own, and those its annotations use (a field named
# "str" would shadow the type for the type checker).
RESERVED: Final = frozenset(
    {"CONTRACT", "to_payload", "Any", "ClassVar", "Literal", "None", "str", "int", "float",
     "bool", "list", "dict", "dataclasses", "_payload"}
)  # fmt: skip
HEADER: Final = '''"""Written by `outbox contracts codegen` from the contracts. Do not edit."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal


def _payload(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_payload()  # type: ignore[attr-defined]
    if isinstance(value, list):
        return [_payload(item) for item in value]
    if isinstance(value, dict):
        return {key: _payload(item) for key, item in value.items()}
    return value
'''


@dataclass
class _Class:
    name: str
    contract: tuple[str, int] | None
    fields: list[tuple[str, str, str, bool]] = field(
        default_factory=list
    )  # py, json, type, required


class Generator:
    """Collects the classes of one or more contracts, then writes them as one module."""

    def __init__(self) -> None:
        self._classes: list[_Class] = []
        self._names: set[str] = set()
        self._defs: dict[str, str] = {}
        self._root: Mapping[str, Any] = {}
        self._base = ""

    def add(self, operation_type: str, version: int, schema: Mapping[str, Any]) -> str:
        """Write the classes of one version; returns its class's name."""
        base = _class_name(f"{operation_type} v{version}")
        self._defs = {}
        self._root = schema
        self._base = base
        return self._object(base, schema, (operation_type, version))

    def source(self) -> str:
        parts = [HEADER]
        for cls in self._classes:
            parts.append(self._render(cls))
        return "\n".join(parts)

    def _object(
        self, name: str, schema: Mapping[str, Any], contract: tuple[str, int] | None
    ) -> str:
        name = self._unique(name)
        cls = _Class(name, contract)
        required = set(schema.get("required", ()))
        properties = schema.get("properties", {})
        taken: set[str] = set()
        for member, subschema in properties.items():
            python = _field_name(member, taken)
            kind = self._type(f"{name} {member}", subschema)
            cls.fields.append((python, member, kind, member in required))
        self._classes.append(cls)
        return name

    def _type(self, name: str, schema: object) -> str:
        """The Python type of a value that ``schema`` describes."""
        if schema is True or not isinstance(schema, Mapping):
            return "Any"
        if "$ref" in schema:
            return self._ref(str(schema["$ref"]))
        if "const" in schema or isinstance(schema.get("enum"), list):
            return _literal([schema["const"]] if "const" in schema else schema["enum"])
        for combinator in ("anyOf", "oneOf"):
            if isinstance(schema.get(combinator), list):
                options = [self._type(f"{name} {i}", s) for i, s in enumerate(schema[combinator])]
                return _union(options)
        return self._typed(name, schema, schema.get("type"))

    def _typed(self, name: str, schema: Mapping[str, Any], kinds: object) -> str:
        """The type of a schema by its ``type`` keyword."""
        if isinstance(kinds, list):
            return _union([self._typed(name, schema, k) for k in kinds])
        if kinds == "object":
            if isinstance(schema.get("properties"), Mapping):
                return self._object(_class_name(name), schema, None)
            return "dict[str, Any]"
        if kinds == "array":
            return f"list[{self._type(f'{name} item', schema.get('items', True))}]"
        return _SIMPLE.get(kinds, "Any") if isinstance(kinds, str) else "Any"

    def _ref(self, ref: str) -> str:
        if ref in self._defs:
            return self._defs[ref]
        target: object = self._root
        for raw in ref.lstrip("#").split("/")[1:]:
            token = raw.replace("~1", "/").replace("~0", "~")
            target = target.get(token) if isinstance(target, Mapping) else None
        self._defs[ref] = "Any"  # a recursive reference: Any rather than a loop
        named = f"{self._base} {ref.rsplit('/', 1)[-1]}"  # "#/$defs/line": ShopOrderV1Line
        kind = self._type(named, target) if isinstance(target, Mapping) else "Any"
        self._defs[ref] = kind
        return kind

    def _unique(self, name: str) -> str:
        candidate, n = name, 2
        while candidate in self._names:
            candidate, n = f"{name}{n}", n + 1
        self._names.add(candidate)
        return candidate

    def _render(self, cls: _Class) -> str:
        lines = ["", "", "@dataclasses.dataclass(frozen=True, kw_only=True)", f"class {cls.name}:"]
        if cls.contract is not None:
            lines.append(f"    CONTRACT: ClassVar[tuple[str, int]] = {cls.contract!r}")
        # Required members first is not needed with kw_only; keep the schema's order.
        for python, _, kind, required in cls.fields:
            optional = kind if kind == "Any" or kind.endswith("None") else f"{kind} | None"
            lines.append(
                f"    {python}: {kind}" if required else f"    {python}: {optional} = None"
            )
        names = {python: member for python, member, _, _ in cls.fields}
        lines += [
            "",
            "    def to_payload(self) -> dict[str, Any]:",
            "        out: dict[str, Any] = {}",
        ]
        for python, member in names.items():
            lines.append(f"        if self.{python} is not None:")
            lines.append(f"            out[{member!r}] = _payload(self.{python})")
        if not names:
            lines.append("        del out")
            lines.append("        return {}")
        else:
            lines.append("        return out")
        return "\n".join(lines)


def _class_name(text: str) -> str:
    words = re.findall(r"[A-Za-z0-9]+", text)
    name = "".join(w[:1].upper() + w[1:] for w in words) or "Contract"
    return name if name[0].isalpha() else f"C{name}"


def _field_name(member: str, taken: set[str]) -> str:
    # ASCII ("²" is \w, not a name), and no leading underscore: "__dict__" would break the
    # dataclass, "__x" would be mangled in the class body.
    name = re.sub(r"[^0-9A-Za-z_]", "_", member).lstrip("_")
    if not name or name[0].isdigit():
        name = f"f_{name}"
    if keyword.iskeyword(name) or name in RESERVED:
        name = f"{name}_"
    candidate, n = name, 2
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _literal(values: list[Any]) -> str:
    usable = [v for v in values if isinstance(v, (str, int, bool)) or v is None]
    if len(usable) != len(values) or not usable:
        return "Any"
    return f"Literal[{', '.join(repr(v) for v in usable)}]"


def _union(options: list[str]) -> str:
    unique = list(dict.fromkeys(options))
    return "Any" if "Any" in unique else " | ".join(unique)

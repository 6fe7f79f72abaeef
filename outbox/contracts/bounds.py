"""What a contract's schema may be: bounded in size, in depth, and in the work it can make one
payload cost, with no reference that leaves the document (no network at enqueue).

The work bound is the one that matters against a schema built to hurt. A schema's references
can reuse a subschema without copying it, so a few hundred bytes can ask a validator for 2^64
evaluations (``anyOf`` of two references to the next level, 64 levels). The bound unfolds the
schema as a validator would walk it against a payload that has every member the schema names,
counting the subschemas that land on each level of the payload, and refuses a schema where one
level gets more than ``MAX_PER_LEVEL``. Each node of a payload is then checked by at most that
many subschemas, so a check costs at most the payload's count of JSON values (bounded at
enqueue) times ``MAX_PER_LEVEL`` (bench/contracts.py measures the worst we could build).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Final
from urllib.parse import unquote

# A schema's JSON text at most: a hundred-property contract with descriptions is under 20 KiB.
MAX_SCHEMA_BYTES: Final = 64 * 1024
# Nesting of the schema document itself.
MAX_SCHEMA_DEPTH: Final = 32
# Subschemas that can land on one value of a payload, references unfolded (see above): a
# member's own schema rarely combines more than a few; at this bound the worst payload the
# door lets through is checked in about 0.15 s (bench/contracts.py).
MAX_PER_LEVEL: Final = 100
# Subschemas in all, unfolded over a payload with every member the schema names: bounds the
# walk itself, and a schema's work on a payload that has all of its members.
MAX_UNFOLDED: Final = 100_000
# How deep a payload can be (enqueue refuses deeper, docs/design.md): unfolding stops there.
PAYLOAD_DEPTH: Final = 64
# The only dialect: a contract names it or nothing.
DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"

# Keywords whose subschemas apply to the same place in the payload...
_SAME_ONE = ("not", "if", "then", "else")
_SAME_MANY = ("allOf", "anyOf", "oneOf")
_SAME_MAP = ("dependentSchemas",)
# ...and those whose subschemas apply one level down (a member, an item, a key).
_DOWN_ONE = (
    "additionalProperties",
    "propertyNames",
    "items",
    "contains",
    "unevaluatedItems",
    "unevaluatedProperties",
)
# (prefixItems, properties and patternProperties: _one_down)
# The step of a subschema that lands on any value one level down.
ANY: Final = "\x00*"
_COUNT: Final = "\x00#"  # in a trie of landing paths, the count of the path that ends there
# References a contract may not hold: resolved by a dynamic scope this bound cannot follow.
_REFUSED = ("$dynamicRef", "$recursiveRef")


class InvalidContract(ValueError):
    """A contract that cannot be published: the reason, and where (file, type, version)."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"{where}: {reason}")
        self.where = where
        self.reason = reason


def check_bounds(where: str, schema: object) -> None:
    """Raise InvalidContract unless ``schema`` keeps every bound above. The size is the
    caller's (it has the text)."""
    if not isinstance(schema, Mapping):
        raise InvalidContract(where, "a contract's schema must be a JSON object")
    dialect = schema.get("$schema", DIALECT)
    if dialect != DIALECT:
        raise InvalidContract(where, f"$schema must be {DIALECT} (Draft 2020-12) or absent")
    for path, node in _nodes(schema, ""):
        if path.count("/") > MAX_SCHEMA_DEPTH:
            raise InvalidContract(where, f"the schema nests deeper than {MAX_SCHEMA_DEPTH}")
        if not isinstance(node, Mapping):
            continue
        for keyword in _REFUSED:
            if keyword in node:
                raise InvalidContract(where, f"{keyword} is not supported (at {path or '/'})")
        if path and "$id" in node and _is_subschema_path(path):
            # "#..." would then resolve against that subschema, not the document.
            raise InvalidContract(where, f"$id is allowed at the top only (at {path})")
        ref = node.get("$ref", "#")
        if not isinstance(ref, str):
            raise InvalidContract(where, f"$ref must be a string (at {path or '/'})")
        if not ref.startswith("#"):
            raise InvalidContract(
                where,
                f"$ref {ref[:80]!r} leaves the document (at {path or '/'}): a contract must be "
                "self-contained; put shared parts under $defs",
            )
    _check_unfolded(where, schema)


def _nodes(node: object, path: str) -> Iterator[tuple[str, object]]:
    """Every JSON value of the document with its pointer, depth first; never deeper than one
    past MAX_SCHEMA_DEPTH (the caller refuses there)."""
    stack = [(path, node)]
    while stack:
        path, node = stack.pop()
        yield path, node
        if path.count("/") > MAX_SCHEMA_DEPTH:
            continue
        if isinstance(node, Mapping):
            stack.extend((f"{path}/{_escape(str(k))}", v) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((f"{path}/{i}", v) for i, v in enumerate(node))


def _check_unfolded(where: str, schema: Mapping[str, Any]) -> None:
    """Walk the schema as a validator would over a payload with every member it names,
    references followed, and refuse it if one value of some payload meets more than
    MAX_PER_LEVEL subschemas (the module's docstring)."""
    # Per payload level, how many subschemas land on each path: a path's steps are a member's
    # name, an item's index, or ANY (items, additionalProperties...: any member or item).
    landing: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(PAYLOAD_DEPTH + 1)]
    walked = 0
    stack: list[tuple[object, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, Mapping):
            continue  # true, false: no work below them
        walked += 1
        if walked > MAX_UNFOLDED:
            raise InvalidContract(
                where,
                f"the schema unfolds to more than {MAX_UNFOLDED:,} subschemas, its references "
                "followed: a $ref cycle that never descends into the payload, or references "
                "that fan out",
            )
        landing[len(path)][path] += 1
        stack.extend((_resolve(where, schema, c), path) for c in _same_place(node))
        if len(path) < PAYLOAD_DEPTH:
            stack.extend((child, (*path, step)) for step, child in _one_down(node))
    for level, paths in enumerate(landing):
        if paths and _most_on_one_value(paths) > MAX_PER_LEVEL:
            raise InvalidContract(
                where,
                f"the schema applies more than {MAX_PER_LEVEL} subschemas to one value of a "
                f"payload (at level {level}), its references unfolded: a check could take "
                "minutes on one payload (references that fan out)",
            )


def _most_on_one_value(paths: Counter[tuple[str, ...]]) -> int:
    """The most subschemas that land on one value at this level: a value's path matches every
    landing path whose steps are its own or ANY. Searched over the values the steps can name
    (a trie of the landing paths, every matching branch followed at once)."""
    trie: dict[str, Any] = {}
    for path, count in paths.items():
        node = trie
        for step in path:
            node = node.setdefault(step, {})
        node[_COUNT] = count
    budget = [MAX_UNFOLDED]

    def most(frontier: list[dict[str, Any]]) -> int:
        budget[0] -= len(frontier)
        if budget[0] < 0:
            return MAX_PER_LEVEL + 1  # too intricate to tell: refused as if over
        if any(_COUNT in node for node in frontier):  # every path here has this length
            return sum(node.get(_COUNT, 0) for node in frontier)
        named = {step for node in frontier for step in node if step != ANY}
        best = 0
        for step in (*named, None):  # None: a name no path names, which only ANY matches
            following = [n[s] for n in frontier for s in (step, ANY) if s is not None and s in n]
            if following:
                best = max(best, most(following))
        return best

    return most([trie])


def _same_place(node: Mapping[str, Any]) -> Iterator[object]:
    for keyword in _SAME_ONE:
        if keyword in node:
            yield node[keyword]
    for keyword in _SAME_MANY:
        yield from _listed(node.get(keyword))
    for keyword in _SAME_MAP:
        yield from _mapped(node.get(keyword))
    if "$ref" in node:
        yield _Ref(node["$ref"])


def _one_down(node: Mapping[str, Any]) -> Iterator[tuple[str, object]]:
    """The subschemas one level down, each with the value it lands on (a member's name, an
    item's index, or ANY)."""
    for keyword in _DOWN_ONE:
        if keyword in node:
            yield ANY, node[keyword]
    for index, child in enumerate(_listed(node.get("prefixItems"))):
        yield f"#{index}", child
    properties = node.get("properties")
    if isinstance(properties, Mapping):
        for name, child in properties.items():
            yield f"/{name}", child  # a member; "#n" an item: never the same step
    patterns = node.get("patternProperties")
    if isinstance(patterns, Mapping):
        for child in patterns.values():
            yield ANY, child  # a pattern may match any name


class _Ref(str):
    """A reference still to resolve (a subschema is never a plain string)."""


def _resolve(where: str, schema: Mapping[str, Any], child: object) -> object:
    if not isinstance(child, _Ref):
        return child
    target = _pointed(schema, str(child))
    if target is None:
        raise InvalidContract(where, f"$ref {str(child)!r} points at nothing in the schema")
    return target


def _pointed(schema: Mapping[str, Any], ref: str) -> object | None:
    """The subschema a local reference names: a JSON pointer ("#/$defs/x") or an $anchor."""
    fragment = unquote(ref[1:])
    if fragment and not fragment.startswith("/"):
        return _anchored(schema, fragment)
    node: object = schema
    for raw in fragment.split("/")[1:] if fragment else []:
        token = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, Mapping) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def _anchored(schema: Mapping[str, Any], anchor: str) -> object | None:
    for _, node in _nodes(schema, ""):
        if isinstance(node, Mapping) and node.get("$anchor") == anchor:
            return node
    return None


def _is_subschema_path(path: str) -> bool:
    """Whether the pointer can name a subschema: not the inside of a keyword that holds plain
    data (enum, const, examples, default), where "$id" is only a value."""
    data = ("/enum/", "/const", "/examples/", "/default")
    return not any(part in path for part in data)


def _listed(value: object) -> Sequence[object]:
    return value if isinstance(value, list) else ()


def _mapped(value: object) -> Iterator[object]:
    if isinstance(value, Mapping):
        yield from value.values()


def _escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")

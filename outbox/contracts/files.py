"""Contracts as files: ``DIR/<operation type>/v<N>.json``, one JSON Schema per version, in the
application's repository. A type's directory may be nested (``payments/charge/v1.json`` is the
type ``payments/charge``)."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import jsonschema_rs

from outbox.contracts.bounds import MAX_SCHEMA_BYTES, InvalidContract, check_bounds
from outbox.contracts.checks import compile_schema

VERSION_FILE: Final = re.compile(r"v([1-9][0-9]{0,8})\.json")
# The bounds of outbox.contracts' columns (sql/0052): an operation type as enqueue takes it.
MAX_TYPE_LENGTH: Final = 128


@dataclass(frozen=True)
class ContractFile:
    """One version of one type's contract, read and checked, ready to publish."""

    operation_type: str
    version: int
    schema: dict[str, Any]
    canonical: str  # the schema's canonical JSON text (sorted keys, no spaces)
    digest: str  # SHA-256 of the canonical text: what "the same content" means

    @property
    def label(self) -> str:
        """``<type>/v<N>``, as the Outbox-Contract header carries it."""
        return label(self.operation_type, self.version)


def label(operation_type: str, version: int) -> str:
    """How a contract version is named everywhere: "<type>/v<N>" (the Outbox-Contract header,
    messages, the file's place under the contracts folder)."""
    return f"{operation_type}/v{version}"


def parse_contract(operation_type: str, version: int, text: str, where: str = "") -> ContractFile:
    """Read one contract's schema text; raises InvalidContract naming the problem."""
    where = where or label(operation_type, version)
    _check_type(where, operation_type)
    if not 1 <= version <= 999_999_999:
        raise InvalidContract(where, "a contract's version is a whole number from 1")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_SCHEMA_BYTES:
        raise InvalidContract(where, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
    try:
        schema = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        raise InvalidContract(where, f"not JSON: {exc}") from None
    check_bounds(where, schema)
    try:
        jsonschema_rs.meta.validate(schema)
    except jsonschema_rs.ValidationError as exc:
        path = "/".join(str(p) for p in exc.instance_path)
        raise InvalidContract(
            where, f"not a valid Draft 2020-12 schema at /{path}: {exc.message}"
        ) from None
    compile_schema(where, schema)  # a pattern that does not compile, say
    canonical = canonical_json(schema)
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    return ContractFile(operation_type, version, schema, canonical, digest)


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def load_dir(root: Path) -> list[ContractFile]:
    """Every contract under ``root``, sorted by type and version; raises InvalidContract for
    the first file that is not one (a name other than v<N>.json included: a typo must not be
    skipped in silence)."""
    if not root.is_dir():
        raise InvalidContract(str(root), "no such directory")
    found: list[ContractFile] = []
    for path in sorted(root.rglob("*")):
        if path.is_dir() or path.name.startswith("."):
            continue
        where = str(path)
        match = VERSION_FILE.fullmatch(path.name)
        relative = path.parent.relative_to(root)
        if match is None or relative == Path():
            raise InvalidContract(
                where, "contract files are named DIR/<operation type>/v<N>.json (v1.json, v2.json)"
            )
        try:
            if path.stat().st_size > MAX_SCHEMA_BYTES:  # not read whole: it may be anything
                raise InvalidContract(where, f"the schema is larger than {MAX_SCHEMA_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidContract(where, f"cannot be read: {exc}") from None
        found.append(parse_contract(relative.as_posix(), int(match.group(1)), text, where))
    if not found:
        raise InvalidContract(str(root), "holds no contract (DIR/<operation type>/v<N>.json)")
    return sorted(found, key=lambda c: (c.operation_type, c.version))


def _check_type(where: str, operation_type: str) -> None:
    if not operation_type.strip() or len(operation_type) > MAX_TYPE_LENGTH:
        raise InvalidContract(where, f"an operation type is 1 to {MAX_TYPE_LENGTH} characters")
    if any(ord(c) < 32 or ord(c) == 127 for c in operation_type):
        raise InvalidContract(where, "an operation type holds no control characters")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")

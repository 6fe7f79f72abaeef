"""Operation contracts (issue 42): a JSON Schema (Draft 2020-12) per operation type and version,
kept as files in the application's repository, published into the database, and checked where
work enters (enqueue), before it leaves (the dispatcher) and where it is received (the inbox).

This package is pure: reading and bounding a schema (``files``, ``bounds``) and checking a
payload against it (``checks``). Publishing and looking contracts up is the database layer's
(``outbox.db.contracts``); the commands are ``outbox contracts ...``.
"""

from outbox.contracts.bounds import (
    MAX_PER_LEVEL,
    MAX_SCHEMA_BYTES,
    MAX_SCHEMA_DEPTH,
    InvalidContract,
)
from outbox.contracts.checks import Checker, Violation, checker_for
from outbox.contracts.files import ContractFile, label, load_dir, parse_contract

__all__ = [
    "MAX_PER_LEVEL",
    "MAX_SCHEMA_BYTES",
    "MAX_SCHEMA_DEPTH",
    "Checker",
    "ContractFile",
    "InvalidContract",
    "Violation",
    "checker_for",
    "label",
    "load_dir",
    "parse_contract",
]

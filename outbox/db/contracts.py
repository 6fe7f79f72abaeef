"""Published contracts (sql/0052): publishing, their states, the aliases of renamed types
(sql/0055), and reading them back. Every
statement the contracts component issues is here; the tables are written only through the
functions of sql/0052, which keep a published version as it is and audit each change."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from outbox.contracts import ContractFile
from outbox.errors import SQLSTATE_CONTRACT_CHANGED

PUBLISH: Final = "SELECT outbox.publish_contract(%s, %s, %s, %s, %s, %s)"
SET_REQUIREMENT: Final = "SELECT outbox.set_contract_requirement(%s, %s, %s, %s)"
SET_STATE: Final = "SELECT outbox.set_contract_state(%s, %s, %s, %s, %s)"
GET: Final = "SELECT canonical, digest, state FROM outbox.get_contract(%s, %s)"
SET_ALIAS: Final = "SELECT outbox.set_contract_alias(%s, %s, %s, %s)"
ALIASES: Final = """
SELECT alias, operation_type, created_at, created_by FROM outbox.contract_aliases
WHERE %(type)s::text IS NULL OR alias = %(type)s OR operation_type = %(type)s
ORDER BY alias
"""
# The versions codegen writes classes for: every one not retired.
SCHEMAS: Final = """
SELECT operation_type, version, canonical FROM outbox.contracts
WHERE state <> 'retired' AND (%(type)s::text IS NULL OR operation_type = %(type)s)
ORDER BY operation_type, version
"""
LIST: Final = """
SELECT c.operation_type, c.version, c.state, c.digest, c.published_at, c.published_by,
       c.state_changed_at, coalesce(t.versions_required, true)
FROM outbox.contracts c
LEFT JOIN outbox.contract_types t ON t.operation_type = c.operation_type
WHERE %(type)s::text IS NULL OR c.operation_type = %(type)s
ORDER BY c.operation_type, c.version
"""


@dataclass(frozen=True)
class Published:
    """A published version as `outbox contracts list` shows it."""

    operation_type: str
    version: int
    state: str
    digest: str
    published_at: datetime
    published_by: str
    state_changed_at: datetime
    versions_required: bool  # the type's: enqueue refuses it without a contract_version

    @property
    def label(self) -> str:
        return f"{self.operation_type}/v{self.version}"


@dataclass(frozen=True)
class Held:
    """One version's schema as the database holds it."""

    canonical: str
    digest: str
    state: str


class ContractChanged(Exception):
    """A version is published with other content; nothing of the push was published."""

    def __init__(self, contract: ContractFile, published: str) -> None:
        super().__init__(f"{contract.label} is published with other content")
        self.contract = contract
        self.published = published  # the canonical text held


def publish(
    conn: psycopg.Connection[Any],
    contracts: list[ContractFile],
    *,
    actor: str,
    reason: str,
    require_version: bool = True,
) -> list[str]:
    """Publish every contract in one transaction: all of them, or none (ContractChanged names
    the first version whose content differs). Returns 'published' or 'unchanged' for each."""
    results: list[str] = []
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        for contract in contracts:
            try:
                with conn.transaction():  # a savepoint: the refusal is read, then raised
                    cur.execute(
                        PUBLISH,
                        (
                            contract.operation_type,
                            contract.version,
                            contract.canonical,
                            actor,
                            reason,
                            require_version,
                        ),
                    )
                    row = cur.fetchone()
            except psycopg.Error as exc:
                if exc.sqlstate != SQLSTATE_CONTRACT_CHANGED:
                    raise
                held = get(conn, contract.operation_type, contract.version)
                raise ContractChanged(contract, held.canonical if held else "") from None
            results.append(str(row[0]) if row else "")
    return results


def set_state(
    conn: psycopg.Connection[Any],
    operation_type: str,
    version: int,
    state: str,
    *,
    actor: str,
    reason: str,
) -> str:
    """Deprecate, retire or reactivate one version; 'unchanged' if it was so already."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SET_STATE, (operation_type, version, state, actor, reason))
        row = cur.fetchone()
    return str(row[0]) if row else ""


def get(conn: psycopg.Connection[Any], operation_type: str, version: int) -> Held | None:
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(GET, (operation_type, version))
        row = cur.fetchone()
    return None if row is None else Held(*row)


def list_published(
    conn: psycopg.Connection[Any], operation_type: str | None = None
) -> list[Published]:
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(LIST, {"type": operation_type})
        return [Published(*row) for row in cur.fetchall()]


def schemas(
    conn: psycopg.Connection[Any], operation_type: str | None = None
) -> list[tuple[str, int, str]]:
    """Type, version and canonical text of every version not retired."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SCHEMAS, {"type": operation_type})
        return [(str(t), int(v), str(c)) for t, v, c in cur.fetchall()]


def set_requirement(
    conn: psycopg.Connection[Any], operation_type: str, required: bool, *, actor: str, reason: str
) -> str:
    """Require producers of the type to name a version, or stop requiring it."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SET_REQUIREMENT, (operation_type, required, actor, reason))
        row = cur.fetchone()
    return str(row[0]) if row else ""


def set_alias(
    conn: psycopg.Connection[Any], alias: str, operation_type: str, *, actor: str, reason: str
) -> str:
    """Make ``alias`` (a renamed type's old name) read ``operation_type``'s contracts, for ever:
    'aliased', or 'unchanged' when it does already."""
    with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SET_ALIAS, (alias, operation_type, actor, reason))
        row = cur.fetchone()
    return str(row[0]) if row else ""


def aliases(
    conn: psycopg.Connection[Any], operation_type: str | None = None
) -> list[tuple[str, str, datetime, str]]:
    """(alias, the type it reads, when, by whom), of ``operation_type`` at either end."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(ALIASES, {"type": operation_type})
        return [(str(a), str(o), at, str(by)) for a, o, at, by in cur.fetchall()]

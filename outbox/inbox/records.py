"""The inbox's records as operators read and act on them (`outbox inbox`), on one connection.

Reads go through outbox_operator's SELECT on the tables; the one change, forgetting a record,
through ``outbox.inbox_forget``, which writes the audit (sql/0042).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from outbox.inbox import statements

MAX_BATCH = 10_000  # inbox_prune's bound


@dataclass(frozen=True)
class Filters:
    """Which records: each given filter narrows the selection."""

    handler: str | None = None
    tenant: str | None = None
    status: int | None = None
    since: timedelta | datetime | None = None
    conflicts: bool = False


def list_records(
    conn: psycopg.Connection[Any], filters: Filters, *, after: int | None, limit: int
) -> list[dict[str, Any]]:
    """Newest first, at most ``limit``, after record ``after``."""
    since = filters.since
    if isinstance(since, timedelta):
        row = conn.execute(statements.SINCE, {"back": since}).fetchone()
        since = row[0] if row else None
    params = {
        "handler": filters.handler,
        "tenant": filters.tenant,
        "status": filters.status,
        "since": since,
        "conflicts": filters.conflicts,
        "after": after,
        "limit": limit,
    }
    with conn.cursor(row_factory=dict_row) as cur:
        return list(cur.execute(statements.LIST, params))


def show_record(conn: psycopg.Connection[Any], inbox_id: int) -> dict[str, Any] | None:
    """One record with its stored response and the conflicts seen against it."""
    with conn.cursor(row_factory=dict_row) as cur:
        record = cur.execute(statements.SHOW, {"id": inbox_id}).fetchone()
        if record is not None:
            record["conflicts"] = list(cur.execute(statements.CONFLICTS, {"id": inbox_id}))
    return record


def forget(
    conn: psycopg.Connection[Any], inbox_id: int, *, reason: str, actor: str, force: bool
) -> None:
    """Delete one record, audited, in its own transaction; raises the function's refusal."""
    params = {"id": inbox_id, "reason": reason, "actor": actor, "force": force}
    with conn.transaction():
        conn.execute(statements.FORGET, params)


def release(conn: psycopg.Connection[Any], inbox_id: int, *, reason: str, actor: str) -> None:
    """Give an abandoned claim (or one whose lease expired) its claims back, audited: the next
    delivery reclaims it, under the same downstream key."""
    with conn.transaction():
        conn.execute(statements.RELEASE, {"id": inbox_id, "reason": reason, "actor": actor})


def prune(conn: psycopg.Connection[Any], batch: int) -> int:
    """Delete every completed record past its retention, ``batch`` at a time, each batch in its
    own transaction (short locks, a prune that stops midway keeps what it did); how many."""
    total = 0
    while True:
        with conn.transaction():
            row = conn.execute(statements.PRUNE, {"batch": batch}).fetchone()
        done = int(row[0]) if row else 0
        total += done
        if done < batch:
            return total


def prunable(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(statements.PRUNABLE).fetchone()
    return int(row[0]) if row else 0

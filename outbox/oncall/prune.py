"""Pruning: finished operations (succeeded, cancelled) leave the table in bounded batches.

Each batch is its own short transaction, so pruning never holds many row locks, never blocks the
dispatcher for long, and can be stopped at any point. It walks the primary key from the oldest
id, so a batch costs the same at the start of a ten-million-row table as at its end, without an
index that every record would have to maintain. Attempts go with their operation (ON DELETE
CASCADE), and so do its identity and key (operation_keys, by a trigger: sql/0051); the audit
stays, since a decision's record outlives its operation.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import psycopg

from outbox.db import statements

DEFAULT_BATCH: Final = 5_000


def prune_finished(
    conn: psycopg.Connection[Any],
    older_than: timedelta,
    *,
    batch: int = DEFAULT_BATCH,
    dry_run: bool = False,
    on_batch: Callable[[int], None] | None = None,
) -> int:
    """Delete operations finished (succeeded or cancelled) more than ``older_than`` ago; returns
    how many went (with ``dry_run``, how many would). ``conn`` must be in autocommit mode."""
    if dry_run:
        row = conn.execute(statements.COUNT_PRUNABLE, {"older_than": older_than}).fetchone()
        return int(row[0]) if row else 0
    total, after = 0, 0
    while True:
        params = {"older_than": older_than, "batch": batch, "after": after}
        ids = [r[0] for r in conn.execute(statements.PRUNE_BATCH, params).fetchall()]
        if not ids:
            return total
        total += len(ids)
        after = max(ids)
        if on_batch is not None:
            on_batch(len(ids))


def prune_idle_keys(conn: psycopg.Connection[Any], *, batch: int = DEFAULT_BATCH) -> int:
    """Delete the lock rows of ordering keys with no unfinished operation (sql/0019), in
    batches; returns how many went. An ordering key per order would otherwise leave a row per
    order for ever. ``conn`` must be in autocommit mode."""
    total, after = 0, ("", "")
    while True:
        params = {"after_tenant": after[0], "after_key": after[1], "batch": batch}
        row = conn.execute(statements.PRUNE_ORDERING_KEYS, params).fetchone()
        if row is None:
            return total
        total += int(row[0])
        after = (row[1], row[2])

"""The database-wide gauges, refreshed by one cheap query on a timer rather than per scrape."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import psycopg
import structlog
from psycopg.rows import dict_row, tuple_row
from psycopg_pool import AsyncConnectionPool

from outbox.core.model import Status
from outbox.db import statements
from outbox.observability import metrics
from outbox.observability.metric_labels import UNCONFIGURED
from outbox.runtime import loops

# Counting succeeded rows reads them all; beyond this many rows the planner's estimate serves.
EXACT_COUNT_LIMIT: Final = 100_000
# What an ordering key's waiting operations can be behind (statements.ORDERING_BLOCKED).
BEHIND: Final = ("pending", "in_flight", "quarantined", "reconciling", "none")

log = structlog.get_logger("outbox.gauges")


def counts(row: Mapping[str, Any]) -> dict[Status, int]:
    """Operations per status from a GAUGES row: exact, except succeeded beyond
    EXACT_COUNT_LIMIT rows, which is the planner's estimate less the rest (see ``estimated``)."""
    others = {s: int(row[s.value]) for s in Status if s is not Status.SUCCEEDED}
    succeeded = row["succeeded_exact"]
    if succeeded is None:
        succeeded = max(int(row["estimated_rows"]) - sum(others.values()), 0)
    return {s: int(succeeded) if s is Status.SUCCEEDED else others[s] for s in Status}


def estimated(row: Mapping[str, Any]) -> bool:
    """Whether ``counts(row)``'s succeeded figure is an estimate."""
    return row["succeeded_exact"] is None


async def refresh(pool: AsyncConnectionPool[Any], windows: Mapping[str, timedelta]) -> None:
    """Read the gauges' values from the database and set them."""
    async with pool.connection() as conn:
        cur = conn.cursor(row_factory=dict_row)
        row = await (
            await cur.execute(
                statements.GAUGES, {"exact_limit": EXACT_COUNT_LIMIT, "providers": list(windows)}
            )
        ).fetchone()
        near = await (
            await conn.cursor(row_factory=tuple_row).execute(
                statements.NEARING_KEY_EXPIRY,
                {"providers": list(windows), "windows": list(windows.values())},
            )
        ).fetchall()
        blocked = await (
            await conn.cursor(row_factory=tuple_row).execute(statements.ORDERING_BLOCKED)
        ).fetchall()
    assert row is not None  # noqa: S101 (a SELECT of scalars returns one row)
    for status, value in counts(row).items():
        metrics.OPERATIONS.labels(status.value).set(value)
    metrics.OLDEST_PENDING_AGE.set(row["oldest_pending_age"] or 0)
    ages: Mapping[str, float] = row["oldest_pending_by_provider"]
    for provider in (*windows, UNCONFIGURED):  # every known label, 0 when none is due
        metrics.PROVIDER_OLDEST_PENDING_AGE.labels(provider).set(ages.get(provider, 0))
    metrics.OLDEST_RECONCILING_AGE.set(row["oldest_reconciling_age"] or 0)
    for provider, count in near:
        metrics.NEARING_KEY_EXPIRY.labels(provider).set(count)
    waiting = {behind: int(operations) for behind, _keys, operations in blocked}
    for behind in BEHIND:
        metrics.ORDERING_BLOCKED.labels(behind).set(waiting.get(behind, 0))
    # Last: a refresh that failed half way leaves the time of the last whole one.
    metrics.GAUGES_REFRESHED.set_to_current_time()


async def refresh_forever(
    pool: AsyncConnectionPool[Any], windows: Mapping[str, timedelta], interval: timedelta
) -> None:
    async def round_() -> float:
        try:
            await refresh(pool, windows)
        except psycopg.Error as exc:
            metrics.DB_ERRORS.labels("gauges").inc()
            log.warning("gauge refresh failed", error_class=type(exc).__name__)
        return interval.total_seconds()

    await loops.forever("gauges", round_)

"""What the console's pages read: the overview, the lists, a search, the failure groups.

Plain functions of a connection, as outbox.oncall's: the pages call them on a worker thread.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row

from outbox.core.model import Status
from outbox.daemon import gauges
from outbox.db import statements as db_statements
from outbox.inbox import statements as inbox_statements
from outbox.observability import redaction
from outbox.oncall import operators
from outbox.web import statements

Row = dict[str, Any]

PAGE: Final = 50  # operations per page of a list
CLOSING_HORIZON: Final = timedelta(hours=1)  # "closes soon": within the hour, as the alert says
# A search by a provider's reference or a correlation id reads this many of the newest
# operations at most (neither has an index).
REFERENCE_WINDOW: Final = 1_000_000
# The failure groups are made of the oldest this many of each status: past it, the page says so.
GROUPED: Final = 10_000
CONFLICTS_SHOWN: Final = 10_000  # past this, the overview says "more than"
_IDENTITY: Final = re.compile(r"([^/]+)/([^/]+)/(.+)")


@dataclass(frozen=True)
class ListFilters:
    """The operations list's filters, as the query string gives them; None means any."""

    status: str | None = None
    provider: str | None = None
    reason: str | None = None
    error: str | None = None
    tenant: str | None = None
    operation_type: str | None = None
    since: timedelta | None = None

    def params(self) -> Row:
        return {
            "status": self.status,
            "provider": self.provider,
            "reason": self.reason,
            "error": self.error,
            "tenant": self.tenant,
            "operation_type": self.operation_type,
            "since_ago": self.since,
        }


def overview(
    conn: psycopg.Connection[Any], windows: dict[str, timedelta], *, closing_limit: int = 20
) -> Row:
    """Everything the overview shows, from partial indexes and small tables only."""
    gauge_row = _one(
        conn,
        db_statements.GAUGES,
        {"exact_limit": gauges.EXACT_COUNT_LIMIT, "providers": sorted(windows)},
    )
    counts = gauges.counts(gauge_row)
    oldest = gauge_row["oldest_pending_by_provider"] or {}
    if isinstance(oldest, str):
        oldest = json.loads(oldest)
    providers, closes = list(windows), list(windows.values())
    return {
        "counts": {s.value: counts[s] for s in Status},
        "succeeded_is_estimate": gauges.estimated(gauge_row),
        "oldest_pending": sorted(
            ((p, float(age)) for p, age in oldest.items() if age is not None),
            key=lambda pa: -pa[1],
        ),
        "attention": _all(conn, statements.ATTENTION_BY_REASON, {"examine": GROUPED}),
        "waiting": {
            r["status"]: r["operations"] for r in _all(conn, statements.WAITING_BY_STATUS, {})
        },
        "grouped": GROUPED,
        "in_doubt": operators.list_attention(conn, Status.RECONCILING, limit=10),
        "closing": _all(
            conn,
            statements.KEY_WINDOW_CLOSING,
            {
                "providers": providers,
                "windows": closes,
                "horizon": CLOSING_HORIZON,
                "limit": closing_limit,
            },
        ),
        "breakers": _all(conn, statements.BREAKERS, {}),
        "inbox": _inbox(conn),
        "inbox_conflicts": _one(
            conn, statements.INBOX_CONFLICTS_TODAY, {"limit": CONFLICTS_SHOWN + 1}
        )["conflicts"],
        "conflicts_shown": CONFLICTS_SHOWN,
    }


def list_operations(
    conn: psycopg.Connection[Any], filters: ListFilters, *, before: int | None, limit: int = PAGE
) -> list[Row]:
    """A page of operations, newest first, below id ``before``."""
    return _all(
        conn, statements.LIST_OPERATIONS, {**filters.params(), "before": before, "limit": limit}
    )


def search(conn: psycopg.Connection[Any], text: str) -> list[int]:
    """The operations ``text`` names: an id, an identity (tenant/type/key), the key an
    operation sends, a provider's reference or a correlation id among the newest."""
    text = text.strip()
    found: list[int] = []
    if text.isdigit() and len(text) < 19:
        found += [int(text)] if _exists(conn, int(text)) else []
    if match := _IDENTITY.fullmatch(text):
        tenant, operation_type, key = match.groups()
        try:
            identity = operators.Identity(tenant, operation_type, key)
            found.append(operators.find_id(conn, identity))
        except operators.ActionRefused:
            pass
    found += [r["id"] for r in _all(conn, statements.FIND_BY_IDEMPOTENCY_KEY, {"key": text})]
    found += [
        r["id"]
        for r in _all(
            conn, statements.FIND_RECENT_BY_REFERENCE, {"text": text, "window": REFERENCE_WINDOW}
        )
    ]
    return list(dict.fromkeys(found))


def failure_groups(
    conn: psycopg.Connection[Any], *, limit: int = 200, examine: int = GROUPED
) -> tuple[list[Row], dict[str, int]]:
    """The failure groups of the oldest ``examine`` waiting operations of each status, and how
    many wait in all, by status (a group's bulk dry run counts it exactly)."""
    groups = _all(conn, statements.FAILURE_GROUPS, {"limit": limit, "examine": examine})
    waiting = {r["status"]: r["operations"] for r in _all(conn, statements.WAITING_BY_STATUS, {})}
    return groups, waiting


def key_window(conn: psycopg.Connection[Any], op: Row, windows: dict[str, timedelta]) -> Row | None:
    """Until when the provider honours the operation's key, by the database's clock: None when
    it was never sent or its provider is not configured here (its window is unknown)."""
    window = windows.get(op["provider"])
    if op.get("first_sent_at") is None or window is None:
        return None
    row = conn.execute(statements.DB_NOW).fetchone()
    assert row is not None  # noqa: S101 (a SELECT of a scalar returns one row)
    closes_at = op["first_sent_at"] + window
    return {"closes_at": closes_at, "seconds_left": (closes_at - row[0]).total_seconds()}


def shown_payload(text: str | None) -> str | None:
    """The payload as the console shows it, when asked: indented, with the values of keys that
    name a secret masked as the logs mask them."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return "(not JSON)"
    return json.dumps(redaction.redact(value, marker="[redacted]"), indent=2, ensure_ascii=False)


def _exists(conn: psycopg.Connection[Any], operation_id: int) -> bool:
    return bool(operators.statuses_of(conn, [operation_id]))


def _inbox(conn: psycopg.Connection[Any]) -> list[Row]:
    """Per inbox handler: external claims in progress, the oldest's age, the abandoned."""
    with conn.cursor() as cur:
        found = cur.execute(inbox_statements.GAUGES).fetchall()
    return [
        {"handler": h, "in_progress": n, "oldest": age, "abandoned": dead}
        for h, n, age, dead in found
    ]


def _one(conn: psycopg.Connection[Any], query: LiteralString, params: Row) -> Row:
    rows = _all(conn, query, params)
    assert rows  # noqa: S101 (a SELECT of scalars returns one row)
    return rows[0]


def _all(conn: psycopg.Connection[Any], query: LiteralString, params: Row) -> list[Row]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()

"""`outbox pending list`: the pending operations that are failing, by provider and last error.

Pending operations whose last attempt failed (retrying after a backoff, or waiting for their
provider's breaker to close) are what an on-call engineer asks about ("50 pending with
http_500"); `outbox status` counts them per provider and error, this lists them. Operations not
tried yet are not listed: `status` counts them.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import click

from outbox.cli import bulk
from outbox.cli.common import TEXT, connect, dsn_option, json_option
from outbox.core.durations import format_duration
from outbox.oncall import operators
from outbox.oncall.text_tables import render_table


@click.group(help="Pending operations that are failing: by provider and last error.")
def pending() -> None:
    pass


@pending.command("list")
@dsn_option
@click.option("--provider", type=TEXT, help="Only this provider's operations.")
@click.option(
    "--error", type=TEXT, help="Only those whose last attempt failed so (http_500, timeout, ...)."
)
@click.option("--tenant", type=TEXT, help="Only this tenant's operations.")
@click.option(
    "--since", type=bulk.Since(), help="Only those whose last failure is since: 2h ago, or a time."
)
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--after", type=TEXT, help="Start after this cursor (what a truncated list printed).")
@json_option
def list_(
    dsn: str,
    provider: str | None,
    error: str | None,
    tenant: str | None,
    since: Any,
    limit: int,
    after: str | None,
    as_json: bool,
) -> None:
    """Pending operations whose last attempt failed, oldest first, a page at a time."""
    try:
        cursor = operators.Cursor.parse(after) if after else None
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--after") from None
    filters = operators.Filters(provider=provider, error=error, tenant=tenant, since=since)
    with connect(dsn) as conn:  # one row more than shown: whether the list goes on
        rows = operators.list_pending_failed(conn, filters, after=cursor, limit=limit + 1)
    truncated, rows = len(rows) > limit, rows[:limit]
    if truncated:  # on stderr, so that the table (or the JSON) stays whole for scripts
        last = operators.Cursor(rows[-1]["status_changed_at"], rows[-1]["id"])
        click.echo(
            f"outbox: {limit} shown; more are pending after a failure: the next page is "
            f"`--after {last}`",
            err=True,
        )
    if as_json:
        click.echo(json.dumps(rows, default=str))
        return
    if not rows:
        click.echo(f"no pending operation with a failed attempt matches ({filters.describe()})")
        return
    click.echo(render_table(HEADERS, [_line(r) for r in rows]))


HEADERS = ("id", "provider", "action", "attempts", "error", "failed", "next try", "identity")


def _line(r: dict[str, Any]) -> tuple[object, ...]:
    budget = f"/{r['max_attempts']}" if r["max_attempts"] else ""
    spent = r["attempts"] - r["attempt_base"]
    if r["ordering_blocked"]:
        next_try = "after its ordering key's turn"
    elif r["due_in_seconds"] > 0:
        next_try = "in " + format_duration(timedelta(seconds=round(r["due_in_seconds"])))
    else:
        next_try = "due"  # held back by its provider's breaker or limits, or about to go
    return (
        r["id"],
        r["provider"],
        r["action"],
        f"{spent}{budget}",
        r["error"] or r["last_error_class"],
        format_duration(timedelta(seconds=round(r["age_seconds"]))) + " ago",
        next_try,
        f"{r['tenant_id']}/{r['operation_type']}/{r['operation_key']}",
    )

"""`outbox status`: how many operations are where, what is oldest, and what waits for a
dispatcher that will never take it (a provider no config names)."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import click
import psycopg
from psycopg.rows import dict_row

from outbox.cli.common import BadInput, config_option, connect, dsn_option, json_option
from outbox.config.loader import load_settings
from outbox.config.settings import ConfigError
from outbox.core.durations import format_duration
from outbox.core.model import Status
from outbox.daemon import gauges
from outbox.db import statements
from outbox.dispatch.dispatcher import UNKNOWN_PROVIDER_GRACE
from outbox.oncall import operators
from outbox.oncall.text_tables import render_table

PROVIDER_LIMIT: Final = 200  # providers shown; more names than this is a producer's bug
COUNT_LIMIT: Final = 10_000  # each provider's count stops here ("10000+")
# The failing pending operations (a last attempt that failed), by provider and error: of each
# provider at most the oldest FAILING_LIMIT are read ("1000+"), each with a probe of its last
# attempt; of FAILING_PROVIDERS providers at most; the TOP_ERRORS commonest errors named.
FAILING_LIMIT: Final = 1_000
FAILING_PROVIDERS: Final = 50
TOP_ERRORS: Final = 3


@click.command()
@dsn_option
@config_option("The settings outbox run uses: then providers it lacks are named.")
@json_option
def status(dsn: str, config_path: Path | None, as_json: bool) -> None:
    """Operations per status, the age of the oldest pending operation that is due, the due ones
    per provider (those no configured provider takes, and when they are quarantined), the
    pending ones whose last attempt failed per provider and error, and the operations waiting
    for their ordering key's turn, by what they wait behind."""
    configured = _configured(config_path)
    # The gauges' query and the skip scans: partial indexes only, fast at ten million rows.
    with connect(dsn) as conn:
        cur = conn.cursor(row_factory=dict_row)
        row = cur.execute(
            statements.GAUGES,
            {"exact_limit": gauges.EXACT_COUNT_LIMIT, "providers": sorted(configured or ())},
        ).fetchone()
        blocked = cur.execute(statements.ORDERING_BLOCKED).fetchall()
        providers = _pending_by_provider(conn, configured)
        failing = _failing_by_provider(conn)
    assert row is not None  # noqa: S101 (a SELECT of scalars returns one row)
    truncated, providers = len(providers) > PROVIDER_LIMIT, providers[:PROVIDER_LIMIT]
    if truncated:  # on stderr, so that the table (or the JSON) stays whole for scripts
        click.echo(
            f"outbox: the first {PROVIDER_LIMIT} providers by name shown; more have due operations",
            err=True,
        )
    counts, approx = gauges.counts(row), gauges.estimated(row)
    oldest: float | None = row["oldest_pending_age"]
    if as_json:
        click.echo(
            json.dumps(
                {
                    "operations": {s.value: counts[s] for s in Status},
                    "succeeded_is_estimate": approx,
                    "oldest_due_pending_age_seconds": oldest,
                    "due_by_provider": providers,
                    "due_by_provider_truncated": truncated,
                    "failing_by_provider": failing,
                    "ordering_blocked": [dict(b) for b in blocked],
                },
                default=str,
            )
        )
        return
    shown = [
        (s.value, f"~{counts[s]}" if approx and s is Status.SUCCEEDED else counts[s])
        for s in Status
    ]
    click.echo(render_table(["status", "count"], shown))
    age = "none due" if oldest is None else format_duration(timedelta(seconds=oldest))
    click.echo(f"\noldest due pending: {age}")
    if providers:
        click.echo("\ndue, by provider:")
        click.echo(
            render_table(
                ["provider", "due", "note"],
                [(p["provider"], _count(p), _note(p, config_path)) for p in providers],
            )
        )
    if failing:
        click.echo(
            "\npending after a failed attempt "
            "(`outbox pending list --provider P --error E` lists them):"
        )
        click.echo(
            render_table(
                ["provider", "pending", "last errors"],
                [(f["provider"], _failing_count(f), _errors(f)) for f in failing],
            )
        )
    if blocked:
        # Pending operations that wait for an earlier one with their ordering key.
        click.echo("\nwaiting for their ordering key's turn:")
        lines = [(b["behind"], b["keys"], b["waiting"]) for b in blocked]
        click.echo(render_table(["behind", "keys", "operations"], lines))


def _configured(config_path: Path | None) -> frozenset[str] | None:
    if config_path is None:
        return None
    try:
        return frozenset(load_settings(config_path).providers)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _pending_by_provider(
    conn: psycopg.Connection[Any], configured: frozenset[str] | None
) -> list[dict[str, Any]]:
    params = {
        "grace": UNKNOWN_PROVIDER_GRACE,
        "count_limit": COUNT_LIMIT + 1,
        "provider_limit": PROVIDER_LIMIT + 1,
    }
    with conn.cursor(row_factory=dict_row) as cur:
        found = cur.execute(statements.PENDING_BY_PROVIDER, params).fetchall()
    for p in found:
        p["due_is_lower_bound"] = p["due"] > COUNT_LIMIT
        p["due"] = min(p["due"], COUNT_LIMIT)
        p["configured"] = None if configured is None else p["provider"] in configured
        if p["configured"] is not False:  # only an unconfigured provider's rows are quarantined
            p["quarantined_from"] = p["quarantine_due"] = None
    return found


def _failing_by_provider(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
    """Per provider, its pending operations whose last attempt failed, with their count by
    that attempt's error class, commonest first."""
    found = operators.pending_failed_by_provider(
        conn, count_limit=FAILING_LIMIT, provider_limit=FAILING_PROVIDERS
    )
    by_provider: dict[str, dict[str, Any]] = {}
    for r in found:
        p = by_provider.setdefault(
            r["provider"], {"provider": r["provider"], "pending": 0, "by_error": []}
        )
        p["pending"] += r["pending"]
        p["by_error"].append({"error": r["error"], "pending": r["pending"]})
    for p in by_provider.values():
        p["pending_is_lower_bound"] = p["pending"] >= FAILING_LIMIT
    return list(by_provider.values())


def _failing_count(f: dict[str, Any]) -> str:
    return f"{f['pending']}+" if f["pending_is_lower_bound"] else str(f["pending"])


def _errors(f: dict[str, Any]) -> str:
    named = [f"{e['error'] or '-'} {e['pending']}" for e in f["by_error"][:TOP_ERRORS]]
    others = sum(e["pending"] for e in f["by_error"][TOP_ERRORS:])
    if others:
        named.append(f"other {others}")
    of_oldest = f" (of the oldest {FAILING_LIMIT})" if f["pending_is_lower_bound"] else ""
    return ", ".join(named) + of_oldest


def _count(p: dict[str, Any]) -> str:
    return f"{p['due']}+" if p["due_is_lower_bound"] else str(p["due"])


def _note(p: dict[str, Any], config_path: Path | None) -> str:
    if p["configured"] is None:
        return "-"
    if p["configured"]:
        return ""
    grace = format_duration(UNKNOWN_PROVIDER_GRACE)
    when = (
        "now, by the next dispatcher that claims them"
        if p["quarantine_due"]
        else f"from {p['quarantined_from']:%Y-%m-%d %H:%M:%S %Z}"
    )
    return (
        f"no provider of this name in {config_path}: each is quarantined as "
        f"unknown_provider {grace} after its enqueue; the first {when}"
    )

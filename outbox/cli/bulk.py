"""Bulk actions of `outbox quarantine` and `outbox reconcile`: the same action on every operation
a set of filters selects.

The ids are taken once, counted and shown, confirmed (a prompt, or --yes), then acted on one by
one, each in its own transaction through the same SQL function as a single action: one audit row
per operation, and an operation that left the status meanwhile is skipped by that function's own
check, never acted on from a stale reading. A run cut short (the database gone) has changed what it
reports and nothing else; the same command again takes up the rest.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click
import psycopg

from outbox import operators
from outbox.cli.common import EXIT_CONFLICT, TEXT, BadInput, connect
from outbox.db import dsn as dsn_util
from outbox.durations import DurationTooLong, format_duration, parse_duration
from outbox.model import Status
from outbox.safe_text import printable
from outbox.text_tables import render_table

F = TypeVar("F", bound=Callable[..., Any])
Action = Callable[[psycopg.Connection[Any], int], Status]

PREVIEW_ROWS = 20  # shown before a confirmation; `list` with the same filters pages the rest


class Since(click.ParamType):  # type: ignore[type-arg]
    """--since: a duration back from the database's now (2h, 30m) or a time with its zone."""

    name = "since"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta | datetime:
        if isinstance(value, timedelta | datetime):
            return value
        text = str(value).strip()
        try:
            return parse_duration(text)
        except DurationTooLong as exc:
            self.fail(str(exc), param, ctx)
        except ValueError:
            pass
        try:
            at = datetime.fromisoformat(text)
        except ValueError:
            self.fail(
                f"{printable(text)!r} is neither a duration (2h, 30m) nor a time "
                "(2026-12-01T09:30:00Z)",
                param,
                ctx,
            )
        if at.tzinfo is None:  # the database's zone or the shell's? Neither, said once.
            self.fail(f"{printable(text)!r} has no time zone: add one (Z, +01:00)", param, ctx)
        return at


def filter_options(command: F) -> F:
    """--provider, --status-reason, --error, --tenant and --since: which operations."""
    for option in reversed(
        [
            click.option("--provider", type=TEXT, help="Only this provider's operations."),
            # Not --reason: that is the audit's why, which every action requires.
            click.option(
                "--status-reason",
                "status_reason",
                type=TEXT,
                help="Only this status reason (permanent_failure, key_window_passed, ...).",
            ),
            click.option(
                "--error",
                type=TEXT,
                help="Only those whose last attempt failed so (http_422, ...).",
            ),
            click.option("--tenant", type=TEXT, help="Only this tenant's operations."),
            click.option(
                "--since",
                type=Since(),
                help="Only those that entered the status since: 2h ago, or a time.",
            ),
        ]
    ):
        command = option(command)
    return command


def bulk_options(command: F) -> F:
    """filter_options plus --all, --dry-run and --yes."""
    for option in reversed(
        [
            click.option(
                "--all",
                "select_all",
                is_flag=True,
                help="Every operation in the status (with filters: every one they select).",
            ),
            click.option("--dry-run", is_flag=True, help="Count and show them; change nothing."),
            click.option("--yes", is_flag=True, help="Act without asking."),
        ]
    ):
        command = option(command)
    return filter_options(command)


def filters_of(params: dict[str, Any]) -> operators.Filters:
    return operators.Filters(
        provider=params.get("provider"),
        reason=params.get("status_reason"),
        error=params.get("error"),
        tenant=params.get("tenant"),
        since=params.get("since"),
    )


def require_one_selection(
    operation_id: int | None, filters: operators.Filters, select_all: bool
) -> None:
    """An id, or filters / --all: never both, never neither (no accidental act on everything)."""
    if operation_id is not None and (filters.given() or select_all):
        raise click.UsageError("give an operation ID or filters (--all, --provider, ...), not both")
    if operation_id is None and not (filters.given() or select_all):
        raise click.UsageError(
            "give an operation ID, or select several with --provider, "
            "--status-reason, --error, --tenant, --since or --all"
        )


@dataclass
class Outcome:
    """What a bulk run did: the new status of each operation acted on, and those skipped."""

    became: Counter[str]
    skipped: dict[int, str]

    def acted_on(self) -> int:
        """How many had their turn: acted on, or skipped."""
        return sum(self.became.values()) + len(self.skipped)


def run(
    dsn: str,
    status: Status,
    filters: operators.Filters,
    *,
    verb: str,
    action: Action,
    dry_run: bool,
    yes: bool,
) -> None:
    """Select, show, confirm, act; exit 3 when some had changed status before their turn."""
    with connect(dsn, autocommit=True) as conn:  # each action commits alone
        ids = operators.select_ids(conn, status, filters)
        if not ids:
            click.echo(f"no {status.value} operations match ({filters.describe()})")
            return
        _show(conn, status, filters, ids)
        if dry_run:
            click.echo(
                f"dry run: nothing changed; without --dry-run, {verb} would act on these {len(ids)}"
            )
            return
        _confirm(verb, status, len(ids), yes)
        outcome = _act_on_each(conn, dsn, ids, verb, action)
    _report(outcome, verb, status, len(ids))


def _show(
    conn: psycopg.Connection[Any], status: Status, filters: operators.Filters, ids: list[int]
) -> None:
    more = (
        f" (the first {operators.MAX_BULK}; run again for the rest)"
        if len(ids) >= operators.MAX_BULK
        else ""
    )
    click.echo(f"{len(ids)} {status.value} operations match ({filters.describe()}){more}:")
    preview = operators.list_attention(conn, status, filters, limit=PREVIEW_ROWS)
    click.echo(render_summary(preview))
    if len(ids) > len(preview):
        click.echo(
            f"... and {len(ids) - len(preview)} more: `outbox {_group(status)} list` "
            "with the same filters pages through them all"
        )


def _confirm(verb: str, status: Status, count: int, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():  # a script, a pipe: nobody there to answer
        raise BadInput(
            f"{count} operations match: add --yes to {verb} them without a prompt "
            "(or --dry-run to only see them)"
        )
    click.confirm(f"{verb.capitalize()} these {count} {status.value} operations?", abort=True)


def _act_on_each(
    conn: psycopg.Connection[Any], dsn: str, ids: list[int], verb: str, action: Action
) -> Outcome:
    outcome = Outcome(Counter(), {})
    with click.progressbar(ids, label=verb, file=sys.stderr, hidden=len(ids) < 2) as bar:
        for operation_id in bar:
            try:
                outcome.became[action(conn, operation_id).value] += 1
            except operators.ActionRefused as exc:
                outcome.skipped[operation_id] = str(exc)
            except psycopg.Error as exc:
                done = outcome.acted_on()
                raise click.ClickException(
                    f"stopped after {done} of {len(ids)} ({dsn_util.scrub(str(exc).strip(), dsn)})"
                    f": those are done, the rest untouched; the same command takes them up"
                ) from None
    return outcome


def _report(outcome: Outcome, verb: str, status: Status, count: int) -> None:
    became = ", ".join(f"{n} now {s}" for s, n in sorted(outcome.became.items()))
    click.echo(f"{verb}: {sum(outcome.became.values())} of {count} ({became or 'none'})")
    if outcome.skipped:
        for operation_id, why in list(outcome.skipped.items())[:PREVIEW_ROWS]:
            click.echo(f"skipped {operation_id}: {printable(why)}", err=True)
        click.echo(
            f"{len(outcome.skipped)} skipped: they were no longer {status.value} as the "
            "command found them",
            err=True,
        )
        sys.exit(EXIT_CONFLICT)


def _group(status: Status) -> str:
    return "quarantine" if status is Status.QUARANTINED else "reconcile"


SUMMARY_HEADERS = (
    "id",
    "provider",
    "action",
    "reason",
    "age",
    "attempts",
    "last error",
    "last check",
    "identity",
)


def render_summary(rows: list[dict[str, Any]]) -> str:
    """The table of `list`, and of a bulk action's preview."""
    return render_table(list(SUMMARY_HEADERS), [_summary(r) for r in rows])


def _summary(r: dict[str, Any]) -> tuple[object, ...]:
    identity = f"{r['tenant_id']}/{r['operation_type']}/{r['operation_key']}"
    age = format_duration(timedelta(seconds=r["age_seconds"]))
    check = r["check_finding"] or "-"
    if r.get("check_state"):
        check += f" ({r['check_state']})"
    return (
        r["id"],
        r["provider"],
        r["action"],
        r["status_reason"],
        age,
        r["attempts"],
        _short(r["last_error"]),
        check,
        identity,
    )


def _short(text: str | None, width: int = 48) -> str:
    if not text:
        return "-"
    return text if len(text) <= width else text[: width - 1] + "…"

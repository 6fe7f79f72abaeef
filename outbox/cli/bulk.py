"""Bulk actions of `outbox quarantine` and `outbox reconcile`: the same action on every operation
a set of filters selects.

The ids are taken once, counted and shown, confirmed (a prompt, or --yes), then acted on one by
one, each in its own transaction through the same SQL function as a single action: one audit row
per operation, and an operation that left the status meanwhile is skipped by that function's own
check, never acted on from a stale reading. A run cut short (the database gone) has changed what it
reports and nothing else; the same command again takes up the rest.
"""

from __future__ import annotations

import csv
import io
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import IO, Any, Final, TypeVar

import click
import psycopg

from outbox.cli.common import EXIT_CONFLICT, TEXT, BadInput, connect
from outbox.core.durations import DurationTooLong, format_duration, parse_duration
from outbox.core.model import Status
from outbox.core.safe_text import printable
from outbox.db import dsn as dsn_util
from outbox.oncall import operators
from outbox.oncall.text_tables import render_table

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


@dataclass(frozen=True)
class Only:
    """A bulk action that applies to some of what the filters select (`reconcile retry` without
    --force: those a check found missing): ``keep`` picks them, ``why`` says why the others are
    left alone."""

    keep: Callable[[psycopg.Connection[Any], list[int]], set[int]]
    why: str


def run(
    dsn: str,
    status: Status,
    filters: operators.Filters,
    *,
    verb: str,
    action: Action,
    dry_run: bool,
    yes: bool,
    only: Only | None = None,
    then: str | None = None,
) -> None:
    """Select, show, confirm, act; exit 3 when some had changed status before their turn.
    ``then``: what to do next, said once the action is done."""
    with connect(dsn, autocommit=True) as conn:  # each action commits alone
        ids = operators.select_ids(conn, status, filters)
        if not ids:
            click.echo(f"no {status.value} operations match ({filters.describe()})")
            return
        more = (
            f" (the first {operators.MAX_BULK}; run again for the rest)"
            if len(ids) >= operators.MAX_BULK
            else ""
        )
        heading = f"{len(ids)} {status.value} operations match ({filters.describe()}){more}"
        if only is not None:
            ids = _narrow(conn, ids, only, heading, verb)
        outcome = confirm_and_act(
            conn,
            dsn,
            ids,
            heading=heading,
            rest=f"`outbox {_group(status)} list` with the same filters pages through them all",
            verb=verb,
            status=status,
            action=action,
            dry_run=dry_run,
            yes=yes,
        )
    if outcome is not None:
        _report(outcome, verb, status, len(ids), then)


def _narrow(
    conn: psycopg.Connection[Any], ids: list[int], only: Only, heading: str, verb: str
) -> list[int]:
    """The ids ``only`` keeps; the others are named, and left alone."""
    kept = only.keep(conn, ids)
    left = [i for i in ids if i not in kept]
    if not left:
        return ids
    named = ", ".join(map(str, left[:PREVIEW_ROWS])) + (", ..." if len(left) > PREVIEW_ROWS else "")
    if len(left) == len(ids):
        raise BadInput(f"{heading}, and {verb} applies to none of them: {only.why} ({named})")
    click.echo(f"{len(left)} of the {len(ids)} that match are left alone: {only.why} ({named})")
    return [i for i in ids if i in kept]


def confirm_and_act(
    conn: psycopg.Connection[Any],
    dsn: str,
    ids: list[int],
    *,
    heading: str,
    rest: str,
    verb: str,
    status: Status,
    action: Action,
    dry_run: bool,
    yes: bool,
    references: Mapping[int, str] | None = None,
) -> Outcome | None:
    """Show ``ids``, then (unless ``dry_run``) confirm and act on each; None for a dry run."""
    _show(conn, heading, ids, rest, references)
    if dry_run:
        click.echo(
            f"dry run: nothing changed; without --dry-run, {verb} would act on these {len(ids)}"
        )
        return None
    _confirm(verb, status, len(ids), yes)
    return _act_on_each(conn, dsn, ids, verb, action)


def _show(
    conn: psycopg.Connection[Any],
    heading: str,
    ids: list[int],
    rest: str,
    references: Mapping[int, str] | None,
) -> None:
    click.echo(f"{heading}:")
    preview = operators.list_ids(conn, ids[:PREVIEW_ROWS])
    if references is None:
        click.echo(render_summary(preview))
    else:
        click.echo(render_with_references(preview, references))
    if len(ids) > len(preview):
        click.echo(f"... and {len(ids) - len(preview)} more: {rest}")


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


def _report(
    outcome: Outcome, verb: str, status: Status, count: int, then: str | None = None
) -> None:
    became = ", ".join(f"{n} now {s}" for s, n in sorted(outcome.became.items()))
    click.echo(f"{verb}: {sum(outcome.became.values())} of {count} ({became or 'none'})")
    if then and outcome.became:
        click.echo(then)
    if outcome.skipped:
        for operation_id, why in list(outcome.skipped.items())[:PREVIEW_ROWS]:
            click.echo(f"skipped {operation_id}: {printable(why)}", err=True)
        click.echo(
            f"{len(outcome.skipped)} skipped, each for the reason above: as they were when their "
            f"turn came (no longer {status.value}, or changed meanwhile), {verb} did not apply",
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


def render_with_references(rows: list[dict[str, Any]], references: Mapping[int, str]) -> str:
    """A resolve's preview: each operation with the reference it is about to be given."""
    headers = ["id", "provider", "action", "reason", "age", "reference", "identity"]
    shown = []
    for r in rows:
        row = _summary(r)
        shown.append((*row[:5], printable(_short(references[r["id"]])), row[-1]))
    return render_table(headers, shown)


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


# --- `reconcile resolve --refs-file`: each operation with the reference of its effect --------

REFS_HEADER: Final = ("id", "reference")
BAD_LINES_SHOWN: Final = 20


@dataclass(frozen=True)
class Ref:
    """One line of a references file: the operation, and its provider's reference."""

    line: int
    operation_id: int
    reference: str


def read_refs(file: IO[str]) -> list[Ref]:
    """The lines ``id,reference`` of ``file`` (CSV: quote a reference that holds a comma).
    Blank lines, lines starting with #, and a first line ``id,reference`` are skipped; any other
    line that is not an id and a reference, as `resolve ID --provider-ref` takes them, refuses
    the whole file, every bad line named: nothing is resolved from a file with a mistake."""
    name = source_of(file)
    try:
        text = file.read()
    except UnicodeDecodeError as exc:
        raise BadInput(f"{name} is not UTF-8 text (byte {exc.start})") from None
    refs: list[Ref] = []
    bad: list[str] = []
    first_line: dict[int, int] = {}
    reader = csv.reader(io.StringIO(text, newline=""), skipinitialspace=True)
    while True:
        try:
            row = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            bad.append(f"line {reader.line_num}: {exc}")
            break
        line = reader.line_num
        fields = [f.strip() for f in row]
        if not any(fields) or fields[0].startswith("#"):
            continue
        if not refs and not bad and tuple(f.lower() for f in fields) == REFS_HEADER:
            continue
        problem, ref = _ref(line, fields)
        if problem:
            bad.append(f"line {line}: {problem}")
        elif ref is not None and ref.operation_id in first_line:
            bad.append(
                f"line {line}: operation {ref.operation_id} is on line "
                f"{first_line[ref.operation_id]} too"
            )
        elif ref is not None:
            first_line[ref.operation_id] = line
            refs.append(ref)
    if bad:
        shown = "\n".join(printable(b) for b in bad[:BAD_LINES_SHOWN])
        more = f"\n... and {len(bad) - BAD_LINES_SHOWN} more" if len(bad) > BAD_LINES_SHOWN else ""
        raise BadInput(
            f"{name}: {len(bad)} line(s) are not `id,reference`; nothing was resolved:\n"
            f"{shown}{more}"
        )
    if not refs:
        raise BadInput(f"{name} has no `id,reference` line")
    if len(refs) > operators.MAX_BULK:
        raise BadInput(f"{name} has {len(refs)} lines: at most {operators.MAX_BULK} at a time")
    return refs


def _ref(line: int, fields: list[str]) -> tuple[str | None, Ref | None]:
    """A line's Ref, or what is wrong with it."""
    if len(fields) != len(REFS_HEADER):
        return f"{len(fields)} field(s), not 2 (id,reference)", None
    text_id, reference = fields
    if not (text_id.isascii() and text_id.isdigit() and len(text_id) < 20) or not (
        0 < int(text_id) < 2**63
    ):
        return f"{printable(text_id)!r} is not an operation id", None
    if not reference:
        return "no reference: resolve needs the provider's reference of the effect", None
    try:
        reference = TEXT.convert(reference, None, None)
    except click.BadParameter as exc:
        return f"the reference {exc.format_message()}", None
    return None, Ref(line, int(text_id), reference)


def source_of(file: IO[str]) -> str:
    name = getattr(file, "name", "-")
    return "stdin" if name in ("-", "<stdin>") else printable(str(name))


def run_refs(
    dsn: str,
    refs: list[Ref],
    source: str,
    *,
    reason: str,
    actor: str,
    dry_run: bool,
    yes: bool,
) -> None:
    """Resolve each operation of ``refs`` with its reference, as `resolve ID --provider-ref`
    does, one transaction and audit row each; only once every one of them is reconciling."""
    references = {r.operation_id: r.reference for r in refs}
    ids = list(references)
    with connect(dsn, autocommit=True) as conn:
        found = operators.statuses_of(conn, ids)
        wrong = [
            f"line {r.line}: no operation {r.operation_id}"
            if r.operation_id not in found
            else f"line {r.line}: operation {r.operation_id} is {found[r.operation_id].value}, "
            "not reconciling"
            for r in refs
            if found.get(r.operation_id) is not Status.RECONCILING
        ]
        if wrong:
            shown = "\n".join(wrong[:BAD_LINES_SHOWN])
            more = (
                f"\n... and {len(wrong) - BAD_LINES_SHOWN} more"
                if len(wrong) > BAD_LINES_SHOWN
                else ""
            )
            raise BadInput(
                f"{source}: {len(wrong)} operation(s) are not reconciling; nothing was "
                f"resolved:\n{shown}{more}"
            )
        outcome = confirm_and_act(
            conn,
            dsn,
            ids,
            heading=f"{len(ids)} reconciling operations to resolve with the references of {source}",
            rest=f"{source} names them all",
            verb="resolve",
            status=Status.RECONCILING,
            action=lambda c, i: operators.resolve(
                c, i, provider_ref=references[i], reason=reason, actor=actor
            ),
            dry_run=dry_run,
            yes=yes,
            references=references,
        )
    if outcome is not None:
        _report(outcome, "resolve", Status.RECONCILING, len(ids))

"""`outbox inbox`: the records of the receiving half (sql/0042), for operators.

`list` and `show` read them; `release` gives an abandoned external claim its claims back;
`forget` deletes records so that the next delivery under their
identity runs again (after fixing a handler that recorded a wrong refusal), one by ID or all
that filters select, each audited; `prune` deletes completed records past their retention.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import click
import psycopg

from outbox.cli import bulk
from outbox.cli.common import TEXT, BadInput, actor_option, connect, dsn_option, json_option
from outbox.core.safe_text import printable
from outbox.errors import SQLSTATE_NO_DATA_FOUND, SQLSTATE_OPERATOR_REFUSED
from outbox.inbox import records
from outbox.oncall.text_tables import render_table

MAX_SELECTED = 10_000
SHOWN = (  # what `show` prints of a record, in this order
    "id", "tenant_id", "handler", "key", "origin", "mode", "state", "response_status",
    "body_digest", "fingerprint", "claims", "last_error", "lease_expires_at", "abandoned_at",
    "created_at", "completed_at", "expires_at",
)  # fmt: skip  # forget by filters acts on at most this many records per run


@click.group(help="The inbox's records: what each worker recorded for each delivery.")
def inbox() -> None:
    pass


def _filter_options(command: Any) -> Any:
    for option in reversed(
        [
            click.option("--handler", type=TEXT, help="Only this handler's records."),
            click.option("--tenant", type=TEXT, help="Only this tenant's records."),
            click.option(
                "--status", type=click.IntRange(200, 499), help="Only this recorded status."
            ),
            click.option("--since", type=bulk.Since(), help="Only those since: 2h ago, or a time."),
            click.option("--conflicts", is_flag=True, help="Only those another body came under."),
        ]
    ):
        command = option(command)
    return command


def _filters(params: dict[str, Any]) -> records.Filters:
    return records.Filters(
        handler=params["handler"],
        tenant=params["tenant"],
        status=params["status"],
        since=params["since"],
        conflicts=params["conflicts"],
    )


@inbox.command("list")
@dsn_option
@_filter_options
@click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
@click.option("--after", type=click.IntRange(1), help="Start after this record id (older ones).")
@json_option
def list_(dsn: str, limit: int, after: int | None, as_json: bool, **filters: Any) -> None:
    """Records, newest first, a page at a time."""
    with connect(dsn) as conn:
        rows = records.list_records(conn, _filters(filters), after=after, limit=limit + 1)
    truncated, rows = len(rows) > limit, rows[:limit]
    if as_json:
        click.echo(json.dumps([_jsonable(r) for r in rows]))
    else:
        headers = ("id", "tenant", "handler", "key", "state", "status", "conflicts", "created")
        click.echo(render_table(headers, [_line(r) for r in rows]))
    if truncated:
        click.echo(f"more match: --after {rows[-1]['id']}", err=True)


@inbox.command("show")
@dsn_option
@click.argument("inbox_id", type=click.IntRange(1))
@click.option("--body", is_flag=True, help="Print the recorded response body too.")
@json_option
def show(dsn: str, inbox_id: int, body: bool, as_json: bool) -> None:
    """One record: its identity, the recorded response, the conflicts seen against it."""
    with connect(dsn) as conn:
        record = records.show_record(conn, inbox_id)
    if record is None:
        raise BadInput(f"inbox record {inbox_id} does not exist")
    stored = bytes(record.pop("response_body") or b"")
    if as_json:
        out = _jsonable(record)
        out["conflicts"] = [_jsonable(c) for c in record["conflicts"]]
        out["response_bytes"] = len(stored)
        if body:
            out["response_body"] = stored.decode("utf-8", "replace")
        click.echo(json.dumps(out))
        return
    for name in SHOWN:
        click.echo(f"{name}: {printable(str(record[name]))}")
    for name, value in record["response_headers"] or ():
        click.echo(f"header: {printable(name)}: {printable(value)}")
    click.echo(f"response: {len(stored)} bytes")
    if body:
        click.echo(printable(stored.decode("utf-8", "replace")))
    for c in record["conflicts"]:
        # An empty digest is the overflow row: bodies past the first 32 (sql/0043).
        what = f"body {c['body_digest'][:16]}..." if c["body_digest"] else "other bodies"
        click.echo(
            f"conflict: {what} seen {c['seen']} times, last {c['last_seen_at']:%Y-%m-%d %H:%M:%S%z}"
        )


@inbox.command("forget")
@dsn_option
@click.argument("inbox_id", type=click.IntRange(1), required=False)
@_filter_options
@click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")
@actor_option
@click.option(
    "--force", is_flag=True, help="Forget records of a success too (their effect exists)."
)
@click.option("--dry-run", is_flag=True, help="Count and show them; change nothing.")
@click.option("--yes", is_flag=True, help="Act without asking.")
def forget(
    dsn: str,
    inbox_id: int | None,
    reason: str,
    actor: str,
    force: bool,
    dry_run: bool,
    yes: bool,
    **filters: Any,
) -> None:
    """Delete records, so that the next delivery under each identity runs the handler again:
    one by INBOX_ID, or every one the filters select. A record of a success needs --force: its
    effect exists, and the next delivery would make a second one. Audited."""
    chosen = _filters(filters)
    if inbox_id is None and chosen == records.Filters():
        raise BadInput("name a record, or select some with filters (--handler, --status, ...)")
    with connect(dsn) as conn:
        if inbox_id is not None:
            ids = [inbox_id]
        else:
            found = records.list_records(conn, chosen, after=None, limit=MAX_SELECTED)
            ids = [int(r["id"]) for r in found]
            click.echo(
                render_table(
                    ("id", "tenant", "handler", "key", "state", "status", "conflicts", "created"),
                    [_line(r) for r in found[:20]],
                )
            )
        click.echo(f"{len(ids)} records selected", err=True)
        if dry_run or not ids:
            return
        _confirm(len(ids), yes or inbox_id is not None)
        done, refused = _forget_each(conn, ids, reason=reason, actor=actor, force=force)
    click.echo(f"forgotten: {done}; refused: {len(refused)}")
    for line in refused[:20]:
        click.echo(f"  {line}", err=True)
    if refused:
        sys.exit(1)


def _confirm(count: int, yes: bool) -> None:
    if yes:
        return
    if not sys.stdin.isatty():
        raise BadInput(f"{count} records match: add --yes to forget them without a prompt")
    click.confirm(f"Forget these {count} records?", abort=True)


def _forget_each(
    conn: psycopg.Connection[Any], ids: list[int], *, reason: str, actor: str, force: bool
) -> tuple[int, list[str]]:
    """Each in its own transaction: a refusal (a success without --force, a record gone
    meanwhile) is reported and the rest go on."""
    done, refused = 0, []
    for inbox_id in ids:
        try:
            records.forget(conn, inbox_id, reason=reason, actor=actor, force=force)
            done += 1
        except psycopg.Error as exc:
            if exc.sqlstate not in (SQLSTATE_OPERATOR_REFUSED, SQLSTATE_NO_DATA_FOUND):
                raise
            refused.append(f"{inbox_id}: {exc.diag.message_primary}")
    return done, refused


@inbox.command("release")
@dsn_option
@click.argument("inbox_id", type=click.IntRange(1))
@click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")
@actor_option
def release(dsn: str, inbox_id: int, reason: str, actor: str) -> None:
    """Give an abandoned external claim (or one whose lease expired) its claims back: the next
    delivery runs the handler again, under the same downstream key. Audited."""
    with connect(dsn) as conn:
        try:
            records.release(conn, inbox_id, reason=reason, actor=actor)
        except psycopg.Error as exc:
            if exc.sqlstate not in (SQLSTATE_OPERATOR_REFUSED, SQLSTATE_NO_DATA_FOUND):
                raise
            raise BadInput(str(exc.diag.message_primary or exc)) from None
    click.echo(f"released: {inbox_id}")


@inbox.command("prune")
@dsn_option
@click.option(
    "--batch",
    type=click.IntRange(1, records.MAX_BATCH),
    default=5000,
    show_default=True,
    help="Records deleted per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Count them; delete nothing.")
def prune(dsn: str, batch: int, dry_run: bool) -> None:
    """Delete completed records past their retention (each record's expires_at), in batches.
    A record in progress is never pruned."""
    with connect(dsn) as conn:
        if dry_run:
            click.echo(f"prunable: {records.prunable(conn)}")
            return
        click.echo(f"pruned: {records.prune(conn, batch)}")


def _line(r: dict[str, Any]) -> tuple[object, ...]:
    key = r["key"] if len(r["key"]) <= 40 else r["key"][:39] + "…"
    return (
        r["id"],
        r["tenant_id"],
        r["handler"],
        key,
        r["state"],
        r["response_status"] if r["response_status"] is not None else "-",
        int(r["conflicts"]),
        f"{r['created_at']:%Y-%m-%d %H:%M:%S}",
    )


def _jsonable(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in r.items():
        if isinstance(value, datetime):
            out[key] = value.isoformat()
        elif key == "conflicts" and isinstance(value, list):
            continue  # show's conflicts: the caller adds them
        else:
            out[key] = int(value) if key in ("conflicts", "seen") else value
    return out

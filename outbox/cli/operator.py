"""`outbox reconcile` and `outbox quarantine`: the on-call engineer's commands.

Both groups share list, show and cancel; reconcile adds resolve and retry (and check, which asks
the provider), quarantine adds replay. Every action takes --reason and records --actor (default:
the login user) in the audit.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import click

from outbox.cli import bulk
from outbox.cli.common import (
    TEXT,
    BadInput,
    actor_option,
    config_option,
    connect,
    dsn_option,
    json_option,
)
from outbox.config.loader import load_settings
from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core import payloads
from outbox.core.durations import format_duration
from outbox.core.model import Status
from outbox.core.safe_text import printable
from outbox.oncall import operators, reconciler
from outbox.oncall.text_tables import render_table
from outbox.providers.base import Provider

F = TypeVar("F", bound=Callable[..., Any])


def _reason_option(command: F) -> F:
    return click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")(
        command
    )


def build_group(name: str, status: Status) -> click.Group:
    """The command group for operations in ``status``."""

    @click.group(name=name, help=f"Operations in {status.value}: inspect and decide.")
    def group() -> None:
        pass

    @group.command("list")
    @dsn_option
    @bulk.filter_options
    @click.option("--limit", type=click.IntRange(1, 10_000), default=100, show_default=True)
    @click.option(
        "--after", type=TEXT, help="Start after this cursor (what a truncated list printed)."
    )
    @json_option
    def list_(dsn: str, limit: int, after: str | None, as_json: bool, **selection: Any) -> None:
        """List them, oldest first, a page at a time."""
        try:
            cursor = operators.Cursor.parse(after) if after else None
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--after") from None
        filters = bulk.filters_of(selection)
        with connect(dsn) as conn:  # one row more than shown: whether the list goes on
            rows = operators.list_attention(conn, status, filters, after=cursor, limit=limit + 1)
        truncated, rows = len(rows) > limit, rows[:limit]
        if truncated:  # on stderr, so that the table (or the JSON) stays whole for scripts
            last = operators.Cursor(rows[-1]["status_changed_at"], rows[-1]["id"])
            click.echo(
                f"outbox: {limit} shown; more are {status.value}: the next page is "
                f"`--after {last}`",
                err=True,
            )
        if as_json:
            click.echo(json.dumps(rows, default=str))
            return
        click.echo(bulk.render_summary(rows))

    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @click.option("--tenant-id", type=TEXT)
    @click.option("--operation-type", type=TEXT)
    @click.option("--operation-key", type=TEXT)
    @click.option(
        "--payload",
        "with_payload",
        is_flag=True,
        help="Include the payload and the provider's answer (they may hold secrets).",
    )
    @json_option
    def show(
        dsn: str,
        operation_id: int | None,
        tenant_id: str | None,
        operation_type: str | None,
        operation_key: str | None,
        with_payload: bool,
        as_json: bool,
    ) -> None:
        """One operation by ID or identity: its attempts and its audit trail."""
        with connect(dsn) as conn:
            if operation_id is None:
                if not (tenant_id and operation_type and operation_key):
                    raise click.UsageError(
                        "give an ID, or --tenant-id, --operation-type and --operation-key"
                    )
                identity = operators.Identity(tenant_id, operation_type, operation_key)
                operation_id = _refusing(lambda: operators.find_id(conn, identity))
            op = _refusing(lambda: operators.show(conn, operation_id, with_payload=with_payload))
        if not with_payload:
            # The provider's answer can hold secrets (a PaymentIntent's client_secret) and echo
            # the payload: shown only on request, like the payload.
            op.pop("result", None)
        click.echo(_show_json(op) if as_json else _describe(op))

    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @_reason_option
    @actor_option
    @bulk.bulk_options
    def cancel(
        dsn: str, operation_id: int | None, reason: str, actor: str, **selection: Any
    ) -> None:
        """Give up: nothing more is sent. One by ID, or every one the filters select."""
        _one_or_many(
            dsn,
            status,
            operation_id,
            selection,
            "cancel",
            lambda conn, i: operators.cancel(conn, i, reason=reason, actor=actor),
        )

    return group


def add_reconcile_actions(group: click.Group) -> None:
    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @click.option("--provider-ref", type=TEXT, help="The provider's id of the effect (with an ID).")
    @click.option(
        "--refs-file",
        type=click.File("r", encoding="utf-8"),
        help="Lines `id,reference` (CSV; '-': stdin): each operation with its effect's id.",
    )
    @click.option(
        "--no-effect",
        is_flag=True,
        help="You found no effect at the provider: recorded as a not_found finding, so that "
        "`retry` needs no --force.",
    )
    @_reason_option
    @actor_option
    @bulk.bulk_options
    def resolve(
        dsn: str,
        operation_id: int | None,
        provider_ref: str | None,
        refs_file: IO[str] | None,
        no_effect: bool,
        reason: str,
        actor: str,
        **selection: Any,
    ) -> None:
        """Settle what a person found at the provider: the effect exists (succeeded), or not.

        --provider-ref REF: operation ID succeeded with the effect REF. --refs-file F: each
        operation of F's lines `id,reference` succeeded with its reference, once every line is
        well formed and every operation reconciling. --no-effect: there is none (ID, or a
        selection): the operation stays reconciling with a not_found finding of yours; then
        `reconcile retry` sends it again under a new key, or `reconcile cancel` gives it up.
        """
        filters = bulk.filters_of(selection)
        selected = filters.given() or selection["select_all"]
        ways = (provider_ref is not None) + (refs_file is not None) + no_effect
        if ways != 1:
            raise click.UsageError(
                "give one of --provider-ref REF (with an ID: the effect exists), --refs-file F "
                "(several, each with its reference) or --no-effect (there is none)"
            )
        if refs_file is not None:
            if operation_id is not None or selected:
                raise click.UsageError("--refs-file names its operations: no ID or filters")
            refs = bulk.read_refs(refs_file)
            bulk.run_refs(
                dsn,
                refs,
                bulk.source_of(refs_file),
                reason=reason,
                actor=actor,
                dry_run=selection["dry_run"],
                yes=selection["yes"],
            )
        elif provider_ref is not None:
            if operation_id is None or selected or selection["dry_run"]:
                raise click.UsageError(
                    "--provider-ref is the effect of one operation: give its ID, no filters "
                    "(for several, --refs-file)"
                )
            _run_action(
                dsn,
                operation_id,
                lambda conn: operators.resolve(
                    conn, operation_id, provider_ref=provider_ref, reason=reason, actor=actor
                ),
            )
        else:
            _one_or_many(
                dsn,
                Status.RECONCILING,
                operation_id,
                selection,
                "record no effect",
                lambda conn, i: operators.record_no_effect(conn, i, reason=reason, actor=actor),
                only=NO_EFFECT_ONLY,
                then=NO_EFFECT_THEN,
            )

    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @_reason_option
    @actor_option
    @click.option(
        "--force", is_flag=True, help="Retry even though no check found the effect missing."
    )
    @click.option(
        "--no-effect",
        is_flag=True,
        help="You found no effect at the provider: record it (as `resolve --no-effect`), then "
        "retry; not with --force.",
    )
    @bulk.bulk_options
    def retry(
        dsn: str,
        operation_id: int | None,
        reason: str,
        actor: str,
        force: bool,
        no_effect: bool,
        **selection: Any,
    ) -> None:
        """Send again under a new key generation (a new request to the provider): one by ID, or
        those the filters select. Without --force, only those a check (or `resolve --no-effect`)
        found missing; a selection leaves the others alone and names them. --no-effect records
        your finding that the provider has none first, each in the transaction of its retry."""
        if force and no_effect:
            raise click.UsageError("--force retries on no finding; --no-effect records yours")

        def action(conn: Any, one: int) -> Status:
            if no_effect:
                return operators.retry_with_no_effect(conn, one, reason=reason, actor=actor)
            return operators.retry(conn, one, reason=reason, actor=actor, force=force)

        _one_or_many(
            dsn,
            Status.RECONCILING,
            operation_id,
            selection,
            "retry",
            action,
            only=NO_EFFECT_ONLY if no_effect else None if force else RETRY_ONLY,
        )


# What `reconcile resolve --no-effect` leads to.
NO_EFFECT_THEN: Final = (
    "no effect recorded: `outbox reconcile retry` with the same ID or selection now sends again "
    "under a new key, without --force; `outbox reconcile cancel` gives up"
)
# `reconcile resolve --no-effect` and `retry --no-effect` of a selection: a person's finding is
# taken of what was last attempted 30 s ago or more.
NO_EFFECT_ONLY: Final = bulk.Only(
    operators.settled_ids,
    "their last attempt was less than 30 s ago, and what the provider shows may not have its "
    "effect yet: look again in a moment",
)
# `reconcile retry` of a selection, without --force: what a check found missing.
RETRY_ONLY: Final = bulk.Only(
    operators.retryable_ids,
    "no check found their effect missing, 30 s or more after their last attempt: "
    "`outbox reconcile check` them, or `reconcile resolve --no-effect` once you looked, "
    "or retry with --force",
)


def add_reconcile_check(group: click.Group) -> None:
    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @click.option("--all", "check_all", is_flag=True, help="Check every reconciling operation.")
    @bulk.filter_options
    @click.option("--dry-run", is_flag=True, help="Look, but record nothing.")
    @config_option("The providers' settings (as for outbox run).")
    @json_option
    def check(
        dsn: str,
        operation_id: int | None,
        check_all: bool,
        dry_run: bool,
        config_path: Path | None,
        as_json: bool,
        **selection: Any,
    ) -> None:
        """Ask the provider whether the effect exists: found -> succeeded; not found -> recorded.

        One operation by ID, those the filters select, or --all. A check changes nothing at the
        provider, so a selection is checked without a prompt.
        """
        filters = bulk.filters_of(selection)
        bulk.require_one_selection(operation_id, filters, check_all)
        try:
            configured = load_settings(config_path).providers
        except ConfigError as exc:
            raise BadInput(str(exc)) from None
        if not configured:  # it would find nothing to ask, and say nothing of why
            raise BadInput(
                "no provider is configured, so none can be asked: give --config (or "
                "OUTBOX_CONFIG) with the providers outbox run uses"
            )
        limits = {name: ps.limits for name, ps in configured.items()}
        ids = None
        with connect(dsn) as conn:
            if filters.given():
                ids = operators.select_ids(conn, Status.RECONCILING, filters)
                if not ids:
                    click.echo(f"no reconciling operations match ({filters.describe()})")
                    return
            wanted = operators.reconciling_providers(conn, operation_id, ids)
        providers, without_lookup = _providers_to_ask(configured, wanted)
        with click.progressbar(
            length=0, label="checking", file=sys.stderr, hidden=as_json or operation_id is not None
        ) as bar:

            def total(n: int) -> None:
                bar.length = n

            results = asyncio.run(
                reconciler.run_checks(
                    dsn,
                    providers,
                    operation_id,
                    ids=ids,
                    dry_run=dry_run,
                    on_total=total,
                    on_result=lambda _: bar.update(1),
                    limits=limits,
                    without_lookup=without_lookup,
                )
            )
        if as_json:
            click.echo(json.dumps([dataclasses.asdict(r) for r in results]))
            return
        click.echo(
            render_table(
                ["id", "provider", "finding", "state", "reference", "note"],
                [
                    (
                        r.operation_id,
                        r.provider,
                        r.finding,
                        r.state or "-",
                        r.reference,
                        _check_note(r, dry_run),
                    )
                    for r in results
                ],
            )
        )


def _providers_to_ask(
    configured: Mapping[str, ProviderSettings], wanted: set[str]
) -> tuple[dict[str, Provider], set[str]]:
    try:
        return reconciler.providers_to_ask(configured, wanted)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _check_note(result: reconciler.CheckResult, dry_run: bool) -> str:
    if result.finding == "no_lookup" and result.error == "not_configured":
        return (
            f"no provider named {result.provider!r} in this config: give the config outbox run uses"
        )
    if result.finding == "no_lookup":
        return (
            "this provider has no lookup for this action: check with its owner, then "
            "`reconcile resolve`, or `reconcile retry --force` if it never acted"
        )
    if result.finding == "error":
        return f"the look-up failed ({result.error}); nothing recorded"
    notes = []
    if result.finding == "refused":
        why = result.details.get("decline_code") or result.details.get("code") or "refused"
        notes.append(f"the provider refused it ({why}): quarantined as provider_declined")
    elif result.finding == "undecided" and result.reference is None:
        notes.append(
            f"the search stopped short ({result.details.get('reason', '?')}): it proves "
            "nothing; a person decides, and a retry needs --force"
        )
    elif result.finding == "undecided":
        notes.append("its state decides nothing yet: a person decides")
    elif result.finding == "not_found" and result.details.get("searched"):
        notes.append(
            f"searched {', '.join(result.details['searched'])} from "
            f"{result.details['since']} to {result.details['until']}"
        )
    if result.duplicates:
        notes.append(f"more effects carry this id: {', '.join(result.duplicates)}")
    if dry_run:
        notes.append("dry run: nothing recorded")
    return "; ".join(notes)


def add_quarantine_actions(group: click.Group) -> None:
    @group.command()
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @_reason_option
    @actor_option
    @bulk.bulk_options
    def replay(
        dsn: str, operation_id: int | None, reason: str, actor: str, **selection: Any
    ) -> None:
        """Back to pending with the same key and a fresh attempt budget (one, or a selection)."""
        _one_or_many(
            dsn,
            Status.QUARANTINED,
            operation_id,
            selection,
            "replay",
            lambda conn, i: operators.replay(conn, i, reason=reason, actor=actor),
        )

    @group.command("reconcile")
    @dsn_option
    @click.argument("operation_id", type=int, required=False)
    @_reason_option
    @actor_option
    @bulk.bulk_options
    def to_reconciliation(
        dsn: str, operation_id: int | None, reason: str, actor: str, **selection: Any
    ) -> None:
        """Send to reconciliation: the provider is asked before anyone decides."""
        _one_or_many(
            dsn,
            Status.QUARANTINED,
            operation_id,
            selection,
            "send to reconciliation",
            lambda conn, i: operators.request_reconciliation(conn, i, reason=reason, actor=actor),
        )


def _one_or_many(
    dsn: str,
    status: Status,
    operation_id: int | None,
    selection: dict[str, Any],
    verb: str,
    action: bulk.Action,
    *,
    only: bulk.Only | None = None,
    then: str | None = None,
) -> None:
    """One operation by id (as before bulk actions existed), or a confirmed selection."""
    filters = bulk.filters_of(selection)
    bulk.require_one_selection(operation_id, filters, selection["select_all"])
    if operation_id is None:
        bulk.run(
            dsn,
            status,
            filters,
            verb=verb,
            action=action,
            dry_run=selection["dry_run"],
            yes=selection["yes"],
            only=only,
            then=then,
        )
        return
    if selection["dry_run"]:
        raise click.UsageError("--dry-run goes with a selection; `show ID` shows one operation")
    _run_action(dsn, operation_id, lambda conn: action(conn, operation_id))
    if then:
        click.echo(then)


@click.command("cancel")
@dsn_option
@click.argument("operation_id", type=int)
@_reason_option
@actor_option
def cancel(dsn: str, operation_id: int, reason: str, actor: str) -> None:
    """Give up on an unfinished operation: nothing more is sent.

    Pending, quarantined or reconciling: cancelled now, unless an earlier attempt may have
    reached the provider: then to reconciliation, where a check or a person decides. In flight:
    the attempt under way is not interrupted; when it ends, the operation is succeeded if it
    succeeded, reconciling if it may have reached the provider, cancelled otherwise. The audit
    records who asked and why.
    """
    with connect(dsn) as conn:
        status = _refusing(
            lambda: operators.request_cancel(conn, operation_id, reason=reason, actor=actor)
        )
    if status is Status.IN_FLIGHT:
        click.echo(
            f"operation {operation_id}: in_flight; cancel requested: it is settled when "
            "the attempt under way ends (succeeded if that succeeds; reconciling if it "
            "may have reached the provider; else cancelled)"
        )
    elif status is Status.RECONCILING:
        click.echo(
            f"operation {operation_id}: reconciling; an earlier attempt may have reached "
            f"the provider: `outbox reconcile check {operation_id}`, then cancel or "
            "resolve it"
        )
    else:
        click.echo(f"operation {operation_id}: {status.value}")


def _run_action(dsn: str, operation_id: int, action: Callable[[Any], Status]) -> None:
    with connect(dsn) as conn:
        status = _refusing(lambda: action(conn))
    click.echo(f"operation {operation_id}: {status.value}")


def _refusing(call: Callable[[], Any]) -> Any:
    try:
        return call()
    except operators.ActionRefused as exc:
        # Exit 2, as the README's table has it: the id, status or arguments do not apply.
        raise BadInput(str(exc)) from None


def _show_json(op: dict[str, Any]) -> str:
    """``show --json``: the payload as an object with its numbers exact (Decimal), or, when it
    cannot be decoded (a row refused as invalid_payload), as its text beside the reason."""
    shown = json.loads(json.dumps(op, default=str))  # datetimes and the like as text
    text = op.get("payload")
    if text is not None:
        try:
            shown["payload"] = payloads.decode(text)
        except payloads.InvalidPayload as exc:
            shown["payload_invalid"] = str(exc)
    return payloads.encode(shown)


def _searched(details: Mapping[str, Any] | None) -> list[str]:
    """What the last check searched, for a person to judge a not-found by."""
    if not details or not details.get("searched"):
        return []
    line = (
        f"searched     {', '.join(map(str, details['searched']))} from {details.get('since')}"
        f" to {details.get('until')}"
    )
    return [line] + ([f"incomplete   {details['reason']}"] if details.get("reason") else [])


def _contract(op: Mapping[str, Any]) -> list[str]:
    """The contract its payload was enqueued under, which deliveries name (Outbox-Contract)."""
    version = op.get("contract_version")
    return [] if version is None else [f"contract     {op['operation_type']}/v{version}"]


def _describe(op: dict[str, Any]) -> str:
    age = format_duration(timedelta(seconds=op["age_seconds"]))
    reason = f" ({op['status_reason']})" if op["status_reason"] else ""
    lines = [
        f"operation {op['id']}  {op['tenant_id']} / {op['operation_type']} / {op['operation_key']}",
        f"status       {op['status']}{reason} for {age}",
        f"provider     {op['provider']}  {op['action']}",
        f"key          {op['idempotency_key']} (generation {op['key_generation']})",
        # What a receiving inbox records of it too (`outbox inbox show`): the same intent.
        f"fingerprint  {op['fingerprint']}",
        *_contract(op),
        f"attempts     {op['attempts']}"
        + (
            f" ({op['attempt_base']} not counted: before the "
            "last replay, or not acted on by the provider)"
            if op["attempt_base"]
            else ""
        ),
        f"first sent   {op['first_sent_at'] or 'never'}",
        f"last error   {op['last_error_class'] or '-'}: {op['last_error'] or '-'}",
        f"last check   {op['check_finding'] or 'never'}"
        + (f" (object {op['check_state']})" if op.get("check_state") else "")
        + (f" at {op['checked_at']}" if op["checked_at"] else ""),
        *_searched(op.get("check_details")),
        f"reference    {op['provider_ref'] or '-'}",
    ]
    if op.get("payload") is not None:
        lines.append(f"payload      {op['payload']}")  # as stored: PostgreSQL's JSON text
    # Each of these lines is one line, whatever a producer, provider or person wrote into it.
    lines = [printable(line) for line in lines]
    history = [
        (
            a["attempt"],
            a["started_at"],
            a["outcome"],
            "yes" if a["sent"] else "no",
            a["error_class"],
            a["http_status"],
            a["provider_request_id"],
            a["worker"],
        )
        for a in op["attempt_history"]
    ]
    lines += [
        "",
        render_table(
            ["attempt", "started", "outcome", "sent", "error", "http", "request id", "worker"],
            history,
        ),
    ]
    # The actor is what a person claimed (--actor); the database user is who logged in.
    audit = [
        (
            a["at"],
            a["actor"],
            a["db_user"],
            a["action"],
            a["from_status"],
            a["to_status"],
            a["reason"],
        )
        for a in op["audit"]
    ]
    if audit:
        lines += [
            "",
            render_table(["at", "actor", "db user", "action", "from", "to", "reason"], audit),
        ]
    return "\n".join(lines)


reconcile = build_group("reconcile", Status.RECONCILING)
add_reconcile_actions(reconcile)
add_reconcile_check(reconcile)
quarantine = build_group("quarantine", Status.QUARANTINED)
add_quarantine_actions(quarantine)

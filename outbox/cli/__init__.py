"""The ``outbox`` command: thin click commands that parse, call the library, and print.

This module holds the group (``main``, the console script) and the commands of one screen each;
the others live beside it: ``status``, ``operator`` (reconcile, quarantine, cancel), ``bulk`` (the
same action on every operation a set of filters selects), ``pending`` (the failing pending
operations) and ``ordering``. ``common`` holds what they share, the exit codes among it. Only
this package imports click.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import click
import psycopg

from outbox import producer
from outbox.cli import contracts, inbox, operator, ordering, pending, providers, status, web
from outbox.cli.common import (
    TEXT,
    BadInput,
    Conflict,
    Duration,
    JsonErrors,
    _check_dsn,
    config_option,
    connect,
    dsn_option,
    json_option,
)
from outbox.config.loader import load_settings
from outbox.config.settings import LOG_LEVELS, ConfigError
from outbox.core import payloads
from outbox.core.durations import format_duration
from outbox.core.safe_text import printable
from outbox.daemon import service as daemon
from outbox.db import dsn as dsn_util
from outbox.db import migrations
from outbox.db.connect import migration_blocker
from outbox.demo import jetstream as demo_queue
from outbox.demo import tour as demo_module
from outbox.dispatch.dispatcher import UNKNOWN_PROVIDER_GRACE
from outbox.errors import InvalidOperation, OperationConflict
from outbox.observability import logs
from outbox.oncall import prune
from outbox.providers.registry import build_providers
from outbox.runtime import event_loop

# Loopback: metrics say how many operations of which tenants flow where; expose them on purpose.
DEFAULT_METRICS_ADDR = "127.0.0.1:9464"


@click.group(cls=JsonErrors, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="outbox")
def main() -> None:
    """outbox: transactional-outbox dispatcher for PostgreSQL."""
    # Log lines go to stderr, so stdout stays the command's output; `run` sets its own level.
    level = os.environ.get("OUTBOX_LOG_LEVEL", "warning").strip().lower()
    if level not in LOG_LEVELS:  # a usage error, exit 2, never a KeyError's traceback
        raise BadInput(
            f"OUTBOX_LOG_LEVEL must be one of {', '.join(LOG_LEVELS)}, not {printable(level)!r}"
        )
    logs.configure(level)


@main.command()
@dsn_option
@click.option("--target", type=click.IntRange(min=1), help="Stop after this migration version.")
@click.option(
    "--lock-timeout",
    type=Duration(),
    default="5s",
    show_default=True,
    help="How long one statement may wait for a table lock before the migration gives up.",
)
@click.option(
    "--lock-wait",
    type=Duration(),
    default="2m",
    show_default=True,
    help="How long to wait for another `outbox migrate` to finish.",
)
@click.option(
    "--with-roles",
    is_flag=True,
    help="Then create the roles outbox_producer, outbox_dispatcher and outbox_operator and grant "
    "each exactly its privileges (sql/roles.sql; needs CREATEROLE).",
)
@click.option(
    "--tenant-rls",
    is_flag=True,
    help="With --with-roles: isolate tenants with row-level security "
    "(sql/roles_tenant_rls.sql); producers must bind their tenant.",
)
def migrate(
    dsn: str,
    target: int | None,
    lock_timeout: timedelta,
    lock_wait: timedelta,
    with_roles: bool,
    tenant_rls: bool,
) -> None:
    """Apply pending schema migrations, in order, under an advisory lock."""

    def applied(m: migrations.Migration) -> None:
        click.echo(f"applied {m.label}")

    # Its advisory lock serialises nothing through a transaction pooler: refuse, do not race.
    blocker = migration_blocker(dsn)
    if blocker is not None:
        raise click.ClickException(blocker)
    with connect(dsn, autocommit=True) as conn:
        # A migration's WARNINGs say what it changed that a person must know of (0035: the
        # allow-list rules it rewrote); the server's log is not where anyone would look.
        conn.add_notice_handler(_show_warning)
        try:
            report = migrations.migrate(
                conn,
                target=target,
                lock_timeout=lock_timeout,
                lock_wait=lock_wait,
                on_apply=applied,
                with_roles=with_roles,
                tenant_rls=tenant_rls,
            )
        except migrations.MigrationError as exc:
            raise click.ClickException(dsn_util.scrub(str(exc), dsn)) from None
    for script in report.scripts:
        click.echo(f"applied {script}")
    if report.unknown_versions:
        versions = ", ".join(f"{v:04d}" for v in report.unknown_versions)
        click.echo(
            f"warning: the database has migrations this outbox does not know: {versions}", err=True
        )
    if report.applied:
        click.echo(f"{len(report.applied)} applied, {report.already_applied} already applied")
    else:
        click.echo(f"up to date: {report.already_applied} migrations applied, nothing to do")


def _show_warning(diagnostic: psycopg.errors.Diagnostic) -> None:
    if diagnostic.severity_nonlocalized == "WARNING" and diagnostic.message_primary:
        click.echo(f"warning: {printable(diagnostic.message_primary)}", err=True)


@main.command()
@dsn_option
@click.option("--tenant-id", type=TEXT, required=True)
@click.option("--operation-type", type=TEXT, required=True)
@click.option(
    "--operation-key", type=TEXT, required=True, help="The application's key for this intent."
)
@click.option("--provider", type=TEXT, required=True, help="A configured provider name.")
@click.option("--action", type=TEXT, required=True, help="What to ask of the provider.")
@click.option("--payload", "payload_text", type=TEXT, help="The payload, a JSON object.")
@click.option(
    "--payload-file", type=click.File("r"), help="Read the payload from a file ('-': stdin)."
)
@click.option("--correlation-id", type=TEXT)
@click.option(
    "--idempotency-key", type=TEXT, help="Use this key instead of deriving one from the identity."
)
@click.option("--max-attempts", type=click.IntRange(min=1))
@click.option(
    "--ordering-key",
    type=TEXT,
    help="Send after the tenant's earlier operations with this key, in order.",
)
@click.option(
    "--contract-version",
    type=click.IntRange(min=1),
    help="The version of the operation type's contract the payload is written to.",
)
@config_option("outbox run's settings: warn when the provider is not among them.")
@json_option
def enqueue(
    dsn: str,
    payload_text: str | None,
    payload_file: IO[str] | None,
    as_json: bool,
    config_path: Path | None,
    **fields: Any,
) -> None:
    """Record one operation, in a transaction of its own."""
    payload = _read_payload(payload_text, payload_file)
    _warn_if_unconfigured(fields["provider"], config_path)
    with connect(dsn) as conn:
        try:
            # One operation for the tenant named on the command line: with tenant isolation on,
            # the transaction must be bound to it (harmless without).
            producer.bind_tenant(conn, fields["tenant_id"])
            result = producer.enqueue(conn, payload=payload, **fields)
        except InvalidOperation as exc:
            raise BadInput(str(exc)) from None
        except OperationConflict as exc:
            raise Conflict(str(exc)) from None
    if as_json:
        click.echo(
            json.dumps({"operation_id": result.operation_id, "outcome": result.outcome.value})
        )
    else:
        click.echo(f"{result.outcome.value}: operation {result.operation_id}")


def _warn_if_unconfigured(provider: str, config_path: Path | None) -> None:
    """An operation for a provider nobody runs waits silently, then is quarantined: say so."""
    if config_path is None:
        return
    try:
        configured = load_settings(config_path).providers
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    if provider not in configured:
        grace = format_duration(UNKNOWN_PROVIDER_GRACE)
        warning = (
            f"outbox: warning: no provider named {printable(provider)!r} in "
            f"{config_path}; the operation waits for a dispatcher that has it, and is "
            f"quarantined as unknown_provider {grace} after its enqueue"
        )
        click.echo(warning, err=True)


def _read_payload(text: str | None, file: IO[str] | None) -> Any:
    if text is not None and file is None:
        source = text
    elif file is not None and text is None:
        try:
            source = file.read()
        except UnicodeDecodeError as exc:
            raise BadInput(f"the payload file is not UTF-8 text (byte {exc.start})") from None
    else:
        raise click.UsageError("give the payload with exactly one of --payload or --payload-file")
    try:
        # The stored payloads' own limits (nesting, digits): the decoder that enforces them, so
        # that a 3,000-level or 5,000-digit payload is bad input, not a traceback.
        return payloads.decode(source)
    except payloads.InvalidPayload as exc:
        # The message gives the position only: the payload itself is never echoed.
        raise BadInput(str(exc)) from None


@main.command("prune")
@dsn_option
@click.option(
    "--older-than",
    type=Duration(),
    required=True,
    help="Prune operations finished (succeeded or cancelled) longer ago than this.",
)
@click.option(
    "--batch",
    type=click.IntRange(1, 100_000),
    default=prune.DEFAULT_BATCH,
    show_default=True,
    help="Rows per transaction.",
)
@click.option("--dry-run", is_flag=True, help="Count what would go; delete nothing.")
def prune_command(dsn: str, older_than: timedelta, batch: int, dry_run: bool) -> None:
    """Delete finished operations and their attempts in short batches; the audit stays. Then
    the lock rows of ordering keys that no unfinished operation uses any more."""
    with connect(dsn, autocommit=True) as conn:
        count = prune.prune_finished(conn, older_than, batch=batch, dry_run=dry_run)
        keys = 0 if dry_run else prune.prune_idle_keys(conn, batch=batch)
    verb = "would prune" if dry_run else "pruned"
    click.echo(f"{verb} {count} operation(s) finished more than {format_duration(older_than)} ago")
    if keys:
        click.echo(f"pruned {keys} idle ordering key(s)")


@main.command()
@dsn_option
@config_option("TOML settings file; without one, defaults and OUTBOX_* variables only.")
@click.option(
    "--metrics-addr",
    type=TEXT,
    default=DEFAULT_METRICS_ADDR,
    show_default=True,
    envvar="OUTBOX_METRICS_ADDR",
    show_envvar=True,
    help="HOST:PORT for /metrics, /healthz and /readyz; 'off' for none.",
)
def run(dsn: str, config_path: Path | None, metrics_addr: str) -> None:
    """Dispatch operations to their providers until SIGTERM or SIGINT."""
    try:
        addr = daemon.parse_addr(metrics_addr)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--metrics-addr") from None
    try:
        settings = load_settings(config_path)
        logs.configure(settings.log_level)
        providers = build_providers(settings.providers, concurrency=settings.dispatcher.concurrency)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None
    serving = daemon.serve(dsn, settings, providers, metrics_addr=addr)
    sys.exit(event_loop.run(serving, settings.dispatcher.event_loop))


@main.command()
@click.option(
    "--dsn",
    type=TEXT,
    callback=_check_dsn,
    help="Use this database instead of an embedded one (the demo adds rows to it).",
)
@click.option("--keep", is_flag=True, help="Leave the embedded database running afterwards.")
@click.option(
    "--queue",
    type=TEXT,
    metavar="nats://HOST:PORT",
    help="Also dispatch to a real NATS JetStream there (a stream of its own, deleted after).",
)
@click.option(
    "--stop",
    "stop_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Stop the database --keep left in this directory; delete it.",
)
def demo(dsn: str | None, keep: bool, queue: str | None, stop_dir: Path | None) -> None:
    """Watch outbox work: an embedded PostgreSQL, fake Stripe and webhook, a real dispatcher."""
    if stop_dir is not None:
        try:
            demo_module.stop(stop_dir)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"stopped the demo's database and deleted {stop_dir}")
        return
    try:
        if queue is not None and not queue.startswith(("nats://", "tls://")):
            raise click.BadParameter("must be a nats:// URL", param_hint="--queue")
        # Before anything starts: the client installed, a server with JetStream answering.
        problem = None if queue is None else asyncio.run(demo_queue.check(queue))
        if problem is not None:
            raise BadInput(problem)
        code = asyncio.run(demo_module.run(dsn, keep=keep, say=click.echo, queue=queue))
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


main.add_command(status.status)
main.add_command(operator.cancel)
main.add_command(operator.reconcile)
main.add_command(operator.quarantine)
main.add_command(pending.pending)
main.add_command(ordering.ordering)
main.add_command(providers.providers)
main.add_command(inbox.inbox)
main.add_command(contracts.contracts)
main.add_command(web.web)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""`outbox ordering`: how ordering keys treat an operation set aside, per operation type.

In mode block (the default) a quarantined or reconciling operation holds up the later operations
of its ordering key until it is replayed, retried, resolved or cancelled; in mode skip they go on
without it. `outbox status` shows how many operations wait, and behind what.
"""

from __future__ import annotations

import json

import click
import psycopg

from outbox.cli.common import TEXT, BadInput, actor_option, connect, dsn_option, json_option
from outbox.db import statements
from outbox.errors import SQLSTATE_INVALID_OPERATION
from outbox.oncall.text_tables import render_table


@click.group()
def ordering() -> None:
    """Ordering keys: block or skip past an operation set aside, per operation type."""


@ordering.command("modes")
@dsn_option
@json_option
def modes(dsn: str, as_json: bool) -> None:
    """The operation types set to a mode; every other type blocks."""
    with connect(dsn) as conn:
        rows = conn.execute(statements.LIST_ORDERING_MODES).fetchall()
    if as_json:
        click.echo(
            json.dumps(
                [
                    {
                        "operation_type": t,
                        "on_failure": m,
                        "updated_at": at.isoformat(),
                        "updated_by": by,
                    }
                    for t, m, at, by in rows
                ]
            )
        )
        return
    click.echo(render_table(["operation type", "on failure", "updated", "by"], rows))
    click.echo("\nevery other operation type: block")


@ordering.command("set-mode")
@dsn_option
@click.argument("operation_type", type=TEXT)
@click.argument("mode", type=click.Choice(["block", "skip"]))
@actor_option
@click.option("--reason", type=TEXT, default=None, help="Why; recorded in the audit.")
def set_mode(dsn: str, operation_type: str, mode: str, actor: str, reason: str | None) -> None:
    """Block or skip past OPERATION_TYPE's quarantined and reconciling operations. Switching
    to skip releases the keys they hold up at once. Recorded in the audit."""
    params = {"operation_type": operation_type, "mode": mode, "actor": actor, "reason": reason}
    with connect(dsn) as conn:
        try:
            row = conn.execute(statements.SET_ORDERING_MODE, params).fetchone()
        except psycopg.Error as exc:
            if exc.sqlstate != SQLSTATE_INVALID_OPERATION:  # a blank or overlong type, or actor
                raise
            raise BadInput(str(exc.diag.message_primary or exc)) from None
    released = row[0] if row else 0
    click.echo(f"{operation_type}: {mode}; {released} ordering key(s) released")

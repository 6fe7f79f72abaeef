"""`outbox providers`: each provider's circuit breaker in every dispatcher, and the two levers on
it (issue 37; docs/operations.md, "Provider isolation").

`list` shows what each `outbox run` last wrote (sql/0031): the breaker's state and reason, the
share of failures among the calls it weighs, the operations found failing alone, and when the
next probe goes. Any dispatcher login may write that table: values no dispatcher writes are shown
as unknown (null in JSON), and a row dated ahead of the database's clock as suspect. `reset`
closes a provider's breakers and `probe` sends a probe now, in every dispatcher within a few
seconds; both are recorded in the audit.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timedelta
from typing import Any, Final

import click
import psycopg

from outbox.cli.common import TEXT, BadInput, actor_option, connect, dsn_option, json_option
from outbox.core.durations import format_duration
from outbox.db import statements
from outbox.errors import SQLSTATE_INVALID_OPERATION, SQLSTATE_OPERATOR_REFUSED
from outbox.oncall.text_tables import render_table

# A dispatcher writes its breakers every 2 s: one not heard from for this long is gone (or
# cannot reach the database); `list` leaves it out unless asked.
STALE_AFTER: Final = timedelta(minutes=1)


@click.group()
def providers() -> None:
    """Each provider's circuit breaker, per dispatcher; reset it or probe it now."""


@providers.command("list")
@dsn_option
@click.option("--provider", type=TEXT, default=None, help="Only this provider.")
@click.option("--all", "show_all", is_flag=True, help="Also dispatchers not heard from lately.")
@json_option
def list_(dsn: str, provider: str | None, show_all: bool, as_json: bool) -> None:
    """Every dispatcher's breaker of each provider, as it wrote it in the last minute."""
    params = {"provider": provider, "stale": STALE_AFTER}
    with connect(dsn) as conn:
        cur = conn.cursor(row_factory=psycopg.rows.dict_row)
        rows = cur.execute(statements.PROVIDER_HEALTH, params).fetchall()
    rows = [r for r in rows if show_all or not r["stale"]]
    if as_json:
        click.echo(json.dumps([_jsonable(r) for r in rows], allow_nan=False))
        return
    if not rows:
        click.echo("no dispatcher has written its breakers in the last minute")
        return
    header = ["provider", "worker", "state", "reason", "failures", "alone", "next probe", "seen"]
    click.echo(render_table(header, [_line(r) for r in rows]))


def _line(r: dict[str, Any]) -> tuple[object, ...]:
    rate = "-"
    if r["calls"]:
        share = "unknown" if r["failure_rate"] is None else f"{r['failure_rate']:.0%}"
        rate = f"{share} of {r['calls']}"
    probe = "-"
    if r["state"] == "half_open":
        probe = "now"
    elif r["probe_in"] is not None:  # counted from now: a row is rewritten every 30 s only
        probe = "in " + format_duration(r["probe_in"])
    elif r["state"] == "open":  # an open breaker has a next probe: this row's is no time
        probe = "unknown"
    seen = "suspect" if r["suspect"] else "stale" if r["stale"] else "live"
    return (
        r["provider"],
        r["worker"],
        r["state"],
        r["reason"] or "-",
        rate,
        r["failing_alone"],
        probe,
        seen,
    )


def _jsonable(r: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in r.items():
        if isinstance(value, datetime):
            out[key] = value.isoformat()
        elif isinstance(value, timedelta):
            out[key] = value.total_seconds()
        elif isinstance(value, float) and not math.isfinite(value):
            out[key] = None  # PROVIDER_HEALTH leaves none; JSON has no NaN
        else:
            out[key] = value
    return out


def _request(dsn: str, provider: str, action: str, actor: str, reason: str) -> None:
    params = {"provider": provider, "action": action, "actor": actor, "reason": reason}
    with connect(dsn) as conn:
        try:
            conn.execute(statements.REQUEST_PROVIDER_ACTION, params)
        except psycopg.Error as exc:
            if exc.sqlstate not in (SQLSTATE_INVALID_OPERATION, SQLSTATE_OPERATOR_REFUSED):
                raise
            raise BadInput(str(exc.diag.message_primary or exc)) from None


_reason = click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")


@providers.command("reset")
@dsn_option
@click.argument("provider", type=TEXT)
@actor_option
@_reason
def reset(dsn: str, provider: str, actor: str, reason: str) -> None:
    """Close PROVIDER's breaker in every dispatcher (within a few seconds). For a provider you
    know is back: its operations go at once instead of after the next probe. Audited."""
    _request(dsn, provider, "reset", actor, reason)
    click.echo(f"{provider}: reset asked of every dispatcher; `outbox providers list` shows it")


@providers.command("probe")
@dsn_option
@click.argument("provider", type=TEXT)
@actor_option
@_reason
def probe(dsn: str, provider: str, actor: str, reason: str) -> None:
    """Send PROVIDER's probe now in every dispatcher whose breaker is open, instead of at the
    end of the open period: one operation each, whose success closes the breaker. Audited."""
    _request(dsn, provider, "probe", actor, reason)
    click.echo(f"{provider}: probe asked of every dispatcher; `outbox providers list` shows it")

"""Bulk actions (issue 21, "act in bulk, safely"): `quarantine replay|cancel|reconcile` and
`reconcile check|cancel` with filters act on exactly the operations the filters select, after a
dry run or a confirmation, with one audit row per operation; `list` pages without losing or
repeating a row while the rows before the page leave the status."""

from __future__ import annotations

import functools
import json
import os
import pty
import random
import subprocess
import sys
from collections.abc import Callable
from datetime import UTC, timedelta
from typing import Any

import psycopg
import pytest

from outbox.cli import bulk
from outbox.core.model import Status
from outbox.oncall import operators
from tests.support.cli import outbox_cli
from tests.support.dispatch import rows

PROVIDERS = ("hook", "hook2")
TENANTS = ("acme", "globex", "initech")
REASONS = ("permanent_failure", "attempts_exhausted")
ERRORS = ("http_422", "unknown_provider")


def quarantine_population(
    db_url: str, rng: random.Random, count: int, status: str = "quarantined", prefix: str = "k-"
) -> list[dict[str, Any]]:
    """``count`` operations in ``status`` with random provider, tenant, reason, error and the
    time they entered it (0 to 48 hours ago), keyed ``prefix`` and a number; returns each one's
    attributes."""
    population = []
    with psycopg.connect(db_url) as conn:
        for i in range(count):
            one: dict[str, Any] = {
                "provider": rng.choice(PROVIDERS),
                "tenant": rng.choice(TENANTS),
                "reason": rng.choice(REASONS),
                "error": rng.choice(ERRORS),
                "hours_ago": rng.uniform(0, 48),
            }
            row = conn.execute(
                "SELECT operation_id FROM outbox.enqueue(%s, 'invoice.charge', %s, %s, "
                "'invoice.paid', '{}'::jsonb)",
                (one["tenant"], f"{prefix}{i}", one["provider"]),
            ).fetchone()
            assert row is not None
            op = row[0]
            conn.execute(
                "UPDATE outbox.operations SET status = %s, status_reason = %s, "
                "last_error_class = 'permanent', attempts = 1, "
                "status_changed_at = now() - make_interval(secs => %s) WHERE id = %s",
                (status, one["reason"], one["hours_ago"] * 3600, op),
            )
            conn.execute(  # the attempt `--error` reads: its error class
                "INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, "
                "started_at, outcome, sent, error_class) "
                "SELECT id, 1, idempotency_key, 'w', now(), 'permanent', false, %s "
                "FROM outbox.operations WHERE id = %s",
                (one["error"], op),
            )
            population.append({**one, "id": op})
    return population


def random_filters(rng: random.Random) -> tuple[list[str], Callable[[dict[str, Any]], bool]]:
    """A random filter set as command-line options, with the predicate it should select by."""
    args: list[str] = []
    tests: list[Callable[[dict[str, Any]], bool]] = []
    choices = (
        ("--provider", "provider", PROVIDERS),
        ("--tenant", "tenant", TENANTS),
        ("--status-reason", "reason", REASONS),
        ("--error", "error", ERRORS),
    )
    for option, key, values in choices:
        if rng.random() < 0.5:
            value = rng.choice(values)
            args += [option, value]
            tests.append(functools.partial(_equals, key, value))
    if rng.random() < 0.5:
        hours = rng.choice((6, 12, 24, 36))
        args += ["--since", f"{hours}h"]
        tests.append(functools.partial(_younger, hours))
    if not args:
        args = ["--all"]
    return args, lambda op: all(t(op) for t in tests)


def _equals(key: str, value: str, op: dict[str, Any]) -> bool:
    return bool(op[key] == value)


def _younger(hours: int, op: dict[str, Any]) -> bool:
    return bool(op["hours_ago"] < hours)


def status_of(db_url: str) -> dict[int, str]:
    return {int(i): str(s) for i, s in rows(db_url, "SELECT id, status FROM outbox.operations")}


def audit_of(db_url: str) -> list[tuple[Any, ...]]:
    return rows(
        db_url,
        "SELECT operation_id, action, reason, from_status, to_status "
        "FROM outbox.audit ORDER BY operation_id",
    )


def away_from_cut(population: list[dict[str, Any]], args: list[str]) -> list[dict[str, Any]]:
    """Drop operations within a minute of a --since cut, which the test's clock cannot place."""
    if "--since" not in args:
        return population
    hours = int(args[args.index("--since") + 1].rstrip("h"))
    return [op for op in population if abs(op["hours_ago"] - hours) > 1 / 60]


# Seeds whose filter sets together use every filter, and --all alone.
@pytest.mark.parametrize("seed", [2, 9, 11, 14])
def test_replay_acts_on_exactly_the_selection_after_a_dry_run_and_with_yes(
    db_url: str, cli_env: dict[str, str], seed: int
) -> None:
    rng = random.Random(seed)
    population = quarantine_population(db_url, rng, 60)
    args, selects = random_filters(rng)
    population = away_from_cut(population, args)
    with psycopg.connect(db_url) as conn:  # the ones near the cut play no part
        conn.execute(
            "DELETE FROM outbox.operations WHERE NOT (id = ANY(%s))",
            ([op["id"] for op in population],),
        )
    expected = sorted(op["id"] for op in population if selects(op))
    before = status_of(db_url)

    dry = outbox_cli(cli_env, "quarantine", "replay", *args, "--reason", "fixed", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    if expected:
        assert f"{len(expected)} quarantined operations match" in dry.stdout
        assert "dry run: nothing changed" in dry.stdout
    else:
        assert "no quarantined operations match" in dry.stdout
    assert status_of(db_url) == before and audit_of(db_url) == []

    unasked = outbox_cli(cli_env, "quarantine", "replay", *args, "--reason", "fixed")
    if expected:  # no terminal to ask on, no --yes: refused, nothing done
        assert unasked.returncode == 2 and "add --yes" in unasked.stderr
    assert status_of(db_url) == before and audit_of(db_url) == []

    done = outbox_cli(cli_env, "quarantine", "replay", *args, "--reason", "fixed", "--yes")
    assert done.returncode == 0, done.stderr
    after = status_of(db_url)
    assert sorted(i for i, s in after.items() if s == "pending") == expected
    assert all(after[i] == "quarantined" for i in before if i not in expected)
    assert audit_of(db_url) == [(i, "replay", "fixed", "quarantined", "pending") for i in expected]
    if expected:
        assert f"replay: {len(expected)} of {len(expected)} ({len(expected)} now pending)" in (
            done.stdout
        )


def test_cancel_and_reconcile_in_bulk_on_both_groups(db_url: str, cli_env: dict[str, str]) -> None:
    rng = random.Random(7)
    quarantined = quarantine_population(db_url, rng, 20)
    to_reconcile = [op["id"] for op in quarantined if op["provider"] == "hook"]
    sent = outbox_cli(
        cli_env, "quarantine", "reconcile", "--provider", "hook", "--reason", "ask", "--yes"
    )
    assert sent.returncode == 0, sent.stderr
    states = status_of(db_url)
    assert sorted(i for i, s in states.items() if s == "reconciling") == sorted(to_reconcile)

    tenant = {op["id"]: op["tenant"] for op in quarantined}
    by_tenant = [i for i in to_reconcile if tenant[i] == "acme"]
    cancelled = outbox_cli(
        cli_env, "reconcile", "cancel", "--tenant", "acme", "--reason", "gone", "--yes"
    )
    assert cancelled.returncode == 0, cancelled.stderr
    states = status_of(db_url)
    assert sorted(i for i, s in states.items() if s == "cancelled") == sorted(by_tenant)
    everything = outbox_cli(cli_env, "quarantine", "cancel", "--all", "--reason", "x", "--yes")
    assert everything.returncode == 0, everything.stderr
    assert set(status_of(db_url).values()) <= {"cancelled", "reconciling"}
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [
        (len(quarantined) + len(by_tenant),)
    ]


def test_no_selection_and_both_selections_are_usage_errors(cli_env: dict[str, str]) -> None:
    neither = outbox_cli(cli_env, "quarantine", "replay", "--reason", "x", "--yes")
    assert neither.returncode == 2 and "give an operation ID, or select several" in neither.stderr
    both = outbox_cli(cli_env, "quarantine", "cancel", "7", "--all", "--reason", "x")
    assert both.returncode == 2 and "not both" in both.stderr
    for since in ("yesterday", "2026-12-01T10:00"):  # not a duration; a time with no zone
        bad = outbox_cli(cli_env, "quarantine", "replay", "--since", since, "--reason", "x")
        assert bad.returncode == 2, bad.stderr
    cursor = outbox_cli(cli_env, "quarantine", "list", "--after", "nonsense")
    assert cursor.returncode == 2 and "--after" in cursor.stderr


def test_since_takes_a_time_with_its_zone(db_url: str, cli_env: dict[str, str]) -> None:
    population = quarantine_population(db_url, random.Random(3), 20)
    (now,) = rows(db_url, "SELECT now()")[0]
    cut = (now - timedelta(hours=24)).astimezone(UTC).isoformat().replace("+00:00", "Z")
    recent = sorted(op["id"] for op in population if op["hours_ago"] < 24)
    listed = outbox_cli(cli_env, "quarantine", "list", "--since", cut, "--json")
    assert listed.returncode == 0, listed.stderr
    assert sorted(r["id"] for r in json.loads(listed.stdout)) == recent


def test_a_selection_prompts_on_a_terminal_and_no_changes_nothing(
    db_url: str, cli_env: dict[str, str]
) -> None:
    quarantine_population(db_url, random.Random(5), 5)
    for answer, code, pending in (("n", 1, 0), ("y", 0, 5)):
        out = on_a_terminal(cli_env, answer, "quarantine", "replay", "--all", "--reason", "x")
        assert out[0] == code, out[1]
        assert "Replay these 5 quarantined operations?" in out[1]
        assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE status = 'pending'") == [
            (pending,)
        ]


def on_a_terminal(env: dict[str, str], answer: str, *args: str) -> tuple[int, str]:
    """Run `outbox` with a pseudo-terminal as its stdin and output; answer its prompt."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "outbox", *args],
        env=env,
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    seen = b""
    answered = False
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the program closed the terminal: it ended
            break
        if not chunk:
            break
        seen += chunk
        if not answered and b"[y/N]" in seen:
            os.write(leader, answer.encode() + b"\n")
            answered = True
    os.close(leader)
    return process.wait(timeout=60), seen.decode(errors="replace")


def test_an_operation_that_changed_meanwhile_is_skipped_and_the_run_says_so(
    db_url: str,
) -> None:
    population = quarantine_population(db_url, random.Random(11), 6)
    ids = [op["id"] for op in sorted(population, key=lambda op: -op["hours_ago"])]
    stolen = ids[3]

    def replay(conn: psycopg.Connection[Any], operation_id: int) -> Status:
        if operation_id == ids[0]:  # someone else replays one of the selection meanwhile
            with psycopg.connect(db_url, autocommit=True) as other:
                operators.replay(other, stolen, reason="by hand", actor="bob")
        return operators.replay(conn, operation_id, reason="bulk", actor="alice")

    with pytest.raises(SystemExit) as exited:
        bulk.run(
            db_url,
            Status.QUARANTINED,
            operators.Filters(provider=None, since=None),
            verb="replay",
            action=replay,
            dry_run=False,
            yes=True,
        )
    assert exited.value.code == 3
    assert rows(db_url, "SELECT actor, count(*) FROM outbox.audit GROUP BY actor ORDER BY 1") == [
        ("alice", 5),
        ("bob", 1),
    ]
    assert set(status_of(db_url).values()) == {"pending"}


def test_a_run_cut_short_by_the_database_says_how_far_it_got_and_a_rerun_finishes(
    db_url: str, cli_env: dict[str, str]
) -> None:
    quarantine_population(db_url, random.Random(13), 10)
    calls = 0

    def replay_then_lose_the_connection(conn: psycopg.Connection[Any], operation_id: int) -> Status:
        nonlocal calls
        calls += 1
        if calls == 4:
            with psycopg.connect(db_url, autocommit=True) as other:
                other.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        return operators.replay(conn, operation_id, reason="bulk", actor="alice")

    import click  # noqa: PLC0415

    with pytest.raises(click.ClickException) as stopped:
        bulk.run(
            db_url,
            Status.QUARANTINED,
            operators.Filters(),
            verb="replay",
            action=replay_then_lose_the_connection,
            dry_run=False,
            yes=True,
        )
    assert "stopped after 3 of 10" in stopped.value.message
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [(3,)]
    again = outbox_cli(cli_env, "quarantine", "replay", "--all", "--reason", "bulk", "--yes")
    assert again.returncode == 0 and "replay: 7 of 7" in again.stdout, again.stderr
    assert rows(db_url, "SELECT count(*), count(DISTINCT operation_id) FROM outbox.audit") == [
        (10, 10)
    ]


def test_list_pages_every_row_once_while_earlier_rows_leave(
    db_url: str, cli_env: dict[str, str]
) -> None:
    population = quarantine_population(db_url, random.Random(17), 45)
    in_order = [op["id"] for op in sorted(population, key=lambda op: -op["hours_ago"])]
    seen: list[int] = []
    after: list[str] = []
    while True:
        page = outbox_cli(cli_env, "quarantine", "list", "--limit", "10", "--json", *after)
        assert page.returncode == 0, page.stderr
        ids = [r["id"] for r in json.loads(page.stdout)]
        seen += ids
        if ids:  # the rows already listed are replayed before the next page is read
            outbox_cli(cli_env, "quarantine", "replay", str(ids[0]), "--reason", "x")
        if "the next page is" not in page.stderr:
            break
        after = ["--after", page.stderr.split("`--after ")[1].split("`")[0]]
    assert seen == in_order


def test_check_takes_filters_and_says_when_none_match(
    db_url: str, check_env: dict[str, str]
) -> None:
    nothing = outbox_cli(check_env, "reconcile", "check", "--provider", "nobody")
    assert nothing.returncode == 0 and "no reconciling operations match" in nothing.stdout
    population = quarantine_population(db_url, random.Random(19), 12, status="reconciling")
    globex = sorted(op["id"] for op in population if op["tenant"] == "globex")
    checked = outbox_cli(check_env, "reconcile", "check", "--tenant", "globex", "--json")
    assert checked.returncode == 0, checked.stderr
    found = json.loads(checked.stdout)
    # hook and hook2 are not in check_env's config: each is named, none is skipped silently
    assert sorted(r["operation_id"] for r in found) == globex
    assert {(r["finding"], r["error"]) for r in found} == {("no_lookup", "not_configured")}

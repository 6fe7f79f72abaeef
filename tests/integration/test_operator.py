"""The on-call engineer's commands, through the real CLI: list, show, replay, resolve, retry,
cancel. Each action changes the status, writes the audit, and the dispatcher does the rest."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, key_of, make_due, rows


async def quarantined_operation(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> int:
    (op,) = enqueue_many(db_url, 1)
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, op))
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("quarantined",)]
    return op


def set_reconciling(db_url: str, op: int, *, first_sent_ago: timedelta) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', "
            "status_reason = 'key_window_passed', attempts = 1, "
            "last_attempt_at = now() - %s, first_sent_at = now() - %s, "
            "last_error_class = 'unknown' WHERE id = %s",
            (first_sent_ago, first_sent_ago, op),
        )


def audit(db_url: str) -> list[tuple[Any, ...]]:
    return rows(
        db_url, "SELECT actor, action, reason, from_status, to_status FROM outbox.audit ORDER BY id"
    )


async def test_quarantine_list_show_and_replay_then_the_dispatcher_delivers(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    op = await quarantined_operation(db_url, pool, receiver, hook)

    listed = outbox_cli(cli_env, "quarantine", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    (entry,) = json.loads(listed.stdout)
    assert (entry["id"], entry["status_reason"], entry["last_error"]) == (
        op,
        "permanent_failure",
        "HTTP 422 Unprocessable Entity",
    )
    table = outbox_cli(cli_env, "quarantine", "list")
    assert "permanent_failure" in table.stdout and str(op) in table.stdout

    shown = outbox_cli(cli_env, "quarantine", "show", str(op))
    assert shown.returncode == 0, shown.stderr
    assert "http_422" in shown.stdout and key_of(db_url, op) in shown.stdout
    assert '"n"' not in shown.stdout  # the payload only on request
    assert '"n": 0' in outbox_cli(cli_env, "quarantine", "show", str(op), "--payload").stdout

    replayed = outbox_cli(
        cli_env, "quarantine", "replay", str(op), "--reason", "receiver fixed", "--actor", "alice"
    )
    assert replayed.returncode == 0, replayed.stderr
    assert replayed.stdout.strip() == f"operation {op}: pending"
    assert audit(db_url) == [("alice", "replay", "receiver fixed", "quarantined", "pending")]

    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    assert rows(db_url, "SELECT status, attempts, attempt_base FROM outbox.operations") == [
        ("succeeded", 2, 1)
    ]
    assert receiver.effect_count() == 1


async def test_a_replay_past_the_key_window_lands_in_reconciling_not_at_the_provider(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    (op,) = enqueue_many(db_url, 1)
    # A refusal the provider answered counts as sent: its key window starts. (An unknown
    # outcome that used up the budget goes to reconciliation, not here: test_one_cause.py.)
    receiver.inject(WebhookFault.status(422))
    d = dispatcher(pool, {"hook": hook}, max_attempts=1)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, first_sent_at IS NOT NULL FROM outbox.operations") == [
        ("quarantined", True)
    ]
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET first_sent_at = now() - interval '23h 30m'")
    assert (
        outbox_cli(cli_env, "quarantine", "replay", str(op), "--reason", "try again").returncode
        == 0
    )
    requests_before = len(receiver.received)
    assert await d.run_once() == 1
    assert rows(db_url, "SELECT status, status_reason FROM outbox.operations") == [
        ("reconciling", "key_window_passed")
    ]
    assert len(receiver.received) == requests_before


def test_resolve_marks_succeeded_with_the_reference_and_audits_it(
    db_url: str, cli_env: dict[str, str]
) -> None:
    (op,) = enqueue_many(db_url, 1)
    set_reconciling(db_url, op, first_sent_ago=timedelta(hours=30))
    listed = json.loads(outbox_cli(cli_env, "reconcile", "list", "--json").stdout)
    assert [e["id"] for e in listed] == [op]
    why = "found in the receiver's dashboard"
    done = outbox_cli(
        cli_env,
        "reconcile",
        "resolve",
        str(op),
        "--provider-ref",
        "wh_77",
        "--reason",
        why,
        "--actor",
        "bob",
    )
    assert done.returncode == 0, done.stderr
    assert rows(
        db_url, "SELECT status, provider_ref, finished_at IS NOT NULL FROM outbox.operations"
    ) == [("succeeded", "wh_77", True)]
    assert audit(db_url) == [
        ("bob", "resolve", "found in the receiver's dashboard", "reconciling", "succeeded")
    ]
    assert rows(
        db_url, "SELECT details->>'provider_ref', details->>'db_user' FROM outbox.audit"
    ) == [("wh_77", "postgres")]


async def test_retry_needs_a_check_that_found_nothing_or_force_and_sends_a_new_key(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    (op,) = enqueue_many(db_url, 1)
    first_key = key_of(db_url, op)
    set_reconciling(db_url, op, first_sent_ago=timedelta(hours=30))

    refused = outbox_cli(cli_env, "reconcile", "retry", str(op), "--reason", "not there")
    assert refused.returncode == 2
    assert "reconcile check" in refused.stderr and "--force" in refused.stderr
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("reconciling",)]

    with psycopg.connect(db_url) as conn:  # what `reconcile check` records when nothing is found
        conn.execute("SELECT outbox.record_check(%s, NULL, 'reconciler')", (op,))
    done = outbox_cli(cli_env, "reconcile", "retry", str(op), "--reason", "not at the receiver")
    assert done.returncode == 0, done.stderr
    ((key, generation, first_sent),) = rows(
        db_url, "SELECT idempotency_key, key_generation, first_sent_at FROM outbox.operations"
    )
    assert (key, generation, first_sent) == (f"{first_key}:r2", 2, None)

    make_due(db_url)
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    assert [e.key for e in receiver.effects] == [f"{first_key}:r2"]
    assert rows(
        db_url, "SELECT action, to_status, details->>'new_key' FROM outbox.audit ORDER BY id"
    ) == [("check", "reconciling", None), ("retry", "pending", f"{first_key}:r2")]


def test_forced_retry_and_cancel(db_url: str, cli_env: dict[str, str]) -> None:
    first, second = enqueue_many(db_url, 2)
    for op in (first, second):
        set_reconciling(db_url, op, first_sent_ago=timedelta(hours=30))
    forced = outbox_cli(cli_env, "reconcile", "retry", str(first), "--reason", "r", "--force")
    assert forced.returncode == 0, forced.stderr
    cancelled = outbox_cli(cli_env, "reconcile", "cancel", str(second), "--reason", "refunded")
    assert cancelled.returncode == 0, cancelled.stderr
    assert rows(db_url, "SELECT id, status FROM outbox.operations ORDER BY id") == [
        (first, "pending"),
        (second, "cancelled"),
    ]
    assert rows(db_url, "SELECT details->>'forced' FROM outbox.audit WHERE action = 'retry'") == [
        ("true",)
    ]


def test_actions_refuse_the_wrong_status_and_unknown_ids_and_need_a_reason(
    db_url: str, cli_env: dict[str, str]
) -> None:
    (op,) = enqueue_many(db_url, 1)  # pending
    wrong = outbox_cli(cli_env, "reconcile", "cancel", str(op), "--reason", "x")
    assert wrong.returncode == 2
    expected = f"cancel applies to reconciling or quarantined operations; operation {op} is pending"
    assert expected in wrong.stderr
    missing = outbox_cli(cli_env, "quarantine", "replay", "999999", "--reason", "x")
    assert missing.returncode == 2 and "no operation with id 999999" in missing.stderr
    blank = outbox_cli(
        cli_env, "reconcile", "resolve", str(op), "--provider-ref", " ", "--reason", "x"
    )
    assert blank.returncode == 2 and "provider's reference" in blank.stderr
    no_reason = outbox_cli(cli_env, "quarantine", "replay", str(op))
    assert no_reason.returncode == 2 and "--reason" in no_reason.stderr
    assert rows(db_url, "SELECT count(*) FROM outbox.audit") == [(0,)]
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("pending",)]


def test_the_audit_is_never_updated_in_place(db_url: str, cli_env: dict[str, str]) -> None:
    (op,) = enqueue_many(db_url, 1)
    set_reconciling(db_url, op, first_sent_ago=timedelta(hours=30))
    assert outbox_cli(cli_env, "reconcile", "cancel", str(op), "--reason", "x").returncode == 0
    with psycopg.connect(db_url) as conn, pytest.raises(psycopg.Error) as caught:
        conn.execute("UPDATE outbox.audit SET reason = 'rewritten'")
    assert caught.value.sqlstate == "OB003"
    assert audit(db_url)[0][2] == "x"


def test_show_by_identity(db_url: str, cli_env: dict[str, str]) -> None:
    (op,) = enqueue_many(db_url, 1)
    shown = outbox_cli(
        cli_env,
        "reconcile",
        "show",
        "--tenant-id",
        "acme",
        "--operation-type",
        "invoice.charge",
        "--operation-key",
        "op-0",
        "--json",
    )
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == op

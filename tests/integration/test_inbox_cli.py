"""`outbox inbox list|show|forget|prune`, the real command against records the inbox made, run as
a member of outbox_operator (issue 40). Each test counts records and audit rows afterwards."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

from tests.integration.test_roles import OPERATOR, apply_roles, as_role
from tests.support.cli import outbox_cli
from tests.support.invoice_worker import count


def record(
    conn: psycopg.Connection[Any], key: str, status: int, *, handler: str = "invoice.create"
) -> int:
    row = conn.execute(
        "SELECT inbox_id, token FROM outbox.inbox_begin('acme', %s, %s, '{\"a\": 1}', NULL,"
        " '1 s', '1 day')",
        (handler, key),
    ).fetchone()
    assert row is not None
    conn.execute(
        "SELECT outbox.inbox_complete(%s, %s, %s, '[[\"Content-Type\", \"text/plain\"]]', 'hi')",
        (row[0], row[1], status),
    )
    conn.commit()
    return int(row[0])


@pytest.fixture
def operator_env(db_url: str, pg_server: str, cli_env: dict[str, str]) -> dict[str, str]:
    apply_roles(pg_server, db_url)
    return {**cli_env, "OUTBOX_DATABASE_URL": as_role(db_url, OPERATOR)}


def test_list_and_show_read_what_was_recorded_and_what_conflicted(
    db_url: str, operator_env: dict[str, str]
) -> None:
    with psycopg.connect(db_url) as conn:
        ok = record(conn, "key:ok", 201)
        record(conn, "key:refused", 422)
        conn.execute(
            "SELECT outbox.inbox_begin('acme', 'invoice.create', 'key:ok', '{\"a\": 2}', NULL,"
            " '1 s', '1 day')"
        )
        conn.commit()
    listed = outbox_cli(operator_env, "inbox", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["key"], r["response_status"], r["conflicts"]) for r in rows] == [
        ("key:refused", 422, 0),
        ("key:ok", 201, 1),
    ]
    only = outbox_cli(operator_env, "inbox", "list", "--conflicts", "--json")
    assert [r["id"] for r in json.loads(only.stdout)] == [ok]
    shown = outbox_cli(operator_env, "inbox", "show", str(ok), "--body")
    assert shown.returncode == 0, shown.stderr
    assert "header: Content-Type: text/plain" in shown.stdout
    assert "hi" in shown.stdout and "conflict: body" in shown.stdout


def test_forget_takes_refusals_asks_force_for_successes_and_audits_each(
    db_url: str, operator_env: dict[str, str]
) -> None:
    with psycopg.connect(db_url) as conn:
        success = record(conn, "key:ok", 201)
        for i in range(3):
            record(conn, f"key:bad-{i}", 422)
    dry = outbox_cli(
        operator_env, "inbox", "forget", "--status", "422", "--reason", "bug 12", "--dry-run"
    )
    assert dry.returncode == 0 and "3 records selected" in dry.stderr, dry.stderr
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 4
    bulk = outbox_cli(
        operator_env, "inbox", "forget", "--status", "422", "--reason", "bug 12", "--yes"
    )
    assert bulk.returncode == 0, bulk.stderr
    refused = outbox_cli(operator_env, "inbox", "forget", str(success), "--reason", "why")
    assert refused.returncode == 1 and "effect exists" in refused.stderr, refused.stderr
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 1
    forced = outbox_cli(operator_env, "inbox", "forget", str(success), "--reason", "why", "--force")
    assert forced.returncode == 0, forced.stderr
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 0
    audited = count(
        db_url,
        "SELECT count(*) FROM outbox.audit WHERE action = 'inbox_forget'"
        " AND db_user = %s AND details ? 'key'",
        (OPERATOR,),
    )
    assert audited == 4


def test_prune_deletes_expired_completed_records_in_batches(
    db_url: str, operator_env: dict[str, str]
) -> None:
    with psycopg.connect(db_url) as conn:
        for i in range(7):
            record(conn, f"key:{i}", 200)
        conn.execute(
            "UPDATE outbox.inbox SET expires_at = now() - interval '1 s' WHERE key <> 'key:6'"
        )
        conn.commit()
    dry = outbox_cli(operator_env, "inbox", "prune", "--dry-run")
    assert dry.stdout.strip() == "prunable: 6", dry.stderr
    pruned = outbox_cli(operator_env, "inbox", "prune", "--batch", "4")
    assert pruned.stdout.strip() == "pruned: 6", pruned.stderr
    assert count(db_url, "SELECT count(*) FROM outbox.inbox") == 1


def test_show_prints_the_fingerprint_the_senders_enqueue_stored(
    db_url: str, operator_env: dict[str, str]
) -> None:
    """A record of a delivery from outbox keeps the sender's fingerprint, checked against the
    body: `outbox inbox show` prints the hex that `outbox reconcile show` prints of the
    operation, the proof that both databases hold the same intent (sql/0046)."""
    with psycopg.connect(db_url) as conn:
        ((op,),) = conn.execute(
            "SELECT operation_id FROM outbox.enqueue('acme', 'invoice', 'k', 'billing',"
            " 'invoice.generate', '{\"amount\": 1.50}')"
        ).fetchall()
        ((text, fingerprint),) = conn.execute(
            "SELECT payload::text, fingerprint FROM outbox.operations WHERE id = %s", (op,)
        ).fetchall()
        row = conn.execute(
            "SELECT inbox_id, token FROM outbox.inbox_begin('acme', 'invoice.create', %s, %s,"
            " NULL, '1 s', '1 day', NULL, %s, 'billing', 'invoice.generate', NULL)",
            (f"op:{op}", text, fingerprint),
        ).fetchone()
        assert row is not None
        conn.execute("SELECT outbox.inbox_complete(%s, %s, 201, '[]', '')", (row[0], row[1]))
        conn.commit()
    shown = outbox_cli(operator_env, "inbox", "show", str(row[0]))
    assert shown.returncode == 0, shown.stderr
    assert f"fingerprint: {bytes(fingerprint).hex()}" in shown.stdout.splitlines()
    sender = outbox_cli(operator_env, "reconcile", "show", str(op))
    assert sender.returncode == 0, sender.stderr
    assert f"fingerprint  {bytes(fingerprint).hex()}" in sender.stdout.splitlines()

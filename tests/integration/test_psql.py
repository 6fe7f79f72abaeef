"""Any language can enqueue: plain SQL through psql, read back with the Python read API."""

from __future__ import annotations

import subprocess
from typing import Any

import psycopg

import outbox
from tests.support.postgres import libpq_env, psql_path

ENQUEUE_SQL = """
\\set ON_ERROR_STOP on
BEGIN;
CREATE TABLE invoices (id int PRIMARY KEY, state text NOT NULL);
INSERT INTO invoices VALUES (884, 'charging');
SELECT operation_id, outcome FROM outbox.enqueue(
  tenant_id      => 'acme',
  operation_type => 'invoice.charge',
  operation_key  => 'client-request-884',
  provider       => 'stripe',
  action         => 'payment_intents.create',
  payload        => '{"amount": 1000, "currency": "usd", "customer": "cus_123"}'::jsonb,
  correlation_id => 'req-193'
);
COMMIT;
"""


def psql(db_url: str, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [psql_path(), "-X", "-q", "-A", "-t", "-v", "VERBOSITY=verbose"],
        input=script,
        env={"PATH": "/usr/bin:/bin", **libpq_env(db_url)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_enqueue_through_psql_then_read_it_with_get_operation(
    db_url: str, conn: psycopg.Connection[Any]
) -> None:
    done = psql(db_url, ENQUEUE_SQL)
    assert done.returncode == 0, done.stderr
    operation_id, outcome = done.stdout.strip().split("|")
    assert outcome == "accepted"

    op = outbox.get_operation(conn, "acme", "invoice.charge", "client-request-884")
    assert op is not None
    assert op.operation_id == int(operation_id)
    assert (op.provider, op.action, op.correlation_id) == (
        "stripe",
        "payment_intents.create",
        "req-193",
    )
    row = conn.execute("SELECT payload, count(*) OVER () FROM outbox.operations").fetchone()
    assert row == ({"amount": 1000, "currency": "usd", "customer": "cus_123"}, 1)


def test_a_conflict_through_psql_reports_its_sqlstate(db_url: str) -> None:
    assert psql(db_url, ENQUEUE_SQL).returncode == 0
    conflicting = (
        ENQUEUE_SQL.replace('"amount": 1000', '"amount": 5000')
        .replace("CREATE TABLE invoices (id int PRIMARY KEY, state text NOT NULL);", "")
        .replace(
            "INSERT INTO invoices VALUES (884, 'charging');", "UPDATE invoices SET state = 'x';"
        )
    )
    done = psql(db_url, conflicting)
    assert done.returncode != 0
    assert "OB001" in done.stderr and "already exists with another provider" in done.stderr
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT payload->>'amount', count(*) OVER () FROM outbox.operations"
        ).fetchone()
        assert row == ("1000", 1)
        # The producer's own write went down with it.
        assert conn.execute("SELECT state FROM invoices").fetchall() == [("charging",)]


def test_invalid_utf8_through_psql_is_refused_and_writes_nothing(db_url: str) -> None:
    script = (
        b"\\set ON_ERROR_STOP on\nSET client_encoding = 'UTF8';\n"
        b"SELECT * FROM outbox.enqueue(tenant_id => 'acme', operation_type => 't', "
        b"operation_key => 'k-\xff\xfe', provider => 'p', action => 'a', payload => '{}');\n"
    )
    done = subprocess.run(
        [psql_path(), "-X", "-q"],
        input=script,
        env={"PATH": "/usr/bin:/bin", **libpq_env(db_url)},
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert b"invalid byte sequence for encoding" in done.stderr
    with psycopg.connect(db_url) as conn:
        assert conn.execute("SELECT count(*) FROM outbox.operations").fetchone() == (0,)

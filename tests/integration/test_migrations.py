"""`outbox migrate`: in order, once, under a lock, never queuing long behind live traffic."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

import outbox
from outbox.core.model import Status
from outbox.db import migrations, statements
from tests.integration.test_operation_keys import KEYS, KEYS_FROM_OPERATIONS
from tests.support.schema import snapshot

ALL = migrations.load_migrations()


def run_migrate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OUTBOX_DATABASE_URL": url}
    return subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def applied_rows(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            "SELECT version, name, checksum, applied_at FROM outbox.schema_migrations ORDER BY 1"
        ).fetchall()


def test_there_are_migrations_numbered_from_one_without_gaps() -> None:
    assert [m.version for m in ALL] == list(range(1, len(ALL) + 1))


def test_all_at_once_equals_one_at_a_time_equals_the_template(
    empty_db_url: str, db_url: str, pg_server: str
) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        for version in range(1, len(ALL) + 1):
            report = migrations.migrate(conn, target=version)
            assert [m.version for m in report.applied] == [version]
    stepwise = snapshot(empty_db_url)
    assert stepwise == snapshot(db_url)
    assert len(stepwise["functions"]) >= 4 and len(stepwise["indexes"]) >= 5


def test_migrate_twice_changes_nothing_the_second_time(empty_db_url: str) -> None:
    first = run_migrate(empty_db_url)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied 0") == len(ALL)
    rows, schema = applied_rows(empty_db_url), snapshot(empty_db_url)

    second = run_migrate(empty_db_url)
    assert second.returncode == 0, second.stderr
    assert "applied 0" not in second.stdout
    assert "nothing to do" in second.stdout
    assert applied_rows(empty_db_url) == rows
    assert snapshot(empty_db_url) == schema


def test_two_processes_at_once_apply_each_migration_once(empty_db_url: str) -> None:
    env = {**os.environ, "OUTBOX_DATABASE_URL": empty_db_url}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "outbox", "migrate"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    applied_lines = sum(out.count("applied 0") for out, _ in outputs)
    assert applied_lines == len(ALL)
    assert [row[0] for row in applied_rows(empty_db_url)] == [m.version for m in ALL]


def test_a_migration_blocked_by_live_traffic_gives_up_and_applies_nothing(
    empty_db_url: str,
) -> None:
    assert run_migrate(empty_db_url, "--target", "1").returncode == 0
    # 0002 adds a foreign key to operations, which needs a lock that this transaction holds.
    with psycopg.connect(empty_db_url) as holder:
        holder.execute("LOCK TABLE outbox.operations IN ACCESS EXCLUSIVE MODE")
        started = time.monotonic()
        blocked = run_migrate(empty_db_url, "--lock-timeout", "300ms")
        elapsed = time.monotonic() - started
        holder.rollback()
    assert blocked.returncode == 1
    assert "0002_attempts" in blocked.stderr and "lock" in blocked.stderr
    assert elapsed < 30  # bounded by the lock timeout, not by the holder
    assert [row[0] for row in applied_rows(empty_db_url)] == [1]

    after = run_migrate(empty_db_url)
    assert after.returncode == 0, after.stderr
    assert [row[0] for row in applied_rows(empty_db_url)] == [m.version for m in ALL]


def test_a_migration_edited_after_it_was_applied_is_refused(db_url: str) -> None:
    edited = [replace(ALL[0], sql=ALL[0].sql + b"\n-- edited\n"), *ALL[1:]]
    with (
        psycopg.connect(db_url, autocommit=True) as conn,
        pytest.raises(migrations.MigrationError, match="0001_operations was changed"),
    ):
        migrations.migrate(conn, migrations=edited)


def test_a_failing_migration_rolls_back_whole(db_url: str) -> None:
    broken = migrations.Migration(
        len(ALL) + 1, "broken", b"CREATE TABLE outbox.half (id int); SELECT 1/0;"
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        with pytest.raises(migrations.MigrationError, match="broken failed and was rolled back"):
            migrations.migrate(conn, migrations=[*ALL, broken])
        assert conn.execute("SELECT to_regclass('outbox.half')").fetchone() == (None,)
        count = conn.execute("SELECT count(*) FROM outbox.schema_migrations").fetchone()
        assert count == (len(ALL),)


def test_status_enum_equals_the_check_constraint(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute(
        "SELECT pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE conname = 'operations_status_valid'"
    ).fetchone()
    assert row is not None
    allowed = set(
        row[0]
        .split("ARRAY[")[1]
        .split("]")[0]
        .replace("::text", "")
        .replace("'", "")
        .replace(" ", "")
        .split(",")
    )
    assert allowed == {s.value for s in Status}


def test_the_claim_index_covers_only_claimable_pending_rows(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute(
        "SELECT indexdef FROM pg_indexes WHERE indexname = 'operations_claim_group'"
    ).fetchone()
    assert row is not None
    assert "(provider, tenant_id, available_at, id)" in row[0]
    assert (
        "WHERE ((status = 'pending'::text) AND (NOT ordering_blocked) AND (NOT scheduled))"
        in row[0]
    )


def test_0019_mends_rows_written_before_enqueue_refused_them(empty_db_url: str) -> None:
    """Rows from before sql/0019: a time that is no schedule, an attempt budget past the cap,
    a row not due yet in the claim index. After the migration none of them can break a gauge,
    `outbox status` or get_operation, and the future one is out of the claim index."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=18)
        for key, available_at, status, max_attempts in [
            ("minus", "-infinity", "pending", None),
            ("plus", "infinity", "pending", None),
            ("far", "12000-01-01 00:00:00+00", "pending", None),
            ("spent", "-infinity", "succeeded", None),
            ("forever", "now", "pending", 2_147_483_647),
            ("tomorrow", "tomorrow", "pending", None),
        ]:
            conn.execute(
                "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, "
                "fingerprint, provider, action, payload, idempotency_key, available_at, status, "
                "max_attempts, provider_ref, finished_at) VALUES ('t', 'x', %(k)s, '\\x00', "
                "'hook', 'a', '{}', %(k)s, %(at)s, %(status)s, %(max)s, "
                "CASE WHEN %(status)s = 'succeeded' THEN 'ref' END, "
                "CASE WHEN %(status)s = 'succeeded' THEN now() END)",
                {"k": key, "at": available_at, "status": status, "max": max_attempts},
            )
        migrations.migrate(conn)
        got = {
            key: rest
            for key, *rest in conn.execute(
                "SELECT operation_key, status, status_reason, isfinite(available_at), "
                "available_at <= now(), scheduled, max_attempts FROM outbox.operations"
            ).fetchall()
        }
        assert got == {
            "minus": ["pending", None, True, True, False, None],
            "plus": ["quarantined", "invalid_available_at", True, True, False, None],
            "far": ["quarantined", "invalid_available_at", True, True, False, None],
            "spent": ["succeeded", None, True, True, False, None],
            "forever": ["pending", None, True, True, False, 1000],
            "tomorrow": ["pending", None, True, False, True, None],
        }
        for key in got:  # Python reads every row back
            assert outbox.get_operation(conn, "t", "x", key) is not None
        row = (
            conn.cursor(row_factory=dict_row)
            .execute(statements.GAUGES, {"exact_limit": 100_000, "providers": []})
            .fetchone()
        )
        assert row is not None and row["pending"] == 3


def test_0048_moves_the_origin_out_of_0046s_keys(empty_db_url: str) -> None:
    """Records 0046 keyed op:<origin>:<id> become key op:<id> with that origin; every other
    record keeps its key, with no origin named. Each is found again by its next delivery."""
    origin = "4cebe4fc-21b6-4c07-b313-c7510c7a24f8"
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=47)
        for key in (f"op:{origin}:7", "op:7", "key:op:x:1", f"op:{origin}:x"):
            conn.execute(
                "INSERT INTO outbox.inbox (tenant_id, handler, key, mode, state, body_digest,"
                " token, lease_expires_at, expires_at) VALUES ('acme', 'work', %s, 'external',"
                " 'in_progress', sha256('{}'), gen_random_uuid(), now() - interval '1 s',"
                " now() + interval '1 day')",
                (key,),
            )
        migrations.migrate(conn)
        got = set(conn.execute("SELECT key, origin::text FROM outbox.inbox").fetchall())
        unnamed = "00000000-0000-0000-0000-000000000000"
        assert got == {
            ("op:7", origin),
            ("op:7", unnamed),
            ("key:op:x:1", unnamed),
            (f"op:{origin}:x", unnamed),
        }
        claim = (
            "SELECT decision FROM outbox.inbox_claim('acme', 'work', 'op:7', '{}', NULL,"
            " '1 min', 5, '1 day', %s)"
        )
        decisions = [conn.execute(claim, (o,)).fetchone() for o in (origin, None)]
    assert decisions == [("reclaimed",), ("reclaimed",)]


def _record(conn: psycopg.Connection[Any], claimed: tuple[Any, ...], outcome: str) -> None:
    """record_attempts as a dispatcher calls it: ``claimed`` is (id, lease_token, attempts)."""
    op, token, attempt = claimed
    done = outcome == "succeeded"
    batch = [
        {
            "id": op, "lease_token": str(token), "attempt": attempt,
            "status": "succeeded" if done else "pending", "reason": None,
            "retry_in_s": 0, "sent": True, "provider_ref": "ref" if done else None,
            "result": None, "error": None if done else "HTTP 500",
            "failure": None if done else outcome, "outcome": outcome,
            "error_class": None if done else "http_500", "http_status": 201 if done else 500,
            "request_id": "req", "unspent": False, "api_version": None, "scope": None,
        }
    ]  # fmt: skip
    got = conn.execute("SELECT * FROM outbox.record_attempts('w', %s)", (Jsonb(batch),)).fetchall()
    assert got == [(op, attempt)]


def _claim(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    return conn.execute(
        "SELECT id, lease_token, attempts FROM outbox.claim_one_group_v2('w', '1 min', 100,"
        " '{}', '{}') ORDER BY id"
    ).fetchall()


def test_0050_keeps_every_attempt_and_records_a_first_success_on_its_row(
    empty_db_url: str,
) -> None:
    """Attempts recorded before the upgrade read the same through the view; an operation in
    flight across it records its success on its row, one that failed before it in the log."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=49)
        for key in ("done-before", "failed-before", "in-flight-a", "in-flight-b"):
            conn.execute(
                "SELECT outbox.enqueue('acme', 'charge', %s, 'hook', 'paid', '{}'::jsonb)", (key,)
            )
        done, failed, flying_a, flying_b = _claim(conn)
        _record(conn, done, "succeeded")
        _record(conn, failed, "unknown")
        conn.execute(
            "UPDATE outbox.operations SET available_at = now() WHERE id = %s", (failed[0],)
        )
        (failed,) = _claim(conn)  # its second attempt is in flight across the upgrade
        history = "SELECT * FROM outbox.attempts ORDER BY operation_id, attempt"
        before = conn.execute(history).fetchall()
        assert len(before) == 2
        migrations.migrate(conn)
        assert conn.execute(history).fetchall() == before
        for claimed in (failed, flying_a):
            _record(conn, claimed, "succeeded")
        _record(conn, flying_b, "unknown")
        after = conn.execute(
            "SELECT operation_id, attempt, outcome, worker FROM outbox.attempts"
            " ORDER BY operation_id, attempt"
        ).fetchall()
        logged = conn.execute(
            "SELECT operation_id, attempt FROM outbox.attempt_log ORDER BY 1, 2"
        ).fetchall()
        inline = conn.execute(
            "SELECT id FROM outbox.operations WHERE success_worker IS NOT NULL"
        ).fetchall()
    assert after == [
        (done[0], 1, "succeeded", "w"),
        (failed[0], 1, "unknown", "w"),
        (failed[0], 2, "succeeded", "w"),
        (flying_a[0], 1, "succeeded", "w"),
        (flying_b[0], 1, "unknown", "w"),
    ]
    # Only the success at a first attempt recorded after the upgrade stays on its row.
    assert inline == [(flying_a[0],)]
    assert logged == [(done[0], 1), (failed[0], 1), (failed[0], 2), (flying_b[0], 1)]


def test_0051_moves_every_operations_keys_and_keeps_them_unique(empty_db_url: str) -> None:
    """Migrating a populated database: every operation, in flight and retried ones included,
    gets its keys row; identities and keys are still refused twice, across tenants; the operation
    in flight across the upgrade records its success."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=50)
        for tenant, key, caller in (
            ("acme", "flying", None),
            ("acme", "waiting", "caller-1"),
            ("acme", "retried", "caller-2"),
            ("beta", "shared", "caller-3"),
        ):
            conn.execute(
                "SELECT outbox.enqueue(%s, 'charge', %s, 'hook', 'paid', '{}'::jsonb,"
                " idempotency_key => %s)",
                (tenant, key, caller),
            )
            if key == "flying":
                (flying,) = _claim(conn)
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', attempts = 1"
            " WHERE operation_key = 'retried'"
        )
        conn.execute("SELECT outbox.retry_operation(3, 'test', 'carol', true)")
        # An operation sharing its key with an older one (sql/0024's key_shared), by hand.
        conn.execute("UPDATE outbox.operations SET key_shared = true WHERE id = 4")
        conn.execute(
            "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint,"
            " provider, action, payload, idempotency_key, key_shared) VALUES ('beta', 'charge',"
            " 'shared-2', '\\x00', 'hook', 'paid', '{}', 'caller-3', true)"
        )
        before = conn.execute("SELECT * FROM outbox.operations ORDER BY id").fetchall()
        migrations.migrate(conn, target=51)
        assert conn.execute("SELECT * FROM outbox.operations ORDER BY id").fetchall() == before
        assert conn.execute(KEYS).fetchall() == conn.execute(KEYS_FROM_OPERATIONS).fetchall()
        derived = "SELECT idempotency_key FROM outbox.operations WHERE id = 1"
        assert [r[5] for r in conn.execute(KEYS).fetchall()] == [
            *conn.execute(derived).fetchall()[0],
            "caller-1",
            "caller-2:r2",
            None,
            None,
        ]
        again = conn.execute(
            "SELECT outcome FROM outbox.enqueue('acme', 'charge', 'waiting', 'hook', 'paid',"
            " '{}'::jsonb, idempotency_key => 'caller-1')"
        ).fetchall()
        assert again == [("duplicate",)]
        for tenant in ("acme", "zeta"):
            with pytest.raises(psycopg.DatabaseError, match="already names another") as refused:
                conn.execute(
                    "SELECT outbox.enqueue(%s, 'charge', 'new', 'hook', 'paid', '{}'::jsonb,"
                    " idempotency_key => 'caller-1')",
                    (tenant,),
                )
            assert refused.value.sqlstate == "OB001"
        _record(conn, flying, "succeeded")
        assert conn.execute("SELECT status FROM outbox.operations WHERE id = 1").fetchall() == [
            ("succeeded",)
        ]
        assert conn.execute("SELECT count(*) FROM outbox.operation_keys").fetchall() == [(5,)]


def test_0053_keeps_every_operation_and_the_twelve_argument_call(empty_db_url: str) -> None:
    """Migrating a populated database to contracts at enqueue: every operation is kept as it
    was, with no contract version; a producer of before (twelve arguments by name) enqueues and
    re-enqueues as before; the operation in flight records."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=52)
        for key in ("flying", "waiting"):
            conn.execute(
                "SELECT outbox.enqueue('acme', 'charge', %s, 'hook', 'paid', '{\"a\": 1}'::jsonb,"
                " correlation_id => 'c', idempotency_key => NULL, available_at => NULL,"
                " max_attempts => 3, traceparent => NULL, ordering_key => NULL)",
                (key,),
            )
        flying = _claim(conn)[0]  # both are due: the first is in flight across the upgrade
        before = conn.execute("SELECT * FROM outbox.operations ORDER BY id").fetchall()
        migrations.migrate(conn)
        after = conn.execute("SELECT * FROM outbox.operations ORDER BY id").fetchall()
        assert [row[:-1] for row in after] == before
        assert [row[-1] for row in after] == [None, None]  # contract_version
        twelve = (
            "SELECT outcome FROM outbox.enqueue(tenant_id => 'acme', operation_type => 'charge',"
            " operation_key => %s, provider => 'hook', action => 'paid',"
            " payload => '{\"a\": 1}'::jsonb, correlation_id => 'c', idempotency_key => NULL,"
            " available_at => NULL, max_attempts => 3, traceparent => NULL,"
            " ordering_key => NULL)"
        )
        assert conn.execute(twelve, ("waiting",)).fetchall() == [("duplicate",)]
        assert conn.execute(twelve, ("new",)).fetchall() == [("accepted",)]
        _record(conn, flying, "succeeded")
        statuses = conn.execute("SELECT status FROM outbox.operations ORDER BY id").fetchall()
        assert statuses == [("succeeded",), ("in_flight",), ("pending",)]

"""`outbox run` through a real PgBouncer in transaction mode, with 2 server sessions shared by
every client: nothing prepared, nothing left in a session, wake-ups through a direct LISTEN URL or
by polling. Each test counts rows and the receiver's effects."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox
from outbox.db import statements
from outbox.db.connect import MIGRATE_THROUGH_POOLER, migration_blocker, shares_server_sessions
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.cli import outbox_cli
from tests.support.daemon import OutboxProcess, outbox_processes, wait_until, write_config
from tests.support.dispatch import rows, statuses
from tests.support.pgbouncer import PgBouncer, pgbouncer

pytestmark = pytest.mark.slow

TRANSACTION_POOLING = {"OUTBOX_DATABASE__POOL_MODE": "transaction"}
# An empty value means "no LISTEN URL", whatever the environment running the tests holds.
NO_LISTEN_URL = {"OUTBOX_LISTEN_DATABASE_URL": ""}
PREPARED_ERRORS = ("prepared statement", "DuplicatePreparedStatement", "InvalidSqlStatementName")


@pytest.fixture
def bouncer(db_url: str) -> Iterator[PgBouncer]:
    with pgbouncer(db_url) as b:
        yield b


def config(tmp_path: Path, receiver: FakeWebhookReceiver, **dispatcher: Any) -> Path:
    settings: dict[str, Any] = {
        "lease": "30s",
        "backoff_base": "50ms",
        "backoff_max": "200ms",
        "shutdown_grace": "10s",
        **dispatcher,
    }
    return write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "5s"}},
        **settings,
    )


def enqueue_through(url: str, count: int, *, prefix: str = "op") -> None:
    """A producer behind the pooler, as docs/pgbouncer.md advises: nothing prepared, and one
    transaction per operation, so each may run in another server session."""
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        for i in range(count):
            with conn.transaction():
                outbox.enqueue(
                    conn,
                    tenant_id="acme",
                    operation_type="invoice.charge",
                    operation_key=f"{prefix}-{i}",
                    provider="hook",
                    action="invoice.paid",
                    payload={"n": i},
                )


def succeeded(url: str) -> int:
    return statuses(url).get("succeeded", 0)


def wait_for_log(proc: OutboxProcess, text: str, timeout: float = 30) -> None:
    wait_until(lambda: text in proc.log_text(), timeout=timeout, what=repr(text))


def assert_no_database_errors(proc: OutboxProcess) -> None:
    """No prepared-statement error, no error line, and no database exception of any kind in the
    process's log (psycopg's classes are CamelCase; provider outcomes' classes are lower-case, and
    a slow provider call on a loaded machine is no concern here)."""
    log = proc.log_text()
    for text in PREPARED_ERRORS:
        assert text not in log, log
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert not [line for line in lines if line.get("level") in ("error", "critical")], log
    assert not [line for line in lines if str(line.get("error_class") or "")[:1].isupper()], log


def test_the_pooler_really_shares_server_sessions(bouncer: PgBouncer, db_url: str) -> None:
    """The ground the other tests stand on: psycopg's defaults fail through this PgBouncer."""
    with (
        psycopg.connect(bouncer.url, autocommit=True) as first,
        psycopg.connect(bouncer.url, autocommit=True) as second,
    ):
        pids = {
            first.execute("SELECT pg_backend_pid()").fetchone(),
            second.execute("SELECT pg_backend_pid()").fetchone(),
        }
        assert len(pids) == 1, "two clients, one server session"
        for i in range(5):  # psycopg prepares a query on its 6th execution (threshold 5)
            first.execute("SELECT %s::int", (i,))
            second.execute("SELECT %s::text", (str(i),))
        first.execute("SELECT %s::int", (5,))  # prepared as _pg3_0 in the shared session
        with pytest.raises(psycopg.errors.DuplicatePreparedStatement):
            second.execute("SELECT %s::text", ("5",))


def test_two_processes_dispatch_300_operations_through_the_pooler_exactly_once(
    bouncer: PgBouncer, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    # Small batches and few slots: many claims and records on each of the 20 pooled connections,
    # far more than the 5 executions after which psycopg would prepare a statement.
    cfg = config(tmp_path, receiver, poll_interval="100ms", batch_size=10, concurrency=8)
    env = {**TRANSACTION_POOLING, **NO_LISTEN_URL}
    with outbox_processes(2, bouncer.url, cfg, tmp_path, env) as procs:
        for p in procs:
            wait_for_log(p, "wake-ups: polling only")
        enqueue_through(bouncer.url, 300)
        wait_until(lambda: succeeded(db_url) == 300, timeout=120, what="300 operations to succeed")
        for p in procs:
            p.signal(signal.SIGTERM)
        assert [p.wait() for p in procs] == [0, 0]
        for p in procs:
            assert '"pool_mode": "transaction"' in p.log_text()
            assert_no_database_errors(p)
    assert statuses(db_url) == {"succeeded": 300}
    assert receiver.effect_count() == 300
    assert len({e.key for e in receiver.effects}) == 300
    # Both processes worked; each operation succeeded once (a retry after a slow call on a loaded
    # machine would resend with the same key, which the receiver counts once).
    assert rows(
        db_url,
        "SELECT count(*), count(DISTINCT worker) FROM outbox.attempts WHERE outcome = 'succeeded'",
    ) == [(300, 2)]
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE provider_ref IS NULL") == [
        (0,)
    ]
    # Nothing was left in the shared server sessions for the next client to inherit.
    with psycopg.connect(bouncer.url, autocommit=True, prepare_threshold=None) as conn:
        for _ in range(4):
            assert conn.execute("SHOW lock_timeout").fetchone() == ("0",)
            assert conn.execute("SHOW statement_timeout").fetchone() == ("0",)
            assert conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone() == (0,)


def test_a_direct_listen_url_wakes_the_dispatcher_at_once(
    bouncer: PgBouncer, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = config(tmp_path, receiver, poll_interval="30s")
    env = {**TRANSACTION_POOLING, "OUTBOX_LISTEN_DATABASE_URL": db_url}
    with outbox_processes(1, bouncer.url, cfg, tmp_path, env) as (proc,):
        wait_for_log(proc, "wake-ups: LISTEN on the direct listen URL")
        wait_for_log(proc, "listening for enqueue notifications")
        time.sleep(1)  # past the claims at startup: from now on only a NOTIFY or 30 s wake it
        # The LISTEN session is PostgreSQL's own, not one the pooler lends.
        assert rows(
            db_url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = "
            "current_database() AND application_name = 'outbox-listen'",
        ) == [(1,)]
        started = time.monotonic()
        enqueue_through(bouncer.url, 1)  # its NOTIFY is sent through the pooler
        wait_until(lambda: succeeded(db_url) == 1, timeout=10, what="the operation to succeed")
        elapsed = time.monotonic() - started
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
        assert elapsed < 3, f"dispatched after {elapsed:.1f}s: woken by polling, not NOTIFY"
        assert "does not reach PostgreSQL directly" not in proc.log_text()
        assert_no_database_errors(proc)
    assert receiver.effect_count() == 1


def test_a_listen_url_through_the_pooler_is_called_out(
    bouncer: PgBouncer, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = config(tmp_path, receiver, poll_interval="200ms")
    env = {**TRANSACTION_POOLING, "OUTBOX_LISTEN_DATABASE_URL": bouncer.url}
    with outbox_processes(1, bouncer.url, cfg, tmp_path, env) as (proc,):
        wait_for_log(proc, "the LISTEN URL does not reach PostgreSQL directly")


def test_without_a_listen_url_the_dispatcher_polls_and_says_so(
    bouncer: PgBouncer, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = config(tmp_path, receiver, poll_interval="2s")
    env = {**TRANSACTION_POOLING, **NO_LISTEN_URL}
    with outbox_processes(1, bouncer.url, cfg, tmp_path, env) as (proc,):
        wait_for_log(proc, "wake-ups: polling only")
        time.sleep(0.5)
        started = time.monotonic()
        enqueue_through(bouncer.url, 3)
        wait_until(lambda: succeeded(db_url) == 3, timeout=10, what="3 operations to succeed")
        elapsed = time.monotonic() - started
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
        log = proc.log_text()
    assert elapsed < 2 + 2, f"dispatched after {elapsed:.1f}s with a 2 s poll interval"
    assert '"wakeups": "polling"' in log
    assert "listening for enqueue notifications" not in log
    assert rows(
        db_url,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = "
        "current_database() AND application_name = 'outbox-listen'",
    ) == [(0,)]
    assert statuses(db_url) == {"succeeded": 3}
    assert receiver.effect_count() == 3


def test_session_settings_through_a_transaction_pooler_stop_the_daemon(
    bouncer: PgBouncer, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """Forgetting pool_mode would prepare statements in shared sessions: refused at startup."""
    enqueue_through(bouncer.url, 5)
    cfg = config(tmp_path, receiver, poll_interval="100ms")
    proc = OutboxProcess(bouncer.url, cfg, tmp_path / "session.log", env=NO_LISTEN_URL)
    try:
        assert proc.wait(timeout=30) == 2
        assert "leads to a transaction-mode pooler" in proc.log_text()
        assert "OUTBOX_DATABASE__POOL_MODE=transaction" in proc.log_text()
    finally:
        proc.stop()
    # Refused before the first claim.
    assert statuses(db_url) == {"pending": 5}
    assert len(receiver.received) == 0


def test_migrations_can_tell_a_transaction_pooler_from_a_direct_session(
    bouncer: PgBouncer, db_url: str
) -> None:
    """What `outbox migrate` checks before it takes its session-level lock."""
    assert migration_blocker(bouncer.url) == MIGRATE_THROUGH_POOLER
    assert migration_blocker(db_url) is None
    # An unreachable database is left for the migration's own connection to report.
    assert migration_blocker("postgresql://postgres@127.0.0.1:1/none?connect_timeout=2") is None


def test_outbox_migrate_refuses_a_transaction_pooler_and_changes_nothing(
    bouncer: PgBouncer, db_url: str
) -> None:
    before = rows(db_url, "SELECT count(*) FROM outbox.schema_migrations")
    done = outbox_cli({**os.environ, "OUTBOX_DATABASE_URL": bouncer.url}, "migrate")
    assert done.returncode == 1
    assert MIGRATE_THROUGH_POOLER in done.stderr
    assert rows(db_url, "SELECT count(*) FROM outbox.schema_migrations") == before


def test_through_the_pooler_two_migrators_would_both_hold_the_migration_lock(
    bouncer: PgBouncer,
) -> None:
    """Why migrations go direct: a session-level advisory lock taken through the pooler belongs
    to a server session the next client shares, so it serialises nothing."""
    key = statements.MIGRATION_LOCK_KEY
    with (
        psycopg.connect(bouncer.url, autocommit=True, prepare_threshold=None) as first,
        psycopg.connect(bouncer.url, autocommit=True, prepare_threshold=None) as second,
    ):
        assert first.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)
        assert second.execute("SELECT pg_try_advisory_lock(%s)", (key,)).fetchone() == (True,)


async def test_a_session_mode_pooler_is_not_taken_for_a_transaction_pooler(db_url: str) -> None:
    with pgbouncer(db_url, pool_mode="session") as session_bouncer:
        assert await shares_server_sessions(session_bouncer.url) is False


def test_a_listen_url_that_does_not_parse_is_refused_without_showing_it(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_through(db_url, 1)
    cfg = config(tmp_path, receiver)
    bad = "postgresql://outbox:hunter2@db-primary/app?bogus=1"
    env = {**TRANSACTION_POOLING, "OUTBOX_LISTEN_DATABASE_URL": bad}
    proc = OutboxProcess(db_url, cfg, tmp_path / "bad-url.log", env=env)
    try:
        assert proc.wait(timeout=30) == 2
        log = proc.log_text()
    finally:
        proc.stop()
    assert "the LISTEN URL (database.listen_url) is not a valid connection string" in log
    assert "hunter2" not in log and "bogus" not in log
    assert statuses(db_url) == {"pending": 1}


def test_with_listen_off_a_listen_url_that_does_not_parse_is_only_a_warning(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_through(db_url, 3)
    bad = "postgresql://outbox:hunter2@db-primary/app?bogus=1"
    env = {
        **TRANSACTION_POOLING,
        "OUTBOX_LISTEN_DATABASE_URL": bad,
        "OUTBOX_DATABASE__LISTEN": "false",
    }
    proc = OutboxProcess(db_url, config(tmp_path, receiver), tmp_path / "unused.log", env=env)
    try:
        wait_until(lambda: succeeded(db_url) == 3, timeout=30, what="3 operations to succeed")
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        lines = [json.loads(line) for line in proc.log_text().splitlines()]
    finally:
        proc.stop()
    (warned,) = [line for line in lines if "not a valid connection string" in line["event"]]
    assert warned["level"] == "warning" and warned["used"] is False
    assert not any("hunter2" in json.dumps(line) or "bogus" in json.dumps(line) for line in lines)
    assert receiver.effect_count() == 3

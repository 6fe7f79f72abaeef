"""`outbox run` fails fast and says why (issue 21, cases 1 and 2; issue 38, item 5).

A metrics port in use left the daemon half started: no claim, no exit, no drain. An un-migrated
database started it anyway, looping on UndefinedTable for ever. Each start-up problem now ends
the run with exit code 2 and one line naming the cause and the fix, before anything is claimed.
A database that does not answer is waited for (``database.startup_wait``), but the reason is
said at once: a wrong database name or a closed port was silent for the whole minute, and a
refusal that waiting will not change (no such database, no such role) now ends the run at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from outbox.daemon.startup import expected_version
from outbox.db import migrations
from tests.support.cluster import free_port
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import enqueue_many, rows
from tests.support.postgres import with_dbname
from tests.support.tcp_proxy import TcpProxy

# "At once": well under this, though a loaded machine takes a second to import outbox.
SAYS_IT_WITHIN = 5.0


def run(
    db_url: str, tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    hook = {"type": "webhook", "url": "http://127.0.0.1:9/"}
    config = write_config(tmp_path / "outbox.toml", providers={"hook": hook})
    return subprocess.run(
        [sys.executable, "-m", "outbox", "run", "--config", str(config), *args],
        env={
            **os.environ,
            "OUTBOX_DATABASE_URL": db_url,
            "OUTBOX_LOG_LEVEL": "info",
            **(env or {}),
        },
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_a_metrics_port_in_use_ends_the_run_before_any_claim(db_url: str, tmp_path: Path) -> None:
    ids = enqueue_many(db_url, 3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run(db_url, tmp_path, "--metrics-addr", f"127.0.0.1:{port}")
    assert done.returncode == 2, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "--metrics-addr" in done.stderr
    assert rows(db_url, "SELECT status, attempts FROM outbox.operations ORDER BY id") == [
        ("pending", 0)
    ] * len(ids)


def test_an_unmigrated_database_says_run_outbox_migrate(empty_db_url: str, tmp_path: Path) -> None:
    done = run(empty_db_url, tmp_path, "--metrics-addr", "off")
    assert done.returncode == 2
    assert "run `outbox migrate` first" in done.stderr


def test_an_older_schema_names_both_versions(empty_db_url: str, tmp_path: Path) -> None:
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn)
        conn.execute(
            "DELETE FROM outbox.schema_migrations WHERE version = %s", (expected_version(),)
        )
    done = run(empty_db_url, tmp_path, "--metrics-addr", "off")
    assert done.returncode == 2
    have, need = expected_version() - 1, expected_version()
    assert f"at migration {have:04d}; this outbox needs {need:04d}" in done.stderr


def test_an_unreachable_database_ends_the_run_after_the_startup_wait(tmp_path: Path) -> None:
    url = f"host=127.0.0.1 port={free_port()} user=postgres dbname=nothing"
    done = run(url, tmp_path, "--metrics-addr", "off", env={"OUTBOX_DATABASE__STARTUP_WAIT": "2s"})
    assert done.returncode == 2
    assert "did not answer in 2s (database.startup_wait)" in done.stderr


@pytest.mark.parametrize("wait", ["0s", "-1s", "forever"])
def test_a_startup_wait_that_is_no_duration_is_refused(
    db_url: str, tmp_path: Path, wait: str
) -> None:
    done = run(
        db_url, tmp_path, "--metrics-addr", "off", env={"OUTBOX_DATABASE__STARTUP_WAIT": wait}
    )
    assert done.returncode == 2 and "startup_wait" in done.stderr


def events(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def start(db_url: str, tmp_path: Path) -> tuple[OutboxProcess, float]:
    """`outbox run` on ``db_url`` with the default startup_wait (1 minute), and when it began."""
    hook = {"type": "webhook", "url": "http://127.0.0.1:9/"}
    config = write_config(tmp_path / "outbox.toml", providers={"hook": hook})
    began = time.monotonic()
    return OutboxProcess(db_url, config, tmp_path / "outbox.log"), began


def test_a_closed_port_says_why_at_once_then_waits_and_starts_when_it_opens(
    db_url: str, tmp_path: Path
) -> None:
    proxy = TcpProxy(db_url)
    proxy.port = free_port()  # nothing listens there yet: a database that is not up yet
    process, began = start(make_conninfo(db_url, host="127.0.0.1", port=proxy.port), tmp_path)
    try:

        def told() -> bool:
            return any(
                "Connection refused" in str(e.get("reason"))
                for e in process.events("waiting for the database to answer")
            )

        wait_until(told, timeout=SAYS_IT_WITHIN, what="the reason in the log")
        assert time.monotonic() - began < SAYS_IT_WITHIN
        (said,) = process.events("waiting for the database to answer")
        assert said["startup_wait"] == "1m" and f"port {proxy.port} failed" in said["reason"]
        # Still waiting, as for a database that is starting: it starts once the port answers.
        assert process.proc.poll() is None
        with proxy:
            assert process.wait_started(timeout=30), process.log_text()[-3000:]
        # The same reason was said once, not once a second.
        assert len(process.events("waiting for the database to answer")) == 1
    finally:
        process.stop()


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            {"dbname": "outbox_no_such_database"},
            'database "outbox_no_such_database" does not exist',
        ),
        ({"user": "outbox_no_such_role"}, 'role "outbox_no_such_role" does not exist'),
    ],
    ids=["no-such-database", "no-such-role"],
)
def test_a_refusal_that_waiting_will_not_change_ends_the_run_at_once(
    pg_server: str, tmp_path: Path, change: dict[str, str], said: str
) -> None:
    process, began = start(make_conninfo(pg_server, **change), tmp_path)
    try:
        # Past SAYS_IT_WITHIN the test fails anyway: no need to wait longer to learn it.
        code = process.wait(timeout=SAYS_IT_WITHIN)
        took = time.monotonic() - began
        log = process.log_text()
    finally:
        process.stop()
    assert code == 2, log
    assert took < SAYS_IT_WITHIN, f"{took:.1f}s: {log}"
    (refusal,) = [e["event"] for e in events(log) if "outbox run cannot start" in e["event"]]
    assert "waiting will not change that" in refusal and said in refusal, refusal
    assert "waiting for the database to answer" not in log


def test_the_reason_never_shows_the_password(pg_server: str, tmp_path: Path) -> None:
    secret = "hunter2-pw"  # noqa: S105 (a test's own secret)
    url = make_conninfo(with_dbname(pg_server, "outbox_no_such_database"), password=secret)
    process, _ = start(url, tmp_path)
    try:
        assert process.wait(timeout=30) == 2
        log = process.log_text()
    finally:
        process.stop()
    assert secret not in log
    assert any("does not exist" in e["event"] for e in events(log)), log

"""`outbox run` fails fast and says why (issue 21, cases 1 and 2).

A metrics port in use left the daemon half started: no claim, no exit, no drain. An un-migrated
database started it anyway, looping on UndefinedTable for ever. Each start-up problem now ends
the run with exit code 2 and one line naming the cause and the fix, before anything is claimed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from outbox.db import migrations
from outbox.startup import expected_version
from tests.support.cluster import free_port
from tests.support.daemon import write_config
from tests.support.dispatch import enqueue_many, rows


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

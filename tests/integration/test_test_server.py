"""The test bed works on a laptop with no PostgreSQL: it starts a throwaway server itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from psycopg.conninfo import conninfo_to_dict

from tests.support.postgres import Server

REPO = Path(__file__).resolve().parents[2]


def test_the_server_is_the_one_asked_for(pg_server_info: Server) -> None:
    params = conninfo_to_dict(pg_server_info.url)
    if os.environ.get("OUTBOX_TEST_DATABASE_URL"):
        assert pg_server_info.origin == "environment"
    elif os.environ.get("OUTBOX_TEST_THROWAWAY") == "1":
        assert pg_server_info.origin == "throwaway"
    if pg_server_info.origin == "throwaway":
        # pgserver listens on a unix socket in its data directory, never on 5432.
        assert str(params.get("host", "")).startswith("/")
    elif pg_server_info.origin == "local":
        assert (params.get("host"), str(params.get("port"))) == ("127.0.0.1", "5432")


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OUTBOX_TEST_THROWAWAY") == "1", reason="already inside one")
def test_the_producer_tests_pass_against_a_throwaway_server(tmp_path: Path) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OUTBOX_TEST_DATABASE_URL", "OUTBOX_TEST_THROWAWAY_URL", "PYTEST_XDIST_WORKER")
    }
    env["OUTBOX_TEST_THROWAWAY"] = "1"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--basetemp",
            str(tmp_path / "run"),
            "tests/integration/test_test_server.py::test_the_server_is_the_one_asked_for",
            "tests/integration/test_enqueue.py",
            "tests/integration/test_migrations.py",
            "tests/integration/test_psql.py",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout

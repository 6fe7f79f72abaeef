"""Readiness follows the database itself (issue 23): /readyz and outbox_database_up go red
within seconds of losing the database and green within seconds of its return, with one log line
per transition naming where. Before, they followed the last claim, which waits up to 30 s for a
pool connection: /readyz answered 200 while no writable database existed."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.daemon import OutboxProcess, http_status, wait_until, write_config

pytestmark = pytest.mark.slow

# PROBE_INTERVAL (1 s) plus PROBE_TIMEOUT (2 s), with room for a loaded machine; the claim's
# pool wait it replaces is 30 s.
WITHIN = 8.0


def database_up(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=2) as answer:  # noqa: S310
        text: str = answer.read().decode()
    lines = [line for line in text.splitlines() if line.startswith("outbox_database_up ")]
    return lines[0].split()[-1]


def test_readiness_goes_red_and_green_with_the_database_within_seconds(
    pg_server: str, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="200ms",
    )
    name = str(conninfo_to_dict(db_url)["dbname"])
    database = sql.Identifier(name)
    proc = OutboxProcess(db_url, config, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
    try:
        base = proc.metrics_url()
        wait_until(lambda: http_status(f"{base}/readyz") == 200, timeout=30, what="ready")
        assert database_up(base) == "1.0"
        with psycopg.connect(pg_server, autocommit=True) as admin:
            admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS false").format(database))
            try:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                    (name,),
                )
                lost = time.monotonic()
                wait_until(
                    lambda: http_status(f"{base}/readyz") == 503,
                    timeout=WITHIN,
                    what="/readyz 503 without a database",
                    interval=0.1,
                )
                red_after = time.monotonic() - lost
                assert database_up(base) == "0.0"
                assert http_status(f"{base}/healthz") == 200  # alive all along: do not restart it
                (said,) = proc.events("database lost")
                port = int(conninfo_to_dict(db_url).get("port") or 5432)
                assert (said["level"], said["port"]) == ("warning", port)
                assert "password" not in json.dumps(said)
            finally:
                admin.execute(sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS true").format(database))
        back = time.monotonic()
        wait_until(
            lambda: http_status(f"{base}/readyz") == 200,
            timeout=WITHIN,
            what="/readyz 200 once the database is back",
            interval=0.1,
        )
        green_after = time.monotonic() - back
        assert database_up(base) == "1.0"
        # once per transition: one "reachable" at start, one "lost", one "reachable" again
        assert len(proc.events("database reachable")) == 2
        assert len(proc.events("database lost")) == 1
        assert proc.proc.poll() is None  # it never exited
    finally:
        proc.stop()
    print(f"red after {red_after:.1f} s, green after {green_after:.1f} s")  # noqa: T201


def test_readiness_goes_red_within_seconds_when_the_database_goes_silent(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """A primary killed hard, or a partition: connections stay open and nothing answers. A claim
    then waits for its pool connection for up to 30 s, and readiness that followed claims
    stayed green all that time; the probe's own deadline is 2 s."""
    from tests.support.tcp_proxy import TcpProxy  # noqa: PLC0415

    config = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="200ms",
    )
    with TcpProxy(db_url) as proxy:
        proc = OutboxProcess(proxy.dsn, config, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
        try:
            base = proc.metrics_url()
            wait_until(lambda: http_status(f"{base}/readyz") == 200, timeout=30, what="ready")
            proxy.deafen()
            silent = time.monotonic()
            wait_until(
                lambda: http_status(f"{base}/readyz") == 503,
                timeout=WITHIN,
                what="/readyz 503 while the database is silent",
                interval=0.1,
            )
            red_after = time.monotonic() - silent
            assert database_up(base) == "0.0"
            (said,) = proc.events("database lost")
            assert said["error_class"] in ("TimeoutError", "OperationalError", "CancelledError")
            proxy.heal()
            back = time.monotonic()
            wait_until(
                lambda: http_status(f"{base}/readyz") == 200,
                timeout=WITHIN + 10,
                what="/readyz 200 once the database answers again",
                interval=0.1,
            )
            green_after = time.monotonic() - back
            assert proc.proc.poll() is None
        finally:
            proc.stop()
    print(f"silent: red after {red_after:.1f} s, green after {green_after:.1f} s")  # noqa: T201

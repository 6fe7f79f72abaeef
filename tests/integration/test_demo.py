"""`outbox demo` runs to the end on an embedded PostgreSQL and leaves nothing behind."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.queues import require_service

pytestmark = pytest.mark.slow


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # The embedded server's unix socket lives in its data directory: keep the path short.
    path = Path(tempfile.mkdtemp(prefix="od", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_demo_runs_to_completion_and_leaves_no_process_or_port(short_tmp: Path) -> None:
    tmp_path = short_tmp
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("OUTBOX_DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    statuses = dict(re.findall(r"(invoice-\d-\w+)\s+\w+\s+(\w+)\s", out))
    assert statuses == {
        **{f"invoice-{n}-charge": "succeeded" for n in (1, 2, 3, 4, 7)},
        **{f"invoice-{n}-paid": "succeeded" for n in (1, 2, 3, 4, 5)},
        "invoice-6-charge": "quarantined",
    }
    assert "5 Stripe objects for 6 charges" in out and "5 webhook deliveries" in out
    # The timeout's charge went through at Stripe: the check finds it paid (docs/runbook.md,
    # "Reconciliation"), not a PaymentIntent that awaits a payment method.
    assert (
        "reconciled invoice-7-charge: the check found its object at stripe in state succeeded, "
        "so the operation is succeeded after 1 attempt(s)"
    ) in out, out
    # Nothing left: the embedded server's directory is gone, and every port it printed is closed.
    assert list(tmp_path.glob("outbox-demo-*")) == []
    for port in re.findall(r"127\.0\.0\.1:(\d+)", out):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, port


def test_a_kept_demo_says_how_to_stop_it_and_that_stops_it(short_tmp: Path) -> None:
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    env.pop("OUTBOX_DATABASE_URL", None)
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--keep"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (kept,) = short_tmp.glob("outbox-demo-*")
    assert f"outbox demo --stop {kept}" in done.stdout
    dsn = re.search(r"OUTBOX_DATABASE_URL='([^']+)'", done.stdout)
    assert dsn is not None
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status"],
        capture_output=True,
        env={**env, "OUTBOX_DATABASE_URL": dsn[1]},
        text=True,
        timeout=60,
        check=False,
    )
    assert status.returncode == 0, status.stderr  # still running, as it said

    # A directory the demo did not make is refused, and left whole.
    other = short_tmp / "pgdata"
    other.mkdir()
    (other / "PG_VERSION").write_text("15\n")
    refused = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--stop", str(other)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2 and "is not a directory" in refused.stderr
    assert (other / "PG_VERSION").exists()

    stopped = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--stop", str(kept)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert stopped.returncode == 0, stopped.stderr
    assert not kept.exists()
    after = subprocess.run(
        [sys.executable, "-m", "outbox", "status"],
        capture_output=True,
        env={**env, "OUTBOX_DATABASE_URL": dsn[1]},
        text=True,
        timeout=60,
        check=False,
    )
    assert after.returncode == 1  # nothing answers there any more


def test_the_demo_in_front_of_a_real_jetstream_shows_the_repeat_recognised(db_url: str) -> None:
    require_service("NATS with JetStream", 4222, "nats-server -js (see the machine notes)")
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--dsn", db_url, "--queue", NATS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    orders = dict(re.findall(r"(order-\d)\s+succeeded\s+1\s+(\S+)", out))
    assert sorted(orders) == [f"order-{n}" for n in range(1, 6)], out
    assert len(set(orders.values())) == 5, orders  # one message, one sequence, per order
    assert "the stream holds 5 messages for 5 orders" in out
    assert f"answered {orders['order-1']} (the same message)" in out


NATS = "nats://127.0.0.1:4222"

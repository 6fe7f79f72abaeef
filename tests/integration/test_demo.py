"""`outbox demo` runs to the end on an embedded PostgreSQL and leaves nothing behind."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cluster import free_port
from tests.support.queues import require_service, wait_for_port
from tests.support.tools import require_tool

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
    # The console, as the demo says to start it, shows the demo's operations.
    said = re.search(r"outbox web --config (\S+)", done.stdout)
    assert said is not None
    port = free_port()
    console = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox",
            "web",
            "--config",
            said[1],
            "--listen",
            f"127.0.0.1:{port}",
        ],
        env={**env, "OUTBOX_DATABASE_URL": dsn[1]},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        page = ""
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                page = httpx.get(f"http://127.0.0.1:{port}/operations", timeout=2).text
                break
            time.sleep(0.05)
    finally:
        console.terminate()
        console.wait(10)
    assert "invoice-6-charge" in page and "invoice-7-charge" in page and "quarantined" in page

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


# A refusal before anything starts: the check connects once, within outbox.demo.jetstream's 5 s.
REFUSED_WITHIN = 15.0


def demo_queue(url: str, tmp: Path, *, block_nats: bool = False) -> tuple[int, str, str, float]:
    """`outbox demo --queue URL` on an embedded PostgreSQL in ``tmp``: its exit code, stdout,
    stderr and time taken. ``block_nats``: as on a machine without the nats extra, `import nats`
    fails (a finder ahead of the others on sys.meta_path, as for a package not installed)."""
    blocker = textwrap.dedent(
        """
        import runpy, sys

        class NoNats:
            def find_spec(self, name, path=None, target=None):
                if name == "nats" or name.startswith("nats."):
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, NoNats())
        sys.argv = ["outbox", *sys.argv[1:]]
        runpy.run_module("outbox", run_name="__main__", alter_sys=True)
        """
    )
    prefix = [sys.executable, "-c", blocker] if block_nats else [sys.executable, "-m", "outbox"]
    env = {**os.environ, "TMPDIR": str(tmp)}
    env.pop("OUTBOX_DATABASE_URL", None)
    began = time.monotonic()
    done = subprocess.run(
        [*prefix, "demo", "--queue", url],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr, time.monotonic() - began


def assert_nothing_started(tmp: Path, out: str, err: str) -> None:
    assert "starting an embedded PostgreSQL" not in out and "enqueued" not in out, out
    assert list(tmp.glob("outbox-demo-*")) == []
    assert "Traceback" not in err, err


def test_a_queue_url_nothing_listens_on_exits_2_at_once_before_anything_starts(
    short_tmp: Path,
) -> None:
    """It retried the connection for ever (nats-py's max_reconnect_attempts=0), after running
    the whole demo first."""
    url = f"nats://127.0.0.1:{free_port()}"
    code, out, err, took = demo_queue(url, short_tmp)
    assert code == 2, out + err
    assert took < REFUSED_WITHIN, f"{took:.1f}s"
    assert f"no NATS server answers at {url} (ConnectionRefusedError" in err, err
    assert "nats-server -js" in err
    assert_nothing_started(short_tmp, out, err)


def test_without_the_nats_extra_the_demo_exits_2_before_anything_starts(short_tmp: Path) -> None:
    """It ran the whole demo, then failed for want of the client. The server is one that
    answers, so that the missing client alone is the reason."""
    require_service("NATS with JetStream", 4222, "nats-server -js (see the machine notes)")
    code, out, err, took = demo_queue(NATS, short_tmp, block_nats=True)
    assert code == 2, out + err
    assert took < REFUSED_WITHIN, f"{took:.1f}s"
    assert "needs the NATS client (nats-py, the nats extra)" in err, err
    assert "pip install 'outbox[nats]'" in err
    assert_nothing_started(short_tmp, out, err)


def test_a_nats_server_without_jetstream_exits_2_naming_it(short_tmp: Path) -> None:
    server = require_tool("nats-server")
    port = free_port()
    nats = subprocess.Popen(
        [server, "-a", "127.0.0.1", "-p", str(port)],  # no -js
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, timeout=20, what="a nats-server without JetStream")
        code, out, err, took = demo_queue(f"nats://127.0.0.1:{port}", short_tmp)
    finally:
        nats.terminate()
        nats.wait(timeout=30)
    assert code == 2, out + err
    assert took < REFUSED_WITHIN, f"{took:.1f}s"
    assert "answers, but not its JetStream" in err and "-js" in err, err
    assert_nothing_started(short_tmp, out, err)

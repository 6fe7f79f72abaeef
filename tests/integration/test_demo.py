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
    done = subprocess.run([sys.executable, "-m", "outbox", "demo"], env=env,
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    statuses = dict(re.findall(r"(invoice-\d-\w+)\s+\w+\s+(\w+)\s", out))
    assert statuses == {
        **{f"invoice-{n}-charge": "succeeded" for n in (1, 2, 3, 4, 7)},
        **{f"invoice-{n}-paid": "succeeded" for n in (1, 2, 3, 4, 5)},
        "invoice-6-charge": "quarantined",
    }
    assert "5 Stripe objects for 6 charges" in out and "5 webhook deliveries" in out
    # Nothing left: the embedded server's directory is gone, and every port it printed is closed.
    assert list(tmp_path.glob("outbox-demo-*")) == []
    for port in re.findall(r"127\.0\.0\.1:(\d+)", out):
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", int(port))) != 0, port

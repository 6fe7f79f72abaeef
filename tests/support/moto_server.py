"""moto's server mode as a subprocess: a private SQS endpoint on a free loopback port for the sqs
provider's tests, started from the venv's own ``moto_server`` and stopped after them.

moto keeps every queue in memory, so a restart forgets them all (and every deduplication id):
the tests stand for an endpoint outage with a TCP proxy instead (tests/support/tcp_proxy.py).
Where moto departs from SQS, the tests say so (docs/providers.md, "Amazon SQS").
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Final

import pytest

# What every client of the fake endpoint signs with: moto accepts any credentials.
CREDENTIALS: Final = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # No instance metadata service to wait for, nor a developer's own profiles to read.
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}
REGION: Final = "us-east-1"
ACCOUNT: Final = "123456789012"  # moto's default account


def moto_binary() -> str | None:
    """The venv's moto_server (beside this interpreter), else one on PATH."""
    beside = Path(sys.executable).with_name("moto_server")
    return str(beside) if beside.exists() else shutil.which("moto_server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class MotoServer:
    """One moto_server process on ``port``; its output goes to ``log_path``."""

    def __init__(self, log_path: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def queue_url(self, name: str, *, port: int | None = None) -> str:
        """The URL of queue ``name`` (through another port: a proxy's)."""
        return f"http://127.0.0.1:{port or self.port}/{ACCOUNT}/{name}"

    def start(self, timeout: float = 30) -> MotoServer:
        binary = moto_binary()
        if binary is None:
            raise RuntimeError("moto_server is not installed (pip install 'moto[server]')")
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [binary, "-H", "127.0.0.1", "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                said = self.log_path.read_text()[-2000:]
                raise RuntimeError(f"moto_server did not start on {self.port}:\n{said}")
            time.sleep(0.1)
        return self

    def answers(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):  # noqa: S310 (loopback)
                return True
        except urllib.error.HTTPError:
            return True  # it answered
        except OSError:
            return False

    def stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def require_moto() -> str:
    """The moto_server binary; skips the test without it (fails it under CI)."""
    binary = moto_binary()
    if binary is not None:
        return binary
    message = "moto_server is not installed (pip install 'moto[server]')"
    if os.environ.get("OUTBOX_TEST_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@contextmanager
def moto_server(log_dir: Path) -> Iterator[MotoServer]:
    """A started moto_server, stopped on the way out."""
    require_moto()
    server = MotoServer(log_dir / f"moto-{os.getpid()}-{time.monotonic_ns()}.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """One moto_server per test module (per xdist worker): tests keep to queues of their own."""
    with moto_server(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The fake credentials in this process's environment, which `outbox run` inherits."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    return dict(CREDENTIALS)


__all__ = [
    "ACCOUNT",
    "CREDENTIALS",
    "REGION",
    "MotoServer",
    "aws_env",
    "free_port",
    "moto",
    "moto_server",
    "require_moto",
]

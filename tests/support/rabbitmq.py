"""A private RabbitMQ node for the tests that stop and start a broker: its own node name, ports,
database, logs, Erlang cookie and (empty) plugins, started from the machine's rabbitmq-server,
so that restarting it touches nothing the other tests share (the machine's broker on 5672).

It starts in about 7 seconds on a quiet machine. Its config file is its own: the machine's
/etc/rabbitmq/rabbitmq.conf names port 5672.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import pytest

from tests.support.queues import service_answers

SERVER: Final = Path("/usr/lib/rabbitmq/bin/rabbitmq-server")
CTL: Final = Path("/usr/lib/rabbitmq/bin/rabbitmqctl")
START_TIMEOUT: Final = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RabbitNode:
    """One private node; ``start`` and ``stop`` may be called again and again, and the node
    keeps its database (durable queues and persistent messages) between them."""

    base: Path
    name: str = field(default_factory=lambda: f"outbox-test-{uuid.uuid4().hex[:8]}@localhost")
    port: int = field(default_factory=free_port)
    dist_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"amqp://127.0.0.1:{self.port}/"

    def env(self) -> dict[str, str]:
        home = self.base / "home"
        return {
            **os.environ,
            "HOME": str(home),  # the Erlang cookie of this node and of its rabbitmqctl
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.base / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.base / "enabled_plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.base / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.base / "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": str(self.base / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(self.base / "node.pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def prepare(self) -> None:
        for sub in ("home", "mnesia", "log"):
            (self.base / sub).mkdir(parents=True, exist_ok=True)
        (self.base / "enabled_plugins").write_text("[].\n")
        (self.base / "rabbitmq-env.conf").write_text("")
        (self.base / "rabbitmq.conf").write_text(
            f"listeners.tcp.1 = 127.0.0.1:{self.port}\nloopback_users.guest = true\n"
        )

    def start(self, timeout: float = START_TIMEOUT) -> None:
        out = (self.base / "server.out").open("ab")
        self.process = subprocess.Popen(
            [str(SERVER)],
            env=self.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group: stopped by its id alone
        )
        out.close()
        deadline = time.monotonic() + timeout
        while not service_answers(self.port, timeout=0.2):
            if self.process.poll() is not None:
                raise AssertionError(f"rabbitmq-server exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"rabbitmq-server did not listen in {timeout}s")
            time.sleep(0.1)
        self.ctl("await_startup", "--timeout", str(int(max(1, deadline - time.monotonic()))))

    def stop(self) -> None:
        """A clean stop (persistent messages in durable queues are kept), waited for."""
        if self.process is None:
            return
        try:
            self.ctl("stop")
            self.process.wait(timeout=60)
        except (AssertionError, subprocess.TimeoutExpired):
            self.kill()
        self.process = None

    def stop_app(self) -> None:
        """Stop the broker (every connection closed, every queue stopped), leaving its Erlang
        VM up: start_app then recovers the durable queues from disk in seconds, where a whole
        node takes ten."""
        self.ctl("stop_app")

    def start_app(self, timeout: float = START_TIMEOUT) -> None:
        self.ctl("start_app")
        self.ctl("await_startup", "--timeout", str(int(timeout)))

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def ctl(self, *args: str) -> str:
        done = subprocess.run(
            [str(CTL), "-n", self.name, *args],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"rabbitmqctl {' '.join(args)}: {done.stdout}{done.stderr}")
        return done.stdout

    def log_tail(self) -> str:
        path = self.base / "server.out"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


@contextmanager
def private_rabbitmq(base: Path) -> Iterator[RabbitNode]:
    """A started private node under ``base``; killed, and its files removed, on the way out.
    Skips the test (fails it under OUTBOX_TEST_REQUIRE_TOOLS=1) without rabbitmq-server."""
    if not SERVER.exists() or not CTL.exists() or shutil.which("erl") is None:
        message = f"rabbitmq-server is not installed ({SERVER}): apt-get install rabbitmq-server"
        if os.environ.get("OUTBOX_TEST_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    node = RabbitNode(base)
    node.prepare()
    try:
        node.start()
        yield node
    finally:
        node.kill()  # its data goes with it: no clean stop needed
        shutil.rmtree(base, ignore_errors=True)


__all__ = ["RabbitNode", "free_port", "private_rabbitmq"]

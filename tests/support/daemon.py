"""Run the real `outbox run` in a subprocess, configured by a TOML file the test writes."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any


def write_config(path: Path, *, providers: dict[str, dict[str, Any]], **dispatcher: Any) -> Path:
    """A TOML config with a [dispatcher] table and one table per provider."""
    lines = ["[dispatcher]"]
    lines += [f"{key} = {_toml(value)}" for key, value in dispatcher.items()]
    for name, table in providers.items():
        lines.append(f"\n[providers.{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in table.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f'"{k}" = {_toml(v)}' for k, v in value.items()) + "}"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class OutboxProcess:
    """One `outbox run` subprocess; its log goes to a file the test can read.

    Each runs in a session of its own, so nothing of pytest's ends it: a test that fails before
    its ``stop()`` would leave it claiming and sending after the run. Every one still running
    when the test process exits is killed then (``_kill_left_over``)."""

    def __init__(
        self,
        db_url: str,
        config: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        metrics_addr: str = "off",
        wrapper: Sequence[str] = (),
    ) -> None:
        """``wrapper``: a command the process runs under, such as ``faketime -f +1h``."""
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        full_env = {**os.environ, "OUTBOX_DATABASE_URL": db_url, **(env or {})}
        self.proc = subprocess.Popen(
            [
                *wrapper,
                sys.executable,
                "-m",
                "outbox",
                "run",
                "--config",
                str(config),
                "--metrics-addr",
                metrics_addr,
            ],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # Its own process group: stop() kills a wrapper's child (faketime forks) as well.
            start_new_session=True,
        )
        _RUNNING.add(self)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, signum: signal.Signals) -> None:
        self.proc.send_signal(signum)

    def wait_started(self, timeout: float = 30) -> bool:
        """Wait until the process says it started (its signal handlers are installed by then:
        a SIGTERM before that ends it by the default action, exit -15); False if it exited or
        the time ran out first."""
        deadline = time.monotonic() + timeout
        while '"outbox run started"' not in self.log_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        """SIGKILL the process and anything it started, if still running; close the log."""
        _RUNNING.discard(self)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()

    def metrics_url(self, timeout: float = 30) -> str:
        """The HTTP listener's base URL, read from the process's log once it started."""
        found: list[str] = []

        def started() -> bool:
            found[:] = re.findall(r'"metrics_addr": "([^"]+)"', self.log_text())
            return bool(found)

        wait_until(started, timeout=timeout, what="the HTTP listener")
        return f"http://{found[0]}"

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self, said: str) -> list[dict[str, Any]]:
        """The JSON log lines whose event contains ``said``."""
        lines = (line for line in self.log_text().splitlines() if line.startswith("{"))
        return [e for e in map(json.loads, lines) if said in str(e.get("event", ""))]


_RUNNING: set[OutboxProcess] = set()


@atexit.register
def _kill_left_over() -> None:
    for process in list(_RUNNING):
        with contextlib.suppress(Exception):
            process.stop()


def http_status(url: str) -> int:
    """The status of a GET (0 when nothing answers): /readyz, /healthz."""
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:  # noqa: S310 (loopback)
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@contextmanager
def outbox_processes(
    count: int, db_url: str, config: Path, log_dir: Path, env: dict[str, str] | None = None
) -> Iterator[list[OutboxProcess]]:
    procs = [OutboxProcess(db_url, config, log_dir / f"outbox-{i}.log", env) for i in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_until(
    predicate: Callable[[], bool], *, timeout: float, what: str, interval: float = 0.05
) -> None:
    """Poll ``predicate`` until true; fail the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


__all__ = ["OutboxProcess", "outbox_processes", "signal", "wait_until", "write_config"]

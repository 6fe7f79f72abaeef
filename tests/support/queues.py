"""What the queue providers' tests share: the services they need, and `outbox run` driven through
the runs every queue is put to (docs/providers.md, "Queues"): a dispatch of many operations, a
SIGKILL between the publish and its record, and a wait for every operation to settle.

A test that needs a service that is not running skips with the reason, except under CI
(``OUTBOX_TEST_REQUIRE_TOOLS=1``), where it fails: a queue test never passes by not running.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Final

import pytest

from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import rows, statuses

# Fast settings for `outbox run` under test: a lease short enough that a second process takes
# back a killed one's operations within seconds.
FAST_RUN: dict[str, Any] = {
    "lease": "3s",
    "poll_interval": "100ms",
    "backoff_base": "50ms",
    "backoff_max": "500ms",
    "shutdown_grace": "5s",
    "gauge_interval": "1s",
}
# How long a publish may sit, answered but unrecorded, while the test kills its process.
HOLD_BEFORE_RECORD: Final = 120


def service_answers(port: int, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_service(name: str, port: int, how_to_start: str, host: str = "127.0.0.1") -> None:
    """Skip the test (fail it under CI) unless ``name`` answers on ``host:port``."""
    if service_answers(port, host):
        return
    message = f"{name} is not running on {host}:{port} (start it with: {how_to_start})"
    if os.environ.get("OUTBOX_TEST_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


def wait_for_port(port: int, *, timeout: float, what: str, host: str = "127.0.0.1") -> None:
    wait_until(lambda: service_answers(port, host, 0.2), timeout=timeout, what=what, interval=0.1)


@contextmanager
def outbox_run(
    db_url: str,
    tmp_path: Path,
    providers: dict[str, dict[str, Any]],
    *,
    name: str = "outbox",
    env: dict[str, str] | None = None,
    **dispatcher: Any,
) -> Iterator[OutboxProcess]:
    """One `outbox run` with ``providers`` and the fast settings (``dispatcher`` overrides them),
    started; SIGKILLed on the way out if still running."""
    config = write_config(
        tmp_path / f"{name}.toml", providers=providers, **{**FAST_RUN, **dispatcher}
    )
    process = OutboxProcess(db_url, config, tmp_path / f"{name}.log", env=env)
    try:
        if not process.wait_started():
            raise AssertionError(f"outbox run did not start:\n{process.log_text()[-4000:]}")
        yield process
    finally:
        process.stop()


def wait_settled(
    db_url: str,
    count: int,
    *,
    timeout: float,
    process: OutboxProcess | None = None,
    broken: Callable[[], str | None] | None = None,
) -> dict[str, int]:
    """Wait until ``count`` operations are succeeded, or none is pending or running any more;
    the statuses then. The assertion message carries the statuses and the process's log.
    ``broken``: what the test would fail on in the end, said as soon as it is seen (a message),
    so that a run that cannot pass stops waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        if broken is not None and (why := broken()) is not None:
            log = process.log_text()[-4000:] if process is not None else ""
            raise AssertionError(f"{why}\n{log}")
        now = statuses(db_url)
        if now.get("succeeded", 0) >= count:
            return now
        if not now.get("pending") and not now.get("in_flight") and sum(now.values()) >= count:
            return now
        if time.monotonic() > deadline:
            log = process.log_text()[-4000:] if process is not None else ""
            raise AssertionError(f"not settled after {timeout}s: {now}\n{log}")
        time.sleep(0.1)


def references(db_url: str) -> dict[int, str]:
    """Every succeeded operation's provider reference, by operation id."""
    found = rows(
        db_url, "SELECT id, provider_ref FROM outbox.operations WHERE status = 'succeeded'"
    )
    return {int(i): str(ref) for i, ref in found}


def crash_between_publish_and_record(
    db_url: str,
    tmp_path: Path,
    providers: dict[str, dict[str, Any]],
    *,
    count: int,
    published: Callable[[], int],
    timeout: float = 60,
    broken: Callable[[], str | None] | None = None,
    **dispatcher: Any,
) -> OutboxProcess:
    """Run `outbox run` until the queue holds ``count`` messages (``published`` counts them)
    while every answer waits before its record, SIGKILL it there, then run a second process
    that takes the operations back after their leases and settles them. Returns the second,
    still running; the caller asserts what the queue received. ``broken``: as for
    :func:`wait_settled`, while the second settles."""
    env = {"OUTBOX_FAILPOINTS": f"before_record={HOLD_BEFORE_RECORD}"}
    with outbox_run(db_url, tmp_path, providers, name="killed", env=env, **dispatcher) as first:
        wait_until(
            lambda: published() >= count, timeout=timeout, what=f"{count} messages published"
        )
        recorded = statuses(db_url).get("succeeded", 0)
        assert recorded == 0, f"{recorded} recorded before the kill: the failpoint did not hold"
        first.stop()
    second = _start(db_url, tmp_path, providers, dispatcher)
    try:
        wait_settled(db_url, count, timeout=timeout, process=second, broken=broken)
    except BaseException:
        second.stop()  # the caller never gets it to stop
        raise
    return second


def _start(
    db_url: str, tmp_path: Path, providers: dict[str, dict[str, Any]], dispatcher: dict[str, Any]
) -> OutboxProcess:
    config = write_config(
        tmp_path / "second.toml", providers=providers, **{**FAST_RUN, **dispatcher}
    )
    process = OutboxProcess(db_url, config, tmp_path / "second.log")
    if not process.wait_started():
        process.stop()
        raise AssertionError(f"the second outbox run did not start:\n{process.log_text()}")
    return process


__all__ = [
    "FAST_RUN",
    "crash_between_publish_and_record",
    "outbox_run",
    "references",
    "require_service",
    "service_answers",
    "wait_for_port",
    "wait_settled",
]

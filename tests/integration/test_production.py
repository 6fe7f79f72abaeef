"""What production sees of `outbox run`: systemd's notify protocol, /healthz, /readyz and
/metrics, over real sockets."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import enqueue_many, key_of, rows
from tests.support.tools import require_tool

pytestmark = pytest.mark.slow


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify.sock"))
    sock.settimeout(0.2)
    yield sock
    sock.close()


def messages(sock: socket.socket, until: float) -> list[str]:
    got: list[str] = []
    while time.monotonic() < until:
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
        if "STOPPING=1" in got:
            break
    return got


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 (loopback)
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_ready_watchdog_and_stopping_reach_systemd_s_socket(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path, notify_socket: socket.socket
) -> None:
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="200ms",
    )
    env = {"NOTIFY_SOCKET": notify_socket.getsockname(), "WATCHDOG_USEC": "1000000"}
    proc = OutboxProcess(db_url, cfg, tmp_path / "run.log", env=env)
    try:
        first = messages(notify_socket, time.monotonic() + 5)
        proc.signal(signal.SIGTERM)
        rest = messages(notify_socket, time.monotonic() + 10)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    assert first.count("READY=1") == 1, first
    assert first.count("WATCHDOG=1") >= 4  # every half of WatchdogSec=1s, for 5 s
    assert rest[-1] == "STOPPING=1"


def scrape_of(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:  # noqa: S310
        return str(answer.read().decode())


def test_health_readiness_and_metrics_over_http(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    succeeded_line = (
        'outbox_dispatch_total{action="invoice.paid",outcome="succeeded",provider="hook"} 2.0'
    )
    ops = enqueue_many(db_url, 3)
    # The held call must outlast every step below on a loaded machine: the default 10 s
    # timeout would end it as unknown before the scrape, and in_flight would read 0.
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "60s"}},
        poll_interval="200ms",
    )
    held_key = key_of(db_url, ops[0])
    with receiver.hold(held_key) as held:
        proc = OutboxProcess(db_url, cfg, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
        try:
            base = proc.metrics_url()
            assert held.arrived.wait(30)
            wait_until(lambda: get(f"{base}/readyz") == 200, timeout=30, what="readiness")
            assert get(f"{base}/healthz") == 200
            assert get(f"{base}/nope") == 404
            # The two calls not held are recorded before the drain begins: on a loaded machine
            # they may still be on their way when the held one arrives.
            wait_until(lambda: succeeded_line in scrape_of(base), timeout=30, what="two records")
            proc.signal(signal.SIGTERM)  # draining: the held call keeps it alive
            wait_until(lambda: get(f"{base}/readyz") == 503, timeout=10, what="unready")
            assert get(f"{base}/healthz") == 200
            scrape = scrape_of(base)
            held.release()
            assert proc.wait(timeout=30) == 0
        finally:
            proc.stop()
    assert succeeded_line in scrape
    # The held call, and nothing else: printed whole when it is not, with what the run logged.
    in_flight = [line for line in scrape.splitlines() if line.startswith("outbox_in_flight ")]
    assert in_flight == ["outbox_in_flight 1.0"], proc.log_text()[-4000:]
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE status = 'succeeded'") == [
        (3,)
    ]


def scrape(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:  # noqa: S310 (loopback)
        return str(answer.read().decode())


def sample(text: str, name: str, **labels: str) -> float:
    """The value of one series in a Prometheus text scrape (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            series = line.split(" ")[0]
            if series == name or series.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_a_scrape_after_a_run_matches_the_rows(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    from outbox.testing.webhook import WebhookFault  # noqa: PLC0415

    ids = enqueue_many(db_url, 10)
    for op in ids[:2]:
        receiver.inject(WebhookFault.status(422), key=key_of(db_url, op))
    receiver.inject(WebhookFault.status(429), key=key_of(db_url, ids[2]))
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="100ms",
        backoff_base="50ms",
        backoff_max="100ms",
        gauge_interval="200ms",
    )
    proc = OutboxProcess(db_url, cfg, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
    try:
        base = proc.metrics_url()
        wait_until(
            lambda: sample(scrape(base), "outbox_operations", status="succeeded") == 8,
            timeout=30,
            what="the gauges to catch up",
        )
        text = scrape(base)
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    outcomes = dict(rows(db_url, "SELECT outcome, count(*) FROM outbox.attempts GROUP BY 1"))
    for outcome, count in outcomes.items():
        got = sample(text, "outbox_dispatch_total", provider="hook", outcome=outcome)
        assert got == count, outcome
    for status, count in rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1"):
        assert sample(text, "outbox_operations", status=status) == count, status
    assert (
        sample(text, "outbox_quarantined_total", provider="hook", reason="permanent_failure") == 2
    )
    assert sample(text, "outbox_retries_total", provider="hook") == 1
    assert sample(text, "outbox_build_info") == 1
    promtool = require_tool("promtool", "prometheus")  # the scrape passes Prometheus's own lint
    linted = subprocess.run(
        [promtool, "check", "metrics"],
        input=text,
        text=True,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert linted.returncode == 0, linted.stdout + linted.stderr


def test_readyz_follows_the_database_going_away_and_coming_back(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    from tests.support.tcp_proxy import TcpProxy  # noqa: PLC0415

    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="100ms",
    )
    with TcpProxy(db_url) as proxy:
        proc = OutboxProcess(proxy.dsn, cfg, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
        try:
            base = proc.metrics_url()
            wait_until(lambda: get(f"{base}/readyz") == 200, timeout=30, what="ready")
            proxy.cut()
            wait_until(lambda: get(f"{base}/readyz") == 503, timeout=30, what="unready")
            assert get(f"{base}/healthz") == 200  # alive all the same
            proxy.heal()
            wait_until(lambda: get(f"{base}/readyz") == 200, timeout=60, what="ready again")
            enqueue_many(db_url, 1)  # and it dispatches again
            wait_until(lambda: receiver.effect_count() == 1, timeout=30, what="a dispatch")
            proc.signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            proc.stop()

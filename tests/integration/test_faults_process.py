"""Faults inside the real `outbox run`: a bug that leaves a transaction open across a provider
call, and a daemon whose clock is an hour off. Each test counts rows and the receiver's effects."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import enqueue_many, key_of, rows, statuses
from tests.support.tools import require_tool

pytestmark = pytest.mark.slow


def config(
    tmp_path: Path, receiver: FakeWebhookReceiver, timeout: str = "10s", **dispatcher: Any
) -> Path:
    hook = {"type": "webhook", "url": receiver.url, "timeout": timeout, "key_retention": "90m"}
    settings: dict[str, Any] = {
        "lease": "3s",
        "poll_interval": "200ms",
        "backoff_base": "1s",
        "backoff_max": "2s",
        **dispatcher,
    }
    return write_config(tmp_path / "outbox.toml", providers={"hook": hook}, **settings)


def row_locked(url: str, op: int) -> bool:
    with psycopg.connect(url) as conn:
        try:
            conn.execute("SELECT 1 FROM outbox.operations WHERE id = %s FOR UPDATE NOWAIT", (op,))
        except psycopg.errors.LockNotAvailable:
            return True
    return False


def test_a_transaction_left_open_across_a_send_is_refused_and_the_server_frees_the_row(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 3)
    # The simulated bug, once: a transaction locking the row is left open just before the send,
    # on a connection never given back; the session's idle-in-transaction timeout is 3 s.
    proc = OutboxProcess(
        db_url,
        config(tmp_path, receiver),
        tmp_path / "run.log",
        env={"OUTBOX_FAILPOINTS": "leak_transaction=3"},
    )
    try:
        wait_until(
            lambda: "ConnectionHeldAcrossSend" in proc.log_text(),
            timeout=30,
            what="the guard to refuse the send",
        )
        # The other two may still be on their way to being recorded when the guard logs.
        wait_until(
            lambda: statuses(db_url) == {"in_flight": 1, "succeeded": 2},
            timeout=30,
            what="the other two to be recorded",
        )
        ((victim,),) = rows(db_url, "SELECT id FROM outbox.operations WHERE status = 'in_flight'")
        assert row_locked(db_url, victim)
        assert len(receiver.effects) == 2  # the other two; nothing under the open transaction
        wait_until(
            lambda: not row_locked(db_url, victim),
            timeout=15,
            what="the server to end the idle transaction",
        )
        wait_until(
            lambda: statuses(db_url) == {"succeeded": 3},
            timeout=30,
            what="the rescued row to be sent",
        )
    finally:
        proc.stop()
    assert receiver.effect_count() == 3
    assert len(receiver.received) == 3  # the victim was sent once, after its row was freed
    assert rows(db_url, "SELECT attempts FROM outbox.operations WHERE id = %s", (victim,)) == [
        (2,)  # the refused attempt counts; its lease expired unsent
    ]


def test_the_wrong_wall_clock_changes_nothing_because_every_comparison_uses_the_database_clock(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    ops = enqueue_many(db_url, 12)
    keys = {op: key_of(db_url, op) for op in ops}
    for op in ops[:4]:  # an unknown outcome each: retried with the same key inside its window
        receiver.inject(WebhookFault.error_500_before_apply(), key=keys[op])
    slow = receiver.hold(keys[ops[4]])  # held past the lease: only heartbeats keep it
    # A 6 s lease, renewed every 2 s: a CI machine at a load of 14 delayed a 1 s heartbeat past a
    # 3 s lease once, and the rescue's resend then met the held key's 409s.
    # The held call must outlive neither its timeout nor a loaded machine: at 10 s, a slow wait for
    # the others plus the 9 s below timed it out, and its retry was a (correct) replay.
    cfg = config(tmp_path, receiver, timeout="60s", lease="6s")
    faketime = require_tool("faketime")
    # asyncio's timers run on the monotonic clock; only the wall clock is wrong.
    env = {"FAKETIME_DONT_FAKE_MONOTONIC": "1"}
    daemons = [
        OutboxProcess(
            db_url, cfg, tmp_path / f"clock{offset}.log", env, wrapper=[faketime, "-f", offset]
        )
        for offset in ("+1h", "-1h")
    ]
    try:
        assert slow.arrived.wait(30)
        wait_until(
            lambda: statuses(db_url).get("succeeded") == 11,
            timeout=60,
            what="the others to succeed",
        )
        time.sleep(9)  # well past the 6 s lease: a rescue by the wall clock would resend it
        slow.release()
        wait_until(
            lambda: statuses(db_url) == {"succeeded": 12},
            timeout=30,
            what="the held call to be recorded",
        )
    finally:
        for daemon in daemons:
            daemon.stop()
    for offset, sign in (("+1h", 1), ("-1h", -1)):  # the fault really was in place
        assert abs(_log_clock_offset(tmp_path / f"clock{offset}.log") - sign * 3600) < 300
    assert receiver.effect_count() == 12
    op_of = {key: op for op, key in keys.items()}
    seen = [
        (ops.index(op_of[r.key]) if r.key in op_of else r.key, r.status, r.replayed)
        for r in receiver.received
    ]
    # The 4 retries; no rescue resent the held call.
    assert len(seen) == 12 + 4, f"{sorted(seen, key=str)} {_outcomes(tmp_path)}"
    assert rows(
        db_url, "SELECT attempts, count(*) FROM outbox.operations GROUP BY 1 ORDER BY 1"
    ) == [(1, 8), (2, 4)]
    # Every timestamp the daemons caused was taken from the database clock, not theirs.
    ((skew,),) = rows(
        db_url, "SELECT max(abs(extract(epoch FROM started_at - finished_at))) FROM outbox.attempts"
    )
    assert skew < 60
    ((off,),) = rows(
        db_url,
        "SELECT count(*) FROM outbox.operations WHERE greatest("
        "abs(extract(epoch FROM updated_at - now())), "
        "abs(extract(epoch FROM first_sent_at - now())), "
        "abs(extract(epoch FROM last_attempt_at - now())), "
        "abs(extract(epoch FROM available_at - now()))) > 600",
    )
    assert off == 0


def _outcomes(tmp_path: Path) -> list[str]:
    """The daemons' log lines past start-up (attempts, warnings), to explain a failure."""
    return [
        line
        for log in sorted(tmp_path.glob("clock*.log"))
        for line in log.read_text().splitlines()[3:]
    ]


def _log_clock_offset(log: Path) -> float:
    """Seconds between the daemon's wall clock (its first log line) and ours."""
    first = json.loads(log.read_text().splitlines()[0])
    stamped = datetime.fromisoformat(first["timestamp"])
    return (stamped - datetime.now(UTC)).total_seconds()

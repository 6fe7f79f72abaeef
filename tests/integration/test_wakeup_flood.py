"""Wake-ups nobody can flood (issue 17, case 7).

Any database role may `NOTIFY outbox_enqueue`. Before the dispatcher coalesced its wake-ups,
40,000 notifications drove about 900 claim queries in 1.5 s; now a claim woken by a notification
that found nothing makes the next wake-up wait a doubling gap, up to WAKE_GAP_MAX.
"""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.dispatch.claims import WAKE_GAP_MAX
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import dispatcher

FLOOD = 40_000
SENDERS = 8


def notify(url: str, part: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for n in range(part, FLOOD, SENDERS):
            conn.execute("SELECT pg_notify('outbox_enqueue', %s)", (str(n),))


def claims(base: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:  # noqa: S310
        text = answer.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("outbox_claim_duration_seconds_count")]
    return float(line.split()[-1])


def test_a_flood_of_notifications_costs_a_claim_per_gap_and_real_work_still_wakes_at_once(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="1s",
    )
    proc = OutboxProcess(db_url, cfg, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
    try:
        base = proc.metrics_url()
        wait_until(
            lambda: '"listening for enqueue notifications"' in proc.log_text(),
            timeout=30,
            what="the LISTEN connection",
        )
        time.sleep(1.5)  # idle: its waiting mark is set, the first polls are done
        before, started = claims(base), time.monotonic()
        # One notification per transaction, from 8 connections at once: they arrive one by
        # one, as a busy producer's would (in batches, a burst costs few claims anyway).
        with concurrent.futures.ThreadPoolExecutor(SENDERS) as pool:
            list(pool.map(lambda part: notify(db_url, part), range(SENDERS)))
        time.sleep(2.0)  # the last notifications reach it, and it reads them all
        spent, elapsed = claims(base) - before, time.monotonic() - started
        # A claim per gap at most, plus the doubling up to it and a poll a second.
        bound = elapsed / WAKE_GAP_MAX + 8 + elapsed
        assert spent <= bound, f"{spent:.0f} claims in {elapsed:.1f} s (bound {bound:.0f})"
        # Real work after the flood still wakes the dispatcher, within a gap, not a poll.
        with psycopg.connect(db_url) as conn:
            outbox.enqueue(
                conn,
                tenant_id="t",
                operation_type="x",
                operation_key="real",
                provider="hook",
                action="a",
                payload={},
            )
        wait_until(lambda: receiver.effect_count() == 1, timeout=10, what="the real one")
        assert proc.proc.poll() is None
    finally:
        proc.stop()


async def test_only_notifications_that_find_nothing_make_the_next_one_wait(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A slot freed or rows staged wake the claim loop too: those must never be counted as a
    flood, or a provider with max_in_flight would make every real notification wait."""
    d = dispatcher(pool, {}, poll_interval=timedelta(seconds=30))
    d.wake()  # a notification: its claim found nothing
    await d.claims.idle(found=False)
    assert d.claims.empty_wakes == 1
    for _ in range(5):  # wake-ups of the process's own, finding nothing
        d.claims.woken.set()
        await d.claims.idle(found=False)
    assert d.claims.empty_wakes == 1
    d.wake()
    await d.claims.idle(found=True)
    assert d.claims.empty_wakes == 1

"""PostgreSQL failover as a tested property (issue 23; docs/operations.md, "Database failover").

A primary and a streaming standby, both private to the test; producers and `outbox run` list
both hosts with ``target_session_attrs=read-write``. Mid-run the primary is killed (``pg_ctl stop
-m immediate``) and the standby promoted, in both replication modes:

* synchronous: every acknowledged enqueue survives, and each is delivered exactly once;
* asynchronous, the standby cut off shortly before the crash: acknowledged enqueues are lost
  with the primary, some of them already delivered; the record of one whose call outlives the
  crash is counted and logged as a row the database lost, not as a lease taken; and one whose
  record the new primary lost is in flight there under the process's own lease, and taken
  back at once.

In both: `outbox run` never exits; dispatch resumes within RESUME_WITHIN of the promotion; no key
has a second effect at the provider (a record lost with the old primary means a re-send, which
the provider answers from its key); readiness goes red, then green on the new server, whose
change of timeline is logged; and rows that the new primary holds in flight under the process's
own lease are taken back at once, not after the lease (LEASE, far beyond the drain's bound).
"""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.daemon import OutboxProcess, http_status, wait_until, write_config
from tests.support.replication import ReplicatedPair, replicated_pair

pytestmark = pytest.mark.slow

RATE = 150.0  # enqueues a second, as in the runs
BEFORE, AFTER = 2.0, 3.0  # seconds of producing before the kill and after the promotion
DOWN = 0.5  # seconds between the kill and the promotion
LEASE = "60s"  # a stale lease left to expire would hold the drain far beyond DRAIN_WITHIN
RESUME_WITHIN = 10.0  # seconds from the promotion to the first delivery of a new enqueue
DRAIN_WITHIN = 30.0  # seconds from the last enqueue to every row finished
ASYNC_DELAY = 0.02  # the asynchronous standby's lag, each way
SLOW_CALL = 4.0  # seconds the provider takes to answer the operation in flight at the crash


class Producer(threading.Thread):
    """Enqueues at RATE through the multi-host URL, one operation per transaction, until
    stopped. A COMMIT that fails is not acknowledged: it may or may not have happened, and the
    next attempt repeats the same operation key (an idempotent enqueue) on a new connection."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.acked: dict[str, float] = {}  # operation key -> time.monotonic() of its COMMIT
        self.failed = 0

    def run(self) -> None:
        n, conn = 0, None
        start = time.monotonic()
        while not self.stop.is_set():
            time.sleep(max(0.0, start + n / RATE - time.monotonic()))
            key = f"op-{n}"
            try:
                conn = conn if conn is not None and not conn.closed else self._connect()
                outbox.enqueue(
                    conn,
                    tenant_id="t",
                    operation_type="failover",
                    operation_key=key,
                    provider="hook",
                    action="a",
                    payload={"n": n},
                )
                conn.commit()
            except psycopg.Error:
                self.failed += 1
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
                continue  # the same key again
            self.acked[key] = time.monotonic()
            n += 1
        if conn is not None:
            conn.close()

    def _connect(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.url, connect_timeout=2)


def enqueue_with_call(
    url: str, receiver: FakeWebhookReceiver, name: str, answer_after: float
) -> str:
    """Enqueue ``name``, whose call the provider answers ``answer_after`` seconds after acting,
    and wait until the call reached the provider; returns its idempotency key."""
    with psycopg.connect(url) as conn:
        op = outbox.enqueue(
            conn,
            tenant_id="t",
            operation_type="failover",
            operation_key=name,
            provider="hook",
            action="a",
            payload={"name": name},
        ).operation_id
        row = conn.execute(
            "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (op,)
        ).fetchone()
        assert row is not None
        key = str(row[0])
        receiver.inject(WebhookFault.delay_after_apply(answer_after), key=key)
        conn.commit()
    wait_until(
        lambda: receiver.effect_count(key) == 1, timeout=10, what=f"{name}'s call", interval=0.002
    )
    return key


def status_on(url: str, name: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT status FROM outbox.operations WHERE operation_key = %s", (name,)
        ).fetchone()
    return None if row is None else str(row[0])


def crash(pair: ReplicatedPair, receiver: FakeWebhookReceiver) -> None:
    """Kill the primary with a call under way ("slow": its answer comes after the promotion,
    so its record meets the new primary). Under asynchronous replication, first cut the standby
    off and let a call end and be recorded ("stale") on the primary alone: the new primary then
    has "stale" in flight under this process's own lease, and lacks "slow" altogether."""
    if not pair.synchronous:
        enqueue_with_call(pair.url, receiver, "stale", answer_after=1.0)
        pair.pause_replication()
    enqueue_with_call(pair.url, receiver, "slow", answer_after=SLOW_CALL)
    if not pair.synchronous:
        wait_until(
            lambda: status_on(pair.primary.url, "stale") == "succeeded",
            timeout=10,
            what="the stale operation's record on the old primary",
        )
    pair.kill_primary()


def rows(url: str) -> dict[str, tuple[str, str]]:
    """operation key -> (status, idempotency key), on whichever server is the primary now."""
    with psycopg.connect(url) as conn:
        found = conn.execute(
            "SELECT operation_key, status, idempotency_key FROM outbox.operations"
        ).fetchall()
    return {key: (status, idem) for key, status, idem in found}


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(f"{base}/metrics", timeout=5) as answer:  # noqa: S310
        text = answer.read().decode()
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(f"{name} "))


@pytest.fixture(params=["synchronous", "asynchronous"])
def pair(request: pytest.FixtureRequest) -> Iterator[ReplicatedPair]:
    synchronous = request.param == "synchronous"
    with replicated_pair(
        synchronous=synchronous, delay=0.0 if synchronous else ASYNC_DELAY
    ) as made:
        yield made


def test_a_failover_keeps_the_promise_in_both_replication_modes(
    pair: ReplicatedPair, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval="200ms",
        lease=LEASE,
    )
    proc = OutboxProcess(pair.url, cfg, tmp_path / "run.log", metrics_addr="127.0.0.1:0")
    producer = Producer(pair.url)
    try:
        base = proc.metrics_url()
        wait_until(lambda: http_status(f"{base}/readyz") == 200, timeout=30, what="ready")
        producer.start()
        time.sleep(BEFORE)
        crash(pair, receiver)
        wait_until(
            lambda: http_status(f"{base}/readyz") == 503,
            timeout=10,
            what="/readyz 503",
            interval=0.1,
        )
        time.sleep(DOWN)
        pair.promote()
        promoted = time.monotonic()
        wait_until(
            lambda: http_status(f"{base}/readyz") == 200,
            timeout=10,
            what="/readyz 200 on the promoted standby",
            interval=0.1,
        )
        time.sleep(AFTER)
        producer.stop.set()
        producer.join(timeout=30)
        last_enqueue = time.monotonic()
        acked_after = [k for k, at in producer.acked.items() if at > promoted]
        assert acked_after, "no enqueue was acknowledged after the promotion"

        def drained() -> bool:
            return all(s in ("succeeded",) for s, _ in rows(pair.url).values())

        wait_until(drained, timeout=DRAIN_WITHIN, what="every row finished", interval=0.2)
        drained_in = time.monotonic() - last_enqueue
        assert proc.proc.poll() is None, "outbox run exited"
        missing_counted = metric(base, "outbox_record_row_missing_total")
    finally:
        producer.stop.set()
        proc.stop()

    now = rows(pair.url)
    effects = receiver.effects
    by_key: dict[str, int] = {}
    for effect in effects:
        by_key[effect.key] = by_key.get(effect.key, 0) + 1
    doubled = {k: n for k, n in by_key.items() if n > 1}
    assert doubled == {}, f"keys with a second effect: {doubled}"

    lost = sorted(set(producer.acked) - set(now))
    if pair.synchronous:
        assert lost == [], f"acknowledged enqueues lost under synchronous replication: {lost}"
    for _key, (_status, idem) in now.items():
        assert by_key.get(idem) == 1  # every surviving row: delivered, exactly once

    # Resumed: the first operation acknowledged after the promotion reached the provider soon.
    first_after = min(producer.acked[k] for k in acked_after)
    first_key = now[min(acked_after, key=producer.acked.__getitem__)][1]
    (arrival,) = [e.at for e in effects if e.key == first_key]
    assert arrival - promoted < RESUME_WITHIN, f"resumed {arrival - promoted:.1f} s after"
    assert arrival >= first_after

    # Readiness and its lines: lost, then reachable on the new server, whose timeline is new.
    (lost_line, *_) = proc.events("database lost")
    assert lost_line["port"] == pair.primary.port
    reachable = proc.events("database reachable")
    assert [e["port"] for e in reachable][-1] == pair.standby.port
    (changed,) = proc.events("database server changed")
    assert changed["timeline"] == changed["previous_timeline"] + 1
    assert changed["system_identifier"] == changed["previous_system_identifier"]

    # Records of rows the new primary lacks say so, and only for rows really gone (by key: the
    # new primary's sequence may give a lost row's id to another operation).
    said_missing = proc.events("found no such operation")
    gone = {e["operation_key"] for e in said_missing}
    assert missing_counted == len(said_missing)
    assert gone.isdisjoint(now), f"said missing, yet there: {gone & set(now)}"
    if pair.synchronous:
        assert gone == set()
        assert now["slow"][0] == "succeeded"
    else:
        assert "slow" not in now and "slow" in gone, "a record of a lost row said nothing"
        # Taken back at once: LEASE would have held it far beyond DRAIN_WITHIN.
        assert now["stale"][0] == "succeeded"
        stale = [e for e in proc.events("taken back now") if e["operations"] >= 1]
        assert stale, "the stale lease was not taken back"
    taken_back = sum(e["operations"] for e in proc.events("taken back now"))
    print(  # noqa: T201
        f"{pair.synchronous=}: {len(producer.acked)} acknowledged, {len(lost)} lost, "
        f"{producer.failed} failed commits, {len(effects)} effects, resumed "
        f"{arrival - promoted:.2f} s after promotion, drained {drained_in:.1f} s after the "
        f"last enqueue, {len(said_missing)} records of missing rows, {taken_back} stale leases "
        "taken back"
    )

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
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox
from outbox.testing.webhook import Effect, FakeWebhookReceiver, Hold, WebhookFault
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
    url: str, receiver: FakeWebhookReceiver, name: str, answer_after: float | None
) -> Hold | None:
    """Enqueue ``name``, whose call the provider answers ``answer_after`` seconds after acting
    (None: when the returned hold is released), and wait until the call reached the provider."""
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
        held = None
        if answer_after is None:
            held = receiver.hold(key)
        else:
            receiver.inject(WebhookFault.delay_after_apply(answer_after), key=key)
        conn.commit()
    wait_until(
        lambda: receiver.effect_count(key) == 1, timeout=10, what=f"{name}'s call", interval=0.002
    )
    return held


def status_on(url: str, name: str) -> str | None:
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT status FROM outbox.operations WHERE operation_key = %s", (name,)
        ).fetchone()
    return None if row is None else str(row[0])


def crash(pair: ReplicatedPair, receiver: FakeWebhookReceiver) -> Hold:
    """Kill the primary with a call under way ("slow": the provider holds its answer until
    the caller releases it after the promotion, so its record meets the new primary; an answer
    timed instead came before the kill on a loaded machine, and was recorded on the old one).
    Under asynchronous replication, first cut the standby off and let a call end and be
    recorded ("stale") on the primary alone: the new primary then has "stale" in flight under
    this process's own lease, and lacks "slow" altogether."""
    if not pair.synchronous:
        enqueue_with_call(pair.url, receiver, "stale", answer_after=1.0)
        # The relay lags and the standby replays when it can: cut it off only once it holds the
        # claim, or on a loaded machine it lacks "stale" altogether and the case is another.
        wait_until(
            lambda: status_on(pair.standby.url, "stale") == "in_flight",
            timeout=10,
            what="the stale operation's claim on the standby",
            interval=0.005,
        )
        pair.pause_replication()
    slow = enqueue_with_call(pair.url, receiver, "slow", answer_after=None)
    assert slow is not None
    if not pair.synchronous:
        wait_until(
            lambda: status_on(pair.primary.url, "stale") == "succeeded",
            timeout=10,
            what="the stale operation's record on the old primary",
        )
    pair.kill_primary()
    return slow


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


@dataclass
class Run:
    """What one failover left: the daemon, the producer's acknowledgements, and when."""

    proc: OutboxProcess
    producer: Producer
    promoted: float  # time.monotonic() when `pg_ctl promote` returned
    drained_in: float  # seconds from the last enqueue to every row finished
    missing_counted: float  # outbox_record_row_missing_total at the end


def fail_over(pair: ReplicatedPair, receiver: FakeWebhookReceiver, tmp_path: Path) -> Run:
    """Produce, crash the primary mid-run, promote the standby, produce, drain."""
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
        ready = f"{base}/readyz"
        wait_until(lambda: http_status(ready) == 200, timeout=30, what="ready")
        producer.start()
        time.sleep(BEFORE)
        slow = crash(pair, receiver)
        wait_until(lambda: http_status(ready) == 503, timeout=10, what="503", interval=0.1)
        time.sleep(DOWN)
        pair.promote()
        promoted = time.monotonic()
        slow.release()
        wait_until(lambda: http_status(ready) == 200, timeout=10, what="200 again", interval=0.1)
        time.sleep(AFTER)
        producer.stop.set()
        producer.join(timeout=30)
        last_enqueue = time.monotonic()

        def drained() -> bool:
            return all(status == "succeeded" for status, _ in rows(pair.url).values())

        wait_until(drained, timeout=DRAIN_WITHIN, what="every row finished", interval=0.2)
        assert proc.proc.poll() is None, "outbox run exited"
        missing = metric(base, "outbox_record_row_missing_total")
        return Run(proc, producer, promoted, time.monotonic() - last_enqueue, missing)
    finally:
        producer.stop.set()
        proc.stop()


def test_a_failover_keeps_the_promise_in_both_replication_modes(
    pair: ReplicatedPair, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    run = fail_over(pair, receiver, tmp_path)
    now = rows(pair.url)
    effects = receiver.effects
    by_key = Counter(effect.key for effect in effects)
    doubled = {k: n for k, n in by_key.items() if n > 1}
    assert doubled == {}, f"keys with a second effect: {doubled}"
    lost = sorted(set(run.producer.acked) - set(now))
    if pair.synchronous:
        assert lost == [], f"acknowledged enqueues lost under synchronous replication: {lost}"
    for _status, idem in now.values():
        assert by_key[idem] == 1  # every surviving row: delivered, exactly once
    resumed = resumed_after(run, now, effects)
    assert resumed < RESUME_WITHIN, f"resumed {resumed:.1f} s after the promotion"
    said_missing = check_log_lines(pair, run, now)
    taken_back = sum(e["operations"] for e in run.proc.events("taken back now"))
    print(  # noqa: T201
        f"{pair.synchronous=}: {len(run.producer.acked)} acknowledged, {len(lost)} lost, "
        f"{run.producer.failed} failed commits, {len(effects)} effects, resumed {resumed:.2f} s "
        f"after promotion, drained {run.drained_in:.1f} s after the last enqueue, "
        f"{said_missing} records of missing rows, {taken_back} stale leases taken back"
    )


def resumed_after(run: Run, now: dict[str, tuple[str, str]], effects: list[Effect]) -> float:
    """Seconds from the promotion to the provider's receipt of the first operation acknowledged
    after it."""
    after = [k for k, at in run.producer.acked.items() if at > run.promoted]
    assert after, "no enqueue was acknowledged after the promotion"
    first = min(after, key=run.producer.acked.__getitem__)
    (arrival,) = [e.at for e in effects if e.key == now[first][1]]
    assert arrival >= run.producer.acked[first]
    return arrival - run.promoted


def check_log_lines(pair: ReplicatedPair, run: Run, now: dict[str, tuple[str, str]]) -> int:
    """Readiness lost and found on the new server, whose timeline is new; records of rows the
    new primary lacks said so, only for those; the stale lease taken back. Returns how many
    records of missing rows were logged."""
    proc = run.proc
    (lost_line, *_) = proc.events("database lost")
    assert lost_line["port"] == pair.primary.port
    assert [e["port"] for e in proc.events("database reachable")][-1] == pair.standby.port
    (changed,) = proc.events("database server changed")
    assert changed["timeline"] == changed["previous_timeline"] + 1
    assert changed["system_identifier"] == changed["previous_system_identifier"]
    # By key, not id: the new primary's sequence may give a lost row's id to another operation.
    said_missing = proc.events("found no such operation")
    gone = {e["operation_key"] for e in said_missing}
    assert run.missing_counted == len(said_missing)
    assert gone.isdisjoint(now), f"said missing, yet there: {gone & set(now)}"
    if pair.synchronous:
        assert gone == set()
        assert now["slow"][0] == "succeeded"
    else:
        assert "slow" not in now and "slow" in gone, "a record of a lost row said nothing"
        # Taken back at once: LEASE would have held it far beyond DRAIN_WITHIN.
        assert now["stale"][0] == "succeeded"
        assert [e for e in proc.events("taken back now") if e["operations"] >= 1]
    return len(said_missing)

"""The real `outbox run` in subprocesses, with real faults: SIGKILL, SIGSTOP, SIGTERM, and
database backends terminated under it. Every test counts rows and the receiver's effects."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.daemon import OutboxProcess, outbox_processes, wait_until, write_config
from tests.support.dispatch import enqueue_many, key_of, rows, statuses

pytestmark = pytest.mark.slow


def config(tmp_path: Path, receiver: FakeWebhookReceiver, **dispatcher: Any) -> Path:
    settings: dict[str, Any] = {
        "lease": "2s",
        "poll_interval": "200ms",
        "backoff_base": "50ms",
        "backoff_max": "200ms",
        "shutdown_grace": "10s",
    }
    settings.update(dispatcher)
    return write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "5s"}},
        **settings,
    )


def count_status(url: str, status: str) -> int:
    return statuses(url).get(status, 0)


def test_four_processes_dispatch_10000_operations_exactly_once(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 10_000)
    cfg = config(tmp_path, receiver, lease="30s", batch_size=100, concurrency=64)
    started = time.monotonic()
    with outbox_processes(4, db_url, cfg, tmp_path) as procs:
        wait_until(
            lambda: count_status(db_url, "succeeded") == 10_000,
            timeout=240,
            what="10,000 operations to succeed",
        )
        elapsed = time.monotonic() - started
        for p in procs:
            p.signal(signal.SIGTERM)
        assert [p.wait() for p in procs] == [0, 0, 0, 0]
    print(f"\n4 x outbox run: 10,000 operations in {elapsed:.1f}s = {10_000 / elapsed:.0f}/s")  # noqa: T201 (the figure the closing note quotes)
    assert statuses(db_url) == {"succeeded": 10_000}
    assert receiver.effect_count() == 10_000
    assert len({e.key for e in receiver.effects}) == 10_000
    # One succeeded attempt each, from all four workers. Any other attempt is a retry with the
    # same key after the 5 s timeout (a loaded CI machine can slow the receiver that much),
    # never a row leased twice: no worker ever found its lease taken.
    assert rows(
        db_url,
        "SELECT count(*) FILTER (WHERE outcome = 'succeeded'), "
        "count(DISTINCT worker) FROM outbox.attempts",
    ) == [(10_000, 4)]
    assert rows(
        db_url, "SELECT DISTINCT outcome FROM outbox.attempts WHERE outcome <> 'succeeded'"
    ) in ([], [("unknown",)])
    assert not any("found the lease taken" in p.log_text() for p in procs)
    assert rows(
        db_url,
        "SELECT count(*) FROM outbox.operations o JOIN outbox.attempts a "
        "ON a.operation_id = o.id WHERE o.provider_ref IS NULL",
    ) == [(0,)]


def test_uvloop_by_default_and_asyncio_on_request_dispatch_together_exactly_once(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 3_000)
    cfg = config(tmp_path, receiver, lease="30s", concurrency=32, batch_size=50)
    loops = {"uvloop": {}, "asyncio": {"OUTBOX_DISPATCHER__EVENT_LOOP": "asyncio"}}
    procs = {
        name: OutboxProcess(db_url, cfg, tmp_path / f"{name}.log", env)
        for name, env in loops.items()
    }
    try:
        wait_until(
            lambda: count_status(db_url, "succeeded") == 3_000,
            timeout=120,
            what="3,000 operations to succeed",
        )
        for proc in procs.values():
            proc.signal(signal.SIGTERM)
        assert [proc.wait() for proc in procs.values()] == [0, 0]
    finally:
        for proc in procs.values():
            proc.stop()
    for name, proc in procs.items():
        assert f'"event_loop": "{name}"' in proc.log_text()
    assert statuses(db_url) == {"succeeded": 3_000}
    assert receiver.effect_count() == 3_000 == len({e.key for e in receiver.effects})
    # Both loops did their share, and no row was leased twice.
    assert rows(
        db_url,
        "SELECT count(DISTINCT worker), count(*) FILTER (WHERE outcome = "
        "'succeeded') FROM outbox.attempts",
    ) == [(2, 3_000)]


def test_sigkill_after_the_provider_acted_resends_with_the_same_key_once(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    cfg = config(tmp_path, receiver)
    with receiver.hold(key) as held:
        first = OutboxProcess(db_url, cfg, tmp_path / "first.log")
        try:
            assert held.arrived.wait(30), first.log_text()
            first.signal(signal.SIGKILL)
            first.wait()
        finally:
            first.stop()
        held.release()
    (effect,) = receiver.effects_for(key)
    with outbox_processes(1, db_url, cfg, tmp_path):
        wait_until(
            lambda: count_status(db_url, "succeeded") == 1,
            timeout=30,
            what="the rescued operation to succeed",
        )
    assert receiver.effect_count(key) == 1
    assert rows(db_url, "SELECT provider_ref, attempts FROM outbox.operations") == [
        (effect.effect_id, 2)
    ]
    assert rows(db_url, "SELECT outcome, error_class FROM outbox.attempts ORDER BY attempt") == [
        ("unknown", "lease_expired"),
        ("succeeded", None),
    ]
    assert [r.replayed for r in receiver.received if r.key == key][-1] is True


def test_sigkill_after_the_claim_and_before_the_send_is_rescued_and_sent_once(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 3)
    cfg = config(tmp_path, receiver)
    paused = OutboxProcess(
        db_url, cfg, tmp_path / "paused.log", env={"OUTBOX_FAILPOINTS": "after_claim=60"}
    )
    try:
        wait_until(
            lambda: count_status(db_url, "in_flight") == 3, timeout=30, what="the claim to commit"
        )
        paused.signal(signal.SIGKILL)
        paused.wait()
    finally:
        paused.stop()
    assert len(receiver.received) == 0
    with outbox_processes(1, db_url, cfg, tmp_path):
        wait_until(
            lambda: count_status(db_url, "succeeded") == 3,
            timeout=30,
            what="the rescued operations to succeed",
        )
    assert receiver.effect_count() == 3
    assert len(receiver.received) == 3
    assert rows(db_url, "SELECT DISTINCT attempts FROM outbox.operations") == [(2,)]


def test_a_zombie_wakes_after_another_worker_finished_its_row_and_changes_nothing(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    cfg = config(tmp_path, receiver)
    with receiver.hold(key) as held:
        zombie = OutboxProcess(db_url, cfg, tmp_path / "zombie.log")
        try:
            assert held.arrived.wait(30)
            zombie.signal(signal.SIGSTOP)  # mid-call, past its lease
            held.release()  # the receiver answers a socket nobody reads
            with outbox_processes(1, db_url, cfg, tmp_path):
                wait_until(
                    lambda: count_status(db_url, "succeeded") == 1,
                    timeout=30,
                    what="another worker to finish the row",
                )
            ((ref, attempts),) = rows(
                db_url, "SELECT provider_ref, attempts FROM outbox.operations"
            )
            zombie.signal(signal.SIGCONT)
            wait_until(
                lambda: "found the lease taken" in zombie.log_text(),
                timeout=30,
                what="the zombie to try its record",
            )
            zombie.signal(signal.SIGTERM)
            assert zombie.wait() == 0
        finally:
            zombie.stop()
    assert rows(db_url, "SELECT status, provider_ref, attempts FROM outbox.operations") == [
        ("succeeded", ref, attempts)
    ]
    assert receiver.effect_count(key) == 1
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts WHERE outcome = 'succeeded'") == [
        (1,)
    ]


def test_a_dispatcher_frozen_between_its_claim_and_its_send_does_not_send_when_it_wakes(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """SIGSTOPped right after its claim, past its lease: meanwhile another worker rescued the row
    and sent it. Woken, the zombie must not send too: its request would overtake the other's on
    the wire (the chaos soak saw two operations of one ordering key in flight at once)."""
    (op,) = enqueue_many(db_url, 1)
    key = key_of(db_url, op)
    cfg = config(tmp_path, receiver)
    zombie = OutboxProcess(
        db_url, cfg, tmp_path / "zombie.log", env={"OUTBOX_FAILPOINTS": "after_claim=2"}
    )
    try:
        wait_until(lambda: count_status(db_url, "in_flight") == 1, timeout=30, what="the claim")
        zombie.signal(signal.SIGSTOP)  # inside the failpoint's pause, before the send
        with outbox_processes(1, db_url, cfg, tmp_path):
            wait_until(
                lambda: count_status(db_url, "succeeded") == 1,
                timeout=30,
                what="another worker to rescue and send it",
            )
        zombie.signal(signal.SIGCONT)
        # Past its send, one way or the other: handed back, or sent and refused its record.
        wait_until(
            lambda: any(
                line in zombie.log_text()
                for line in ("the lease ran out before the send", "found the lease taken")
            ),
            timeout=30,
            what="the zombie to go past its send",
        )
        zombie.signal(signal.SIGTERM)
        assert zombie.wait() == 0
    finally:
        zombie.stop()
    assert len(receiver.received_for(key)) == 1
    assert receiver.effect_count(key) == 1
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("succeeded",)]


def test_sigterm_releases_unsent_claims_without_counting_an_attempt(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 5)
    proc = OutboxProcess(
        db_url,
        config(tmp_path, receiver),
        tmp_path / "run.log",
        env={"OUTBOX_FAILPOINTS": "after_claim=2"},
    )
    try:
        wait_until(lambda: count_status(db_url, "in_flight") == 5, timeout=30, what="the claim")
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    assert rows(
        db_url, "SELECT status, attempts, lease_token FROM outbox.operations GROUP BY 1, 2, 3"
    ) == [("pending", 0, None)]
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(0,)]
    assert len(receiver.received) == 0


def test_sigterm_lets_in_flight_calls_finish_and_records_them(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 3)
    receiver.inject(WebhookFault.delay_after_apply(1.0), times=3)
    proc = OutboxProcess(db_url, config(tmp_path, receiver), tmp_path / "run.log")
    try:
        wait_until(lambda: len(receiver.received) == 3, timeout=30, what="three calls")
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    assert statuses(db_url) == {"succeeded": 3}
    assert receiver.effect_count() == 3


def test_calls_cut_off_at_the_grace_deadline_are_unknown_never_succeeded(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 2)
    receiver.inject(WebhookFault.delay_after_apply(4.0), times=2)
    proc = OutboxProcess(
        db_url, config(tmp_path, receiver, shutdown_grace="500ms"), tmp_path / "run.log"
    )
    try:
        wait_until(lambda: len(receiver.received) == 2, timeout=30, what="two calls")
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    assert rows(
        db_url,
        "SELECT status, last_error_class, first_sent_at IS NOT NULL "
        "FROM outbox.operations GROUP BY 1, 2, 3",
    ) == [("pending", "unknown", True)]
    assert rows(db_url, "SELECT outcome, error_class FROM outbox.attempts GROUP BY 1, 2") == [
        ("unknown", "shutdown")
    ]


def test_terminated_backends_do_not_lose_or_duplicate_anything(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(db_url, 2_000)
    cfg = config(tmp_path, receiver, concurrency=32, batch_size=50)
    with (
        outbox_processes(2, db_url, cfg, tmp_path) as procs,
        psycopg.connect(db_url, autocommit=True) as admin,
    ):
        for _ in range(5):
            time.sleep(0.4)
            # Every connection of the dispatchers to this database dies at once.
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
        wait_until(
            lambda: count_status(db_url, "succeeded") == 2_000,
            timeout=120,
            what="every operation to succeed",
        )
        for p in procs:
            p.signal(signal.SIGTERM)
        assert [p.wait() for p in procs] == [0, 0]
    assert receiver.effect_count() == 2_000
    assert len({e.key for e in receiver.effects}) == 2_000
    assert rows(db_url, "SELECT count(*) FROM outbox.operations WHERE provider_ref IS NULL") == [
        (0,)
    ]


def test_notify_wakes_an_idle_dispatcher_and_listen_survives_its_backend_dying(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    # Polling every 30 s: only a NOTIFY can deliver within the waits below.
    cfg = config(tmp_path, receiver, poll_interval="30s")
    with (
        outbox_processes(1, db_url, cfg, tmp_path),
        psycopg.connect(db_url, autocommit=True) as admin,
    ):

        def listening() -> bool:
            found = admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE "
                "application_name = 'outbox-listen' AND datname = "
                "current_database()"
            ).fetchone()
            return found is not None and found[0] == 1

        wait_until(listening, timeout=30, what="LISTEN")
        time.sleep(0.5)  # the first poll happened; the next is 30 s away
        enqueue_many(db_url, 1, prefix="first")
        wait_until(lambda: receiver.effect_count() == 1, timeout=10, what="a NOTIFY wake-up")

        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE application_name = 'outbox-listen' AND datname = current_database()"
        )
        wait_until(listening, timeout=30, what="LISTEN to come back")
        enqueue_many(db_url, 1, prefix="second")
        wait_until(lambda: receiver.effect_count() == 2, timeout=10, what="a wake-up after it")


def test_with_listen_off_the_dispatcher_claims_only_when_it_polls(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """[database] listen = false: no LISTEN connection, no waiting mark (so producers never
    notify), and a row committed while the dispatcher idles waits for the next poll."""
    cfg = config(tmp_path, receiver, poll_interval="4s")
    cfg.write_text(cfg.read_text() + "\n[database]\nlisten = false\n")
    enqueue_many(db_url, 1, prefix="first")
    with (
        outbox_processes(1, db_url, cfg, tmp_path) as (proc,),
        psycopg.connect(db_url, autocommit=True) as listener,
    ):
        listener.execute("LISTEN outbox_enqueue")
        # The first claim took it; the claim after it found nothing, so the next is a poll away.
        wait_until(lambda: receiver.effect_count() == 1, timeout=30, what="the first claim")
        enqueue_many(db_url, 1, prefix="second")
        committed = time.monotonic()
        while_idle = rows(
            db_url,
            "SELECT (SELECT count(*) FROM outbox.waiting_dispatchers),"
            " (SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-listen'"
            "  AND datname = current_database())",
        )
        wait_until(lambda: receiver.effect_count() == 2, timeout=30, what="the next poll")
        waited = time.monotonic() - committed
        heard = sum(1 for _ in listener.notifies(timeout=0.5))
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0
        log = proc.log_text()
    assert "wake-ups: polling only, since database.listen is false" in log
    assert '"wakeups": "polling"' in log
    assert "listening for enqueue notifications" not in log
    assert while_idle == [(0, 0)]
    assert heard == 0
    # Up to 4 s; with LISTEN it would have been milliseconds.
    assert waited > 1.5, f"claimed {waited:.2f}s after its commit: not by a poll"
    assert statuses(db_url) == {"succeeded": 2}
    assert receiver.effect_count() == 2


def test_1000_payment_intents_through_two_processes_with_random_faults(
    db_url: str, tmp_path: Path
) -> None:
    import random  # noqa: PLC0415

    from outbox.testing.stripe import FakeStripe, StripeFault  # noqa: PLC0415
    from tests.support.dispatch import enqueue_charges  # noqa: PLC0415

    ids = enqueue_charges(db_url, 1_000)
    rng = random.Random(11)
    faults = (
        [StripeFault.delay_after_apply(1.5)] * 40
        + [
            StripeFault.status(
                409, error_type="invalid_request_error", code_str="idempotency_key_in_use"
            )
        ]
        * 60
        + [StripeFault.status(429, error_type="invalid_request_error", code_str="rate_limit")] * 60
        + [StripeFault.status(503, error_type="api_error")] * 60
    )
    rng.shuffle(faults)
    with FakeStripe() as fake:
        # One fault for every fourth request, in random order. Each request meets the next
        # armed fault, so they strike the first requests one after another: a run of failures
        # the circuit breaker would rightly take for an outage (and wait out with probes). This
        # test is about how each fault is handled, so the breaker stays out of it.
        for fault in faults:
            fake.inject(fault)
        cfg = write_config(
            tmp_path / "outbox.toml",
            providers={
                "stripe": {
                    "type": "stripe",
                    "api_key_env": "TEST_STRIPE_KEY",
                    "api_base": fake.url,
                    "timeout": "500ms",
                    "breaker_failures": 10_000,
                }
            },
            lease="10s",
            poll_interval="200ms",
            backoff_base="50ms",
            backoff_max="300ms",
            concurrency=32,
        )
        with outbox_processes(
            2, db_url, cfg, tmp_path, env={"TEST_STRIPE_KEY": "sk_test_fake"}
        ) as procs:
            wait_until(
                lambda: count_status(db_url, "succeeded") == 1_000,
                timeout=180,
                what="1,000 payment intents",
            )
            for p in procs:
                p.signal(signal.SIGTERM)
            assert [p.wait() for p in procs] == [0, 0]
        objects = fake.objects("payment_intents")
    assert len(objects) == 1_000
    by_operation = {int(o["metadata"]["outbox_operation_id"]): o["id"] for o in objects}
    assert sorted(by_operation) == sorted(ids)
    refs = dict(rows(db_url, "SELECT id, provider_ref FROM outbox.operations"))
    assert refs == by_operation
    outcomes = dict(rows(db_url, "SELECT outcome, count(*) FROM outbox.attempts GROUP BY 1"))
    assert outcomes["succeeded"] == 1_000
    # Every planted fault cost one failed attempt: 120 transient (409s, 429s) and 100 unknown
    # (timeouts, 503s). Under load the client's own 500 ms timeout can cut off a planted 409 or
    # 429 before it is read, which makes it unknown instead; either way it was retried with the
    # same key, and the 1,000 objects above show no effect doubled.
    assert outcomes["transient"] + outcomes["unknown"] >= 220
    assert outcomes["unknown"] >= 100

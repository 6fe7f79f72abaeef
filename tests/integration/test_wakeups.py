"""One wake-up per idle period, and none lost (issue 23, case 1; sql/0029).

A NOTIFY holds a database-wide lock through the producer's COMMIT, synchronous replication's
wait included, so notifying commits queue behind each other. The first commit after a
dispatcher marked itself waiting takes the mark and notifies; the others do not. What must not
follow is a lost wake-up: a commit that checked before the dispatcher's mark and became visible
after its last claim. The dispatcher's mark tries the wake-up lock that such commits hold, and
does not sleep while it cannot get it. That lock is the table outbox.wake_gate's, which only
outbox's roles can take (sql/0039): an advisory key, 0029's, any role could hold.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import outbox
from outbox.db.statements import ENQUEUE_CHANNEL, MARK_WAITING
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_roles import APP, apply_roles, as_role
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.replication import replicated_pair

# What a producer holds from its COMMIT's wake-up check until its rows are visible (sql/0039).
PRODUCER_GATE = "LOCK TABLE outbox.wake_gate IN ROW EXCLUSIVE MODE"
# 0029's advisory key, which any role could take.
OLD_KEY = "1869968504, 0"


@pytest.fixture(scope="module")
def sync_url() -> Iterator[str]:
    """A primary with a synchronous standby 5 ms away, shared by this module's tests (each uses
    operation keys of its own): only there do producers take marks (sql/0029)."""
    with replicated_pair(synchronous=True, delay=0.005) as pair:
        yield pair.url


@pytest.fixture
def sync_conn(sync_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(sync_url) as conn:
        conn.execute("DELETE FROM outbox.waiting_dispatchers")
        conn.commit()
        yield conn


def enqueue(conn: psycopg.Connection[Any], key: str) -> int:
    return outbox.enqueue(
        conn,
        tenant_id="t",
        operation_type="wake",
        operation_key=key,
        provider="hook",
        action="a",
        payload={"k": key},
    ).operation_id


def notifications(listener: psycopg.Connection[Any], timeout: float = 0.5) -> int:
    return len(list(listener.notifies(timeout=timeout)))


def mark(conn: psycopg.Connection[Any], worker: str) -> tuple[bool, int]:
    """What a dispatcher's mark tells it: no commit becoming visible, and the count of commits
    that woke no one."""
    row = conn.execute(MARK_WAITING, {"worker": worker}).fetchone()
    assert row is not None
    return bool(row[0]), int(row[1])


def marks(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.waiting_dispatchers").fetchone()
    assert row is not None
    return int(row[0])


def test_the_first_commit_of_an_idle_period_notifies_and_the_rest_do_not(
    sync_conn: psycopg.Connection[Any], sync_url: str
) -> None:
    conn, db_url = sync_conn, sync_url
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        for period in range(3):
            for name in ("a", "b"):  # two idle dispatchers: one notification wakes both
                quiet, before = mark(listener, name)
                assert quiet
            for n in range(4):
                enqueue(conn, f"p{period}-{n}")
                conn.commit()
            heard = list(listener.notifies(timeout=0.5))
            assert [n.payload for n in heard] == ["taken"], f"idle period {period}"
            assert marks(db_url) == 0  # taken by the first commit
            # The other three woke no one, and say so to the dispatcher's next mark.
            assert mark(listener, "c")[1] == before + 3
            listener.execute("DELETE FROM outbox.waiting_dispatchers")
    with psycopg.connect(db_url) as check:
        found = check.execute(
            "SELECT count(*) FROM outbox.operations WHERE operation_key LIKE 'p_-%'"
        ).fetchone()
        assert found == (12,)


def test_without_a_synchronous_standby_marks_stay_and_each_commit_notifies(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    """A NOTIFY costs little there, and a dispatcher marking itself again after every wake-up
    would cost it a statement per operation at a trickle."""
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        mark(listener, "idle")
        for n in range(3):
            enqueue(conn, f"stay-{n}")
            conn.commit()
        assert [n.payload for n in listener.notifies(timeout=0.5)] == ["", "", ""]
        assert marks(db_url) == 1


def test_commits_racing_in_one_idle_period_notify_once(sync_conn: Any, sync_url: str) -> None:
    db_url = sync_url
    rng = random.Random(23)
    for round_ in range(5):
        producers = rng.randint(2, 8)
        with psycopg.connect(db_url, autocommit=True) as listener:
            listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
            listener.execute(MARK_WAITING, {"worker": "idle"})
            ready = threading.Barrier(producers)

            def produce(n: int, ready: threading.Barrier = ready, round_: int = round_) -> None:
                with psycopg.connect(db_url) as conn:
                    enqueue(conn, f"r{round_}-{n}")
                    ready.wait(timeout=10)  # every one of them at COMMIT at once
                    conn.commit()

            threads = [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=30)
            assert notifications(listener) == 1, f"{producers} producers"
            assert marks(db_url) == 0


def test_a_commit_becoming_visible_keeps_a_dispatcher_from_sleeping(db_url: str) -> None:
    # What a producer holds from its COMMIT's check until its rows are visible.
    with psycopg.connect(db_url, autocommit=True) as dispatcher, psycopg.connect(db_url) as mid:
        mid.execute(PRODUCER_GATE)
        assert mark(dispatcher, "d")[0] is False
        mid.commit()
        assert mark(dispatcher, "d")[0] is True


def test_whoever_holds_the_wake_gate_costs_notifications_never_a_commit(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    """Only the schema owner (a superuser here) can hold the gate outside outbox's functions.
    Held, producers cannot take it and notify as they did before sql/0029, mark or no mark;
    nobody ever waits for it."""
    with (
        psycopg.connect(db_url) as holder,
        psycopg.connect(db_url, autocommit=True) as listener,
    ):
        holder.execute("LOCK TABLE outbox.wake_gate IN ACCESS EXCLUSIVE MODE")
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        conn.execute("SET lock_timeout = '2s'")  # a COMMIT that waited would fail the test
        for n in range(3):
            enqueue(conn, f"held-{n}")
            conn.commit()
        assert notifications(listener) == 3
        holder.rollback()
        enqueue(conn, "free")
        conn.commit()
        assert notifications(listener) == 0  # no mark, nobody waiting: no notification


def test_no_other_role_can_take_the_wake_lock(
    conn: psycopg.Connection[Any], db_url: str, pg_server: str
) -> None:
    """Any role that could connect took 0029's advisory key and turned idle dispatchers into
    pollers (1,360 transactions in 10 s instead of 43) and every commit into a notification
    (issue 38). The key means nothing now, and the gate is out of reach: a producer's login
    (the role of every application) can neither lock it nor read it, and a dispatcher's mark
    finds the way clear, so it sleeps, and no commit notifies."""
    apply_roles(pg_server, db_url)
    app = as_role(db_url, APP)
    with (
        psycopg.connect(app, autocommit=True) as attacker,
        psycopg.connect(db_url, autocommit=True) as dispatcher,
    ):
        attacker.execute(f"SELECT pg_advisory_lock({OLD_KEY})")
        attacker.execute(f"SELECT pg_advisory_lock_shared({OLD_KEY})")
        dispatcher.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        assert mark(dispatcher, "idle")[0] is True  # quiet: it may sleep
        for n in range(3):
            enqueue(conn, f"attacked-{n}")
            conn.commit()
        # One notification per commit, as for any idle dispatcher without a standby: the key
        # changes nothing, where before it made every mark fail and the dispatcher poll.
        assert [n.payload for n in dispatcher.notifies(timeout=0.5)] == ["", "", ""]
        assert mark(dispatcher, "idle")[0] is True
        for query in (
            "LOCK TABLE outbox.wake_gate IN ACCESS EXCLUSIVE MODE",
            "LOCK TABLE outbox.wake_gate IN ROW EXCLUSIVE MODE",
            "LOCK TABLE outbox.wake_gate IN ACCESS SHARE MODE",
            "SELECT * FROM outbox.wake_gate",
            "SELECT outbox.try_wake_gate()",
            "SELECT outbox.wake_lock_space()",
        ):
            with pytest.raises(psycopg.errors.InsufficientPrivilege), attacker.transaction():
                attacker.execute(query)
        assert mark(dispatcher, "idle")[0] is True


def test_a_dispatcher_of_an_earlier_version_still_loses_no_wake_up(db_url: str) -> None:
    """Its MARK_WAITING (0029's) tries the advisory key of outbox.wake_lock_space(), which now
    gives the key only once it holds the gate: with a commit in flight, no key, so not quiet."""
    old_mark = MARK_WAITING.replace(
        "outbox.try_wake_gate() AS quiet",
        "pg_catalog.pg_try_advisory_xact_lock(outbox.wake_lock_space(), 0) AS quiet",
    )
    with psycopg.connect(db_url, autocommit=True) as dispatcher, psycopg.connect(db_url) as mid:
        mid.execute(PRODUCER_GATE)
        row = dispatcher.execute(old_mark, {"worker": "old"}).fetchone()
        assert row is not None and not row[0]  # NULL: the old code's bool() says not quiet
        mid.commit()
        row = dispatcher.execute(old_mark, {"worker": "old"}).fetchone()
        assert row is not None and row[0] is True


# --- under synchronous replication, with a real `outbox run` -------------------------------------

POLL = 10.0  # a lost wake-up waits for this, or for the next burst's first notification
BURSTS, BURST, QUIET = 14, 0.15, 0.9  # seconds: producers commit in bursts with quiet between
WORST_LATENCY = 0.7  # seconds: below QUIET, far above a claim's round trip


@pytest.fixture(params=["synchronous standby", "one server"])
def server(request: pytest.FixtureRequest) -> str:
    """The database URL: a primary whose every COMMIT waits 10 ms for a synchronous standby 5 ms
    away (a wide window between a commit's check and its rows' visibility; marks are taken), or
    the test's own database on the shared server (commits quicker than a claim; marks stay)."""
    if request.param == "one server":
        return str(request.getfixturevalue("db_url"))
    url = str(request.getfixturevalue("sync_url"))
    with psycopg.connect(url, autocommit=True) as conn:  # what the module's other tests left
        conn.execute("TRUNCATE outbox.operations, outbox.attempt_log CASCADE")
        conn.execute("DELETE FROM outbox.waiting_dispatchers")
    return url


def produce_randomly(url: str, seed: int, start: float, out: list[tuple[str, float]]) -> None:
    """In each burst, transactions of one to three operations at random moments, some held open
    a while before COMMIT; appends (operation key, time.monotonic() when COMMIT returned). A
    wake-up lost near a burst's end shows as a wait through the quiet spell after it."""
    rng = random.Random(seed)
    n = 0
    with psycopg.connect(url) as conn:
        for burst in range(BURSTS):
            opens = start + burst * (BURST + QUIET)
            time.sleep(max(0.0, opens - time.monotonic()))
            while time.monotonic() < opens + BURST:
                time.sleep(rng.expovariate(1 / 0.02))
                keys = [f"s{seed}-{n + i}" for i in range(rng.choice((1, 1, 1, 2, 3)))]
                n += len(keys)
                for key in keys:
                    enqueue(conn, key)
                if rng.random() < 0.2:
                    time.sleep(rng.uniform(0, 0.03))
                conn.commit()
                done = time.monotonic()
                out.extend((key, done) for key in keys)


def test_no_wake_up_is_lost_and_few_commits_notify(
    server: str, db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
        poll_interval=f"{POLL:g}s",
    )
    proc = OutboxProcess(server, cfg, tmp_path / "run.log")
    try:
        wait_until(
            lambda: '"listening for enqueue notifications"' in proc.log_text(),
            timeout=30,
            what="the LISTEN connection",
        )
        committed: list[tuple[str, float]] = []
        with psycopg.connect(server, autocommit=True) as listener:
            listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
            start = time.monotonic() + 0.2
            threads = [
                threading.Thread(target=produce_randomly, args=(server, s, start, committed))
                for s in range(6)
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=60)
            effects = receiver.wait_for_effects(len(committed), timeout=POLL + 5)
            notified = notifications(listener, timeout=1.0)
    finally:
        proc.stop()
    idempotency = keys_of(server)
    keys = {idempotency[key]: at for key, at in committed}
    arrived = {e.key: e.at for e in effects}
    assert len(effects) == len(committed) == len(arrived)  # each once, none lost
    late = sorted((arrived[k] - at, k) for k, at in keys.items())[-3:]
    assert late[-1][0] < WORST_LATENCY, f"wake-ups lost: the slowest waited {late}"
    # The promise's other half: under synchronous replication, where a dispatcher's cycle takes
    # a round trip, producers mostly do not notify, so they do not queue behind each other.
    commits = len({at for _, at in committed})
    if server != db_url:
        assert notified < commits / 2, f"{notified} of {commits} commits notified"


def keys_of(url: str) -> dict[str, str]:
    """Each operation's idempotency key (what the receiver saw), by its operation key."""
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT operation_key, idempotency_key FROM outbox.operations")
        return {str(op): str(key) for op, key in rows}


def test_a_commit_still_becoming_visible_keeps_the_dispatcher_claiming(
    receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    """Deterministic, where the seeded test above is by chance. A and P commit with
    synchronous_commit = remote_apply to a standby that applies WAL 2 s late, so each stays
    between its wake-up check and its rows' visibility for 2 s. P checks while A holds the
    mark, so P does not notify; A's wait is cancelled, so A's commit ends and wakes the
    dispatcher, whose mark then finds P still becoming visible. The dispatcher must keep
    claiming until P shows, not sleep until the poll."""
    with replicated_pair(synchronous=True) as pair:
        pair.set_on_standby("recovery_min_apply_delay", "2s")
        cfg = write_config(
            tmp_path / "outbox.toml",
            providers={"hook": {"type": "webhook", "url": receiver.url}},
            poll_interval=f"{POLL:g}s",
        )
        proc = OutboxProcess(pair.url, cfg, tmp_path / "run.log")
        a, p = psycopg.connect(pair.url), psycopg.connect(pair.url)
        try:
            wait_until(lambda: marks(pair.url) == 1, timeout=30, what="the dispatcher's mark")
            done: dict[str, float] = {}

            def commit(conn: psycopg.Connection[Any], name: str) -> None:
                conn.execute("SET synchronous_commit = remote_apply")
                enqueue(conn, name)
                conn.commit()
                done[name] = time.monotonic()

            threads = [threading.Thread(target=commit, args=(a, "a"))]
            threads[0].start()
            wait_until(lambda: waiting_for_standby(pair) == 1, timeout=10, what="A's wait")
            threads.append(threading.Thread(target=commit, args=(p, "p")))
            threads[1].start()
            wait_until(lambda: waiting_for_standby(pair) == 2, timeout=10, what="P's wait")
            with psycopg.connect(pair.primary.admin_url, autocommit=True) as admin:
                admin.execute("SELECT pg_cancel_backend(%s)", (a.info.backend_pid,))
            receiver.wait_for_effects(1, timeout=10)  # A, woken by its notification
            for thread in threads:
                thread.join(timeout=30)
            assert "a" in done and "p" in done
            # P's effect is due within WORST_LATENCY of its commit; waiting for the poll, which
            # a sleeping dispatcher would wake at, only delays the same verdict.
            due = done["p"] + WORST_LATENCY - time.monotonic()
            try:
                (effect,) = receiver.wait_for_effects(2, timeout=max(due, 0) + 1.0)[1:]
            except TimeoutError:
                raise AssertionError("the dispatcher slept with P in flight") from None
        finally:
            a.close()
            p.close()
            proc.stop()
    assert effect.at - done["p"] < WORST_LATENCY, "the dispatcher slept with P in flight"


def waiting_for_standby(pair: Any) -> int:
    """Backends of the outbox database whose COMMIT waits for the standby."""
    with psycopg.connect(pair.primary.admin_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
        ).fetchone()
    return int(row[0]) if row else 0

"""PostgreSQL crashes (`pg_ctl stop -m immediate`) and restarts under three `outbox run`
processes dispatching 5,000 webhook operations: nothing is lost, no effect happens twice.

The crash runs on a private cluster (tests/support/cluster.py), never on the shared server.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.cluster import PrivateCluster, private_cluster
from tests.support.daemon import outbox_processes, wait_until, write_config
from tests.support.dispatch import rows

pytestmark = pytest.mark.slow

OPERATIONS = 5_000


@pytest.fixture
def cluster() -> Iterator[PrivateCluster]:
    with private_cluster() as c:
        yield c


def enqueue_webhooks(url: str, count: int) -> None:
    """``count`` operations through the public SQL function, in one statement and transaction
    (5,000 round trips would cost more than the dispatch on a loaded machine)."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'invoice.charge', "
            "operation_key => 'op-' || i, provider => 'hook', action => 'invoice.paid', "
            "payload => jsonb_build_object('n', i)) FROM generate_series(1, %s) AS i",
            (count,),
        )


def count_by_status(url: str) -> dict[str, int] | None:
    """Operations per status, or None while the server is down."""
    try:
        with psycopg.connect(url, connect_timeout=2) as conn:
            found = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1")
            return dict(found.fetchall())
    except psycopg.OperationalError:
        return None


def reached(url: str, status: str, at_least: int) -> bool:
    counts = count_by_status(url)
    return counts is not None and counts.get(status, 0) >= at_least


def test_a_postgres_crash_mid_run_loses_nothing_and_duplicates_nothing(
    cluster: PrivateCluster, tmp_path: Path
) -> None:
    url = cluster.url
    enqueue_webhooks(url, OPERATIONS)
    assert count_by_status(url) == {"pending": OPERATIONS}
    with FakeWebhookReceiver() as receiver:
        # Short lease and backoff: rows whose record died with the server come back within
        # seconds of the restart.
        cfg = write_config(
            tmp_path / "outbox.toml",
            providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "5s"}},
            lease="3s",
            poll_interval="200ms",
            backoff_base="50ms",
            backoff_max="500ms",
            shutdown_grace="5s",
            concurrency=32,
            batch_size=50,
        )
        started = time.monotonic()
        with outbox_processes(3, url, cfg, tmp_path) as procs:
            wait_until(
                lambda: reached(url, "succeeded", OPERATIONS // 3),
                timeout=120,
                what="a third of the operations to succeed",
            )
            before_crash = receiver.effect_count()
            cluster.stop(immediate=True)
            time.sleep(1.5)
            cluster.start()
            wait_until(
                lambda: reached(url, "succeeded", OPERATIONS),
                timeout=180,
                interval=0.5,
                what="every operation to succeed after the restart",
            )
            elapsed = time.monotonic() - started
            alive = [p.proc.poll() is None for p in procs]
            for p in procs:
                p.signal(signal.SIGTERM)
            exits = [p.wait() for p in procs]
            logs = "".join(p.log_text() for p in procs)
        effects = receiver.effects
    print(f"\n5,000 operations, 3 processes, crash after {before_crash} effects: {elapsed:.1f}s")  # noqa: T201 (the figure the closing note quotes)

    # The dispatchers rode out the crash instead of dying with their connections.
    assert alive == [True, True, True]
    assert exits == [0, 0, 0]
    # They did meet the crash, mid-run: every LISTEN connection died with the server, after
    # some effects and before the last.
    assert logs.count("LISTEN connection lost; reconnecting") >= 3
    assert 0 < before_crash < OPERATIONS
    assert count_by_status(url) == {"succeeded": OPERATIONS}

    # Exactly one effect per operation, none without one, none twice.
    keys = dict(rows(url, "SELECT idempotency_key, id FROM outbox.operations"))
    effect_keys = [e.key for e in effects]
    assert len(effects) == OPERATIONS
    assert len(set(effect_keys)) == OPERATIONS
    assert set(effect_keys) == set(keys)
    # Each operation's reference is the one effect its key produced.
    refs = dict(rows(url, "SELECT idempotency_key, provider_ref FROM outbox.operations"))
    assert refs == {e.key: e.effect_id for e in effects}

    # Attempts: one row per counted attempt, numbered 1..attempts, the last one the success;
    # every earlier one ended unknown or transient (a lost record, a rescued lease), none
    # succeeded twice.
    assert rows(
        url,
        """
        SELECT count(*) FROM outbox.operations o
        WHERE o.attempts <> (SELECT count(*) FROM outbox.attempts a WHERE a.operation_id = o.id)
           OR o.attempts <> (SELECT max(attempt) FROM outbox.attempts a
                             WHERE a.operation_id = o.id)
           OR (SELECT outcome FROM outbox.attempts a
               WHERE a.operation_id = o.id AND a.attempt = o.attempts) <> 'succeeded'
    """,
    ) == [(0,)]
    assert rows(url, "SELECT count(*) FROM outbox.attempts WHERE outcome = 'succeeded'") == [
        (OPERATIONS,)
    ]
    assert rows(
        url,
        "SELECT count(*) FROM outbox.attempts WHERE outcome NOT IN "
        "('succeeded', 'unknown', 'transient')",
    ) == [(0,)]
    # Retries after the crash reached the receiver with the same key and were replays.
    # Every replay spent a counted attempt: one operation may be replayed twice when the record
    # of its first replay was cut short too. A crash need not cost any retry at all: a record it
    # cut short is written again while its lease lasts, and a claim it cut short rolled back.
    replays = sum(1 for r in receiver.received if r.replayed)
    ((retried, retries),) = rows(
        url,
        "SELECT count(*) FILTER (WHERE attempts > 1), "
        "coalesce(sum(attempts - 1), 0) "
        "FROM outbox.operations",
    )
    assert replays <= retries, f"{replays} replays for {retries} retries of {retried} operations"

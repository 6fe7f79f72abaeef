"""The database-wide gauges equal what SELECT status, count(*) says."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox import gauges, metrics
from outbox.providers.base import Provider
from outbox.providers.fakes.webhook import FakeWebhookReceiver, Fault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, key_of, rows


def gauge(status: str) -> float:
    return float(metrics.OPERATIONS.labels(status)._value.get())


async def test_gauges_match_the_table_after_a_dispatch_run(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_many(db_url, 12)
    receiver.inject(Fault.status(422), key=key_of(db_url, ids[0]))
    receiver.inject(Fault.status(422), key=key_of(db_url, ids[1]))
    assert await dispatcher(pool, {"hook": hook}, batch_size=8).run_once() == 8
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET status = 'reconciling', status_changed_at = "
                     "now() - interval '2 hours' WHERE id = %s", (ids[2],))  # fmt: skip
        conn.execute(
            "UPDATE outbox.operations SET first_sent_at = now() - interval '22h 30m', "
            "available_at = now() - interval '5 minutes' WHERE id = %s",
            (ids[11],),
        )
    await gauges.refresh(pool, {"hook": timedelta(hours=23)})
    counted = dict(rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1"))
    assert counted == {"succeeded": 5, "quarantined": 2, "reconciling": 1, "pending": 4}
    for status in ("pending", "in_flight", "succeeded", "quarantined", "reconciling", "cancelled"):
        assert gauge(status) == counted.get(status, 0), status
    assert 290 <= metrics.OLDEST_PENDING_AGE._value.get() <= 400
    assert 7100 <= metrics.OLDEST_RECONCILING_AGE._value.get() <= 7300
    assert metrics.NEARING_KEY_EXPIRY.labels("hook")._value.get() == 1


async def test_a_row_due_at_minus_infinity_planted_behind_enqueues_back_breaks_no_gauge(
    db_url: str, pool: AsyncConnectionPool[Any], cli_env: dict[str, str]
) -> None:
    """enqueue refuses such a time (sql/0019); a superuser's row must still not freeze the
    gauges (before: "cannot subtract infinite timestamps" on every refresh)."""
    (op,) = enqueue_many(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET available_at = '-infinity' WHERE id = %s",
                     (op,))  # fmt: skip
    await gauges.refresh(pool, {"hook": timedelta(hours=23)})
    assert gauge("pending") == 1
    # Bounded below at a century: the alert fires, the arithmetic does not overflow.
    assert metrics.OLDEST_PENDING_AGE._value.get() >= 99 * 365 * 86400
    done = outbox_cli(cli_env, "status", "--json")
    assert done.returncode == 0, done.stderr

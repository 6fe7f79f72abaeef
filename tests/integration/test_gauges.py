"""The database-wide gauges equal what SELECT status, count(*) says."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox.daemon import gauges
from outbox.observability import metrics
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, key_of, rows


def gauge(status: str) -> float:
    return float(metrics.OPERATIONS.labels(status)._value.get())


async def test_gauges_match_the_table_after_a_dispatch_run(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    ids = enqueue_many(db_url, 12)
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids[0]))
    receiver.inject(WebhookFault.status(422), key=key_of(db_url, ids[1]))
    assert await dispatcher(pool, {"hook": hook}, batch_size=8).run_once() == 8
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', status_changed_at = "
            "now() - interval '2 hours' WHERE id = %s",
            (ids[2],),
        )
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
        conn.execute("UPDATE outbox.operations SET available_at = '-infinity' WHERE id = %s", (op,))
    await gauges.refresh(pool, {"hook": timedelta(hours=23)})
    assert gauge("pending") == 1
    # Bounded below at a century: the alert fires, the arithmetic does not overflow.
    assert metrics.OLDEST_PENDING_AGE._value.get() >= 99 * 365 * 86400
    done = outbox_cli(cli_env, "status", "--json")
    assert done.returncode == 0, done.stderr


async def test_the_oldest_due_age_is_kept_per_provider_and_unconfigured_ones_share_one(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """What the age alert leaves out a paused provider by (deploy/prometheus): each configured
    provider's own age, 0 when none is due, and every other name under _unconfigured."""
    ages = {"hook": 600, "stripe": 0, "typo-1": 120, "typo-2": 900}
    for provider, seconds in ages.items():
        if seconds:
            enqueue_many(db_url, 3, provider=provider, prefix=provider)
            with psycopg.connect(db_url) as conn:
                conn.execute(
                    "UPDATE outbox.operations SET available_at = now() - "
                    "make_interval(secs => %s) WHERE provider = %s AND operation_key "
                    "LIKE '%%-0'",
                    (seconds, provider),
                )
    enqueue_many(db_url, 2, provider="later", prefix="s", available_at=None)
    await gauges.refresh(pool, {"hook": timedelta(hours=23), "stripe": timedelta(hours=23)})

    def age(provider: str) -> float:
        return float(metrics.PROVIDER_OLDEST_PENDING_AGE.labels(provider)._value.get())

    assert 595 <= age("hook") <= 700
    assert age("stripe") == 0  # configured, nothing due: present at 0
    assert 895 <= age("_unconfigured") <= 1000  # the older of typo-1 and typo-2
    assert 895 <= metrics.OLDEST_PENDING_AGE._value.get() <= 1000  # the overall: the max
    labelled = {
        s.labels["provider"]
        for m in metrics.PROVIDER_OLDEST_PENDING_AGE.collect()
        for s in m.samples
    }
    assert not labelled & {"typo-1", "typo-2", "later"}

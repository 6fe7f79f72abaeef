"""A record whose operation is gone says so (issue 23, case 4). After an asynchronous failover
the new primary may lack operations the old one had acknowledged, some already sent: their
records found no row and were logged as "lease taken", which sent the on-call engineer looking
for another worker."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import structlog
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import dispatcher, enqueue_many, key_of


def counter(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


async def test_a_record_for_a_row_the_database_lost_is_counted_and_logged_as_such(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    gone, kept = enqueue_many(db_url, 2)
    # The call is slow enough for the row to vanish under it, as a failover would lose it.
    receiver.inject(WebhookFault.delay_after_apply(1.0), key=key_of(db_url, gone))
    missing, lost = counter("outbox_record_row_missing_total"), counter("outbox_lease_lost_total")
    d = dispatcher(pool, {"hook": hook})
    with structlog.testing.capture_logs() as logs:
        running = asyncio.create_task(d.run_once())
        async with asyncio.timeout(10):  # both sent; the slow one's answer still to come
            while receiver.effect_count() < 2:  # noqa: ASYNC110 (the receiver has its own thread)
                await asyncio.sleep(0.01)
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox.operations WHERE id = %s", (gone,))
        assert await running == 2
    assert counter("outbox_record_row_missing_total") == missing + 1
    assert counter("outbox_lease_lost_total") == lost  # not a lease another worker took
    said = [e for e in logs if "found no such operation" in e["event"]]
    assert [(e["operation_id"], e["log_level"]) for e in said] == [(gone, "error")]
    assert not [e for e in logs if "lease taken" in e["event"]]
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT id, status FROM outbox.operations").fetchall()
    assert rows == [(kept, "succeeded")]  # the other operation's record is untouched
    assert receiver.effect_count() == 2  # one effect each: nothing was re-sent

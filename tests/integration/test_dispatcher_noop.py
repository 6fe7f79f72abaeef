"""The dispatch loop on its own, with an in-process provider that always succeeds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from psycopg_pool import AsyncConnectionPool

from outbox.providers.noop import NoopProvider
from tests.support.dispatch import dispatcher, enqueue_many, rows, statuses


async def test_run_once_dispatches_a_batch_and_records_every_attempt(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 30, provider="fast")
    d = dispatcher(pool, {"fast": NoopProvider("fast", timedelta(hours=24))}, batch_size=20)
    assert await d.run_once() == 20
    assert await d.run_once() == 10
    assert await d.run_once() == 0
    assert statuses(db_url) == {"succeeded": 30}
    attempts = rows(db_url, "SELECT count(*), count(DISTINCT operation_id), bool_and(sent), "
                            "min(outcome), max(attempt) FROM outbox.attempts")  # fmt: skip
    assert attempts == [(30, 30, True, "succeeded", 1)]
    refs = rows(db_url, "SELECT count(*) FROM outbox.operations "
                        "WHERE provider_ref = 'noop_' || id AND lease_token IS NULL "
                        "AND first_sent_at IS NOT NULL AND finished_at IS NOT NULL")  # fmt: skip
    assert refs == [(30,)]

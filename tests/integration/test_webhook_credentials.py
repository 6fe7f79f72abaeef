"""A webhook that refuses our credentials pauses its provider; the backlog waits, unspent
(issue 21, case 3). Before, a 401 or 403 was a permanent failure: 101 operations quarantined
in a tenth of a second, while docs/operations.md said the provider pauses."""

from __future__ import annotations

import os
from typing import Any

import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from outbox.providers.fakes.webhook import FakeWebhookReceiver, Fault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, rows


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_pause_the_provider_and_quarantine_nothing(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider,
    status: int,
) -> None:  # fmt: skip
    enqueue_many(db_url, 101)
    receiver.inject(Fault.status(status), times=1000)
    d = dispatcher(pool, {"hook": hook})
    for _ in range(3):
        await d.run_once()
    assert rows(db_url, "SELECT status, count(*), sum(attempts) FROM outbox.operations "
                        "GROUP BY 1") == [("pending", 101, 0)]  # fmt: skip
    refused = sum(r.status == status for r in receiver.received)
    assert 1 <= refused <= 101  # the calls in flight when it opened; none after
    assert REGISTRY.get_sample_value("outbox_provider_paused", {"provider": "hook"}) == 1
    assert receiver.effect_count() == 0


def test_a_list_that_stops_short_says_so(db_url: str) -> None:
    enqueue_many(db_url, 5)
    rows(db_url, "UPDATE outbox.operations SET status = 'quarantined', "
                 "status_reason = 'permanent_failure' RETURNING id")  # fmt: skip
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url}
    short = outbox_cli(env, "quarantine", "list", "--limit", "3")
    whole = outbox_cli(env, "quarantine", "list", "--limit", "5")
    assert short.returncode == whole.returncode == 0
    assert len(short.stdout.splitlines()) == 4 and "the oldest 3 shown" in short.stderr
    assert len(whole.stdout.splitlines()) == 6 and whole.stderr == ""

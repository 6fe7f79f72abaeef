"""A webhook that refuses our credentials pauses its provider; the backlog waits, unspent
(issue 21, case 3). Before, a 401 or 403 was a permanent failure: 101 operations quarantined
in a tenth of a second, while docs/operations.md said the provider pauses."""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider, SendRequest, SendResult, transient
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, rows


@pytest.mark.parametrize("status", [401, 403])
async def test_refused_credentials_pause_the_provider_and_quarantine_nothing(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    status: int,
) -> None:
    enqueue_many(db_url, 101)
    receiver.inject(WebhookFault.status(status), times=1000)
    d = dispatcher(pool, {"hook": hook})
    for _ in range(3):
        await d.run_once()
    assert rows(
        db_url, "SELECT status, count(*), sum(attempts) FROM outbox.operations GROUP BY 1"
    ) == [("pending", 101, 0)]
    refused = sum(r.status == status for r in receiver.received)
    assert 1 <= refused <= 101  # the calls in flight when it opened; none after
    assert REGISTRY.get_sample_value("outbox_provider_paused", {"provider": "hook"}) == 1
    assert receiver.effect_count() == 0


def test_a_list_that_stops_short_says_so(db_url: str) -> None:
    enqueue_many(db_url, 5)
    rows(
        db_url,
        "UPDATE outbox.operations SET status = 'quarantined', "
        "status_reason = 'permanent_failure' RETURNING id",
    )
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url}
    short = outbox_cli(env, "quarantine", "list", "--limit", "3")
    whole = outbox_cli(env, "quarantine", "list", "--limit", "5")
    assert short.returncode == whole.returncode == 0
    assert len(short.stdout.splitlines()) == 4 and "3 shown; more are quarantined" in short.stderr
    assert len(whole.stdout.splitlines()) == 6 and whole.stderr == ""


class RefusedPlugin:
    """A provider plug-in of no built-in type whose credentials are refused: it says so through
    the provider interface (``Failed.pause``), as the built-in ones do."""

    name = "plugin"
    key_retention = timedelta(hours=24)

    def __init__(self) -> None:
        self.calls = 0

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        pass

    async def send(self, request: SendRequest) -> SendResult:
        self.calls += 1
        return transient("http_401", "the plug-in's key was refused", http_status=401, pause=True)

    async def aclose(self) -> None:
        pass


async def test_a_plug_in_pauses_through_the_provider_interface(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    enqueue_many(db_url, 20, provider="plugin")
    plugin = RefusedPlugin()
    d = dispatcher(pool, {"plugin": plugin})
    await d.run_once()
    in_flight_when_paused = plugin.calls
    for _ in range(2):
        await d.run_once()
    assert rows(
        db_url, "SELECT status, count(*), sum(attempts) FROM outbox.operations GROUP BY 1"
    ) == [("pending", 20, 0)]
    assert plugin.calls == in_flight_when_paused >= 1  # none sent once it paused
    assert REGISTRY.get_sample_value("outbox_provider_paused", {"provider": "plugin"}) == 1

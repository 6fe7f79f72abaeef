"""The webhook provider's connection pool is as large as the calls the dispatcher may send it at
once: its ``max_in_flight`` when set, else ``dispatcher.concurrency``. It used to be fixed at
httpx's 100 connections, so with 1,024 slow calls in flight only 100 reached the receiver and the
rest queued inside the client, their timeouts running. Counted after the fact by the fake
receiver's high-water mark of requests being processed at once."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from outbox.config.settings import ProviderSettings
from outbox.providers.base import SendRequest, Succeeded
from outbox.providers.registry import build_providers
from outbox.providers.shards import connection_cap
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.daemon import outbox_processes, wait_until, write_config
from tests.support.dispatch import enqueue_many, statuses

# More than the 100 connections the pool used to be fixed at.
CALLS = 160
HOLD_S = 3.0


def test_the_cap_is_max_in_flight_when_set_and_never_beyond_concurrency() -> None:
    assert connection_cap(1024, None) == 1024
    assert connection_cap(1024, 120) == 120
    assert connection_cap(64, 500) == 64


def request(i: int) -> SendRequest:
    return SendRequest(
        operation_id=i,
        tenant_id="t",
        operation_type="pool.test",
        operation_key=f"k{i}",
        action="pool.test",
        payload={"n": i},
        idempotency_key=f"pool-key-{i}",
        correlation_id=None,
        attempt=1,
    )


@pytest.mark.parametrize(("max_in_flight", "at_once"), [(None, CALLS), (120, 120)])
async def test_slow_calls_reach_the_receiver_at_once_up_to_the_cap(
    receiver: FakeWebhookReceiver, max_in_flight: int | None, at_once: int
) -> None:
    receiver.inject(WebhookFault.delay_after_apply(HOLD_S), times=CALLS)
    ps = ProviderSettings(
        "hook",
        "webhook",
        timeout=timedelta(seconds=30),
        max_in_flight=max_in_flight,
        options={"url": receiver.url},
    )
    provider = build_providers({"hook": ps}, concurrency=256)["hook"]
    try:
        results = await asyncio.gather(*(provider.send(request(i)) for i in range(CALLS)))
    finally:
        await provider.aclose()
    assert all(isinstance(r, Succeeded) for r in results)
    assert receiver.effect_count() == CALLS
    assert receiver.peak_in_flight == at_once


@pytest.mark.slow
def test_outbox_run_holds_as_many_slow_calls_as_its_concurrency(
    db_url: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    cfg = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": receiver.url, "timeout": "30s"}},
        concurrency=CALLS,
        poll_interval="200ms",
        lease="60s",
    )
    enqueue_many(db_url, CALLS)
    receiver.inject(WebhookFault.delay_after_apply(HOLD_S), times=CALLS)
    with outbox_processes(1, db_url, cfg, tmp_path):
        wait_until(
            lambda: statuses(db_url) == {"succeeded": CALLS},
            timeout=90,
            what=f"{CALLS} slow calls to succeed",
        )
    assert receiver.effect_count() == CALLS
    assert receiver.peak_in_flight == CALLS

"""The Stripe provider's connections, like the webhook's: as many as the calls the dispatcher may
send it at once (its ``max_in_flight`` when set, else ``dispatcher.concurrency``), spread over SDK
clients of at most eight. With one SDK client the cap was httpx's default of 100 connections, so
past 100 slow calls the rest queued inside the client, their timeouts running. Counted after the
fact by the fake Stripe's high-water mark of requests being processed at once.

Unlike the webhook's clients, the SDK's take no pool limit, so ``max_in_flight`` is kept by the
dispatcher alone (tests/integration/test_provider_isolation.py), not also by the clients."""

from __future__ import annotations

import asyncio
from datetime import timedelta

from outbox.config.settings import ProviderSettings
from outbox.providers.base import SendRequest, Succeeded
from outbox.providers.registry import build_providers
from outbox.testing.stripe import DEFAULT_API_KEY, FakeStripe, StripeFault

# More than the 100 connections one SDK client holds.
CALLS = 160
HOLD_S = 3.0


def request(i: int) -> SendRequest:
    return SendRequest(
        operation_id=i,
        tenant_id="t",
        operation_type="pool.test",
        operation_key=f"k{i}",
        action="payment_intents.create",
        payload={"amount": 100 + i, "currency": "usd"},
        idempotency_key=f"pool-key-{i}",
        correlation_id=None,
        attempt=1,
    )


async def test_slow_creates_reach_stripe_at_once_past_one_sdk_clients_pool(
    fake: FakeStripe,
) -> None:
    fake.inject(StripeFault.delay_after_apply(HOLD_S), times=CALLS)
    ps = ProviderSettings(
        "stripe",
        "stripe",
        timeout=timedelta(seconds=30),
        options={"api_key_env": "KEY", "api_base": fake.url},
    )
    provider = build_providers({"stripe": ps}, {"KEY": DEFAULT_API_KEY}, concurrency=256)
    try:
        results = await asyncio.gather(*(provider["stripe"].send(request(i)) for i in range(CALLS)))
    finally:
        await provider["stripe"].aclose()
    assert all(isinstance(r, Succeeded) for r in results)
    assert len({r.reference for r in results if isinstance(r, Succeeded)}) == CALLS
    assert fake.object_count() == CALLS
    assert fake.peak_in_flight == CALLS

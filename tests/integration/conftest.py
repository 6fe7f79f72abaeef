"""Fixtures shared by the integration tests: a pool for in-process dispatchers, and the fake
providers on loopback with real providers pointed at them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.daemon import write_config
from tests.support.dispatch import stripe_provider, webhook


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """Autocommit connections to this test's database, as `outbox run` uses them."""
    async with AsyncConnectionPool(
        db_url, min_size=1, max_size=6, kwargs={"autocommit": True}
    ) as p:
        yield p


@pytest.fixture
def receiver() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as r:
        yield r


@pytest.fixture
async def hook(receiver: FakeWebhookReceiver) -> AsyncIterator[Provider]:
    """The webhook provider named "hook", pointed at the fake receiver."""
    provider = webhook("hook", receiver.url, timeout=2.0)
    yield provider
    await provider.aclose()


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe() as f:
        yield f


@pytest.fixture
async def provider(fake: FakeStripe) -> AsyncIterator[Provider]:
    """The Stripe provider named "stripe", pointed at the fake Stripe."""
    p = stripe_provider("stripe", fake.url)
    yield p
    await p.aclose()


@pytest.fixture
def check_env(db_url: str, fake: FakeStripe, tmp_path: Path) -> dict[str, str]:
    """The environment of an `outbox` subprocess (`reconcile check`) pointed at the fake Stripe."""
    config = write_config(
        tmp_path / "outbox.toml",
        providers={
            "stripe": {"type": "stripe", "api_key_env": "TEST_STRIPE_KEY", "api_base": fake.url}
        },
    )
    return {
        **os.environ,
        "OUTBOX_DATABASE_URL": db_url,
        "OUTBOX_CONFIG": str(config),
        "TEST_STRIPE_KEY": "sk_test_fake",
    }

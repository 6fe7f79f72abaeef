"""Helpers to run a dispatcher in the test's own event loop, and to read what it did."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import DispatcherSettings, ProviderLimits
from outbox.db.store import Store
from outbox.dispatch.dispatcher import Dispatcher
from outbox.providers.base import Provider

# Fast settings for tests: time moves in the data, these only bound the waits.
FAST = {
    "lease": timedelta(seconds=5),
    "poll_interval": timedelta(milliseconds=100),
    "backoff_base": timedelta(milliseconds=10),
    "backoff_max": timedelta(milliseconds=50),
    "shutdown_grace": timedelta(seconds=5),
}


def settings(**overrides: Any) -> DispatcherSettings:
    return DispatcherSettings(**{**FAST, **overrides})


def dispatcher(
    pool: AsyncConnectionPool[Any],
    providers: Mapping[str, Provider],
    *,
    worker: str = "test-worker",
    call_timeouts: Mapping[str, timedelta] | None = None,
    limits: Mapping[str, ProviderLimits] | None = None,
    **overrides: Any,
) -> Dispatcher:
    return Dispatcher(
        Store(pool),
        providers,
        settings(**overrides),
        worker_id=worker,
        call_timeouts=call_timeouts,
        rng=random.Random(7),
        limits=limits,
    )


# The optional arguments of outbox.enqueue() that enqueue_many passes on, with their SQL types.
_ENQUEUE_FIELDS: Final = {
    "correlation_id": "text",
    "idempotency_key": "text",
    "available_at": "timestamptz",
    "max_attempts": "integer",
    "traceparent": "text",
    "ordering_key": "text",
}


def enqueue_many(
    url: str, count: int, *, provider: str = "hook", prefix: str = "op", **fields: Any
) -> list[int]:
    """Enqueue ``count`` operations (``{prefix}-{i}``, payload ``{"n": i}``) in one committed
    transaction; returns their ids, in that order. One statement calls outbox.enqueue() per
    operation, as outbox.enqueue in Python does (tests/integration/test_enqueue.py tests that
    path), without a round trip each: 20,000 of them in a fraction of the time."""
    unknown = set(fields) - set(_ENQUEUE_FIELDS)
    if unknown:
        raise TypeError(f"enqueue_many got unexpected arguments {sorted(unknown)}")
    extra = sql.SQL("").join(
        sql.SQL(", {} => {}::{}").format(
            sql.Identifier(name), sql.Placeholder(name), sql.SQL(_ENQUEUE_FIELDS[name])
        )
        for name in fields
    )
    query = sql.SQL(
        "SELECT e.operation_id FROM generate_series(0, %(count)s - 1) AS i "
        "CROSS JOIN LATERAL outbox.enqueue(tenant_id => 'acme', "
        "operation_type => 'invoice.charge', operation_key => %(prefix)s || '-' || i, "
        "provider => %(provider)s, action => 'invoice.paid', "
        "payload => jsonb_build_object('n', i){}) AS e ORDER BY i"
    ).format(extra)
    params = {"count": count, "prefix": prefix, "provider": provider, **fields}
    with psycopg.connect(url) as conn:
        return [int(i) for (i,) in conn.execute(query, params).fetchall()]


def statuses(url: str) -> dict[str, int]:
    with psycopg.connect(url) as conn:
        rows = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1").fetchall()
    return dict(rows)


def rows(url: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(query, params).fetchall()


def webhook(
    name: str, url: str, *, timeout: float = 5.0, key_retention: float = 86400.0, **options: Any
) -> Provider:
    """A real webhook provider pointed at a fake receiver."""
    from outbox.config.settings import ProviderSettings  # noqa: PLC0415 (keeps this helper's imports light)
    from outbox.providers.registry import build_providers  # noqa: PLC0415

    ps = ProviderSettings(
        name,
        "webhook",
        key_retention=timedelta(seconds=key_retention),
        timeout=timedelta(seconds=timeout),
        options={"url": url, **options},
    )
    return build_providers({name: ps})[name]


def key_of(url: str, operation_id: int) -> str:
    ((key,),) = rows(
        url, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (operation_id,)
    )
    return str(key)


def make_due(url: str) -> None:
    """Move time in the data: every scheduled retry becomes due now."""
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET available_at = now(), scheduled = false "
            "WHERE status = 'pending'"
        )


def stripe_provider(
    name: str,
    url: str,
    *,
    api_key: str = "sk_test_fake",
    timeout: float = 5.0,
    key_retention: float = 86400.0,
    **options: Any,
) -> Provider:
    """The real Stripe provider pointed at a fake Stripe, its key read from a variable."""
    from outbox.config.settings import ProviderSettings  # noqa: PLC0415
    from outbox.providers.registry import build_providers  # noqa: PLC0415

    ps = ProviderSettings(
        name,
        "stripe",
        key_retention=timedelta(seconds=key_retention),
        timeout=timedelta(seconds=timeout),
        options={"api_key_env": "TEST_STRIPE_KEY", "api_base": url, **options},
    )
    return build_providers({name: ps}, environ={"TEST_STRIPE_KEY": api_key})[name]


def enqueue_charges(
    url: str,
    count: int,
    *,
    provider: str = "stripe",
    prefix: str = "inv",
    action: str = "payment_intents.create",
) -> list[int]:
    ids = []
    with psycopg.connect(url) as conn:
        for i in range(count):
            result = outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="invoice.charge",
                operation_key=f"{prefix}-{i}",
                provider=provider,
                action=action,
                payload={
                    "amount": 1000 + i,
                    "currency": "usd",
                    "customer": "cus_123",
                    "metadata": {"invoice": f"{prefix}-{i}"},
                },
            )
            ids.append(result.operation_id)
    return ids


async def run_until(d: Dispatcher, done: Callable[[], bool], within: float) -> float:
    """Run ``d`` until ``done()`` holds; returns the seconds that took. Only cheap,
    non-blocking checks in ``done``: it runs in the dispatcher's own event loop."""
    runner = asyncio.create_task(d.run())
    started = time.monotonic()
    try:
        while not done():
            if time.monotonic() - started > within or runner.done():
                raise AssertionError(f"not done within {within}s")
            await asyncio.sleep(0.01)
        return time.monotonic() - started
    finally:
        d.request_stop()
        await runner

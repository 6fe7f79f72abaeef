"""Counters exist at 0 from start-up (issue 21, case 5). Labelled counters were created on their
first increment, so ten quarantines on a new provider showed Prometheus a series that began at
10: increase(outbox_quarantined_total[1h]) was 0 and OutboxQuarantineGrowing never fired."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.daemon import gauges
from outbox.db.probe import DatabaseProbe
from outbox.inbox import gauges as inbox_gauges
from outbox.observability import metrics
from outbox.providers.base import Provider
from tests.support.cluster import free_port
from tests.support.dispatch import dispatcher


async def test_a_new_providers_label_sets_are_exported_at_zero_before_any_event(
    pool: AsyncConnectionPool[Any], hook: Provider
) -> None:
    name = "fresh-provider-for-zero"
    dispatcher(pool, {name: hook})  # construction alone: nothing claimed, nothing sent
    sample = REGISTRY.get_sample_value
    for reason in metrics.QUARANTINE_REASONS:
        labels = {"provider": name, "reason": reason}
        assert sample("outbox_quarantined_total", labels) == 0, reason
    for reason in metrics.ROUTED_REASONS:
        labels = {"provider": name, "reason": reason}
        assert sample("outbox_reconciliation_routed_total", labels) == 0, reason
    assert sample("outbox_retries_total", {"provider": name}) == 0
    for finding in metrics.CHECK_FINDINGS:
        labels = {"provider": name, "finding": finding}
        assert sample("outbox_reconcile_checks_total", labels) == 0
    for operation in metrics.DB_OPERATIONS:
        assert sample("outbox_db_errors_total", {"operation": operation}) is not None


async def test_the_database_being_unreachable_and_stale_gauges_are_visible(
    db_url: str, pool: AsyncConnectionPool[Any], hook: Provider
) -> None:
    """Issue 21, case 4: /readyz said 503 but nothing a scrape could alert on did, and the
    gauges kept their last values (0 pending while 10 waited)."""
    nowhere = f"host=127.0.0.1 port={free_port()} user=postgres connect_timeout=1"
    dead = AsyncConnectionPool(nowhere, min_size=1, max_size=1, open=False, timeout=1.0)
    await dead.open(wait=False)
    try:
        assert await dispatcher(dead, {"hook": hook}).run_once() == 0
        # outbox_database_up follows the readiness probe (outbox/db/probe.py), not the claims
        probe = DatabaseProbe(nowhere)
        assert await probe.probe_once() is False
        await probe.aclose()
        assert REGISTRY.get_sample_value("outbox_database_up") == 0
        before = REGISTRY.get_sample_value("outbox_gauges_refreshed_timestamp_seconds") or 0.0
        with pytest.raises(psycopg.Error):
            await gauges.refresh(dead, {})
        assert (
            REGISTRY.get_sample_value("outbox_gauges_refreshed_timestamp_seconds") or 0.0
        ) == before
    finally:
        await dead.close()
    assert await dispatcher(pool, {"hook": hook}).run_once() == 0
    probe = DatabaseProbe(db_url)
    assert await probe.probe_once() is True
    await probe.aclose()
    assert REGISTRY.get_sample_value("outbox_database_up") == 1
    await gauges.refresh(pool, {})
    assert (REGISTRY.get_sample_value("outbox_gauges_refreshed_timestamp_seconds") or 0.0) > before


async def test_the_inbox_says_when_its_gauges_could_not_be_read(
    pool: AsyncConnectionPool[Any],
) -> None:
    """A worker whose database is down keeps its inbox gauges' last values: it says so in
    outbox_inbox_database_up, which the inbox's alerts read to leave it out."""
    nowhere = f"host=127.0.0.1 port={free_port()} user=postgres connect_timeout=1"
    up = "outbox_inbox_database_up"
    # Up first, so that the 0 after it is a change, not the gauge's initial value.
    for target, expected in ((pool, 1), (AsyncConnectionPool(nowhere, open=False, timeout=0.5), 0)):
        if target is not pool:
            await target.open(wait=False)
        watching = asyncio.create_task(inbox_gauges.watch(target, every=0.05))
        try:
            for _ in range(100):
                await asyncio.sleep(0.05)
                if REGISTRY.get_sample_value(up) == expected:
                    break
            assert REGISTRY.get_sample_value(up) == expected
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watching
            if target is not pool:
                await target.close()

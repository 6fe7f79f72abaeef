"""Operations for a provider nobody configured are visible (issue 21, case 9). They were
accepted, waited silently, and were quarantined as unknown_provider after 10 minutes, which no
document mentioned."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import structlog
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from tests.support.cli import outbox_cli
from tests.support.daemon import write_config
from tests.support.dispatch import dispatcher, enqueue_many, make_due, rows

ARGS = ("--tenant-id", "acme", "--operation-type", "t", "--provider", "billing", "--action",
        "a", "--payload", "{}")  # fmt: skip


def test_the_cli_warns_when_the_provider_is_not_in_the_config(db_url: str, tmp_path: Path) -> None:
    config = write_config(tmp_path / "outbox.toml", providers={
        "hook": {"type": "webhook", "url": "http://127.0.0.1:9/"}})  # fmt: skip
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url, "OUTBOX_CONFIG": str(config)}
    warned = outbox_cli(env, "enqueue", "--operation-key", "k1", *ARGS)
    assert warned.returncode == 0, warned.stderr
    assert "no provider named 'billing'" in warned.stderr and "10m" in warned.stderr
    quiet = outbox_cli({k: v for k, v in env.items() if k != "OUTBOX_CONFIG"}, "enqueue",
                       "--operation-key", "k2", *ARGS)  # fmt: skip
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert rows(db_url, "SELECT count(*) FROM outbox.operations") == [(2,)]  # still accepted


async def test_the_dispatcher_says_once_what_becomes_of_them(
    db_url: str, pool: AsyncConnectionPool[Any], hook: Provider
) -> None:
    enqueue_many(db_url, 3, provider="billing")
    d = dispatcher(pool, {"hook": hook})
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            make_due(db_url)
            await d.run_once()
    told = [e for e in logs if "does not have" in e["event"]]
    assert len(told) == 1 and "unknown_provider 10m after its enqueue" in told[0]["event"]
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("pending", 3)]  # fmt: skip

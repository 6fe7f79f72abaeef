"""Operations for a provider nobody configured are visible (issue 21, case 9). They were
accepted, waited silently, and were quarantined as unknown_provider after 10 minutes, which no
document mentioned."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import structlog
from psycopg_pool import AsyncConnectionPool

from outbox.providers.base import Provider
from tests.support.cli import outbox_cli
from tests.support.daemon import write_config
from tests.support.dispatch import dispatcher, enqueue_many, make_due, rows

ARGS = (
    "--tenant-id",
    "acme",
    "--operation-type",
    "t",
    "--provider",
    "billing",
    "--action",
    "a",
    "--payload",
    "{}",
)


def test_the_cli_warns_when_the_provider_is_not_in_the_config(db_url: str, tmp_path: Path) -> None:
    config = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": "http://127.0.0.1:9/"}},
    )
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url, "OUTBOX_CONFIG": str(config)}
    warned = outbox_cli(env, "enqueue", "--operation-key", "k1", *ARGS)
    assert warned.returncode == 0, warned.stderr
    assert "no provider named 'billing'" in warned.stderr and "10m" in warned.stderr
    quiet = outbox_cli(
        {k: v for k, v in env.items() if k != "OUTBOX_CONFIG"},
        "enqueue",
        "--operation-key",
        "k2",
        *ARGS,
    )
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
        ("pending", 3)
    ]


def test_status_names_due_operations_no_configured_provider_takes_and_when(
    db_url: str, tmp_path: Path
) -> None:
    config = write_config(
        tmp_path / "outbox.toml",
        providers={"hook": {"type": "webhook", "url": "http://127.0.0.1:9/"}},
    )
    enqueue_many(db_url, 3, provider="billing", prefix="b")
    enqueue_many(db_url, 2, provider="hook", prefix="h")
    enqueue_many(db_url, 1, provider="late", prefix="l")
    with psycopg.connect(db_url) as conn:  # one enqueued 11 minutes ago: its grace has passed
        conn.execute(
            "UPDATE outbox.operations SET created_at = now() - interval '11 minutes' "
            "WHERE provider = 'late'"
        )
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url, "OUTBOX_CONFIG": str(config)}
    shown = outbox_cli(env, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    by = {p["provider"]: p for p in json.loads(shown.stdout)["due_by_provider"]}
    assert {n: (p["due"], p["configured"]) for n, p in by.items()} == {
        "billing": (3, False),
        "hook": (2, True),
        "late": (1, False),
    }
    (enqueued,) = rows(
        db_url, "SELECT min(created_at) FROM outbox.operations WHERE provider = 'billing'"
    )[0]
    assert datetime.fromisoformat(by["billing"]["quarantined_from"]) == enqueued + timedelta(
        minutes=10
    )
    assert (by["billing"]["quarantine_due"], by["late"]["quarantine_due"]) == (False, True)
    assert by["hook"]["quarantined_from"] is None
    table = outbox_cli(env, "status").stdout
    billing = next(line for line in table.splitlines() if line.startswith("billing"))
    assert "quarantined as unknown_provider 10m after its enqueue; the first from" in billing
    late = next(line for line in table.splitlines() if line.startswith("late"))
    assert "the first now" in late
    # without a config nothing can be said of which are configured: none is called unconfigured
    bare = outbox_cli({k: v for k, v in env.items() if k != "OUTBOX_CONFIG"}, "status", "--json")
    assert {p["configured"] for p in json.loads(bare.stdout)["due_by_provider"]} == {None}


def test_status_bounds_what_a_million_provider_names_would_cost(
    db_url: str, cli_env: dict[str, str]
) -> None:
    with psycopg.connect(db_url) as conn:  # a producer that names a new provider each time
        for i in range(205):
            conn.execute(
                "SELECT outbox.enqueue('acme', 't', %s, %s, 'a', '{}'::jsonb)",
                (f"k{i}", f"p{i:03}"),
            )
    shown = outbox_cli(cli_env, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert len(report["due_by_provider"]) == 200 and report["due_by_provider_truncated"]
    assert report["due_by_provider"][-1]["provider"] == "p199"
    assert "the first 200 providers by name shown" in shown.stderr

"""`outbox reconcile check` says why it cannot ask (issue 21, case 8). Without --config it
printed an empty table and exited 0; for a provider that cannot be asked (a webhook) it now
says what a person does instead."""

from __future__ import annotations

import os
from pathlib import Path

import psycopg

from tests.support.cli import outbox_cli
from tests.support.daemon import write_config
from tests.support.dispatch import enqueue_many


def reconciling(db_url: str) -> int:
    (op,) = enqueue_many(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', "
            "status_reason = 'key_window_passed'"
        )
    return op


def test_without_a_config_the_check_refuses_with_the_fix(db_url: str) -> None:
    op = reconciling(db_url)
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_CONFIG"}
    done = outbox_cli({**env, "OUTBOX_DATABASE_URL": db_url}, "reconcile", "check", str(op))
    assert done.returncode == 2
    assert "give --config" in done.stderr and done.stdout == ""


def test_a_provider_that_cannot_be_asked_or_is_not_configured_is_named(
    db_url: str, tmp_path: Path
) -> None:
    op = reconciling(db_url)  # provider "hook"
    env = {**os.environ, "OUTBOX_DATABASE_URL": db_url}
    hook = write_config(
        tmp_path / "hook.toml",
        providers={"hook": {"type": "webhook", "url": "http://127.0.0.1:9/"}},
    )
    other = write_config(
        tmp_path / "other.toml",
        providers={"billing": {"type": "webhook", "url": "http://127.0.0.1:9/"}},
    )
    asked = outbox_cli(env, "reconcile", "check", str(op), "--config", str(hook))
    elsewhere = outbox_cli(env, "reconcile", "check", str(op), "--config", str(other))
    assert asked.returncode == elsewhere.returncode == 0
    assert "retry --force" in asked.stdout
    assert "no provider named 'hook' in this config" in elsewhere.stdout

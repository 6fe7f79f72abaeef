"""`outbox reconcile check` says why it cannot ask (issue 21, case 8). Without --config it
printed an empty table and exited 0; for a provider that cannot be asked (a webhook) it now
says what a person does instead."""

from __future__ import annotations

import json
import os
from pathlib import Path

import psycopg

from outbox.testing.stripe import FakeStripe
from tests.support.cli import outbox_cli
from tests.support.daemon import write_config
from tests.support.dispatch import enqueue_charges, enqueue_many, rows


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


def test_a_check_builds_only_the_providers_of_what_it_checks(
    db_url: str, tmp_path: Path, fake: FakeStripe
) -> None:
    """Issue 37: an on-call laptop need not hold every provider's secret. Only the providers of
    the selected operations are built; one without a lookup is not built at all (its secret
    unread): it answers no_lookup. A provider that must be asked and cannot be built is named."""
    (charge,) = enqueue_charges(db_url, 1)
    (hook_op,) = enqueue_many(db_url, 1, provider="hook")
    (broken_op,) = enqueue_charges(db_url, 1, provider="broken", prefix="b")
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', "
            "status_reason = 'key_window_passed', attempts = 1, "
            "first_sent_at = now() - interval '10 minutes', "
            "last_attempt_at = now() - interval '10 minutes'"
        )
    config = write_config(
        tmp_path / "outbox.toml",
        providers={
            "stripe": {"type": "stripe", "api_key_env": "TEST_STRIPE_KEY", "api_base": fake.url},
            "broken": {"type": "stripe", "api_key_file": str(tmp_path / "no-such-key")},
            "unset": {"type": "stripe", "api_key_env": "OUTBOX_TEST_UNSET_KEY"},
            "hook": {
                "type": "webhook",
                "url": "https://hooks.example.com/in",
                "secret_headers": {"Authorization": {"env": "OUTBOX_TEST_UNSET_TOKEN"}},
            },
        },
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OUTBOX_TEST_UNSET_KEY", "OUTBOX_TEST_UNSET_TOKEN")
    }
    env |= {"OUTBOX_DATABASE_URL": db_url, "OUTBOX_CONFIG": str(config)}
    env["TEST_STRIPE_KEY"] = "sk_test_fake"

    stripe = outbox_cli(env, "reconcile", "check", "--provider", "stripe", "--json")
    assert stripe.returncode == 0, stripe.stderr
    assert [(r["operation_id"], r["finding"]) for r in json.loads(stripe.stdout)] == [
        (charge, "not_found")
    ]
    for selection in (["--provider", "hook"], [str(hook_op)]):
        hook = outbox_cli(env, "reconcile", "check", *selection)
        assert hook.returncode == 0, hook.stderr
        assert "this provider has no lookup" in hook.stdout, hook.stdout
    assert rows(db_url, "SELECT id, check_finding FROM outbox.operations ORDER BY id") == [
        (charge, "not_found"),
        (hook_op, None),
        (broken_op, None),
    ]
    # Asking the provider whose key is missing: refused, naming the key, nothing recorded.
    for selection in (["--provider", "broken"], ["--all"]):
        broken = outbox_cli(env, "reconcile", "check", *selection)
        assert broken.returncode == 2, broken.stderr
        assert "providers.broken.api_key" in broken.stderr, broken.stderr
    assert rows(
        db_url, "SELECT count(*) FROM outbox.audit WHERE operation_id <> %s", (charge,)
    ) == [(0,)]

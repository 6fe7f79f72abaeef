"""No secret anywhere: every command and a full dispatch with faults, the stripe SDK at DEBUG,
and then everything captured is searched for each secret: command output, the daemon's log,
the metrics, the repr of the settings and providers, and every table the dispatcher wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import urllib.request
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.config.loader import load_settings
from outbox.providers.registry import build_providers
from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import key_of, statuses

pytestmark = pytest.mark.slow

# Distinctive, so that a hit cannot be a coincidence.
DSN_PASSWORD = "pw-Q7vX2-never-print-me"  # noqa: S105 (a decoy)
STRIPE_KEY = "sk_test_51SecretKEYnever0printed9x"
PAYLOAD_MARKER = "payload-marker-6c1d"
WEBHOOK_TOKEN = "Bearer whk-TOKEN-8f3b-never-printed"  # noqa: S105 (a decoy)


def with_password(url: str) -> str:
    """The test database's URL with a password (trust auth accepts and ignores it)."""
    params = conninfo_to_dict(url)
    params["password"] = DSN_PASSWORD
    return make_conninfo("", **{k: str(v) for k, v in params.items()})


def enqueue(url: str, provider: str, key: str, **payload: object) -> int:
    with psycopg.connect(url) as conn:
        action = "payment_intents.create" if provider == "stripe" else "invoice.paid"
        return outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="secret.test",
            operation_key=key,
            provider=provider,
            action=action,
            payload=dict(payload),
        ).operation_id


def test_no_secret_appears_in_any_output_log_metric_repr_or_table(
    db_url: str, tmp_path: Path
) -> None:
    url = with_password(db_url)
    env_secrets = {"STRIPE_TEST_KEY": STRIPE_KEY, "BILLING_TOKEN": WEBHOOK_TOKEN}
    with FakeStripe(api_key=STRIPE_KEY) as fake, FakeWebhookReceiver() as receiver:
        cfg = write_config(
            tmp_path / "outbox.toml",
            providers={
                "stripe": {
                    "type": "stripe",
                    "api_key_env": "STRIPE_TEST_KEY",
                    "api_base": fake.url,
                    "timeout": "2s",
                },
                "hook": {
                    "type": "webhook",
                    "url": receiver.url,
                    "timeout": "2s",
                    "secret_headers": {"Authorization": {"env": "BILLING_TOKEN"}},
                },
            },
            lease="3s",
            poll_interval="200ms",
            backoff_base="50ms",
            backoff_max="200ms",
        )
        env = {
            **os.environ,
            "OUTBOX_DATABASE_URL": url,
            **env_secrets,
            "STRIPE_LOG": "debug",
            "OUTBOX_LOG_LEVEL": "debug",
        }
        captured: list[str] = []

        def cli(*args: str) -> str:
            done = outbox_cli(env, *args)
            captured.append(done.stdout + done.stderr)
            return done.stdout

        # Faults on both providers: retries, a permanent failure, an unknown outcome.
        for _ in range(3):
            fake.inject(StripeFault.status(503, error_type="api_error"))
            receiver.inject(WebhookFault.status(503))
        fake.inject(StripeFault.reset_before_apply())
        for n in range(6):
            enqueue(
                url, "stripe", f"pi-{n}", amount=100 + n, currency="usd", description=PAYLOAD_MARKER
            )
            enqueue(url, "hook", f"hook-{n}", n=n, note=PAYLOAD_MARKER)
        bad = enqueue(url, "hook", "hook-bad", n=99)
        receiver.inject(WebhookFault.status(400), key=key_of(url, bad))
        cli("status")
        daemon = OutboxProcess(url, cfg, tmp_path / "run.log", env, metrics_addr="127.0.0.1:0")
        try:
            wait_until(
                lambda: statuses(url) == {"succeeded": 12, "quarantined": 1},
                timeout=60,
                what="every operation to finish",
            )
            metrics_text = _fetch(daemon.metrics_url() + "/metrics")
        finally:
            daemon.stop()
        captured += [daemon.log_text(), metrics_text]
        # The on-call engineer's commands, over the quarantined operation.
        for args in (
            ("quarantine", "list"),
            ("quarantine", "show", str(bad)),
            ("quarantine", "reconcile", str(bad), "--reason", "check it"),
            ("reconcile", "list"),
            ("reconcile", "show", str(bad)),
            ("reconcile", "check", str(bad), "--config", str(cfg)),
            ("reconcile", "resolve", str(bad), "--provider-ref", "ev_1", "--reason", "ok"),
            ("status", "--json"),
        ):
            cli(*args)
        # Errors print the connection's problem, never its password.
        wrong_db = make_conninfo(url, dbname="no_such_database_here")
        failed = _stderr(outbox_cli({**env, "OUTBOX_DATABASE_URL": wrong_db}, "status"))
        assert "no_such_database_here" in failed  # the error is shown, the password is not
        missing = {k: v for k, v in env.items() if k != "BILLING_TOKEN"}
        unset = _stderr(outbox_cli(missing, "run", "--config", str(cfg)))
        assert "BILLING_TOKEN" in unset
        captured += [failed, unset]
        settings = load_settings(cfg, env)
        captured += [repr(settings), repr(build_providers(settings.providers, env))]
    captured += _tables(url)
    assert statuses(url)["succeeded"] == 13  # the resolved one too: the run really happened
    everything = "\n".join(captured)
    # STRIPE_LOG=debug would have the SDK print every request and response body: outbox drops
    # the SDK's lines below WARNING whatever the environment says.
    assert "Request to Stripe" not in everything
    assert PAYLOAD_MARKER not in daemon.log_text() + metrics_text
    for secret in (DSN_PASSWORD, STRIPE_KEY, WEBHOOK_TOKEN, "whk-TOKEN-8f3b"):
        assert secret not in everything, f"a secret leaked: {secret[:6]}..."
    assert not re.search(r"sk_test_51Secret", everything)


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 (loopback)
        return str(response.read().decode())


def _stderr(done: subprocess.CompletedProcess[str]) -> str:
    """The output of a command that must have failed."""
    assert done.returncode != 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def _tables(url: str) -> list[str]:
    with psycopg.connect(url) as conn:
        return [
            json.dumps(conn.execute(f"SELECT json_agg(t) FROM outbox.{table} t").fetchone())  # noqa: S608
            for table in ("operations", "attempts", "audit")
        ]

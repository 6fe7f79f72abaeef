"""The real `outbox` CLI in a subprocess: enqueue, status, and what it refuses."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import psycopg
import pytest

from tests.support.cli import outbox_cli
from tests.support.producers import count

CHARGE = [
    "--tenant-id",
    "acme",
    "--operation-type",
    "invoice.charge",
    "--operation-key",
    "invoice-42-charge",
    "--provider",
    "stripe",
    "--action",
    "payment_intents.create",
]
PAYLOAD = '{"amount": 1000, "currency": "usd"}'


def test_enqueue_prints_the_outcome_and_a_second_one_is_a_duplicate(
    cli_env: dict[str, str], db_url: str
) -> None:
    first = outbox_cli(cli_env, "enqueue", *CHARGE, "--payload", PAYLOAD)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("accepted: operation ")
    second = outbox_cli(cli_env, "enqueue", *CHARGE, "--payload", PAYLOAD, "--json")
    assert second.returncode == 0, second.stderr
    result = json.loads(second.stdout)
    assert result["outcome"] == "duplicate"
    assert first.stdout.split()[-1] == str(result["operation_id"])
    assert count(db_url) == 1


def test_enqueue_reads_the_payload_from_a_file_or_stdin(
    cli_env: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    payload_file = tmp_path / "payload.json"
    payload_file.write_text(PAYLOAD)
    from_file = outbox_cli(cli_env, "enqueue", *CHARGE, "--payload-file", str(payload_file))
    assert from_file.returncode == 0, from_file.stderr
    stdin_args = [*CHARGE[:5], "invoice-43-charge", *CHARGE[6:]]
    from_stdin = outbox_cli(cli_env, "enqueue", *stdin_args, "--payload-file", "-", stdin=PAYLOAD)
    assert from_stdin.returncode == 0, from_stdin.stderr
    assert count(db_url) == 2


def test_a_conflict_exits_3_and_changes_nothing(cli_env: dict[str, str], db_url: str) -> None:
    assert outbox_cli(cli_env, "enqueue", *CHARGE, "--payload", PAYLOAD).returncode == 0
    conflict = outbox_cli(cli_env, "enqueue", *CHARGE, "--payload", '{"amount": 1}')
    assert conflict.returncode == 3
    assert "already exists with another provider, action or payload" in conflict.stderr
    assert count(db_url) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--payload", "[1]"], "the payload is a JSON array, not an object"),
        (["--payload", '{"amount": '], "the payload is not valid JSON"),
        # Issue 21: these were tracebacks with exit 1.
        (["--payload", '{"a": ' * 3000 + "1" + "}" * 3000], "nests deeper than 64 levels"),
        (["--payload", '{"n": ' + "9" * 5000 + "}"], "a number of 1e100 or more"),
        (["--payload", "{}", "--tenant-id", "t\udcff"], "'--tenant-id': is not UTF-8 text"),
        (["--payload", PAYLOAD, "--idempotency-key", "a b"], "idempotency_key must be"),
        ([], "exactly one of --payload or --payload-file"),
    ],
    ids=["array", "broken-json", "deep", "digits", "surrogate", "bad-key", "no-payload"],
)
def test_bad_input_exits_2_with_a_clear_message_and_writes_nothing(
    cli_env: dict[str, str], db_url: str, args: list[str], message: str
) -> None:
    done = outbox_cli(cli_env, "enqueue", *CHARGE, *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert count(db_url) == 0


def test_a_payload_file_that_is_not_utf8_and_an_unknown_log_level_exit_2(
    cli_env: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe{}")
    done = outbox_cli(cli_env, "enqueue", *CHARGE, "--payload-file", str(bad))
    assert (done.returncode, done.stderr.strip()) == (
        2,
        "Error: the payload file is not UTF-8 text (byte 0)",
    )
    trace = outbox_cli({**cli_env, "OUTBOX_LOG_LEVEL": "trace"}, "status")
    assert trace.returncode == 2 and "OUTBOX_LOG_LEVEL must be one of" in trace.stderr
    assert "Traceback" not in done.stderr + trace.stderr and count(db_url) == 0


def test_status_counts_every_status_as_table_and_json(cli_env: dict[str, str]) -> None:
    for key in ("a", "b", "c"):
        args = [*CHARGE[:5], key, *CHARGE[6:]]
        assert outbox_cli(cli_env, "enqueue", *args, "--payload", PAYLOAD).returncode == 0

    table = outbox_cli(cli_env, "status")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["STATUS", "COUNT"]
    assert lines[1].split() == ["pending", "3"]
    assert lines[2].split() == ["in_flight", "0"]
    assert "oldest due pending:" in table.stdout

    as_json = json.loads(outbox_cli(cli_env, "status", "--json").stdout)
    assert as_json["operations"] == {
        "pending": 3,
        "in_flight": 0,
        "succeeded": 0,
        "quarantined": 0,
        "reconciling": 0,
        "cancelled": 0,
    }
    assert as_json["oldest_due_pending_age_seconds"] >= 0
    assert as_json["succeeded_is_estimate"] is False


def test_status_estimates_succeeded_on_a_large_table_without_reading_it(
    cli_env: dict[str, str], db_url: str
) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:  # 150,000 finished rows, analysed
        conn.execute(
            "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint,"
            " provider, action, payload, idempotency_key, status, provider_ref, finished_at) "
            "SELECT 't', 'x', 'k' || g, '\\x00', 'p', 'a', '{}', 'key-' || g, 'succeeded', 'r',"
            " now() FROM generate_series(1, 150000) g"
        )
        conn.execute("ANALYZE outbox.operations")
    as_json = json.loads(outbox_cli(cli_env, "status", "--json").stdout)
    assert as_json["succeeded_is_estimate"] is True
    assert 140_000 <= as_json["operations"]["succeeded"] <= 160_000
    table = outbox_cli(cli_env, "status").stdout
    assert re.search(r"succeeded\s+~1[45]\d{4}", table)


def test_status_says_none_due_when_nothing_is_pending(cli_env: dict[str, str]) -> None:
    done = outbox_cli(cli_env, "status", "--json")
    assert json.loads(done.stdout)["oldest_due_pending_age_seconds"] is None


def test_a_password_on_the_command_line_is_refused_and_never_echoed() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DATABASE_URL"}
    done = outbox_cli(env, "status", "--dsn", "postgresql://app:s3cret-pw@127.0.0.1:1/app")
    assert done.returncode == 2
    assert "password on the command line" in done.stderr
    assert "s3cret-pw" not in done.stdout + done.stderr


def test_a_failed_connection_never_prints_the_password(db_url: str) -> None:
    env = {
        **os.environ,
        "OUTBOX_DATABASE_URL": "postgresql://app:s3cret-pw@127.0.0.1:1/app?connect_timeout=2",
    }
    done = outbox_cli(env, "status")
    assert done.returncode == 1
    assert "connection" in done.stderr
    assert "s3cret-pw" not in done.stdout + done.stderr


def test_commands_on_an_unmigrated_database_say_to_migrate(empty_db_url: str) -> None:
    done = outbox_cli({**os.environ, "OUTBOX_DATABASE_URL": empty_db_url}, "status")
    assert done.returncode == 1
    assert "run `outbox migrate` first" in done.stderr


def test_no_dsn_at_all_is_a_usage_error() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_DATABASE_URL"}
    done = outbox_cli(env, "status")
    assert done.returncode == 2
    assert "--dsn" in done.stderr and "OUTBOX_DATABASE_URL" in done.stderr


def test_run_with_a_missing_secret_exits_2_naming_the_key_before_claiming_anything(
    cli_env: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    assert outbox_cli(cli_env, "enqueue", *CHARGE, "--payload", PAYLOAD).returncode == 0
    config = tmp_path / "outbox.toml"
    config.write_text('[providers.stripe]\ntype = "stripe"\napi_key_env = "UNSET_STRIPE_KEY"\n')
    env = {k: v for k, v in cli_env.items() if k != "UNSET_STRIPE_KEY"}
    done = outbox_cli(env, "run", "--config", str(config), "--metrics-addr", "off")
    assert done.returncode == 2
    assert (
        "providers.stripe.api_key: environment variable UNSET_STRIPE_KEY is not set" in done.stderr
    )
    status = json.loads(outbox_cli(cli_env, "status", "--json").stdout)
    assert status["operations"]["pending"] == 1 and status["operations"]["in_flight"] == 0


def test_run_refuses_an_unknown_config_key(cli_env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "outbox.toml"
    config.write_text("[dispatcher]\nconcurency = 4\n")
    done = outbox_cli(cli_env, "run", "--config", str(config), "--metrics-addr", "off")
    assert done.returncode == 2
    assert "unknown key dispatcher.concurency" in done.stderr

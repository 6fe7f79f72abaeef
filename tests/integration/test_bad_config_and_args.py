"""Bad input at the other doors: a config file `outbox run` cannot use, and command lines that
do not parse. Each is a clear error naming what is wrong, exit code 2, no traceback, and nothing
claimed or written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.daemon import service as daemon
from tests.support.cli import outbox_cli
from tests.support.daemon import wait_until, write_config
from tests.support.dispatch import enqueue_many, rows, statuses

BAD_CONFIGS = [
    ("[dispatcher]\nconcurency = 4\n", "unknown key dispatcher.concurency"),
    ('[dispatcher]\nconcurrency = "lots"\n', "dispatcher.concurrency"),
    ("[dispatcher]\nconcurrency = 0\n", "dispatcher.concurrency"),
    ('[dispatcher]\nlease = "soon"\n', "dispatcher.lease"),
    ("[dispatcher]\nlease = true\n", "dispatcher.lease"),
    ('[dispatcher\nlease = "30s"\n', "outbox.toml"),  # not TOML at all
    ('[providers.hook]\ntype = "webhook"\n', "providers.hook.url"),
    ('[providers.hook]\ntype = "carrier-pigeon"\n', "providers.hook.type"),
    (
        '[providers.hook]\ntype = "webhook"\nurl = "http://x"\ntimeout = "fast"\n',
        "providers.hook.timeout",
    ),
    (
        '[providers.pay]\ntype = "stripe"\napi_key_env = "NO_SUCH_VARIABLE_SET"\n',
        "providers.pay.api_key",
    ),
    ('[providers.pay]\ntype = "stripe"\napi_key = "sk_test_inline"\n', "providers.pay.api_key"),
    (
        '[providers.pay]\ntype = "stripe"\napi_key_file = "/nonexistent/key"\n',
        "providers.pay.api_key",
    ),
    ('[providers.hook]\ntype = "noop"\nmax_in_flight = 0\n', "providers.hook.max_in_flight"),
    ('[providers.hook]\ntype = "noop"\nrate_limit = "lots"\n', "providers.hook.rate_limit"),
    (
        '[providers.hook]\ntype = "noop"\nrate_limit = "5/s"\nrate_burst = 0\n',
        "providers.hook.rate_burst",
    ),
    ('[providers.hook]\ntype = "noop"\nrate_burst = 5\n', "providers.hook.rate_burst"),
    (
        '[providers.hook]\ntype = "noop"\nbreaker_failures = "five"\n',
        "providers.hook.breaker_failures",
    ),
    (
        '[providers.hook]\ntype = "noop"\nbreaker_open_for = "-1s"\n',
        "providers.hook.breaker_open_for",
    ),
    ('[database]\nlisten = "no"\n', "database.listen (in"),
    ("[database]\nlisten = 1\n", "database.listen (in"),
]


@pytest.mark.parametrize(("text", "named"), BAD_CONFIGS)
def test_a_bad_config_exits_2_naming_the_key_before_anything_is_claimed(
    cli_env: dict[str, str], db_url: str, tmp_path: Path, text: str, named: str
) -> None:
    enqueue_many(db_url, 2)
    config = tmp_path / "outbox.toml"
    config.write_text(text)
    done = outbox_cli(cli_env, "run", "--config", str(config), "--metrics-addr", "off")
    assert done.returncode == 2, done.stdout + done.stderr
    assert named in done.stderr
    assert "Traceback" not in done.stderr
    assert "sk_test_inline" not in done.stderr  # a secret written inline is refused, not echoed
    assert statuses(db_url) == {"pending": 2}
    assert rows(db_url, "SELECT count(*) FROM outbox.attempts") == [(0,)]


def test_a_bad_environment_override_exits_2_naming_the_key_and_its_variable(
    cli_env: dict[str, str], db_url: str, tmp_path: Path
) -> None:
    enqueue_many(db_url, 1)
    config = tmp_path / "outbox.toml"
    config.write_text("[dispatcher]\n")
    env = {**cli_env, "OUTBOX_DATABASE__LISTEN": "sometimes"}
    done = outbox_cli(env, "run", "--config", str(config), "--metrics-addr", "off")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "database.listen (from OUTBOX_DATABASE__LISTEN) must be true or false" in done.stderr
    assert "Traceback" not in done.stderr
    assert statuses(db_url) == {"pending": 1}


BAD_ARGS = [
    (("frobnicate",), "No such command 'frobnicate'"),
    (("status", "--colour"), "No such option '--colour'"),
    (("run", "--metrics-addr", "nowhere"), "invalid address 'nowhere'"),
    (("enqueue", "--tenant-id", "t"), "Missing option"),
    (
        (
            "enqueue",
            "--tenant-id",
            "t",
            "--operation-type",
            "x",
            "--operation-key",
            "k",
            "--provider",
            "hook",
            "--action",
            "a",
            "--max-attempts",
            "zero",
        ),
        "--max-attempts",
    ),
    (
        (
            "enqueue",
            "--tenant-id",
            "t",
            "--operation-type",
            "x",
            "--operation-key",
            "k",
            "--provider",
            "hook",
            "--action",
            "a",
            "--payload",
            "{not json",
        ),
        "payload",
    ),
    (
        ("reconcile", "resolve", "forty-two", "--provider-ref", "x", "--reason", "r"),
        "'forty-two' is not a valid integer",
    ),
    (("reconcile", "resolve", "42"), "Missing option '--reason'"),
    (("reconcile", "resolve", "42", "--reason", "r"), "give one of --provider-ref REF"),
    (("quarantine", "replay", "42"), "Missing option '--reason'"),
    (("reconcile", "list", "--limit", "-5"), "--limit"),
    (("migrate", "--target", "0"), "--target"),
]


@pytest.mark.parametrize(
    ("args", "says"), BAD_ARGS, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None
)
def test_arguments_that_do_not_parse_exit_2_with_usage_and_write_nothing(
    cli_env: dict[str, str], db_url: str, args: tuple[str, ...], says: str
) -> None:
    enqueue_many(db_url, 1)
    done = outbox_cli(cli_env, *args)
    assert done.returncode == 2, done.stdout + done.stderr
    assert says in done.stderr
    assert "Traceback" not in done.stderr
    assert statuses(db_url) == {"pending": 1}
    status = json.loads(outbox_cli(cli_env, "status", "--json").stdout)
    assert sum(status["operations"].values()) == 1


def test_the_metrics_listener_binds_loopback_unless_told_otherwise() -> None:
    assert daemon.parse_addr(":9464") == ("127.0.0.1", 9464)
    assert daemon.parse_addr("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert daemon.parse_addr("0.0.0.0:9464") == ("0.0.0.0", 9464)  # noqa: S104 (told to)
    assert daemon.parse_addr("off") is None


@pytest.mark.parametrize("configured", [False, True], ids=["no config", "a noop provider"])
def test_a_run_without_providers_warns_before_it_starts(
    cli_env: dict[str, str], tmp_path: Path, configured: bool
) -> None:
    """With no provider, `outbox run` sends nothing and quarantines what it claims 10 minutes
    after its enqueue (issue 38, item 6): it says so before it starts, not 10 minutes later."""
    env = {k: v for k, v in cli_env.items() if k != "OUTBOX_CONFIG"}
    args = ["--metrics-addr", "off"]
    if configured:
        config = write_config(tmp_path / "outbox.toml", providers={"hook": {"type": "noop"}})
        args += ["--config", str(config)]
    log_path = tmp_path / "run.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "run", *args],
            env={**env, "OUTBOX_LOG_LEVEL": "info"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    started = '"outbox run started"'
    try:  # what it says as it starts is the point here, not how it drains: killed after
        wait_until(lambda: started in log_path.read_text(), timeout=30, what="the run to start")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    text = log_path.read_text()
    warned = "outbox run has no providers" in text
    assert warned is not configured, text
    if warned:
        assert "unknown_provider" in text and "10m" in text
        assert text.index("no providers") < text.index(started)

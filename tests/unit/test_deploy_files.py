"""The systemd units and the Containerfile say what production needs. The image cannot be built
on these machines (no container engine), so its file is checked for the properties instead."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from outbox import cli
from outbox.cli.common import BadInput
from outbox.config.settings import DEFAULT_SHUTDOWN_GRACE, DatabaseSettings
from outbox.core.durations import parse_duration
from outbox.daemon.service import EXIT_MISCONFIGURED

REPO = Path(__file__).resolve().parents[2]
UNITS = ("outbox.service", "outbox-migrate.service")


def unit(name: str) -> dict[str, list[str]]:
    """Every Key=Value of a unit file; keys may repeat."""
    keys: dict[str, list[str]] = defaultdict(list)
    for line in (REPO / "systemd" / name).read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            keys[key.strip()].append(value.strip())
    return keys


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd is not installed")
def test_systemd_analyze_verify_finds_nothing(tmp_path: Path) -> None:
    outbox_bin = Path(sys.executable).parent / "outbox"
    for name in UNITS:  # the units name the installed path; point it at this environment's
        text = (REPO / "systemd" / name).read_text()
        (tmp_path / name).write_text(text.replace("/usr/local/bin/outbox", str(outbox_bin)))
    done = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(tmp_path / n) for n in UNITS)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout + done.stderr == ""  # unknown keys are only warnings: none allowed


def test_the_service_notifies_drains_restarts_and_is_hardened() -> None:
    service = unit("outbox.service")
    assert service["Type"] == ["notify"]
    assert parse_duration(service["WatchdogSec"][0]).total_seconds() > 0
    assert parse_duration(service["TimeoutStopSec"][0]) > DEFAULT_SHUTDOWN_GRACE
    assert service["Restart"] == ["on-failure"]
    # A refusal to start (exit 2) is not restarted in a loop; everything else is.
    assert service["RestartPreventExitStatus"] == [str(EXIT_MISCONFIGURED)]
    assert BadInput.exit_code == EXIT_MISCONFIGURED == 2
    # A database late at boot ends as a start timeout, which restarts, before its exit 2.
    assert parse_duration(service["TimeoutStartSec"][0]) <= DatabaseSettings().startup_wait
    for key in ("DynamicUser", "NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert service[key] == ["yes"], key
    assert service["ProtectSystem"] == ["strict"]
    assert service["CapabilityBoundingSet"] == [""]
    assert service["Environment"] and any(
        "PGPASSFILE=%d/pgpass" in e for e in service["Environment"]
    )
    assert "outbox-migrate.service" in service["After"][0]


def test_no_unit_loads_a_credential_an_install_may_not_have() -> None:
    # systemd will not start a unit whose LoadCredential= file is missing: a webhook-only install
    # has no Stripe key, a peer- or certificate-authenticated database no password file.
    for name in UNITS:
        assert unit(name).get("LoadCredential", []) == [], name
        text = (REPO / "systemd" / name).read_text()
        assert "systemctl edit" in text and "LoadCredential=pgpass:" in text, name


def test_no_secret_is_on_a_command_line() -> None:
    for name in UNITS:
        for command in unit(name)["ExecStart"]:
            assert "--dsn" not in command and "password" not in command.lower()
            assert not re.search(r"sk_(live|test)_", command)


def test_the_migrate_unit_is_a_oneshot_before_the_service() -> None:
    migrate = unit("outbox-migrate.service")
    assert migrate["Type"] == ["oneshot"]
    assert migrate["ExecStart"][0].endswith("migrate --lock-timeout 5s --lock-wait 2m")
    assert migrate["Before"] == ["outbox.service"]


def test_the_containerfile_is_multi_stage_non_root_and_runs_the_installed_wheel() -> None:
    text = (REPO / "Containerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, re.MULTILINE)
    assert len(stages) >= 2
    final = text[text.rindex("\nFROM ") :]
    assert "COPY --from=build /wheels" in final
    assert not re.search(r"^COPY\s+(outbox|sql|\.)\b", final, re.MULTILINE)  # no source tree
    # With the console's extra: `outbox web` runs from the same image (docs/console.md).
    assert re.search(r"pip install .*--no-index --find-links /wheels 'outbox\[web\]'", final)
    user = re.findall(r"^USER\s+(\S+)", final, re.MULTILINE)
    assert user and user[-1] not in ("root", "0")
    assert "HEALTHCHECK" in final and "/healthz" in final
    assert re.search(r"^EXPOSE\s+9464\b", final, re.MULTILINE)
    assert 'ENTRYPOINT ["outbox"]' in final and '"run"' in final


def test_every_documented_podman_build_keeps_the_healthcheck() -> None:
    # podman builds OCI images by default, and the OCI format has no HEALTHCHECK: podman drops
    # it with a warning, and the container is never health-checked.
    for doc in ("README.md", "docs/operations.md", "Containerfile"):
        builds = re.findall(r"podman build[^`\n]*", (REPO / doc).read_text())
        assert builds, doc
        assert all("--format docker" in b for b in builds), (doc, builds)


def final_stage() -> list[tuple[str, str]]:
    """The last stage's instructions as (KEYWORD, arguments), continuation lines joined and
    comment lines dropped, as the builders read them."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in (REPO / "Containerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or not (pending or line.strip()):
            continue
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        keyword, _, arguments = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    last_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    return instructions[last_from:]


def instruction(keyword: str) -> str:
    found = [arguments for k, arguments in final_stage() if k == keyword]
    assert len(found) == 1, (keyword, found)
    return found[0]


def healthcheck_command() -> list[str]:
    """HEALTHCHECK's CMD, in the exec (JSON) form: a builder that cannot parse it as JSON would
    silently run it through /bin/sh as one word."""
    _, cmd, command = instruction("HEALTHCHECK").partition(" CMD ")
    assert cmd, "HEALTHCHECK without CMD"
    parsed = json.loads(command)
    assert isinstance(parsed, list) and all(isinstance(word, str) for word in parsed)
    return parsed


def test_run_and_the_healthcheck_read_one_metrics_address() -> None:
    env = dict(word.partition("=")[::2] for word in instruction("ENV").split())
    host, _, port = env["OUTBOX_METRICS_ADDR"].rpartition(":")
    assert host == "0.0.0.0"  # faces the container's network  # noqa: S104
    assert instruction("EXPOSE").split() == [port]
    # run takes the address from the variable alone: no --metrics-addr to contradict it.
    assert json.loads(instruction("CMD")) == ["run"]
    metrics_addr = next(p for p in cli.run.params if p.name == "metrics_addr")
    assert metrics_addr.envvar == "OUTBOX_METRICS_ADDR"
    # Unset or empty, the check asks run's own default.
    assert f"or {cli.DEFAULT_METRICS_ADDR!r}" in healthcheck_command()[-1]


class _Healthz(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class _Stalled(_Healthz):
    status = 503


class _Server6(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _check(metrics_addr: str | None) -> int:
    """The HEALTHCHECK's exit status, run here with this OUTBOX_METRICS_ADDR."""
    python, *args = healthcheck_command()
    assert python == "python"
    env = {k: v for k, v in os.environ.items() if k != "OUTBOX_METRICS_ADDR"}
    if metrics_addr is not None:
        env["OUTBOX_METRICS_ADDR"] = metrics_addr
    done = subprocess.run(
        [sys.executable, *args], env=env, capture_output=True, timeout=30, check=False
    )
    return done.returncode


@pytest.fixture
def serving() -> Iterator[Callable[[str, type[_Healthz]], int]]:
    """Starts a /healthz server on a free port of a host; gives the port."""
    servers: list[ThreadingHTTPServer] = []

    def serve(host: str, handler: type[_Healthz]) -> int:
        server = (_Server6 if ":" in host else ThreadingHTTPServer)((host, 0), handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return int(server.server_address[1])

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def test_the_healthcheck_asks_where_run_listens(
    serving: Callable[[str, type[_Healthz]], int],
) -> None:
    port = serving("127.0.0.1", _Healthz)
    assert _check(f"127.0.0.1:{port}") == 0
    assert _check(f"0.0.0.0:{port}") == 0  # a wildcard is asked on loopback
    assert _check(f":{port}") == 0  # no host: 127.0.0.1, as run binds it
    stalled = serving("127.0.0.1", _Stalled)
    assert _check(f"127.0.0.1:{stalled}") != 0
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        nobody = unused.getsockname()[1]
    assert _check(f"127.0.0.1:{nobody}") != 0
    assert _check("off") == 0  # no listener to ask


def test_the_healthcheck_asks_an_ipv6_listener(
    serving: Callable[[str, type[_Healthz]], int],
) -> None:
    try:
        port = serving("::1", _Healthz)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    assert _check(f"[::1]:{port}") == 0
    assert _check(f"[::]:{port}") == 0


def _ignore_rules(name: str) -> list[tuple[re.Pattern[str], bool]]:
    """A .containerignore's patterns as docker and buildah match them: `*` and `?` within one
    path segment, `**` across them, `!` to take a path back; the last match decides."""
    rules = []
    for line in (REPO / name).read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        regex = ""
        for part in re.split(r"(\*\*/|\*\*|\*|\?|\[[^]]*\])", pattern):
            if part == "**/":
                regex += "(.*/)?"
            elif part == "**":
                regex += ".*"
            elif part == "*":
                regex += "[^/]*"
            elif part == "?":
                regex += "[^/]"
            elif part.startswith("[") and part.endswith("]"):
                regex += part
            else:
                regex += re.escape(part)
        rules.append((re.compile(regex), keep))
    return rules


def _sent(path: str, rules: list[tuple[re.Pattern[str], bool]]) -> bool:
    """Whether the builder gets this path of the context: a rule matching it or a directory
    above it decides, the last one last."""
    parts = path.split("/")
    sent = True
    for regex, keep in rules:
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            sent = keep
    return sent


def test_docker_and_podman_ignore_the_same_files() -> None:
    assert (REPO / ".dockerignore").read_text() == (REPO / ".containerignore").read_text()


def test_the_build_context_is_what_the_containerfile_copies() -> None:
    rules = _ignore_rules(".containerignore")
    sources = [
        word
        for line in (REPO / "Containerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from=" not in line
        for word in line.split()[1:-1]
    ]
    assert sorted(sources) == ["README.md", "outbox", "pyproject.toml", "sql"]
    copied = [
        path.relative_to(REPO).as_posix()
        for source in sources
        for path in ([REPO / source] if (REPO / source).is_file() else (REPO / source).rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    ]
    assert len(copied) > 50
    assert [path for path in copied if not _sent(path, rules)] == []
    left_out = (
        ".git/HEAD",
        ".venv/bin/python",
        "bench/.venv-hatchet/bin/python",
        "bench/chaos.py",
        "mutants/outbox/policy.py",
        "py_spy-0.4.0-py2.py3-none-manylinux_2_5_x86_64.whl",
        "dist/outbox-0.1.0-py3-none-any.whl",
        "outbox.egg-info/PKG-INFO",
        ".pytest_cache/v/cache/nodeids",
        ".mypy_cache/3.11/outbox/metrics.data.json",
        "outbox/__pycache__/metrics.cpython-311.pyc",
        "outbox/db/__pycache__/store.cpython-311.pyc",
        "outbox/stray.pyc",
        "tests/unit/test_deploy_files.py",
        "docs/runbook.md",
        "deploy/grafana/outbox-dashboard.json",
        "Containerfile",
    )
    assert [path for path in left_out if _sent(path, rules)] == []

"""The command tree as a whole. Every command's options are distinct: click takes the last of
two same-named options silently, so a filter named like an action's own option (the audit's
--reason) would change what the action does, not fail. Every --json command fails in JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import click
from click.testing import CliRunner

from outbox.cli import main
from outbox.cli.common import TEXT


def commands(group: click.Group, path: str = "outbox") -> Iterator[tuple[str, click.Command]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from commands(command, f"{path} {name}")
        else:
            yield f"{path} {name}", command


def test_no_command_has_two_options_of_one_name_or_spelling() -> None:
    found = list(commands(main))
    assert len(found) >= 20  # the walk reached the subcommands
    for path, command in found:
        names = Counter(p.name for p in command.params)
        spellings = Counter(o for p in command.params for o in (*p.opts, *p.secondary_opts))
        assert [n for n, k in names.items() if k > 1] == [], path
        assert [s for s, k in spellings.items() if k > 1] == [], path


def test_every_json_command_reports_its_failures_as_json() -> None:
    json_commands = [p for p, c in commands(main) if any(x.name == "as_json" for x in c.params)]
    assert len(json_commands) >= 6
    env = {**os.environ, "OUTBOX_DATABASE_URL": "host=127.0.0.1 port=1 user=nobody"}
    cases = [
        (path, extra, code)
        for path in json_commands
        for extra, code in ((["--no-such-option"], 2), ([], None))
    ]

    def run(case: tuple[str, list[str], int | None]) -> subprocess.CompletedProcess[str]:
        path, extra, _ = case
        return subprocess.run(
            [sys.executable, "-m", "outbox", *path.split()[1:], "--json", *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    # Each process spends its time importing outbox: four at once, the checks in order after.
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(run, cases))
    for (path, _, code), done in zip(cases, answers, strict=True):
        if code is None and done.returncode == 0:
            continue  # needs no database, and had nothing to fail on
        error = json.loads(done.stderr)  # one JSON object, nothing else
        assert error["exit_code"] == done.returncode != 0, (path, done.stderr)
        assert code is None or done.returncode == code, (path, done.stderr)
        assert done.stdout == "", path


def test_every_text_parameter_refuses_what_no_database_text_holds() -> None:
    """Bytes that are not UTF-8 on a command line arrive as lone surrogates, which the driver
    could not encode: a traceback and exit 1, where the README promises exit 2. Every text
    parameter is outbox.cli.common.TEXT, and refuses them (and NUL) by name."""
    runner = CliRunner()
    checked = 0
    for path, command in commands(main):
        for param in command.params:
            if param.type is click.STRING:
                raise AssertionError(f"{path} {param.name}: a text parameter must be TEXT")
            if param.type is not TEXT:
                continue
            for bad in ("caf\udce9", "a\x00b"):
                given = [param.opts[0], bad] if isinstance(param, click.Option) else [bad]
                done = runner.invoke(main, [*path.split()[1:], *given])
                assert done.exit_code == 2, (path, param.name, done.output)
                assert "not UTF-8 text" in done.output or "NUL" in done.output, done.output
            checked += 1
    assert checked >= 25

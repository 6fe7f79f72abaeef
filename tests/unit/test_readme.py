"""The README says what the code does: its configs load, its commands and options exist, every
block is run or says why not, and its Layout names every module. docs/design.md's CLI table names
every command and option. tests/integration/test_readme_runs.py runs the blocks themselves."""

from __future__ import annotations

import asyncio
import fnmatch
import re
import shlex
import tomllib
from collections.abc import Iterator
from datetime import timedelta

import click
import pytest

from outbox.cli import main
from outbox.config.loader import settings_from_mapping
from outbox.config.settings import ProviderLimits
from outbox.providers.registry import build_providers, stripe_options, webhook_options
from tests.support.readme import LOADED, README, RUN, TEXT, Block, blocks, stray_markers

ROOT = README.parent
# The blocks a test cannot run, each with its reason in the README. A new one is a decision:
# make the example runnable instead where you can.
# Four in "The receiving half": two excerpts (Starlette, Flask), two servers that run until stopped.
NOT_RUN = 10


def test_the_readme_config_loads_with_its_secret_from_the_environment() -> None:
    (block,) = re.findall(r"```toml\n(# outbox.toml\n.*?)```", README.read_text(), re.DOTALL)
    settings = settings_from_mapping(tomllib.loads(block), environ={})
    assert settings.dispatcher.lease == timedelta(seconds=30)
    options = webhook_options(settings.providers["billing"], {"BILLING_TOKEN": "Bearer t0k"})
    assert options.secret_headers == {"Authorization": "Bearer t0k"}
    assert options.url == "https://billing.internal/outbox"
    assert settings.providers["billing"].limits == ProviderLimits(
        max_in_flight=16,
        rate=100.0,
        burst=100,
        breaker_failures=5,
        breaker_open_for=timedelta(seconds=30),
    )
    assert "t0k" not in repr(options) and "t0k" not in repr(settings)


def test_the_readme_stripe_block_loads() -> None:
    (block,) = re.findall(
        r"```toml\n(\[providers\.stripe\]\n.*?)```", README.read_text(), re.DOTALL
    )
    settings = settings_from_mapping(tomllib.loads(block), environ={})
    options = stripe_options(settings.providers["stripe"], {"STRIPE_API_KEY": "sk_test_x"})
    assert options.api_key == "sk_test_x"
    assert options.key_retention == timedelta(hours=24)
    assert options.timeout == timedelta(seconds=20)


# --- every block -------------------------------------------------------------------------------


def test_every_block_is_run_loaded_or_says_why_not() -> None:
    found = blocks()
    assert len(found) >= 12  # the parser reached the whole README
    kinds = {b.where(): b.lang for b in found if b.lang not in (*RUN, *LOADED, *TEXT)}
    assert kinds == {}, "a block of a language no test runs (sh, python, sql, toml)"
    marked_idle = [b.where() for b in found if b.not_run and b.lang not in RUN]
    assert marked_idle == [], "only a block that would run can be marked not run"
    assert stray_markers() == [], "a not-run marker must be the line just before a fence"
    not_run = [b for b in found if b.not_run is not None]
    assert len(not_run) == NOT_RUN, [f"{b.where()}: {b.not_run}" for b in not_run]
    assert all(len(b.not_run or "") >= 10 for b in not_run), "each marker says why"
    assert sum(b.lang in RUN and b.not_run is None for b in found) >= 5  # most of them run


def test_the_marker_belongs_to_the_fence_right_after_it() -> None:
    text = (
        "<!-- not run: it runs for ever -->\n```sh\nsleep inf\n```\n\n"
        "<!-- not run: too far from its fence -->\n\n```sh\ntrue\n```\n"
        "<!-- not-run: misspelt -->\n```python\npass\n```\n"
    )
    first, second, third = blocks(text)
    assert (first.not_run, first.line, first.text) == ("it runs for ever", 2, "sleep inf\n")
    assert second.not_run is None and third.not_run is None
    assert [s.line for s in stray_markers(text)] == [6, 11]


def _secrets(document: object) -> Iterator[str]:
    """The environment variables a config's secrets name (``{ env = "NAME" }``, ``*_env``)."""
    if isinstance(document, dict):
        for key, value in document.items():
            if (key == "env" or key.endswith("_env")) and isinstance(value, str):
                yield value
            else:
                yield from _secrets(value)


@pytest.mark.parametrize("block", [b for b in blocks() if b.lang in LOADED], ids=Block.where)
def test_every_toml_block_loads_and_builds_its_providers(block: Block) -> None:
    document = tomllib.loads(block.text)
    environ = dict.fromkeys(_secrets(document), "a-secret-for-the-test")
    settings = settings_from_mapping(document, environ={})
    providers = build_providers(settings.providers, environ)
    assert set(providers) == set(document.get("providers", {}))

    async def close() -> None:
        for provider in providers.values():
            await provider.aclose()

    asyncio.run(close())


# --- the commands the shell blocks name --------------------------------------------------------


def _outbox_commands(block: Block) -> Iterator[list[str]]:
    """Each `outbox ...` command of a shell block, as words: continuations joined, comments
    dropped, split at &&, ||, ; and |, a synopsis's brackets taken off."""
    for line in block.text.replace("\\\n", " ").splitlines():
        words: list[str] = []
        for word in [*shlex.split(line, comments=True), "&&"]:
            if word in ("&&", "||", ";", "|"):
                if words[:1] == ["outbox"]:
                    yield words
                words = []
            else:
                words.append(word.strip("[]") if word.startswith("[") else word.rstrip("]"))


def _leaves(words: list[str], where: str) -> tuple[list[click.Command], list[str]]:
    """The commands ``words`` names (``reset|probe`` names two), and the words after them."""
    commands: list[click.Command] = [main]
    rest = words[1:]
    while all(isinstance(c, click.Group) for c in commands):
        assert rest, f"{where}: {' '.join(words)} names a group, no command"
        names = rest.pop(0).split("|")
        groups = [c for c in commands if isinstance(c, click.Group)]
        missing = [n for g in groups for n in names if n not in g.commands]
        assert missing == [], f"{where}: {' '.join(words)}: no command {missing}"
        commands = [g.commands[n] for g in groups for n in names]
    return commands, rest


def test_every_outbox_command_of_the_shell_blocks_exists_with_its_options() -> None:
    checked = 0
    for block in (b for b in blocks() if b.lang == "sh"):
        for words in _outbox_commands(block):
            commands, rest = _leaves(words, block.where())
            options = {w.split("=", 1)[0] for w in rest if w.startswith("--")}
            for command in commands:
                known = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
                unknown = options - known - {"--help"}
                assert unknown == set(), f"{block.where()}: {' '.join(words)}: no {unknown}"
            checked += 1
    assert checked >= 20  # the walk reached the blocks' commands


# --- the Layout -------------------------------------------------------------------------------


def _layout() -> dict[str, str]:
    """The Layout block's paragraphs by the directory that starts each."""
    text = README.read_text()
    section = text[text.index("\n## Layout\n") :]
    (layout,) = [b for b in blocks(section) if b.lang == ""]
    paragraphs: dict[str, str] = {}
    for line in layout.text.splitlines():
        rest = line
        if line[:1].strip():
            directory, _, rest = line.partition(" ")
            paragraphs[directory] = ""
        paragraphs[directory] += " " + rest.strip()
    return paragraphs


def test_the_layout_names_every_module_of_the_package() -> None:
    paragraphs = _layout()
    package = ROOT / "outbox"
    missing: list[str] = []
    # Every package at any depth: one below the top has a paragraph of its own; a deeper one
    # (outbox/providers/http/) may instead be named in its parent's, and if it has its own, every
    # module of it is named there too.
    packages = sorted(p for p in package.rglob("*") if (p / "__init__.py").exists())
    for directory in [package, *packages]:
        key = f"{directory.relative_to(ROOT)}/"
        if key not in paragraphs:
            if directory.parent == package:
                missing.append(key)
            continue
        named = re.findall(r"[\w*]+\.py", paragraphs[key])
        for module in sorted(directory.glob("*.py")):
            if module.name.startswith("__"):
                continue
            if not any(fnmatch.fnmatchcase(module.name, pattern) for pattern in named):
                missing.append(str(module.relative_to(ROOT)))
        for sub in sorted(p for p in directory.iterdir() if (p / "__init__.py").exists()):
            if directory != package and f"{sub.name}/" not in paragraphs[key]:
                missing.append(f"{sub.relative_to(ROOT)}/")
    assert missing == [], "README.md, Layout: name these"


# --- docs/design.md, "CLI" ---------------------------------------------------------------------


def _commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from _commands(command, (*path, name))
        else:
            yield (*path, name)


def test_the_design_cli_table_names_every_command_and_option() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    start = text.index("\n### CLI\n")
    section = text[start : text.index("\n### ", start + 1)]
    missing: list[str] = []
    for path in _commands(main):
        if not re.search(rf"^\| `{re.escape(path[0])}\b", section, re.MULTILINE):
            missing.append(f"a row for {path[0]}")
        if not re.search(rf"\b{re.escape(path[-1])}\b", section):
            missing.append(" ".join(path))
        command: click.Command = main
        for name in path:
            assert isinstance(command, click.Group)
            command = command.commands[name]
        options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
        missing += [
            f"{' '.join(path)} {o}"
            for o in sorted(options)
            if o.startswith("--") and not re.search(rf"{re.escape(o)}\b", section)
        ]
    assert missing == [], "docs/design.md, CLI: name these"

"""Every `outbox` command's options are distinct: click takes the last of two same-named
options silently, so a filter named like an action's own option (the audit's --reason) would
change what the action does, not fail."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import click

from outbox.cli import main


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

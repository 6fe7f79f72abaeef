"""The README's code blocks as a reader finds them, and the markers that keep one from running.

A fenced block whose language is ``sh``, ``python`` or ``sql`` is run, in README order, against one
fresh database (tests/integration/test_readme_runs.py); a ``toml`` block is loaded as a config
(tests/unit/test_readme.py). A block that cannot run in a test says why on the line before it:

    <!-- not run: the reason, for the reader too -->

The tests count those markers: each new one is a decision, made in the test as well.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

README: Final = Path(__file__).resolve().parents[2] / "README.md"

RUN: Final = ("sh", "python", "sql")  # run as written, in order
LOADED: Final = ("toml",)  # loaded through outbox.config
TEXT: Final = ("",)  # no language: a picture in text (the Layout), never code

_MARKER: Final = re.compile(r"<!-- not run: (?P<reason>.+?) -->")
_MISSPELT: Final = re.compile(r"<!--.*not.?run", re.IGNORECASE)
_FENCE: Final = re.compile(r"```(?P<lang>\S*)")


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its text, the README line of its opening fence, and the
    reason it is not run (None: it runs)."""

    lang: str
    text: str
    line: int
    not_run: str | None

    def where(self) -> str:
        return f"README.md line {self.line} (```{self.lang})"


@dataclass(frozen=True)
class Stray:
    """A marker that is not on the line just before an opening fence: it marks nothing."""

    line: int
    text: str


def blocks(text: str | None = None) -> list[Block]:
    """Every fenced block of the README (or of ``text``), in order."""
    return _parse(README.read_text() if text is None else text)[0]


def stray_markers(text: str | None = None) -> list[Stray]:
    return _parse(README.read_text() if text is None else text)[1]


def _parse(text: str) -> tuple[list[Block], list[Stray]]:
    lines = text.splitlines()
    found: list[Block] = []
    strays: list[Stray] = []
    pending: tuple[int, str] | None = None  # a marker waiting for its fence
    number = 0
    while number < len(lines):
        line = lines[number]
        opening = _FENCE.fullmatch(line)
        if opening is not None:
            reason = None
            if pending is not None and pending[0] == number - 1:
                reason = pending[1]
            elif pending is not None:
                strays.append(Stray(pending[0] + 1, lines[pending[0]]))
            pending = None
            end = lines.index("```", number + 1)  # ValueError: an unclosed fence
            body = "\n".join(lines[number + 1 : end]) + "\n"
            found.append(Block(opening["lang"], body, number + 1, reason))
            number = end + 1
            continue
        if pending is not None:  # the marker's next line was not a fence
            strays.append(Stray(pending[0] + 1, lines[pending[0]]))
            pending = None
        marker = _MARKER.search(line)
        if marker is not None:
            pending = (number, marker["reason"].strip())
        elif _MISSPELT.search(line):  # a marker misspelt is a stray too
            strays.append(Stray(number + 1, line))
        number += 1
    if pending is not None:
        strays.append(Stray(pending[0] + 1, lines[pending[0]]))
    return found, strays

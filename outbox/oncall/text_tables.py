"""Plain-text tables for people, from the CLI and `outbox demo`; the CLI's --json is for scripts."""

from __future__ import annotations

from collections.abc import Sequence

from outbox.core.safe_text import printable


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned, text left-aligned; control
    characters escaped, so that no cell can draw a row or move the cursor."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [
        all(isinstance(row[i], int | float) for row in rows) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        padded = (
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        )
        return "  ".join(padded).rstrip()

    return "\n".join([line([h.upper() for h in headers]), *(line(r) for r in cells)])


def _cell(value: object) -> str:
    # A cell is one line of plain text, whatever it holds (outbox.core.safe_text).
    return "-" if value is None else printable(str(value))

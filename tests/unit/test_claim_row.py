"""The claim's rows become Claimed by position (psycopg's args_row): its RETURNING list must name
Claimed's fields in their order."""

from __future__ import annotations

import re

from outbox.db import statements
from outbox.db.store import Claimed


def top_level_items(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses (a column may be an expression)."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    return [*items, text[start:]]


def test_the_claim_returns_claimed_fields_in_order() -> None:
    returning = statements.CLAIM.rsplit("RETURNING", 1)[1]
    code = "\n".join(line.split("--")[0] for line in returning.splitlines())
    columns = [re.split(r"\s+AS\s+|\.", item.strip())[-1] for item in top_level_items(code)]
    assert columns == list(Claimed._fields)

"""The claim's rows become Claimed by position (psycopg's args_row): the claim functions must
return Claimed's fields in their order."""

from __future__ import annotations

import re
from pathlib import Path

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


def _functions() -> str:
    return (Path(__file__).parents[2] / "sql" / DISPATCH_SQL_NAME).read_text()


DISPATCH_SQL_NAME = "0040_the_dispatcher_writes_through_functions.sql"
CLAIMS = ("lease_claimed", "claim_fair", "claim_one_group", "claim_probe")


def test_every_claim_returns_claimed_fields_in_order() -> None:
    """The claim functions of sql/0040 declare Claimed's fields as their columns, in order."""
    text = _functions()
    for name in CLAIMS:
        declared = text.split(f"CREATE FUNCTION outbox.{name}(", 1)[1]
        table = declared.split("RETURNS TABLE (", 1)[1].split(")\nLANGUAGE", 1)[0]
        columns = [item.split()[0] for item in top_level_items(table)]
        assert columns == list(Claimed._fields), name


def test_the_lease_returns_claimed_fields_in_order() -> None:
    """RETURN QUERY matches its rows to the declared columns by position and type only: two
    text columns swapped would go unnoticed by the server."""
    body = _functions().split("CREATE FUNCTION outbox.lease_claimed(", 1)[1].split("$$;", 1)[0]
    returning = body.rsplit("RETURNING", 1)[1].split(";", 1)[0]
    code = "\n".join(line.split("--")[0] for line in returning.splitlines())
    columns = [re.split(r"\s+AS\s+|\.", item.strip())[-1] for item in top_level_items(code)]
    assert columns == list(Claimed._fields)

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


def _functions(name: str = "0040_the_dispatcher_writes_through_functions.sql") -> str:
    return (Path(__file__).parents[2] / "sql" / name).read_text()


INTENT_SQL_NAME = "0045_deliveries_carry_their_origin_and_fingerprint.sql"
CONTRACT_SQL_NAME = "0054_the_dispatcher_checks_contracts.sql"
# sql/0040's claims, which dispatchers of two versions ago call: Claimed's fields before the
# intent's three and the contract's version; 0045's, which those of the previous version call:
# all but the contract's version.
OLD_CLAIMS = ("lease_claimed", "claim_fair", "claim_one_group", "claim_probe")
V2_CLAIMS = ("with_intent", "claim_fair_v2", "claim_one_group_v2", "claim_probe_v2")
CLAIMS = ("with_intent_v3", "claim_fair_v3", "claim_one_group_v3", "claim_probe_v3")
V2_FIELDS = list(Claimed._fields)[:-1]
OLD_FIELDS = V2_FIELDS[: -len(("ordering_key", "fingerprint", "origin"))]


def _declared(text: str, name: str) -> list[str]:
    declared = text.split(f"CREATE FUNCTION outbox.{name}(", 1)[1]
    table = declared.split("RETURNS TABLE (", 1)[1].split(")\nLANGUAGE", 1)[0]
    return [item.split()[0] for item in top_level_items(table)]


def test_every_claim_returns_claimed_fields_in_order() -> None:
    """The claim functions that this version calls (sql/0054) declare Claimed's fields as their
    columns, in order; those of sql/0045 all but the last, those of sql/0040 the fields before
    the intent's, and the row type that carries them between the two statements of a _v2 or _v3
    claim has those too."""
    for name in CLAIMS:
        assert _declared(_functions(CONTRACT_SQL_NAME), name) == list(Claimed._fields), name
    for name in V2_CLAIMS:
        assert _declared(_functions(INTENT_SQL_NAME), name) == V2_FIELDS, name
    for name in OLD_CLAIMS:
        assert _declared(_functions(), name) == OLD_FIELDS, name
    row_type = _functions(INTENT_SQL_NAME).split("CREATE TYPE outbox.claimed_row AS (", 1)[1]
    columns = [item.split()[0] for item in top_level_items(row_type.split(");", 1)[0])]
    assert columns == OLD_FIELDS


def _selected(code: str) -> list[str]:
    code = "\n".join(line.split("--")[0] for line in code.splitlines())
    return [re.split(r"\s+AS\s+|\.", item.strip())[-1] for item in top_level_items(code)]


def test_the_lease_returns_claimed_fields_in_order() -> None:
    """RETURN QUERY matches its rows to the declared columns by position and type only: two
    text columns swapped would go unnoticed by the server. So with the _v2 and _v3 claims' two
    statements: the row they keep and the row with_intent (with_intent_v3) returns."""
    body = _functions().split("CREATE FUNCTION outbox.lease_claimed(", 1)[1].split("$$;", 1)[0]
    returning = body.rsplit("RETURNING", 1)[1].split(";", 1)[0]
    assert _selected(returning) == OLD_FIELDS
    for sql_name, claims, fields in (
        (INTENT_SQL_NAME, V2_CLAIMS, V2_FIELDS),
        (CONTRACT_SQL_NAME, CLAIMS, list(Claimed._fields)),
    ):
        sql = _functions(sql_name)
        body = sql.split(f"CREATE FUNCTION outbox.{claims[0]}(", 1)[1].split("$$;", 1)[0]
        select = body.split("SELECT ", 1)[1].split("\n    FROM unnest", 1)[0]
        # The origin is a subquery: its name is the declared column's.
        selected = _selected(select)
        origin = fields.index("origin")
        assert selected[:origin] + selected[origin + 1 :] == fields[:origin] + fields[origin + 1 :]
        for name in claims[1:]:
            body = sql.split(f"CREATE FUNCTION outbox.{name}(", 1)[1].split("$$;", 1)[0]
            kept = body.split("array_agg((", 1)[1].split(")::outbox.claimed_row", 1)[0]
            assert _selected(kept) == OLD_FIELDS, name

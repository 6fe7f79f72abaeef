"""The claim's rows become Claimed by position (psycopg's args_row): its RETURNING list must name
Claimed's fields in their order."""

from __future__ import annotations

import re

from outbox.db import statements
from outbox.db.store import Claimed


def test_the_claim_returns_claimed_fields_in_order() -> None:
    returning = statements.CLAIM.rsplit("RETURNING", 1)[1]
    columns = [re.split(r"\s+AS\s+|\.", column.strip())[-1] for column in returning.split(",")]
    assert columns == list(Claimed._fields)

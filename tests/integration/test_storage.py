"""How outbox.operations sits on disk (sql/0018): each row is updated twice after its insert, and
a new row version that stays on its page costs the database less than one that moves."""

from __future__ import annotations

from datetime import timedelta

import psycopg

from outbox.db import statements
from outbox.db.store import claim_params
from tests.support.dispatch import enqueue_many, rows

CLAIM_ALL = claim_params("w", 400, timedelta(seconds=30))
BLOCKS = "SELECT id, (ctid::text::point)[0]::int FROM outbox.operations"


def test_a_claim_finds_room_for_most_rows_on_their_own_pages(db_url: str) -> None:
    enqueue_many(db_url, 400)
    before = dict(rows(db_url, BLOCKS))
    with psycopg.connect(db_url, autocommit=True) as conn:
        claimed = conn.execute(statements.CLAIM, CLAIM_ALL, prepare=False).fetchall()
    after = dict(rows(db_url, BLOCKS))
    assert len(claimed) == 400 and after.keys() == before.keys()
    stayed = sum(1 for op, block in after.items() if block == before[op])
    # Packed full (fill factor 100) every version would move to a new page; with a fifth of each
    # page kept free, about a fifth of the rows' new versions fit beside them.
    assert stayed >= 400 * 0.15, f"{stayed} of 400 claimed rows stayed on their page"
    ((options,),) = rows(
        db_url, "SELECT reloptions FROM pg_class WHERE oid = 'outbox.operations'::regclass"
    )
    assert options == ["fillfactor=80"]

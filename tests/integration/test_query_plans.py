"""The hot statements read partial indexes, so millions of finished rows cost them nothing
(pgqueuer's query-plan regression test, in spirit): EXPLAIN on a table of finished rows."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest

from outbox.db import statements
from outbox.db.store import claim_params
from tests.support.dispatch import enqueue_many

FINISHED_ROWS = 60_000


@pytest.fixture
def big_db(db_url: str) -> str:
    enqueue_many(db_url, 20)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint,"
            " provider, action, payload, idempotency_key, status, provider_ref, attempts,"
            " finished_at) SELECT 'acme', 'done', 'k' || g, '\\x00', 'hook', 'a', '{}',"
            " 'key' || g, 'succeeded', 'ref' || g, 1, now() FROM generate_series(1, %s) g",
            (FINISHED_ROWS,),
        )
        conn.execute(
            "UPDATE outbox.operations SET status = 'in_flight', lease_owner = 'w', "
            "lease_token = gen_random_uuid(), lease_expires_at = now() "
            "WHERE operation_type = 'invoice.charge' AND operation_key < 'op-13'"
        )
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.operations")
    return db_url


def plan_nodes(url: str, query: LiteralString, params: dict[str, Any],
               *, analyze: bool = False) -> list[dict[str, Any]]:  # fmt: skip
    explain: LiteralString = (
        "EXPLAIN (ANALYZE, FORMAT JSON) " if analyze else "EXPLAIN (FORMAT JSON) "
    )
    with psycopg.connect(url) as conn:
        row = conn.execute(explain + query, params).fetchone()
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    nodes: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        nodes.append(node)
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return nodes


def scans_of_operations(nodes: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(n["Node Type"], n.get("Index Name")) for n in nodes
            if n.get("Relation Name") == "operations"]  # fmt: skip


CLAIM_PARAMS: dict[str, Any] = claim_params("w", 100, timedelta(seconds=30))


def test_the_claim_reads_the_claim_index(big_db: str) -> None:
    scans = scans_of_operations(plan_nodes(big_db, statements.CLAIM, CLAIM_PARAMS, analyze=True))
    assert ("Seq Scan", None) not in scans
    reads = {index for node, index in scans if node != "ModifyTable"}
    assert reads == {"operations_claim_group", "operations_pkey"}, scans


def test_the_rescue_reads_the_lease_index(big_db: str) -> None:
    scans = scans_of_operations(plan_nodes(big_db, statements.RESCUE,
                                           {"limit": 500, "max_attempts": 10}))  # fmt: skip
    assert ("Seq Scan", None) not in scans
    assert any(index == "operations_lease" for _, index in scans), scans


def test_the_gauges_read_only_partial_indexes_once_the_table_is_big(big_db: str) -> None:
    nodes = plan_nodes(big_db, statements.GAUGES, {"exact_limit": 0}, analyze=True)
    # The exact count of succeeded rows is in the plan, but never executed past the limit.
    executed = [n for n in nodes if n.get("Actual Loops", 0) > 0]
    scans = scans_of_operations(executed)
    assert len(scans) >= 7
    assert all(kind != "Seq Scan" for kind, _ in scans), scans


def test_the_key_expiry_gauge_reads_only_partial_indexes(big_db: str) -> None:
    params = {"providers": ["hook", "stripe"], "windows": [timedelta(hours=24)] * 2}
    scans = scans_of_operations(plan_nodes(big_db, statements.NEARING_KEY_EXPIRY, params))
    assert scans and all(kind != "Seq Scan" for kind, _ in scans), scans
    assert {index for _, index in scans} <= {"operations_claim_group",
                                             "operations_ordering_blocked"}, scans  # fmt: skip

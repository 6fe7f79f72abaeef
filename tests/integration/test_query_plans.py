"""The hot statements read partial indexes, so millions of finished rows cost them nothing
(pgqueuer's query-plan regression test, in spirit): EXPLAIN on a table of finished rows.

`outbox run`'s sessions use generic plans (plan_cache_mode in outbox.db.connect), planned
without the parameters' values: the generic plan of each statement it repeats may read no whole
table and do no more work than the plan made for the values at hand."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from outbox.db import connect, statements
from outbox.db.store import claim_params
from outbox.oncall import operators
from tests.support import postgres
from tests.support.dispatch import enqueue_many

FINISHED_ROWS = 60_000


@pytest.fixture(scope="module")
def big_template(pg_server: str, template_db: str) -> Iterator[str]:
    """The big table, built and analysed once per module (and xdist worker): each test gets a
    copy of it (the claims run under EXPLAIN ANALYZE change it), statistics included."""
    name = postgres.create_database(pg_server, template_db)
    fill(postgres.with_dbname(pg_server, name))
    yield name
    postgres.drop_database(pg_server, name)


@pytest.fixture
def big_db(pg_server: str, big_template: str) -> Iterator[str]:
    name = postgres.create_database(pg_server, big_template)
    yield postgres.with_dbname(pg_server, name)
    postgres.drop_database(pg_server, name)


def fill(db_url: str) -> None:
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
            "lease_token = gen_random_uuid(), lease_expires_at = now(), attempts = 1, "
            "last_attempt_at = now() "
            "WHERE operation_type = 'invoice.charge' AND operation_key < 'op-13'"
        )
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE outbox.operations")


def _walk(plan: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = [plan]
    for child in plan.get("Plans", []):
        nodes.extend(_walk(child))
    return nodes


def _top(row: tuple[Any, ...] | None) -> dict[str, Any]:
    assert row is not None
    plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    top: dict[str, Any] = plan[0]["Plan"]
    return top


def plan_nodes(
    url: str, query: LiteralString, params: dict[str, Any], *, analyze: bool = False
) -> list[dict[str, Any]]:
    """The nodes of ``query``'s plan, its top node first. For a call of one of outbox's
    functions (sql/0040), the nodes of the statements it ran come after it (auto_explain's
    nested plans: EXPLAIN shows only a function scan), so the call is always run."""
    analyze = analyze or _calls_function(query)
    explain: LiteralString = (
        "EXPLAIN (ANALYZE, FORMAT JSON) " if analyze else "EXPLAIN (FORMAT JSON) "
    )
    with psycopg.connect(url) as conn:
        nested = explain_nested(conn, analyze=analyze)
        top = _walk(_top(conn.execute(explain + query, params).fetchone()))
    return top + [n for plan in nested for n in _walk(plan)]


def _calls_function(query: str) -> bool:
    return query.lstrip().startswith("SELECT * FROM outbox.")


def explain_nested(conn: psycopg.Connection[Any], *, analyze: bool) -> list[dict[str, Any]]:
    """The plans of the statements functions run on ``conn`` from now on, as auto_explain
    reports them (a superuser's session: LOAD needs one). Filled in as they run."""
    plans: list[dict[str, Any]] = []

    def collect(diag: psycopg.errors.Diagnostic) -> None:
        text = diag.message_primary or ""
        if "plan:" in text:
            found = json.loads(text[text.index("{") :])
            if not found["Query Text"].lstrip().upper().startswith(("EXPLAIN", "SELECT * FROM")):
                plans.append(found["Plan"])

    conn.execute("LOAD 'auto_explain'")
    settings = {
        "auto_explain.log_format": "json",
        "auto_explain.log_level": "notice",
        "auto_explain.log_min_duration": "0",
        "auto_explain.log_nested_statements": "on",
        "auto_explain.log_analyze": "on" if analyze else "off",
        "auto_explain.log_buffers": "on" if analyze else "off",
        "auto_explain.log_timing": "off",
    }
    for name, value in settings.items():
        conn.execute(statements.SET_SESSION_LIMIT, (name, value))
    conn.add_notice_handler(collect)
    return plans


def scans_of_operations(nodes: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [
        (n["Node Type"], n.get("Index Name"))
        for n in nodes
        if n.get("Relation Name") == "operations"
    ]


CLAIM_PARAMS: dict[str, Any] = claim_params("w", 100, timedelta(seconds=30))


def assert_reads_only_the_claim_index(nodes: list[dict[str, Any]]) -> None:
    """No whole-table read: the claim index to choose, the primary key to lease."""
    scans = scans_of_operations(nodes)
    assert ("Seq Scan", None) not in scans
    reads = {index for node, index in scans if node != "ModifyTable"}
    assert reads == {"operations_claim_group", "operations_pkey"}, scans


def test_the_claim_reads_the_claim_index(big_db: str) -> None:
    assert_reads_only_the_claim_index(
        plan_nodes(big_db, statements.CLAIM, CLAIM_PARAMS, analyze=True)
    )


def test_the_one_group_claim_reads_the_claim_index(big_db: str) -> None:
    with psycopg.connect(big_db) as conn:
        pending = conn.execute(
            "SELECT count(*) FROM outbox.operations WHERE status = 'pending'"
        ).fetchone()
    nodes = plan_nodes(big_db, statements.CLAIM_ONE_GROUP, CLAIM_PARAMS, analyze=True)
    assert_reads_only_the_claim_index(nodes)
    assert (nodes[0]["Actual Rows"],) == pending  # one group's: every pending row


PROBE_PARAMS: dict[str, Any] = {
    "worker": "w",
    "provider": "hook",
    "lease": timedelta(seconds=30),
    "after_tenant": "",
}


def test_the_probe_claim_reads_the_claim_index(big_db: str) -> None:
    nodes = plan_nodes(big_db, statements.CLAIM_PROBE, PROBE_PARAMS, analyze=True)
    assert_reads_only_the_claim_index(nodes)
    assert nodes[0]["Actual Rows"] == 1  # one probe


def test_the_rescue_reads_the_lease_index(big_db: str) -> None:
    scans = scans_of_operations(
        plan_nodes(big_db, statements.RESCUE, {"limit": 500, "max_attempts": 10})
    )
    assert ("Seq Scan", None) not in scans
    assert any(index == "operations_lease" for _, index in scans), scans


def test_the_gauges_read_only_partial_indexes_once_the_table_is_big(big_db: str) -> None:
    nodes = plan_nodes(
        big_db, statements.GAUGES, {"exact_limit": 0, "providers": ["p0"]}, analyze=True
    )
    # The exact count of succeeded rows is in the plan, but never executed past the limit.
    executed = [n for n in nodes if n.get("Actual Loops", 0) > 0]
    scans = scans_of_operations(executed)
    assert len(scans) >= 7
    assert all(kind != "Seq Scan" for kind, _ in scans), scans


def test_the_key_expiry_gauge_reads_only_partial_indexes(big_db: str) -> None:
    params = {"providers": ["hook", "stripe"], "windows": [timedelta(hours=24)] * 2}
    scans = scans_of_operations(plan_nodes(big_db, statements.NEARING_KEY_EXPIRY, params))
    assert scans and all(kind != "Seq Scan" for kind, _ in scans), scans
    assert {index for _, index in scans} <= {
        "operations_claim_group",
        "operations_ordering_blocked",
        "operations_scheduled",
    }, scans


def custom_and_generic(
    url: str, query: LiteralString, params: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """EXPLAIN ANALYZE of ``query`` planned for ``params``, and of its generic plan (a
    server-side PREPARE in a session set as `outbox run` sets its own), each run in a
    transaction rolled back; the top plan node of each. For a call of one of outbox's functions,
    the statements it runs are what is planned: PL/pgSQL keeps their plans as a PREPARE would,
    so the call runs once in a session with custom plans forced and once with generic ones."""
    if _calls_function(query):
        return _function_plan(url, query, params, "force_custom_plan"), _function_plan(
            url, query, params, "force_generic_plan"
        )
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    explain: LiteralString = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
    with psycopg.connect(url, autocommit=True) as conn:
        with conn.transaction(force_rollback=True):
            custom = _top(conn.execute(explain + query, params).fetchone())
        mode = connect.SESSION_LIMITS["plan_cache_mode"]
        conn.execute(statements.SET_SESSION_LIMIT, ("plan_cache_mode", mode))
        text = re.sub(r"%\((\w+)\)s", number, query).replace("%%", "%")
        conn.execute(("PREPARE generic AS " + text).encode())
        values = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
        with conn.transaction(force_rollback=True):
            generic = _top(
                conn.execute(sql.SQL(explain + "EXECUTE generic({})").format(values)).fetchone()
            )
        kinds = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
        ).fetchone()
    assert kinds == (1, 0), "EXPLAIN EXECUTE should have run the generic plan"
    return custom, generic


def _function_plan(
    url: str, query: LiteralString, params: dict[str, Any], mode: str
) -> dict[str, Any]:
    """The statements the call ran, planned in ``mode``, as one plan: a node holding them all,
    with the buffers they touched."""
    with psycopg.connect(url) as conn:
        nested = explain_nested(conn, analyze=True)
        conn.execute(statements.SET_SESSION_LIMIT, ("plan_cache_mode", mode))
        conn.execute(query, params)
        conn.rollback()
    return {
        "Node Type": "Function Body",
        "Plans": nested,
        "Shared Hit Blocks": sum(int(p["Shared Hit Blocks"]) for p in nested),
        "Shared Read Blocks": sum(int(p["Shared Read Blocks"]) for p in nested),
    }


def _one_record() -> dict[str, Any]:
    return {
        "id": 1,
        "lease_token": str(uuid.uuid4()),
        "attempt": 1,
        "status": "succeeded",
        "reason": None,
        "retry_in_s": 0.0,
        "sent": True,
        "provider_ref": "ref",
        "result": None,
        "error": None,
        "failure": None,
        "outcome": "succeeded",
        "error_class": None,
        "http_status": 200,
        "request_id": None,
    }


# Every statement with parameters that `outbox run` repeats on the table, with parameters like
# its own. (One without, such as ORDERING_BLOCKED, has the same plan either way.)
DISPATCHER_STATEMENTS: dict[str, tuple[LiteralString, dict[str, Any]]] = {
    "CLAIM": (statements.CLAIM, CLAIM_PARAMS),
    "CLAIM_ONE_GROUP": (statements.CLAIM_ONE_GROUP, CLAIM_PARAMS),
    "CLAIM_PROBE": (statements.CLAIM_PROBE, PROBE_PARAMS),
    "RECORD_MANY": (statements.RECORD_MANY, {"batch": Jsonb([_one_record()]), "worker": "w"}),
    "UNCLAIM": (
        statements.UNCLAIM,
        {"id": 1, "lease_token": uuid.uuid4(), "status": "pending", "reason": None, "delay": None},
    ),
    "HEARTBEAT": (
        statements.HEARTBEAT,
        {"ids": [1, 2], "tokens": [uuid.uuid4(), uuid.uuid4()], "lease": timedelta(seconds=30)},
    ),
    "RESCUE": (statements.RESCUE, {"limit": 500, "max_attempts": 10}),
    "ATTEMPT_RECORDED": (statements.ATTEMPT_RECORDED, {"id": 1, "attempt": 1, "worker": "w"}),
    "GAUGES": (statements.GAUGES, {"exact_limit": 0, "providers": ["p0"]}),
    "NEARING_KEY_EXPIRY": (
        statements.NEARING_KEY_EXPIRY,
        {"providers": ["hook", "stripe"], "windows": [timedelta(hours=24)] * 2},
    ),
    "REPAIRS_DUE": (statements.REPAIRS_DUE, {"limit": 10}),
}


def reads_whole_table(plan: dict[str, Any]) -> bool:
    return any(
        n["Node Type"] == "Seq Scan" and n.get("Relation Name") in ("operations", "attempts")
        for n in _walk(plan)
    )


def blocks(plan: dict[str, Any]) -> int:
    """Buffers the whole statement touched (a node's counts include its children's)."""
    return int(plan["Shared Hit Blocks"]) + int(plan["Shared Read Blocks"])


@pytest.mark.parametrize("name", list(DISPATCHER_STATEMENTS))
def test_the_generic_plan_does_the_work_of_the_custom_plan(big_db: str, name: str) -> None:
    query, params = DISPATCHER_STATEMENTS[name]
    custom, generic = custom_and_generic(big_db, query, params)
    # Which index, and how it is read (an index or a bitmap scan), may differ: they cost about
    # the same here, and which one wins turns on ANALYZE's sample. The work may not grow, and no
    # whole table may be read that the custom plan leaves alone. (The gauges' plans both hold a
    # read of the whole table, never run past the exact-count limit; see the test above.)
    assert reads_whole_table(generic) <= reads_whole_table(custom)
    assert blocks(generic) <= 2 * blocks(custom) + 50, (blocks(generic), blocks(custom))


def test_the_failing_pending_operations_are_read_from_their_own_index(big_db: str) -> None:
    """`outbox status`'s failing operations per provider and `outbox pending list` read the
    partial index of pending operations with a last error (sql/0033), never the whole table."""
    with psycopg.connect(big_db) as conn:
        conn.execute(
            "UPDATE outbox.operations SET last_error_class = 'unknown' WHERE status = 'pending'"
        )
    with psycopg.connect(big_db, autocommit=True) as conn:
        conn.execute("ANALYZE outbox.operations")

    def listed(**filters: Any) -> dict[str, Any]:
        params = operators.Filters(**filters).params()
        return {"status": "pending", **params, "limit": 101, "after_at": None, "after_id": None}

    for query, params in (
        (statements.PENDING_FAILED_BY_PROVIDER, {"count_limit": 1000, "provider_limit": 50}),
        (statements.LIST_PENDING_FAILED, listed()),
        (statements.LIST_PENDING_FAILED, listed(provider="hook", error="http_500")),
    ):
        nodes = plan_nodes(big_db, query, params, analyze=True)
        assert ("Seq Scan", None) not in scans_of_operations(nodes)
        indexes = {n.get("Index Name") for n in nodes if n.get("Index Name")}
        assert "operations_pending_failed" in indexes, indexes

"""Least-privilege roles (`outbox migrate --with-roles`, sql/roles.sql), tested through real
logins: each role does its job, and is refused (SQLSTATE 42501) everything else.

Roles are cluster-wide while every test has its own database, and xdist workers run tests at the
same time: the cluster-wide part (creating roles) runs under an advisory lock taken in the
server's maintenance database, the only database every worker shares. Connections log in as the
roles themselves (trust authentication on loopback and in the throwaway server), so role
settings, membership inheritance and session_user are the real ones.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.core.model import Status
from outbox.daemon import gauges
from outbox.db import connect, migrations, statements
from outbox.db.store import Store, TokenTake
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.cli import outbox_cli
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import dispatcher, enqueue_many, rows, statuses

Query = LiteralString | sql.Composed
ROLES_LOCK_KEY = int.from_bytes(b"obx:role", "big")
INSUFFICIENT_PRIVILEGE = "42501"

# Login roles of the tests: an application that produces, a person who operates, and the login
# `outbox run` uses, a member of the NOLOGIN outbox_dispatcher (sql/roles.sql).
APP = "outbox_test_app"
OPERATOR = "outbox_test_operator"
DISPATCHER = "outbox_test_dispatcher"
WORKER = "outbox_test_worker"  # a worker that records its deliveries (outbox_consumer)

_TEST_LOGINS = """
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_test_app') THEN
        CREATE ROLE outbox_test_app LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_test_operator') THEN
        CREATE ROLE outbox_test_operator LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_test_dispatcher') THEN
        CREATE ROLE outbox_test_dispatcher LOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_test_worker') THEN
        CREATE ROLE outbox_test_worker LOGIN;
    END IF;
END
$$;
GRANT outbox_producer TO outbox_test_app;
GRANT outbox_operator TO outbox_test_operator;
GRANT outbox_dispatcher TO outbox_test_dispatcher;
GRANT outbox_consumer TO outbox_test_worker;
-- The last step of the upgrade from a LOGIN outbox_dispatcher (sql/roles.sql), which a cluster
-- that ran earlier versions' tests still has.
ALTER ROLE outbox_dispatcher NOLOGIN;
"""


@contextmanager
def cluster_lock(server_url: str) -> Iterator[None]:
    """Serialise cluster-wide role changes across xdist workers (and their databases)."""
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (ROLES_LOCK_KEY,))
        try:
            yield
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (ROLES_LOCK_KEY,))


def apply_roles(server_url: str, url: str, *, tenant_rls: bool = False) -> None:
    """`outbox migrate --with-roles` on ``url``, plus the tests' login roles. The roles script
    runs again once the dispatcher's login is new, as the operations guide says to: it sets the
    session limits on the members of outbox_dispatcher it finds."""
    with cluster_lock(server_url), psycopg.connect(url, autocommit=True) as conn:
        migrations.migrate(conn, with_roles=True, tenant_rls=tenant_rls)
        conn.execute(_TEST_LOGINS)
        new = conn.execute(
            "SELECT rolconfig IS NULL FROM pg_roles WHERE rolname = %s", (DISPATCHER,)
        ).fetchone()
        if new == (True,):
            migrations.migrate(conn, with_roles=True, tenant_rls=tenant_rls)


def as_role(url: str, role: str) -> str:
    """``url`` logged in as ``role`` instead (no password: trust authentication)."""
    params = {k: v for k, v in conninfo_to_dict(url).items() if k != "password"}
    return make_conninfo("", **{**params, "user": role})


@pytest.fixture
def roles_db(db_url: str, pg_server: str) -> str:
    """A fresh database with every migration and the roles applied."""
    apply_roles(pg_server, db_url)
    return db_url


def sqlstate_of(url: str, query: Query, params: Any = None) -> str | None:
    """Run ``query`` in a transaction of its own, rolled back; its SQLSTATE, None on success."""
    with psycopg.connect(url) as conn:
        try:
            conn.execute(query, params)
        except psycopg.Error as exc:
            return exc.sqlstate
        finally:
            conn.rollback()
    return None


def refusals(url: str, queries: Mapping[str, Query]) -> dict[str, str | None]:
    return {name: sqlstate_of(url, query) for name, query in queries.items()}


def all_refused(queries: Mapping[str, Query]) -> dict[str, str | None]:
    return dict.fromkeys(queries, INSUFFICIENT_PRIVILEGE)


# Statements nobody but the owner may run; each role's list adds its own.
_TABLE_WRITES: dict[str, LiteralString] = {
    "insert operations": "INSERT INTO outbox.operations (tenant_id, operation_type, "
    "operation_key, fingerprint, provider, action, payload, idempotency_key) "
    "VALUES ('t', 't', 'k', '\\x00', 'hook', 'a', '{}', 'k')",
    "delete operations": "DELETE FROM outbox.operations",
    "truncate operations": "TRUNCATE outbox.operations CASCADE",
    # attempt_log holds the attempts; outbox.attempts is a view of it nobody writes (sql/0050).
    "update attempts": "UPDATE outbox.attempt_log SET outcome = 'succeeded'",
    "delete attempts": "DELETE FROM outbox.attempt_log",
    "truncate attempts": "TRUNCATE outbox.attempt_log",
    "insert audit": "INSERT INTO outbox.audit (operation_id, actor, action, reason) "
    "VALUES (1, 'me', 'resolve', 'because')",
    "update audit": "UPDATE outbox.audit SET reason = 'other'",
    "delete audit": "DELETE FROM outbox.audit",
    "truncate audit": "TRUNCATE outbox.audit",
    "schema_migrations": "SELECT * FROM outbox.schema_migrations",
    "create in schema": "CREATE TABLE outbox.mine (id int)",
    "internal check_text": "SELECT outbox.check_text('tenant_id', 't', 128)",
    "internal require_tenant": "SELECT outbox.require_tenant('t')",
    "internal write_audit": "SELECT outbox.write_audit(o, 'me', 'resolve', 'why', 'succeeded', "
    "'{}') FROM outbox.operations o",
    "internal lock_for_action": "SELECT outbox.lock_for_action(1, 'x', ARRAY['pending'])",
    "internal record_check": "SELECT outbox.record_check(1, NULL, 'me', '{}'::jsonb)",
}
_OPERATOR_ACTIONS: dict[str, LiteralString] = {
    "resolve": "SELECT outbox.resolve_operation(1, 'pi_1', 'why', 'me')",
    "cancel": "SELECT outbox.cancel_operation(1, 'why', 'me')",
    "replay": "SELECT outbox.replay_operation(1, 'why', 'me')",
    "request reconciliation": "SELECT outbox.request_reconciliation(1, 'why', 'me')",
    "retry": "SELECT outbox.retry_operation(1, 'why', 'me', true)",
    "cancel request": "SELECT outbox.request_cancel(1, 'why', 'me')",
    "ordering set-mode": "SELECT outbox.set_ordering_mode('t', 'skip', 'me')",
    "ordering set-mode with a reason": "SELECT outbox.set_ordering_mode('t', 'skip', 'me', 'x')",
}
_PRODUCER_API: dict[str, LiteralString] = {
    "enqueue": "SELECT * FROM outbox.enqueue('t', 't', 'k', 'hook', 'a', '{}'::jsonb)",
    "get_operation": "SELECT * FROM outbox.get_operation('t', 't', 'k')",
}


# --- the roles themselves -----------------------------------------------------------------------


def test_roles_exist_with_the_dispatchers_session_limits(roles_db: str) -> None:
    assert rows(
        roles_db,
        "SELECT rolname, rolcanlogin, rolsuper, rolcreaterole, rolbypassrls "
        "FROM pg_roles WHERE rolname IN ('outbox_producer', 'outbox_dispatcher',"
        " 'outbox_operator', 'outbox_consumer') ORDER BY 1",
    ) == [
        ("outbox_consumer", False, False, False, False),
        ("outbox_dispatcher", False, False, False, False),
        ("outbox_operator", False, False, False, False),
        ("outbox_producer", False, False, False, False),
    ]
    # A new session of the dispatcher's login has the limits from the role, with no SET of its
    # own (behind PgBouncer in transaction mode it could not SET them): roles.sql sets them on
    # each login that is a member of outbox_dispatcher, since a role's settings are not inherited.
    with psycopg.connect(as_role(roles_db, DISPATCHER)) as conn:
        for name, value in connect.SESSION_LIMITS.items():
            if name == "plan_cache_mode":
                continue  # not on the role: behind a transaction pooler nothing is prepared
            if name in ("jit", "default_transaction_isolation", "search_path"):  # not durations
                got = conn.execute("SELECT current_setting(%s)", (name,)).fetchone()
                assert got == (value,), name
                continue
            same = conn.execute(
                "SELECT current_setting(%s)::interval = %s::interval", (name, value)
            ).fetchone()
            assert same == (True,), name


def test_the_migrations_alone_leave_no_function_to_public(db_url: str) -> None:
    """Without the roles script too: a migration that adds or replaces a function must revoke
    PUBLIC's EXECUTE and pin search_path itself (CREATE OR REPLACE resets the SET clauses)."""
    loose = rows(
        db_url,
        """
        SELECT p.oid::regprocedure::text FROM pg_proc p
        WHERE p.pronamespace = 'outbox'::regnamespace
          AND (has_function_privilege('public', p.oid, 'EXECUTE')
               OR p.proconfig IS DISTINCT FROM ARRAY['search_path=pg_catalog, pg_temp'])""",
    )
    assert loose == []


def test_every_function_is_pinned_and_executable_only_by_its_roles(roles_db: str) -> None:
    functions = rows(
        roles_db,
        """
        SELECT p.oid::regprocedure::text, p.prosecdef, p.proconfig,
               EXISTS (SELECT FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner))) a
                       WHERE a.grantee = 0) AS public_execute,
               array(SELECT r FROM unnest(ARRAY['outbox_producer', 'outbox_dispatcher',
                                                'outbox_operator', 'outbox_consumer']) AS r
                     WHERE has_function_privilege(r, p.oid, 'EXECUTE') ORDER BY 1) AS roles
        FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace""",
    )
    assert len(functions) >= 20
    for name, _definer, config, public_execute, _roles in functions:
        assert config == ["search_path=pg_catalog, pg_temp"], name
        assert not public_execute, name
    granted = {name: (definer, roles) for name, definer, _, _, roles in functions if roles}
    dispatcher_and_operator = ["outbox_dispatcher", "outbox_operator"]
    assert granted == {
        "outbox.enqueue(text,text,text,text,text,jsonb,text,text,timestamp with time zone,"
        "integer,text,text,integer)": (True, ["outbox_producer"]),
        "outbox.get_operation(text,text,text)": (True, ["outbox_producer"]),
        "outbox.bind_tenant(text)": (False, ["outbox_consumer", "outbox_producer"]),
        # A worker's deliveries, recorded in its own transactions (sql/0042).
        "outbox.inbox_begin(text,text,text,text,bytea,interval,interval,"
        "uuid,bytea,text,text,text,text)": (
            True,
            ["outbox_consumer"],
        ),
        "outbox.inbox_complete(bigint,uuid,integer,jsonb,bytea)": (True, ["outbox_consumer"]),
        "outbox.inbox_prune(integer)": (True, ["outbox_consumer", "outbox_operator"]),
        "outbox.inbox_forget(bigint,text,text,boolean)": (True, ["outbox_operator"]),
        "outbox.inbox_release(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.inbox_claim(text,text,text,text,bytea,interval,integer,interval,"
        "uuid,bytea,text,text,text,text)": (
            True,
            ["outbox_consumer"],
        ),
        "outbox.inbox_renew(bigint,uuid,interval)": (True, ["outbox_consumer"]),
        "outbox.inbox_fail(bigint,uuid,text)": (True, ["outbox_consumer"]),
        "outbox.inbox_gauges()": (True, ["outbox_consumer", "outbox_operator"]),
        "outbox.resolve_operation(bigint,text,text,text)": (True, ["outbox_operator"]),
        "outbox.cancel_operation(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.request_cancel(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.replay_operation(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.request_reconciliation(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.retry_operation(bigint,text,text,boolean)": (True, ["outbox_operator"]),
        "outbox.record_no_effect(bigint,text,text)": (True, ["outbox_operator"]),
        "outbox.record_check(bigint,text,text,jsonb,integer,integer)": (
            True,
            dispatcher_and_operator,
        ),
        "outbox.record_finding(bigint,text,text,text,text,jsonb,integer,integer)": (
            True,
            dispatcher_and_operator,
        ),
        "outbox.touch_check(bigint)": (True, dispatcher_and_operator),
        "outbox.claim_checks(text[],interval,integer)": (True, ["outbox_dispatcher"]),
        "outbox.defer_check(bigint,interval,interval)": (True, dispatcher_and_operator),
        "outbox.defer_check(bigint,interval,interval,integer,integer)": (
            True,
            dispatcher_and_operator,
        ),
        "outbox.take_tokens(text,double precision,double precision,integer,integer)": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.throttle_bucket(text,double precision,double precision,interval)": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.repair_ordering_key(text,text)": (True, ["outbox_dispatcher"]),
        "outbox.set_ordering_mode(text,text,text)": (True, ["outbox_operator"]),
        "outbox.set_ordering_mode(text,text,text,text)": (True, ["outbox_operator"]),
        "outbox.request_provider_action(text,text,text,text)": (True, ["outbox_operator"]),
        "outbox.schema_version()": (True, ["outbox_dispatcher", "outbox_operator"]),
        "outbox.server_identity()": (True, ["outbox_dispatcher"]),
        "outbox.wake_lock_space()": (True, ["outbox_dispatcher"]),
        "outbox.try_wake_gate()": (True, ["outbox_dispatcher"]),
        # Every write of the dispatcher's to operations and attempts (sql/0040).
        "outbox.claim_fair(text,interval,integer,text[],integer[],text,text,integer)": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_one_group(text,interval,integer,text[],integer[])": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_probe(text,text,interval,text)": (True, ["outbox_dispatcher"]),
        # The claims that carry each delivery's intent (sql/0045).
        "outbox.claim_fair_v2(text,interval,integer,text[],integer[],text,text,integer)": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_one_group_v2(text,interval,integer,text[],integer[])": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_probe_v2(text,text,interval,text)": (True, ["outbox_dispatcher"]),
        # ... and each row's contract version (sql/0054).
        "outbox.claim_fair_v3(text,interval,integer,text[],integer[],text,text,integer)": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_one_group_v3(text,interval,integer,text[],integer[])": (
            True,
            ["outbox_dispatcher"],
        ),
        "outbox.claim_probe_v3(text,text,interval,text)": (True, ["outbox_dispatcher"]),
        "outbox.origin()": (True, ["outbox_operator"]),
        "outbox.record_attempts(text,jsonb)": (True, ["outbox_dispatcher"]),
        "outbox.unclaim(bigint,uuid,text,text,interval)": (True, ["outbox_dispatcher"]),
        "outbox.renew_leases(bigint[],uuid[],interval)": (True, ["outbox_dispatcher"]),
        "outbox.rescue_leases(integer,integer)": (True, ["outbox_dispatcher"]),
        "outbox.stage_due(integer)": (True, ["outbox_dispatcher"]),
        "outbox.expire_stray_leases(text,uuid[],timestamp with time zone)": (
            True,
            ["outbox_dispatcher"],
        ),
        # Contracts (sql/0052): every role reads a version; operators publish and retire.
        "outbox.get_contract(text,integer)": (
            True,
            ["outbox_consumer", "outbox_dispatcher", "outbox_operator", "outbox_producer"],
        ),
        "outbox.publish_contract(text,integer,text,text,text,boolean)": (
            True,
            ["outbox_operator"],
        ),
        "outbox.set_contract_requirement(text,boolean,text,text)": (True, ["outbox_operator"]),
        # A renamed type's old name reads the new name's contracts (0055).
        "outbox.set_contract_alias(text,text,text,text)": (True, ["outbox_operator"]),
        "outbox.set_contract_state(text,integer,text,text,text)": (True, ["outbox_operator"]),
    }
    # Only those entry points run as the owner, and the triggers: the wake-up and the ordering
    # key's turn fire at the producer's commit, after enqueue has returned (sql/0012, 0015);
    # passing the turn fires in the dispatcher's record.
    assert {name for name, definer, *_ in functions if definer} == {
        *(name for name, (definer, _) in granted.items() if definer),
        "outbox.wake_dispatchers()",
        "outbox.take_turn()",
        "outbox.pass_turn()",
        "outbox.rejoin_line()",
        "outbox.cancel_when_attempt_ends()",
        "outbox.inbox_outcome_before_commit()",
        # The keys follow their operation (sql/0051): whoever may delete it, or move its key,
        # moves or deletes its keys row, which no role is granted.
        "outbox.operation_keys_follow_key()",
        "outbox.operation_keys_follow_deletes()",
    }


def test_the_dispatcher_holds_no_write_on_operations_or_attempts(roles_db: str) -> None:
    """Every write it makes is one of sql/0040's functions: not a table's, not a column's."""
    writes = rows(
        roles_db,
        """
        SELECT t.relname, p.privilege
        FROM (VALUES ('operations'), ('attempts'), ('attempt_log')) AS t (relname),
             unnest(ARRAY['INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) AS p (privilege)
        WHERE has_table_privilege('outbox_dispatcher', 'outbox.' || t.relname, p.privilege)
           OR (p.privilege IN ('INSERT', 'UPDATE')
               AND has_any_column_privilege('outbox_dispatcher', 'outbox.' || t.relname,
                                            p.privilege))""",
    )
    assert writes == []


def _settled_and_in_flight(url: str) -> tuple[int, int, str]:
    """A quarantined operation that was sent, and one in flight (its id and lease token)."""
    quarantined, in_flight = enqueue_many(url, 2, prefix="attack")
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', status_reason = 'permanent', "
            "attempts = 1, first_sent_at = now(), last_attempt_at = now() WHERE id = %s",
            (quarantined,),
        )
        token = conn.execute(
            "UPDATE outbox.operations SET status = 'in_flight', attempts = 1, "
            "lease_owner = 'w', lease_token = gen_random_uuid(), last_attempt_at = now(), "
            "lease_expires_at = now() + interval '1 minute' WHERE id = %s "
            "RETURNING lease_token::text",
            (in_flight,),
        ).fetchone()
    assert token is not None
    return quarantined, in_flight, token[0]


def _record(op: int, token: str, **fields: Any) -> str:
    entry = {
        "id": op,
        "lease_token": token,
        "attempt": 1,
        "status": "succeeded",
        "retry_in_s": 0,
        "sent": True,
        "unspent": False,
        "outcome": "succeeded",
        "provider_ref": "forged",
        **fields,
    }
    return json.dumps([entry])


def test_the_dispatchers_credential_cannot_rewrite_history(roles_db: str) -> None:
    """The attacks of issue 38 (item 1), as the dispatcher's login: a quarantined operation set
    back to pending and unsent, a forged success, invented attempts, checks deferred and
    providers throttled for a thousand years. Each is refused, and nothing changed."""
    quarantined, in_flight, token = _settled_and_in_flight(roles_db)
    before = rows(roles_db, "SELECT * FROM outbox.operations ORDER BY id")
    # Writes to the tables: no privilege at all (42501).
    unprivileged: dict[str, Query] = {
        "resurrect": sql.SQL(
            "UPDATE outbox.operations SET status = 'pending', first_sent_at = NULL, "
            "attempts = 0 WHERE id = {}"
        ).format(quarantined),
        "forge a success": sql.SQL(
            "UPDATE outbox.operations SET status = 'succeeded', provider_ref = 'forged' "
            "WHERE id = {}"
        ).format(quarantined),
        "invent an attempt": sql.SQL(
            "INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, "
            "started_at, outcome, sent) VALUES ({}, 9, 'k', 'w', now(), 'succeeded', true)"
        ).format(quarantined),
    }
    # Calls of the functions it is granted, with arguments no dispatcher passes (22023).
    out_of_bounds: dict[str, Query] = {
        "defer a check by -1000 years": "SELECT outbox.defer_check(1, '1 minute', '-1000 years')",
        "defer a check by 1000 years": "SELECT outbox.defer_check(1, '1 minute', '1000 years', "
        "1, 1)",
        "throttle for 1000 years": "SELECT outbox.throttle_bucket('hook', 1, 1, '1000 years')",
        "take tokens at an infinite rate": "SELECT * FROM outbox.take_tokens('hook', "
        "'Infinity', 1, 1, 0)",
        "lease for 1000 years": "SELECT * FROM outbox.claim_fair('w', '1000 years', 10, '{}', "
        "'{}', '', '', 20)",
        "renew for 1000 years": sql.SQL(
            "SELECT * FROM outbox.renew_leases(ARRAY[{}]::bigint[], ARRAY[{}]::uuid[], "
            "'1000 years')"
        ).format(in_flight, token),
        "hand back as succeeded": sql.SQL(
            "SELECT * FROM outbox.unclaim({}, {}, 'succeeded', NULL, NULL)"
        ).format(in_flight, token),
        "record as cancelled": sql.SQL("SELECT * FROM outbox.record_attempts('w', {})").format(
            _record(in_flight, token, status="cancelled", outcome="permanent")
        ),
        "retry in 1000 years": sql.SQL("SELECT * FROM outbox.record_attempts('w', {})").format(
            _record(
                in_flight,
                token,
                status="pending",
                outcome="transient",
                retry_in_s=1000 * 366 * 86400,
            )
        ),
        "a success that failed": sql.SQL("SELECT * FROM outbox.record_attempts('w', {})").format(
            _record(in_flight, token, outcome="permanent")
        ),
        "rescue with an endless budget": "SELECT * FROM outbox.rescue_leases(10, 2000000000)",
    }
    dispatcher_url = as_role(roles_db, DISPATCHER)
    assert refusals(dispatcher_url, unprivileged) == all_refused(unprivileged)
    assert refusals(dispatcher_url, out_of_bounds) == dict.fromkeys(
        out_of_bounds, INVALID_PARAMETER
    )
    # A record under no lease of the settled row changes nothing: there is no lease to match.
    with psycopg.connect(as_role(roles_db, DISPATCHER), autocommit=True) as conn:
        for stolen in (token, "00000000-0000-0000-0000-000000000000"):
            forged = _record(quarantined, stolen)
            recorded = conn.execute(
                "SELECT * FROM outbox.record_attempts('w', %s)", (forged,)
            ).fetchall()
            assert recorded == []
    assert rows(roles_db, "SELECT * FROM outbox.operations ORDER BY id") == before
    assert rows(roles_db, "SELECT count(*) FROM outbox.attempts") == [(0,)]


INVALID_PARAMETER = "22023"


def test_rerunning_the_roles_script_converges_on_exactly_its_grants(
    roles_db: str, pg_server: str
) -> None:
    with psycopg.connect(roles_db, autocommit=True) as conn:
        conn.execute("GRANT DELETE ON outbox.operations TO outbox_dispatcher")
        conn.execute(
            "GRANT EXECUTE ON FUNCTION outbox.write_audit(outbox.operations, text, "
            "text, text, text, jsonb) TO outbox_producer"
        )
    apply_roles(pg_server, roles_db)
    dispatcher_url, app_url = as_role(roles_db, DISPATCHER), as_role(roles_db, APP)
    assert sqlstate_of(dispatcher_url, "DELETE FROM outbox.operations") == INSUFFICIENT_PRIVILEGE
    assert sqlstate_of(app_url, _TABLE_WRITES["internal write_audit"]) == INSUFFICIENT_PRIVILEGE


# --- producer -----------------------------------------------------------------------------------


def test_the_producer_enqueues_and_reads_through_the_api_and_nothing_else(roles_db: str) -> None:
    app = as_role(roles_db, APP)
    (op,) = enqueue_many(app, 1)
    (again,) = enqueue_many(app, 1)  # a duplicate reads the existing row, as the owner
    assert again == op
    with psycopg.connect(app) as conn:
        found = outbox.get_operation(conn, "acme", "invoice.charge", "op-0")
        assert found is not None and found.status is Status.PENDING
        assert conn.execute("SELECT session_user, current_user").fetchone() == (APP, APP)
    refused = {
        "select operations": "SELECT * FROM outbox.operations",
        "update operations": "UPDATE outbox.operations SET status = 'cancelled'",
        "select attempts": "SELECT * FROM outbox.attempts",
        "select attempt_log": "SELECT * FROM outbox.attempt_log",
        "select audit": "SELECT * FROM outbox.audit",
        "record_check": "SELECT outbox.record_check(1, NULL, 'me', '{}', 1, 0)",
        "touch_check": "SELECT outbox.touch_check(1)",
        **_TABLE_WRITES,
        **_OPERATOR_ACTIONS,
    }
    assert refusals(app, refused) == all_refused(refused)
    assert rows(roles_db, "SELECT count(*) FROM outbox.operations") == [(1,)]


# --- operator -----------------------------------------------------------------------------------


def _needing_attention(url: str) -> dict[str, int]:
    """Four operations in the states operators act on, made by the owner; ids by key."""
    ids = dict(
        zip(
            ["q-replay", "q-reconcile", "r-retry", "r-resolve"],
            enqueue_many(url, 4, prefix="x"),
            strict=True,
        )
    )
    with psycopg.connect(url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', status_reason = "
            "'permanent_failure', attempts = 1 WHERE id = ANY(%s)",
            ([ids["q-replay"], ids["q-reconcile"]],),
        )
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', attempts = 1, "
            "status_reason = 'key_window_passed', check_finding = 'not_found', "
            "last_attempt_at = now() - interval '1 hour', checked_at = now() "
            "WHERE id = ANY(%s)",
            ([ids["r-retry"], ids["r-resolve"]],),
        )
    return ids


def test_the_operator_reads_everything_and_acts_only_through_audited_functions(
    roles_db: str,
) -> None:
    ids = _needing_attention(roles_db)
    old_key = rows(
        roles_db, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (ids["r-retry"],)
    )[0][0]
    with psycopg.connect(as_role(roles_db, OPERATOR), autocommit=True) as conn:
        listed = operators.list_attention(conn, Status.QUARANTINED)
        assert sorted(r["id"] for r in listed) == sorted([ids["q-replay"], ids["q-reconcile"]])
        shown = operators.show(conn, ids["r-retry"], with_payload=True)
        # The payload as stored (PostgreSQL's JSON text): never decoded through floats.
        assert shown["payload"] == '{"n": 2}' and shown["attempt_history"] == []
        gauges_row = (
            conn.cursor(row_factory=dict_row)
            .execute(  # what `outbox status` reads
                statements.GAUGES, {"exact_limit": 100_000, "providers": []}
            )
            .fetchone()
        )
        assert gauges_row is not None
        assert (gauges_row["quarantined"], gauges_row["reconciling"]) == (2, 2)
        done = [
            operators.replay(conn, ids["q-replay"], reason="fixed", actor="alice"),
            operators.request_reconciliation(conn, ids["q-reconcile"], reason="?", actor="alice"),
            operators.cancel(conn, ids["q-reconcile"], reason="gone", actor="alice"),
            operators.retry(conn, ids["r-retry"], reason="not there", actor="alice"),
            operators.resolve(
                conn, ids["r-resolve"], provider_ref="ev_1", reason="seen", actor="alice"
            ),
        ]
    assert done == [
        Status.PENDING,
        Status.RECONCILING,
        Status.CANCELLED,
        Status.PENDING,
        Status.SUCCEEDED,
    ]
    # The audit names the person's own login, whatever the functions run as.
    assert rows(roles_db, "SELECT DISTINCT actor, details->>'db_user' FROM outbox.audit") == [
        ("alice", OPERATOR)
    ]
    assert rows(roles_db, "SELECT count(*) FROM outbox.audit") == [(5,)]
    assert rows(
        roles_db,
        "SELECT idempotency_key, key_generation FROM outbox.operations WHERE id = %s",
        (ids["r-retry"],),
    ) == [(f"{old_key}:r2", 2)]
    refused = {
        "update operations": "UPDATE outbox.operations SET status = 'cancelled'",
        "update checked_at": "UPDATE outbox.operations SET checked_at = now()",
        "enqueue": _PRODUCER_API["enqueue"],
        **_TABLE_WRITES,
    }
    assert refusals(as_role(roles_db, OPERATOR), refused) == all_refused(refused)


# --- dispatcher ---------------------------------------------------------------------------------


def test_the_dispatcher_is_refused_everything_but_its_statements(roles_db: str) -> None:
    beyond_its_columns = (
        "payload",
        "fingerprint",
        "idempotency_key",
        "key_generation",
        "tenant_id",
        "provider",
        "check_details",
        "max_attempts",
        "check_finding",
        "checked_at",
        "created_at",
    )
    refused: dict[str, Query] = {
        f"update {column}": sql.SQL("UPDATE outbox.operations SET {0} = {0}").format(
            sql.Identifier(column)
        )
        for column in beyond_its_columns
    }
    refused |= {
        "select audit": "SELECT * FROM outbox.audit",
        # Buckets change only through take_tokens and throttle_bucket.
        "select buckets": "SELECT * FROM outbox.provider_buckets",
        "update buckets": "UPDATE outbox.provider_buckets SET tokens = 1000",
        **_TABLE_WRITES,
        **_OPERATOR_ACTIONS,
        **_PRODUCER_API,
    }
    assert refusals(as_role(roles_db, DISPATCHER), refused) == all_refused(refused)


async def test_the_real_dispatcher_works_fully_as_the_dispatcher_role(
    roles_db: str, receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    app, dispatcher_url = as_role(roles_db, APP), as_role(roles_db, DISPATCHER)
    ids = enqueue_many(app, 20)
    pool = connect.dispatcher_pool(dispatcher_url, max_size=4)
    await pool.open(wait=True)
    try:
        # Claim, send, record (attempts inserted), the session limits each connection sets.
        d = dispatcher(pool, {"hook": hook})
        assert await d.run_once() == 20
        assert statuses(roles_db) == {"succeeded": 20}
        assert receiver.effect_count() == 20
        assert {e.headers["outbox-operation-id"] for e in receiver.effects} == {str(i) for i in ids}
        assert rows(
            roles_db,
            "SELECT count(*), count(DISTINCT operation_id) FROM "
            "outbox.attempts WHERE outcome = 'succeeded'",
        ) == [(20, 20)]
        await _contract_check(pool, roles_db, app, hook)
        await _lease_statements(pool, roles_db, app, d)
        await _reconciler_and_gauges(pool, roles_db, hook)
        await _token_buckets(pool)
    finally:
        await pool.close()
    assert receiver.effect_count() == 20


async def _lease_statements(pool: AsyncConnectionPool[Any], url: str, app: str, d: Any) -> None:
    """Heartbeat, unclaim, attempt_recorded and rescue, each as the dispatcher role."""
    (op,) = enqueue_many(app, 1, prefix="lease")
    store = Store(pool)
    (claimed,) = await store.claim("w1", 10, timedelta(seconds=30))
    assert await store.heartbeat([claimed], timedelta(seconds=30)) == {op}
    assert await store.unclaim(claimed, Status.PENDING, None)
    assert not await store.attempt_recorded(op, 1, "w1")
    (claimed,) = await store.claim("w1", 10, timedelta(seconds=30))
    with psycopg.connect(url) as conn:  # the worker died: its lease ran out long ago
        conn.execute(
            "UPDATE outbox.operations SET lease_expires_at = now() - interval '1 hour' "
            "WHERE id = %s",
            (op,),
        )
    assert await d.rescue_once() == 1
    # The rescuer's attempt row names w1, but it is not w1's record (test_lease_fence.py).
    assert not await store.attempt_recorded(op, 1, "w1")
    ((done, worker),) = rows(
        url, "SELECT operation_id, worker FROM outbox.attempts WHERE outcome = 'succeeded' LIMIT 1"
    )
    assert await store.attempt_recorded(done, 1, worker)
    assert rows(
        url, "SELECT status, last_error_class FROM outbox.operations WHERE id = %s", (op,)
    ) == [("pending", "unknown")]


async def _reconciler_and_gauges(pool: AsyncConnectionPool[Any], url: str, hook: Provider) -> None:
    """The periodic reconciler's statements and the gauges' query, as the dispatcher role."""
    ((op,),) = rows(
        url,
        "UPDATE outbox.operations SET status = 'reconciling', "
        "status_reason = 'key_window_passed' WHERE operation_key = 'op-0' "
        "RETURNING id",
    )
    checker = Reconciler(pool, {"hook": hook})
    (row,) = await checker.candidates(askable_only=False)
    assert row["id"] == op
    async with pool.connection() as conn:
        claimed = await conn.execute(
            statements.CLAIM_CHECKS,
            {"providers": ["hook"], "recheck_after": timedelta(hours=1), "limit": 10},
        )
        assert [r[0] for r in await claimed.fetchall()] == [op]
        await conn.execute(
            statements.DEFER_CHECK,
            {
                "id": op,
                "recheck_after": timedelta(hours=1),
                "retry_in": timedelta(minutes=5),
                "generation": row["key_generation"],
                "attempts": row["attempts"],
            },
        )
        cur = await conn.execute(
            statements.RECORD_FINDING,
            {
                "id": op,
                "finding": "not_found",
                "found_ref": None,
                "state": None,
                "actor": "outbox-reconciler",
                "details": json.dumps({}),
                "generation": row["key_generation"],
                "attempts": row["attempts"],
            },
        )
        assert await cur.fetchone() == ("reconciling",)
    assert rows(
        url,
        "SELECT check_finding, actor, details->>'db_user' FROM outbox.operations "
        "JOIN outbox.audit ON operation_id = operations.id",
    ) == [("not_found", "outbox-reconciler", DISPATCHER)]
    await gauges.refresh(pool, {"hook": timedelta(hours=23)})


async def _token_buckets(pool: AsyncConnectionPool[Any]) -> None:
    """A rate-limited provider's shared bucket, taken from and throttled as the dispatcher."""
    store = Store(pool)
    take = TokenTake("hook", rate=10.0, burst=5, wanted=3)
    assert (await store.take_tokens([take]))["hook"].granted == 0  # a new bucket starts empty
    assert await store.throttle_bucket("hook", 10.0, 5, timedelta(seconds=2)) == -20.0
    assert (await store.take_tokens([take]))["hook"].granted == 0  # in debt


async def _contract_check(
    pool: AsyncConnectionPool[Any], url: str, app: str, hook: Provider
) -> None:
    """The claim's contract version and the contract's look-up (sql/0054, 0052), as the
    dispatcher role: a row of the producer's that breaks its contract is quarantined unsent."""
    schema = '{"type": "object", "required": ["amount"]}'
    with psycopg.connect(url) as conn:
        conn.execute("SELECT outbox.publish_contract('charge', 1, %s, 'test', 'test')", (schema,))
    with psycopg.connect(app) as conn:
        ((op,),) = conn.execute(
            "SELECT operation_id FROM outbox.enqueue(tenant_id => 'acme', operation_type => "
            "'charge', operation_key => 'c1', provider => 'hook', action => 'a', "
            "payload => '{\"n\": 1}', contract_version => 1)"
        ).fetchall()
    await dispatcher(pool, {"hook": hook}).run_once()
    assert rows(
        url,
        "SELECT status, status_reason, first_sent_at FROM outbox.operations WHERE id = %s",
        (op,),
    ) == [("quarantined", "contract_violation", None)]


def test_outbox_run_dispatches_when_it_logs_in_as_the_dispatcher_role(
    roles_db: str, receiver: FakeWebhookReceiver, tmp_path: Path
) -> None:
    enqueue_many(as_role(roles_db, APP), 10)
    config = write_config(
        tmp_path / "outbox.toml",
        poll_interval="100ms",
        gauge_interval="1s",
        reconcile_interval="1s",
        providers={"hook": {"type": "webhook", "url": receiver.url}},
    )
    proc = OutboxProcess(as_role(roles_db, DISPATCHER), config, tmp_path / "outbox.log")
    try:
        wait_until(
            lambda: statuses(roles_db) == {"succeeded": 10},
            timeout=30,
            what="10 operations dispatched by outbox run",
        )
        time.sleep(1.5)  # another turn of the gauge and reconciler timers, as the same role
        proc.signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        proc.stop()
    assert receiver.effect_count() == 10
    log = proc.log_path.read_text()
    assert "failed" not in log and "InsufficientPrivilege" not in log, log


# --- immutability -------------------------------------------------------------------------------


def test_the_request_and_its_key_never_change_except_by_a_retry(roles_db: str) -> None:
    long_key = "k" * 254
    (op,) = enqueue_many(roles_db, 1)
    (long_op,) = enqueue_many(roles_db, 1, prefix="long", idempotency_key=long_key)
    changes: dict[str, LiteralString] = {
        "payload": "UPDATE outbox.operations SET payload = '{\"n\": 9}' WHERE id = %s",
        "idempotency_key": "UPDATE outbox.operations SET idempotency_key = 'other' WHERE id = %s",
        "key_generation": "UPDATE outbox.operations SET key_generation = 2 WHERE id = %s",
        "tenant_id": "UPDATE outbox.operations SET tenant_id = 'other' WHERE id = %s",
        "fingerprint": "UPDATE outbox.operations SET fingerprint = '\\x01' WHERE id = %s",
    }
    for column, query in changes.items():
        with psycopg.connect(roles_db) as conn, pytest.raises(psycopg.Error) as caught:
            conn.execute(query, (op,))
        assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB005", column)
    # Even the shape of a retry needs the key the next generation derives.
    with psycopg.connect(roles_db) as conn:
        conn.execute("UPDATE outbox.operations SET status = 'reconciling' WHERE id = %s", (op,))
        with pytest.raises(psycopg.Error) as caught:
            conn.execute(
                "UPDATE outbox.operations SET status = 'pending', key_generation = 2, "
                "idempotency_key = idempotency_key || ':r3' WHERE id = %s",
                (op,),
            )
        conn.rollback()
    assert caught.value.sqlstate == "OB005"

    keys = {
        op: [
            rows(roles_db, "SELECT idempotency_key FROM outbox.operations WHERE id = %s", (op,))[0][
                0
            ]
        ],
        long_op: [long_key],
    }
    for generation in (2, 3, 4):
        for operation_id, seen in keys.items():
            with psycopg.connect(roles_db) as conn:
                conn.execute(
                    "UPDATE outbox.operations SET status = 'reconciling' WHERE id = %s",
                    (operation_id,),
                )
                operators.retry(conn, operation_id, reason="r", actor="a", force=True)
            ((key, gen),) = rows(
                roles_db,
                "SELECT idempotency_key, key_generation FROM outbox.operations WHERE id = %s",
                (operation_id,),
            )
            assert gen == generation
            seen.append(key)
    assert keys[op][1:] == [f"{keys[op][0]}:r{g}" for g in (2, 3, 4)]
    assert len(set(keys[long_op])) == 4 and all(len(k) <= 255 for k in keys[long_op])
    assert rows(roles_db, "SELECT count(*) FROM outbox.audit WHERE action = 'retry'") == [(6,)]


# --- the command --------------------------------------------------------------------------------


def test_migrate_with_roles_applies_the_scripts_and_refuses_rls_alone(
    empty_db_url: str, pg_server: str
) -> None:
    env = {**os.environ, "OUTBOX_DATABASE_URL": empty_db_url}
    with cluster_lock(pg_server):
        first = outbox_cli(env, "migrate", "--with-roles")
        second = outbox_cli(env, "migrate", "--with-roles")
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("applied 0") == len(migrations.load_migrations())
    assert "applied roles.sql" in first.stdout
    assert second.returncode == 0, second.stderr
    assert "applied 0" not in second.stdout and "applied roles.sql" in second.stdout
    assert (
        sqlstate_of(as_role(empty_db_url, DISPATCHER), "SELECT count(*) FROM outbox.operations")
        is None
    )
    alone = outbox_cli(env, "migrate", "--tenant-rls")
    assert alone.returncode == 1
    assert "--with-roles" in alone.stderr

"""Tenant isolation (`outbox migrate --with-roles --tenant-rls`): a producer bound to one tenant
can neither read nor enqueue for another, the binding ends with its transaction, and the
dispatcher and operators still see every tenant. Real logins, as in test_roles."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

import outbox
from outbox.core.model import Status
from outbox.db import connect, migrations, statements
from outbox.oncall import operators
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_query_plans import CLAIM_PARAMS, explain_nested
from tests.integration.test_roles import (
    APP,
    DISPATCHER,
    INSUFFICIENT_PRIVILEGE,
    OPERATOR,
    apply_roles,
    as_role,
    cluster_lock,
)
from tests.support import postgres
from tests.support.dispatch import dispatcher, rows, statuses

# A schema owner that is not a superuser: row-level security applies to it (FORCE), which is
# what the SECURITY DEFINER functions run as.
OWNER = "outbox_test_owner"


@pytest.fixture
def rls_db(db_url: str, pg_server: str) -> str:
    apply_roles(pg_server, db_url, tenant_rls=True)
    return db_url


def enqueue_for(url: str, tenant: str, key: str, *, bind: str | None = None) -> int:
    """Enqueue one operation for ``tenant`` in a transaction bound to ``bind`` (default: it)."""
    with psycopg.connect(url) as conn:
        outbox.bind_tenant(conn, bind or tenant)
        result = outbox.enqueue(
            conn,
            tenant_id=tenant,
            operation_type="invoice.charge",
            operation_key=key,
            provider="hook",
            action="invoice.paid",
            payload={"tenant": tenant},
        )
    return result.operation_id


def refused(call: Callable[[], object]) -> str | None:
    """The SQLSTATE ``call`` fails with, None if it succeeds."""
    try:
        call()
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def test_a_bound_producer_acts_for_its_own_tenant_only(rls_db: str) -> None:
    app = as_role(rls_db, APP)
    op_a = enqueue_for(app, "tenant-a", "k1")
    enqueue_for(app, "tenant-b", "k1")
    assert refused(lambda: enqueue_for(app, "tenant-b", "k2", bind="tenant-a")) == (
        INSUFFICIENT_PRIVILEGE
    )
    with psycopg.connect(app) as conn:
        outbox.bind_tenant(conn, "tenant-a")
        mine = outbox.get_operation(conn, "tenant-a", "invoice.charge", "k1")
        assert mine is not None and mine.operation_id == op_a
        theirs = refused(lambda: outbox.get_operation(conn, "tenant-b", "invoice.charge", "k1"))
        assert theirs == INSUFFICIENT_PRIVILEGE
    assert rows(rls_db, "SELECT tenant_id, operation_key FROM outbox.operations ORDER BY 1") == [
        ("tenant-a", "k1"),
        ("tenant-b", "k1"),
    ]


def test_an_unbound_transaction_may_do_nothing(rls_db: str) -> None:
    with psycopg.connect(as_role(rls_db, APP)) as conn:
        assert (
            refused(
                lambda: outbox.enqueue(
                    conn,
                    tenant_id="tenant-a",
                    operation_type="t",
                    operation_key="k",
                    provider="hook",
                    action="a",
                    payload={},
                )
            )
            == INSUFFICIENT_PRIVILEGE
        )
        conn.rollback()
        assert refused(lambda: outbox.get_operation(conn, "tenant-a", "t", "k")) == (
            INSUFFICIENT_PRIVILEGE
        )
    assert rows(rls_db, "SELECT count(*) FROM outbox.operations") == [(0,)]


def test_bind_tenant_refuses_an_autocommit_connection_outside_a_transaction(rls_db: str) -> None:
    with psycopg.connect(as_role(rls_db, APP), autocommit=True) as conn:
        with pytest.raises(psycopg.ProgrammingError, match="open transaction"):
            outbox.bind_tenant(conn, "tenant-a")
        with conn.transaction():
            outbox.bind_tenant(conn, "tenant-a")
            outbox.enqueue(
                conn,
                tenant_id="tenant-a",
                operation_type="t",
                operation_key="k",
                provider="hook",
                action="a",
                payload={},
            )
    assert rows(rls_db, "SELECT tenant_id FROM outbox.operations") == [("tenant-a",)]


def test_a_pooled_connection_does_not_carry_the_tenant_into_the_next_transaction(
    rls_db: str,
) -> None:
    with ConnectionPool(as_role(rls_db, APP), min_size=1, max_size=1, open=True) as pool:
        with pool.connection() as conn:
            pid = conn.info.backend_pid
            outbox.bind_tenant(conn, "tenant-a")
            enqueue_in(conn, "tenant-a", "first")
        with pool.connection() as conn:  # the same server session, a new transaction
            assert conn.info.backend_pid == pid
            assert conn.execute("SELECT current_setting('outbox.tenant_id', true)").fetchone() == (
                "",
            )
            assert refused(lambda: enqueue_in(conn, "tenant-a", "second")) == (
                INSUFFICIENT_PRIVILEGE
            )
    assert rows(rls_db, "SELECT operation_key FROM outbox.operations") == [("first",)]


def enqueue_in(conn: psycopg.Connection[Any], tenant: str, key: str) -> None:
    outbox.enqueue(
        conn,
        tenant_id=tenant,
        operation_type="t",
        operation_key=key,
        provider="hook",
        action="a",
        payload={},
    )


async def test_the_dispatcher_and_the_operator_see_every_tenant(
    rls_db: str, receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    app = as_role(rls_db, APP)
    ops = {tenant: enqueue_for(app, tenant, "k") for tenant in ("tenant-a", "tenant-b")}
    pool = connect.dispatcher_pool(as_role(rls_db, DISPATCHER), max_size=2)
    await pool.open(wait=True)
    try:
        assert await dispatcher(pool, {"hook": hook}).run_once() == 2
    finally:
        await pool.close()
    assert statuses(rls_db) == {"succeeded": 2}
    assert sorted(e.body["tenant"] for e in receiver.effects) == ["tenant-a", "tenant-b"]
    with psycopg.connect(rls_db) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure'"
        )
    with psycopg.connect(as_role(rls_db, OPERATOR), autocommit=True) as conn:
        listed = operators.list_attention(conn, Status.QUARANTINED)
        assert sorted(r["tenant_id"] for r in listed) == ["tenant-a", "tenant-b"]
        assert operators.replay(conn, ops["tenant-b"], reason="r", actor="alice") is Status.PENDING


def test_the_claim_still_reads_its_partial_index_under_row_level_security(rls_db: str) -> None:
    """The claim's statements, which run as the schema owner inside outbox.claim_fair (sql/0040),
    called by the dispatcher's login: auto_explain shows their plans (loaded as a superuser,
    then the session becomes the login)."""
    with psycopg.connect(rls_db) as conn:
        nested = explain_nested(conn, analyze=False)
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(DISPATCHER)))
        conn.execute(statements.CLAIM, CLAIM_PARAMS)
        conn.rollback()
    assert '"Index Name": "operations_claim_group"' in _json_text(nested)


def _json_text(value: Any) -> str:
    return json.dumps(value)


# --- a schema owner that is not a superuser -----------------------------------------------------


@pytest.fixture
def owned_db(pg_server: str) -> Iterator[str]:
    """A database migrated (roles and tenant isolation too) by a non-superuser owner with
    CREATEROLE: the deployment the docs recommend, where FORCE binds the definer functions."""
    with cluster_lock(pg_server), psycopg.connect(pg_server, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (OWNER,)).fetchone()
        if not exists:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN CREATEROLE").format(sql.Identifier(OWNER)))
    name = postgres.create_database(pg_server, None)
    url = postgres.with_dbname(pg_server, name)
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
                sql.Identifier(name), sql.Identifier(OWNER)
            )
        )
    with cluster_lock(pg_server), psycopg.connect(as_role(url, OWNER), autocommit=True) as conn:
        migrations.migrate(conn, with_roles=True, tenant_rls=True)
    apply_roles(pg_server, url)  # the tests' login roles (and a rerun, which changes nothing)
    yield url
    postgres.drop_database(pg_server, name)


def test_force_binds_a_non_superuser_owner_and_its_definer_functions(owned_db: str) -> None:
    app, owner = as_role(owned_db, APP), as_role(owned_db, OWNER)
    assert rows(owned_db, "SELECT tableowner FROM pg_tables WHERE tablename = 'operations'") == [
        (OWNER,)
    ]
    enqueue_for(app, "tenant-a", "k")
    op_b = enqueue_for(app, "tenant-b", "k")
    assert refused(lambda: enqueue_for(app, "tenant-b", "k2", bind="tenant-a")) == (
        INSUFFICIENT_PRIVILEGE
    )
    with psycopg.connect(owner) as conn:
        # Unbound, the owner (migrations, operator functions) sees every tenant ...
        assert conn.execute("SELECT count(*) FROM outbox.operations").fetchone() == (2,)
        # ... bound, only that one, as inside outbox.enqueue and outbox.get_operation.
        outbox.bind_tenant(conn, "tenant-a")
        assert conn.execute("SELECT tenant_id FROM outbox.operations").fetchall() == [("tenant-a",)]
        touched = conn.execute(
            "UPDATE outbox.operations SET status_reason = 'x' RETURNING tenant_id"
        ).fetchall()
        assert touched == [("tenant-a",)]
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="row-level security"):
            conn.execute(
                "INSERT INTO outbox.operations (tenant_id, operation_type, "
                "operation_key, fingerprint, provider, action, payload, "
                "idempotency_key) VALUES ('tenant-b', 't', 'x', '\\x00', 'hook', 'a', "
                "'{}', 'x')"
            )
        conn.rollback()
    with psycopg.connect(owned_db) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', "
            "status_reason = 'permanent_failure'"
        )
    # The operator's definer function runs as that owner, unbound: it reaches tenant-b's row.
    with psycopg.connect(as_role(owned_db, OPERATOR), autocommit=True) as conn:
        assert operators.cancel(conn, op_b, reason="r", actor="alice") is Status.CANCELLED
    assert rows(owned_db, "SELECT tenant_id, status FROM outbox.operations ORDER BY 1") == [
        ("tenant-a", "quarantined"),
        ("tenant-b", "cancelled"),
    ]


def test_without_isolation_binding_changes_nothing(db_url: str) -> None:
    """enqueue skips the catalog read when the transaction is bound to its tenant (sql/0017):
    bound to it, to another tenant, or to none, a database without isolation accepts all."""
    for key, bind in (("k1", "tenant-a"), ("k2", "tenant-b"), ("k3", None)):
        with psycopg.connect(db_url) as conn:
            if bind is not None:
                outbox.bind_tenant(conn, bind)
            result = outbox.enqueue(
                conn,
                tenant_id="tenant-a",
                operation_type="invoice.charge",
                operation_key=key,
                provider="hook",
                action="invoice.paid",
                payload={},
            )
            assert result.outcome == "accepted"
    assert rows(db_url, "SELECT operation_key FROM outbox.operations ORDER BY 1") == [
        ("k1",),
        ("k2",),
        ("k3",),
    ]


# --- a binding ends with its transaction, however it was set (issue 38; sql/0038) ----------------


def test_a_session_level_binding_binds_no_later_transaction(rls_db: str) -> None:
    """`SET outbox.tenant_id` (of the session) outlives its transaction: on a pooled connection
    the next request's transaction, which bound nothing, acted for that tenant. It binds
    nothing now, in that transaction or any later one, and enqueue and get_operation say so."""
    with psycopg.connect(as_role(rls_db, APP), autocommit=True) as conn:
        conn.execute("SET outbox.tenant_id = 'tenant-a'")
        with conn.transaction():
            error = refused(lambda: enqueue_in(conn, "tenant-a", "leaked"))
        assert error == INSUFFICIENT_PRIVILEGE
        with conn.transaction():
            assert refused(lambda: outbox.get_operation(conn, "tenant-a", "t", "k")) == (
                INSUFFICIENT_PRIVILEGE
            )
        with pytest.raises(
            psycopg.errors.InsufficientPrivilege, match=r"not by outbox\.bind_tenant"
        ):
            enqueue_in(conn, "tenant-a", "leaked")  # autocommit: a transaction of its own
        conn.execute("SELECT set_config('outbox.tenant_id', 'tenant-a', false)")
        assert refused(lambda: enqueue_in(conn, "tenant-a", "leaked")) == INSUFFICIENT_PRIVILEGE
        # Bound in the transaction, it acts; the session's value is still there after it.
        with conn.transaction():
            outbox.bind_tenant(conn, "tenant-a")
            enqueue_in(conn, "tenant-a", "bound")
        assert refused(lambda: enqueue_in(conn, "tenant-a", "after")) == INSUFFICIENT_PRIVILEGE
    assert rows(rls_db, "SELECT operation_key FROM outbox.operations") == [("bound",)]


def test_a_binding_copied_into_the_session_binds_only_its_own_transaction(rls_db: str) -> None:
    """Both settings copied into the session by hand: the start they name is their own
    transaction's, so no later one takes them."""
    with psycopg.connect(as_role(rls_db, APP)) as conn:
        outbox.bind_tenant(conn, "tenant-a")
        ((bound_at,),) = conn.execute("SELECT current_setting('outbox.tenant_bound_at')")
        conn.execute("SELECT set_config('outbox.tenant_id', 'tenant-a', false)")
        conn.execute("SELECT set_config('outbox.tenant_bound_at', %s, false)", (bound_at,))
        enqueue_in(conn, "tenant-a", "first")
        conn.commit()
        assert conn.execute("SELECT current_setting('outbox.tenant_bound_at')").fetchone() == (
            bound_at,
        )
        assert refused(lambda: enqueue_in(conn, "tenant-a", "second")) == INSUFFICIENT_PRIVILEGE
    assert rows(rls_db, "SELECT operation_key FROM outbox.operations") == [("first",)]


def test_sql_binds_with_outbox_bind_tenant_and_set_config_alone_no_longer(rls_db: str) -> None:
    with psycopg.connect(as_role(rls_db, APP)) as conn:
        conn.execute("SELECT outbox.bind_tenant('tenant-a')")
        enqueue_in(conn, "tenant-a", "bound")
        conn.commit()
        conn.execute("SELECT set_config('outbox.tenant_id', 'tenant-a', true)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege) as caught:
            enqueue_in(conn, "tenant-a", "set-config")
        assert "outbox.bind_tenant" in (caught.value.diag.message_hint or "")
        conn.rollback()
        with pytest.raises(psycopg.Error) as blank:
            conn.execute("SELECT outbox.bind_tenant('  ')")
        assert (blank.value.sqlstate, blank.value.diag.column_name) == ("OB002", "tenant_id")
    assert rows(rls_db, "SELECT operation_key FROM outbox.operations") == [("bound",)]


def test_a_role_reading_the_table_sees_no_tenant_through_a_session_binding(
    rls_db: str, pg_server: str
) -> None:
    """The policy for any other role granted the table reads the binding the same way."""
    enqueue_for(as_role(rls_db, APP), "tenant-a", "k")
    with psycopg.connect(rls_db, autocommit=True) as admin:
        admin.execute("DROP ROLE IF EXISTS outbox_test_reader")
        admin.execute("CREATE ROLE outbox_test_reader")
        admin.execute("GRANT USAGE ON SCHEMA outbox TO outbox_test_reader")
        admin.execute("GRANT SELECT ON outbox.operations TO outbox_test_reader")
        admin.execute("GRANT EXECUTE ON FUNCTION outbox.bind_tenant(text) TO outbox_test_reader")
    try:
        with psycopg.connect(rls_db) as conn:
            conn.execute("SET ROLE outbox_test_reader")
            conn.execute("SET outbox.tenant_id = 'tenant-a'")
            conn.commit()
            assert conn.execute("SELECT count(*) FROM outbox.operations").fetchone() == (0,)
            conn.commit()
            conn.execute("SELECT outbox.bind_tenant('tenant-a')")
            assert conn.execute("SELECT count(*) FROM outbox.operations").fetchone() == (1,)
            conn.rollback()
    finally:
        with psycopg.connect(rls_db, autocommit=True) as admin:
            admin.execute("DROP OWNED BY outbox_test_reader")
            admin.execute("DROP ROLE outbox_test_reader")


def test_0038_alters_the_policies_a_deployment_already_has(empty_db_url: str) -> None:
    """The policies of roles_tenant_rls.sql as they were made before 0038 read the setting
    alone: the migration makes them read the binding as enqueue does."""
    old = "nullif(current_setting('outbox.tenant_id', true), '')"
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=37)
        conn.execute(
            f"CREATE POLICY operations_bound_tenant ON outbox.operations TO PUBLIC "
            f"USING (tenant_id = {old}) WITH CHECK (tenant_id = {old})"
        )
        conn.execute(
            f"CREATE POLICY operations_owner_postgres ON outbox.operations TO postgres "
            f"USING ({old} IS NULL OR tenant_id = {old})"
        )
        migrations.migrate(conn)
        quals = conn.execute(
            "SELECT policyname, qual, with_check FROM pg_policies "
            "WHERE tablename = 'operations' ORDER BY 1"
        ).fetchall()
    assert [name for name, *_ in quals] == ["operations_bound_tenant", "operations_owner_postgres"]
    for _, qual, check in quals:
        assert "outbox.tenant_bound_at" in qual and "outbox.tenant_bound_at" in check

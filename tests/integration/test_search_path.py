"""No name of outbox's resolves through public, function or operator (issue 20, case 2).

Before PostgreSQL 15 (and in databases upgraded from it) anyone may create functions in public.
A function there whose argument types fit a call better than pg_catalog's own takes it over:
the planted public.format(text, text, text) below made its creator SUPERUSER the next time
`outbox migrate --with-roles --tenant-rls` ran. Every session outbox opens now pins
search_path to pg_catalog, pg_temp, and the role scripts name pg_catalog's functions.

The planter here is an unprivileged login with CREATE on public; each planted function records
that it ran, and format() tries to make its creator superuser.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.cli.common import connect as cli_connect
from outbox.config.settings import DispatcherSettings, ProviderLimits
from outbox.daemon import gauges
from outbox.db import connect, migrations, statements
from outbox.db.store import Store
from outbox.dispatch.dispatcher import Dispatcher
from outbox.providers.base import SendRequest, SendResult, Succeeded
from outbox.providers.noop import NoopProvider
from tests.integration.test_roles import as_role, cluster_lock, roles_db
from tests.support.cli import outbox_cli
from tests.support.dispatch import rows

__all__ = ["roles_db"]  # the fixture, shared with test_roles

PLANTER = "outbox_test_planter"
PLANT = """
CREATE TABLE public.hijacks (what text);
GRANT INSERT, SELECT ON public.hijacks TO PUBLIC;
CREATE FUNCTION public.format(text, text, text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.hijacks VALUES ('format');
    BEGIN
        -- Makes its creator superuser, when a superuser is the caller.
        EXECUTE 'ALTER ROLE ' || quote_ident((SELECT pg_get_userbyid(proowner) FROM pg_proc
            WHERE oid = 'public.format(text, text, text)'::regprocedure)) || ' SUPERUSER';
    EXCEPTION WHEN insufficient_privilege THEN NULL;
    END;
    RETURN pg_catalog.format($1, $2, $3);
END $$;
CREATE FUNCTION public.format(text, text) RETURNS text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('format2'); RETURN pg_catalog.format($1, $2); END $$;
-- What RECORD_MANY calls when an answer is past 64 KiB: both beat pg_catalog's VARIADIC "any".
CREATE FUNCTION public.format(text, integer) RETURNS text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('format int'); RETURN pg_catalog.format($1, $2); END $$;
CREATE FUNCTION public.jsonb_build_object(text, text) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('jsonb_build_object');
      RETURN pg_catalog.jsonb_build_object($1, $2); END $$;
CREATE FUNCTION public.unnest(text[]) RETURNS SETOF text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('unnest text[]');
      RETURN QUERY SELECT pg_catalog.unnest($1); END $$;
CREATE FUNCTION public.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('unnest bigint[]');
      RETURN QUERY SELECT pg_catalog.unnest($1); END $$;
CREATE FUNCTION public.set_config(text, text, boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('set_config');
      RETURN pg_catalog.set_config($1, $2, $3); END $$;
-- An operator: text || integer beats pg_catalog's text || anynonarray.
CREATE FUNCTION public.evil_concat(text, integer) RETURNS text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('operator ||');
      RETURN pg_catalog.textcat($1, $2::text); END $$;
CREATE OPERATOR public.|| (LEFTARG = text, RIGHTARG = integer, FUNCTION = public.evil_concat);
CREATE FUNCTION public.current_setting(text, boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.hijacks VALUES ('current_setting');
      RETURN pg_catalog.current_setting($1, $2); END $$;
"""


@pytest.fixture
def planter(request: pytest.FixtureRequest) -> str:
    """A planter of this test's own: the control below makes its planter superuser, which
    another test running at the same time (xdist) must not see happen to its own."""
    return f"{PLANTER}_{hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]}"


@pytest.fixture
def planted(empty_db_url: str, pg_server: str, planter: str) -> str:
    """An empty database whose public schema holds the planter's functions."""
    with cluster_lock(pg_server), psycopg.connect(empty_db_url, autocommit=True) as conn:
        conn.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = "
            f"'{planter}') THEN CREATE ROLE {planter} LOGIN; END IF; END $$"
        )
        conn.execute(f"ALTER ROLE {planter} NOSUPERUSER")
        conn.execute(f"GRANT CREATE ON SCHEMA public TO {planter}")
    with psycopg.connect(as_role(empty_db_url, planter), autocommit=True) as conn:
        conn.execute(PLANT)
    return empty_db_url


def hijacks(url: str) -> list[str]:
    return [what for (what,) in rows(url, "SELECT what FROM public.hijacks")]


def test_a_session_that_does_not_pin_its_path_is_taken_over(planted: str, planter: str) -> None:
    """The control: without the pin, the planted format() runs as the caller, a superuser here,
    and makes its creator one."""
    superuser = "SELECT rolsuper FROM pg_roles WHERE rolname = %s"
    try:
        with psycopg.connect(planted, autocommit=True) as conn:
            conn.execute("SELECT format('%s-%s', 'a', 'b')")
            conn.execute("SELECT 'attempt ' || 7")
        assert hijacks(planted) == ["format", "operator ||"]
        assert rows(planted, superuser, (planter,)) == [(True,)]
    finally:
        with psycopg.connect(planted, autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} NOSUPERUSER").format(sql.Identifier(planter)))


def test_migrate_with_the_roles_dispatch_and_the_cli_never_run_a_planted_function(
    planted: str, pg_server: str, planter: str
) -> None:
    with cluster_lock(pg_server), psycopg.connect(planted, autocommit=True) as conn:
        migrations.migrate(conn, with_roles=True, tenant_rls=True)
    with psycopg.connect(planted) as conn:
        outbox.bind_tenant(conn, "acme")
        ids = [
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="t",
                operation_key=f"k{i}",
                provider="noop",
                action="a",
                payload={"n": i},
            ).operation_id
            for i in range(5)
        ]
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="t",
            operation_key="big",
            provider="verbose",
            action="a",
            payload={},
        )
    asyncio.run(_dispatch(planted))
    assert rows(planted, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("succeeded", 6)
    ]
    ((kept,),) = rows(planted, "SELECT result FROM outbox.operations WHERE provider = 'verbose'")
    assert set(kept) == {"outbox_omitted"}  # the 64 KiB branch ran
    env = {**os.environ, "OUTBOX_DATABASE_URL": planted}
    for args in (
        ["status"],
        ["quarantine", "list"],
        ["reconcile", "list"],
        ["quarantine", "show", str(ids[0])],
        ["prune", "--older-than", "1d"],
        ["ordering", "modes"],
        ["ordering", "set-mode", "t", "skip", "--actor", "a"],
        ["status", "--json"],
        ["migrate", "--with-roles", "--tenant-rls"],
    ):
        done = outbox_cli(env, *args)
        assert done.returncode == 0, (args, done.stderr)
    assert hijacks(planted) == []
    assert rows(planted, "SELECT rolsuper FROM pg_roles WHERE rolname = %s", (planter,)) == [
        (False,)
    ]


class Verbose:
    """A provider whose answer is past the 64 KiB outbox keeps of one."""

    name = "verbose"
    key_retention = timedelta(hours=24)

    def check(self, action: str, payload: Mapping[str, Any]) -> None: ...

    async def send(self, request: SendRequest) -> SendResult:
        return Succeeded("ref-1", {"text": "x" * 70_000})

    async def aclose(self) -> None: ...


async def _dispatch(url: str) -> None:
    pool = connect.dispatcher_pool(url, max_size=4)
    await pool.open()
    try:
        noop = NoopProvider("noop", timedelta(hours=24))
        # A cap and a rate: the claim unnests its caps (inside outbox.claim_fair, pinned since
        # sql/0040) and the dispatcher takes tokens (TAKE_TOKENS), more of its statements run
        # beside the planted functions.
        limits = {"noop": ProviderLimits(max_in_flight=8, rate=10_000.0, burst=100)}
        d = Dispatcher(
            Store(pool),
            {"noop": noop, "verbose": Verbose()},
            DispatcherSettings(),
            worker_id="search-path",
            limits=limits,
        )
        done = 0
        async with asyncio.timeout(10):  # the bucket starts empty and fills at the rate
            while done < 6:
                done += await d.run_once()
        assert done == 6
        await gauges.refresh(pool, {"noop": timedelta(hours=23)})
        # Its hottest statements run inside pinned functions since sql/0040 and would survive an
        # unpinned session; the next statement outbox adds at the top level might not.
        async with pool.connection() as conn:
            shown = await (await conn.execute(statements.SHOW_SEARCH_PATH)).fetchone()
        assert shown == (statements.SEARCH_PATH,)
    finally:
        await pool.close()


def test_every_migration_runs_with_the_pinned_search_path(empty_db_url: str) -> None:
    """Migrations and the role scripts run after the runner pinned the path (the role scripts
    also name pg_catalog's functions, which the test above shows)."""
    probe = migrations.Migration(
        9999,
        "probe",
        b"""
        DO $$ BEGIN
            IF pg_catalog.current_setting('search_path') <> 'pg_catalog, pg_temp' THEN
                RAISE EXCEPTION 'unpinned: %', pg_catalog.current_setting('search_path');
            END IF;
        END $$;""",
    )
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        report = migrations.migrate(conn, migrations=[*migrations.load_migrations(), probe])
        assert report.applied[-1].version == 9999
        shown = conn.execute("SELECT pg_catalog.current_setting('search_path')").fetchone()
    assert shown is not None and shown[0] != "pg_catalog, pg_temp"  # put back afterwards


def test_the_cli_and_the_dispatcher_role_pin_it_too(roles_db: str) -> None:
    """A CLI session pins its own; through a transaction pooler no session setting holds, so
    the dispatcher role carries it (sql/roles.sql)."""
    with cli_connect(roles_db) as conn:
        shown = conn.execute("SELECT pg_catalog.current_setting('search_path')").fetchone()
        conn.rollback()  # a command's rollback does not undo it
        again = conn.execute("SELECT pg_catalog.current_setting('search_path')").fetchone()
    assert shown == again == ("pg_catalog, pg_temp",)
    ((config,),) = rows(
        roles_db, "SELECT rolconfig FROM pg_roles WHERE rolname = 'outbox_dispatcher'"
    )
    assert "search_path=pg_catalog, pg_temp" in config

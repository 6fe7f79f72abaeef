"""sql/schema.sql is what the migrations produce (issue 22): regenerated from a fresh database
and compared line for line, so a migration that lands without it fails here."""

from __future__ import annotations

import difflib
import re
from dataclasses import replace
from pathlib import Path

import psycopg
import pytest

from outbox.db import dsn as dsn_util
from outbox.db import migrations, schema_dump

REPO = Path(__file__).resolve().parents[2]
SCHEMA_FILE = REPO / "sql" / "schema.sql"


def difference(expected: str, actual: str) -> str | None:
    """Why sql/schema.sql (``expected``) is not what was generated: a unified diff and the
    command that regenerates it; None when they agree."""
    if expected == actual:
        return None
    diff = "".join(
        difflib.unified_diff(
            expected.splitlines(keepends=True),
            actual.splitlines(keepends=True),
            fromfile="sql/schema.sql (committed)",
            tofile="sql/schema.sql (what the migrations produce)",
        )
    )
    return (
        "sql/schema.sql is not what the migrations produce. If the migrations are right, "
        f"regenerate it and commit it with them:\n    {schema_dump.REGENERATE}\n"
        "(--dsn: any database of a server where you may CREATE DATABASE)\n\n" + diff
    )


def test_the_schema_file_is_what_the_migrations_produce(pg_server: str, tmp_path: Path) -> None:
    # The command the file's header gives, on this run's server: a scratch database, migrated
    # one file at a time, dumped and dropped.
    generated = tmp_path / "schema.sql"
    assert schema_dump.main(["--dsn", pg_server, "--output", str(generated)]) == 0
    problem = difference(SCHEMA_FILE.read_text(encoding="utf-8"), generated.read_text("utf-8"))
    if problem is not None:
        pytest.fail(f"{problem}\n(this test used: {dsn_util.redact(pg_server)})", pytrace=False)


def test_a_changed_function_shows_in_the_diff(empty_db_url: str) -> None:
    """The check itself: a migration that changes a function's body and drops its SECURITY
    DEFINER makes the comparison fail, with the lines that changed."""
    *earlier, last = migrations.load_migrations()
    edit = (
        b"\nALTER FUNCTION outbox.take_turn() SECURITY INVOKER;\n"
        b"CREATE OR REPLACE FUNCTION outbox.schema_version() RETURNS integer\n"
        b"LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp\n"
        b"AS $$ SELECT 42 $$;\n"
    )
    generated = schema_dump.migrate_and_dump(
        empty_db_url, [*earlier, replace(last, sql=last.sql + edit)]
    )
    problem = difference(SCHEMA_FILE.read_text(encoding="utf-8"), generated)
    assert problem is not None
    assert schema_dump.REGENERATE in problem
    changed = [line for line in problem.splitlines() if line[:1] in "+-"]
    assert any(line.startswith("+") and "SELECT 42" in line for line in changed)
    assert "- SECURITY DEFINER" in changed
    # Each object's history names the migration that changed it.
    assert any(line.startswith("+-- history:") and last.label in line for line in changed)


def test_an_existing_database_dumps_the_same_but_for_the_history(db_url: str) -> None:
    """--existing on a database migrated in one go (the tests' template) gives the committed
    file without its history lines: the way to compare a deployed database with it."""
    with psycopg.connect(db_url) as conn:
        existing = schema_dump.dump_existing(conn)
    committed = SCHEMA_FILE.read_text(encoding="utf-8")
    without_history = re.sub(r"^-- history:.*\n(?:--     .*\n)*", "", committed, flags=re.M)
    assert objects(existing) == objects(without_history)


def objects(text: str) -> str:
    """The file past its header."""
    return text[text.index("\n-- ===") :]


def test_only_numbered_files_are_migrations() -> None:
    """sql/schema.sql and the role scripts sit beside the migrations; none of them is one."""
    sql_dir = REPO / "sql"
    assert {"schema.sql", "roles.sql", "roles_tenant_rls.sql"} <= {
        p.name for p in sql_dir.iterdir()
    }
    numbered = sorted(p.name for p in sql_dir.glob("[0-9][0-9][0-9][0-9]_*.sql"))
    assert [f"{m.label}.sql" for m in migrations.load_migrations(sql_dir)] == numbered


def test_the_left_out_roles_are_those_roles_sql_makes() -> None:
    roles_sql = (REPO / "sql" / "roles.sql").read_text(encoding="utf-8")
    made = set(re.findall(r"\('(outbox_[a-z]+)', '(?:NO)?LOGIN'\)", roles_sql))
    assert made == schema_dump.ROLE_SCRIPT_ROLES

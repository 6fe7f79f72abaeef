"""Finds or starts the PostgreSQL server the tests use, and hands out fresh databases.

Order: $OUTBOX_TEST_DATABASE_URL; else the server at 127.0.0.1:5432 if it answers; else a
throwaway server (the pgserver package's binaries). $OUTBOX_TEST_THROWAWAY=1 skips the probe, to
prove the fresh-laptop path. The run's first process (the xdist controller, tests/conftest.py)
starts the throwaway server and owns it, and its workers find it through
$OUTBOX_TEST_THROWAWAY_URL: when each worker held a handle of its own, one that ended while
another was starting stopped the server under it (pgserver counts handles, racily).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.db import migrations

LOCAL_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/test"
# Serialises template builds across xdist workers; advisory locks are per database, and every
# worker takes this one in the server's maintenance database.
TEMPLATE_LOCK_KEY = int.from_bytes(b"obx:tmpl", "big")
TEST_DB_PREFIX = "outbox_test_"
THROWAWAY_URL_ENV = "OUTBOX_TEST_THROWAWAY_URL"


@dataclass(frozen=True)
class Server:
    """A running server's maintenance database, and where the server came from."""

    url: str
    origin: Literal["environment", "local", "throwaway"]


def find_server(shared_dir: Path) -> Server:
    """The server named by the environment, the local one, or a throwaway one, in that order."""
    explicit = os.environ.get("OUTBOX_TEST_DATABASE_URL")
    if explicit:
        return Server(explicit, "environment")
    owned = os.environ.get(THROWAWAY_URL_ENV)
    if owned:
        return Server(owned, "throwaway")
    if os.environ.get("OUTBOX_TEST_THROWAWAY") != "1" and _answers(LOCAL_SERVER_URL):
        return Server(LOCAL_SERVER_URL, "local")
    return Server(_start_throwaway(shared_dir / "pgdata"), "throwaway")


def start_owned_throwaway() -> None:
    """If the run needs a throwaway server, start it in this process, which keeps it until it
    exits (then it is deleted), and publish its address to the workers this process starts."""
    if os.environ.get("OUTBOX_TEST_DATABASE_URL") or os.environ.get(THROWAWAY_URL_ENV):
        return
    if os.environ.get("OUTBOX_TEST_THROWAWAY") != "1" and _answers(LOCAL_SERVER_URL):
        return
    # Short: the server's unix socket lives in its data directory, and such paths are limited.
    directory = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)  # after pgserver's own
    os.environ[THROWAWAY_URL_ENV] = _start_throwaway(directory / "pgdata", cleanup="delete")


def _answers(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def _start_throwaway(pgdata: Path, cleanup: str = "stop") -> str:
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); its fallback is fine.
        warnings.simplefilter("ignore")
        import pgserver  # noqa: PLC0415 (only machines without a server need it)

        # pgserver counts handles across processes: every xdist worker shares this one server,
        # and the last worker to exit stops it. Its start-up is serialised by a lock of its own,
        # but not its mkdir of pgdata, which fails when another worker made the directory since
        # it looked: made here first, where that cannot fail.
        pgdata.mkdir(exist_ok=True)
        server = pgserver.get_server(pgdata, cleanup_mode=cleanup)  # type: ignore[attr-defined]
    return str(server.get_uri())


def with_dbname(url: str, dbname: str) -> str:
    return make_conninfo(url, dbname=dbname)


def template_name() -> str:
    """A template per set of migrations, so a changed migration never meets a stale template."""
    digest = hashlib.sha256()
    for m in migrations.load_migrations():
        digest.update(m.checksum.encode())
    return f"outbox_tpl_{digest.hexdigest()[:16]}"


def ensure_template(url: str) -> str:
    """Create the migrated template database once per server and set of migrations."""
    name = template_name()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_advisory_lock(%s)", (TEMPLATE_LOCK_KEY,))
        try:
            exists = conn.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)
            ).fetchone()
            if not exists:
                _build_template(conn, url, name)
        finally:
            conn.execute("SELECT pg_advisory_unlock(%s)", (TEMPLATE_LOCK_KEY,))
    return name


def _build_template(conn: psycopg.Connection[Any], url: str, name: str) -> None:
    # Built under another name and renamed when complete, so a run killed half-way never
    # leaves a half-migrated template behind.
    building = f"{name}_building"
    conn.execute(
        sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(building))
    )
    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(building)))
    with psycopg.connect(with_dbname(url, building), autocommit=True) as tpl:
        migrations.migrate(tpl)
    conn.execute(
        sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
            sql.Identifier(building), sql.Identifier(name)
        )
    )


def create_database(url: str, template: str | None) -> str:
    """A new database (a clone of ``template``, or empty); returns its name."""
    name = f"{TEST_DB_PREFIX}{uuid.uuid4().hex[:16]}"
    query = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
        sql.Identifier(name), sql.Identifier(template or "template0")
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(query)
    return name


def drop_database(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


def psql_path() -> str:
    """psql from PATH, or the one pgserver ships."""
    found = shutil.which("psql")
    if found:
        return found
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import pgserver  # noqa: PLC0415

    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "psql")


def libpq_env(url: str) -> dict[str, str]:
    """The connection as libpq environment variables, for psql and other subprocesses."""
    names = {
        "host": "PGHOST",
        "port": "PGPORT",
        "user": "PGUSER",
        "dbname": "PGDATABASE",
        "password": "PGPASSWORD",
    }
    params = conninfo_to_dict(url)
    return {env: str(params[key]) for key, env in names.items() if params.get(key)}

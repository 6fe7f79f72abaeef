"""Applies the numbered migrations of ``sql/`` in order, once each, under an advisory lock.

Safe to run twice (applied files are skipped) and from many processes at once (they queue on the
lock, and the later ones find nothing to do). Each file runs in its own transaction, so a failure
leaves the database at the previous version. Statements wait at most ``lock_timeout`` for a lock,
so a migration never queues for long behind live traffic, and behind it the traffic.

With ``with_roles``, the role scripts of ``sql/`` (``roles.sql``, and ``roles_tenant_rls.sql``
for tenant isolation) run after the numbered files, under the same lock. They are not numbered:
roles are cluster-wide and need CREATEROLE, so they stay out of the migrations everyone applies,
and they are idempotent, so they run again on every ``migrate --with-roles``.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg.rows import tuple_row

from outbox.core.durations import format_duration, to_postgres_interval
from outbox.db import statements
from outbox.errors import OutboxError

# Long enough to outlast another process applying the same migrations, short enough that a
# deploy stuck behind a hung migrator fails instead of hanging.
DEFAULT_LOCK_WAIT: Final = timedelta(minutes=2)
# A DDL statement queued behind a long transaction blocks every query behind it: give up soon.
DEFAULT_LOCK_TIMEOUT: Final = timedelta(seconds=5)

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")

# The least-privilege roles and their grants; then, optionally, tenant row-level security.
ROLES_SCRIPT: Final = "roles.sql"
TENANT_RLS_SCRIPT: Final = "roles_tenant_rls.sql"
# Roles are cluster-wide: two databases' migrators creating the same role or setting the same
# role option at the same moment collide in the shared catalogs. The script is idempotent, so
# the loser runs it again and finds the work done.
_ROLE_RACE_ATTEMPTS: Final = 5
_ROLE_RACE_PAUSE_SECONDS: Final = 0.2


class MigrationError(OutboxError):
    """A migration could not be applied, or the files and the database disagree."""


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered file of ``sql/``."""

    version: int
    name: str
    sql: bytes

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql).hexdigest()

    @property
    def label(self) -> str:
        return f"{self.version:04d}_{self.name}"


@dataclass
class MigrationReport:
    """What a run did: the migrations it applied, and how many were already there."""

    applied: list[Migration] = field(default_factory=list)
    already_applied: int = 0
    # Versions the database has that these files do not: a newer outbox migrated it.
    unknown_versions: list[int] = field(default_factory=list)
    # The role scripts run after the migrations (with_roles), by file name.
    scripts: list[str] = field(default_factory=list)


def default_sql_dir() -> Path:
    """The migrations: inside the installed package (a wheel), or at the top of a checkout."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[1] / "sql", here.parents[2] / "sql"):
        if candidate.is_dir():
            return candidate
    raise MigrationError(f"cannot find the sql/ migrations next to {here.parents[1]}")


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migrations in ``directory`` (default: :func:`default_sql_dir`), ordered by version."""
    found: dict[int, Migration] = {}
    for path in sorted((directory or default_sql_dir()).iterdir()):
        match = _FILE_NAME.match(path.name)
        if not match:
            continue
        version = int(match.group(1))
        if version in found:
            raise MigrationError(f"two migrations share version {version}: {path.name}")
        found[version] = Migration(version, match.group(2), path.read_bytes())
    return [found[v] for v in sorted(found)]


def load_script(name: str, directory: Path | None = None) -> bytes:
    """The text of one role script of ``sql/`` (:data:`ROLES_SCRIPT`, :data:`TENANT_RLS_SCRIPT`)."""
    path = (directory or default_sql_dir()) / name
    try:
        return path.read_bytes()
    except OSError as exc:
        raise MigrationError(f"cannot read {path}: {exc.strerror}") from None


def migrate(
    conn: psycopg.Connection[Any],
    *,
    target: int | None = None,
    migrations: Sequence[Migration] | None = None,
    lock_wait: timedelta = DEFAULT_LOCK_WAIT,
    lock_timeout: timedelta = DEFAULT_LOCK_TIMEOUT,
    on_apply: Callable[[Migration], None] | None = None,
    with_roles: bool = False,
    tenant_rls: bool = False,
) -> MigrationReport:
    """Apply pending migrations up to ``target`` (default: all) on an autocommit connection.

    ``with_roles`` then applies ``roles.sql`` (needs CREATEROLE), and ``tenant_rls`` also
    ``roles_tenant_rls.sql``; both only once every migration is applied.
    """
    if not conn.autocommit:
        raise MigrationError(
            "migrate needs an autocommit connection: it runs one transaction per file"
        )
    if tenant_rls and not with_roles:
        raise MigrationError("tenant row-level security needs the roles: add --with-roles")
    if with_roles and target is not None:
        raise MigrationError("the roles need every migration: drop --target or --with-roles")
    todo = list(migrations if migrations is not None else load_migrations())
    cur = conn.cursor(row_factory=tuple_row)
    # The migrator is the most privileged login outbox ever uses: nothing it runs (migrations,
    # the role scripts) may resolve a name through public, where a producer could have planted
    # a format() or an operator of its own.
    cur.execute(statements.PIN_SEARCH_PATH)
    _set_lock_timeout(cur, lock_wait)
    try:
        cur.execute(statements.ACQUIRE_MIGRATION_LOCK, (statements.MIGRATION_LOCK_KEY,))
    except psycopg.errors.LockNotAvailable:
        raise MigrationError(
            f"another outbox migrate held the migration lock for over {format_duration(lock_wait)}"
        ) from None
    try:
        _set_lock_timeout(cur, lock_timeout)
        cur.execute(statements.CREATE_SCHEMA)
        cur.execute(statements.CREATE_MIGRATIONS_TABLE)
        report = _apply_pending(cur, todo, target, lock_timeout, on_apply)
        if with_roles:
            scripts = [ROLES_SCRIPT, TENANT_RLS_SCRIPT] if tenant_rls else [ROLES_SCRIPT]
            for name in scripts:
                _apply_script(cur, name, load_script(name), lock_timeout)
                report.scripts.append(name)
        return report
    finally:
        if not conn.broken:
            cur.execute(statements.RELEASE_MIGRATION_LOCK, (statements.MIGRATION_LOCK_KEY,))
            cur.execute(statements.RESET_LOCK_TIMEOUT)
            cur.execute(statements.RESET_SEARCH_PATH)


def _apply_pending(
    cur: psycopg.Cursor[tuple[Any, ...]],
    todo: list[Migration],
    target: int | None,
    lock_timeout: timedelta,
    on_apply: Callable[[Migration], None] | None,
) -> MigrationReport:
    applied = {row[0]: row[2] for row in cur.execute(statements.APPLIED_MIGRATIONS)}
    report = MigrationReport(unknown_versions=sorted(set(applied) - {m.version for m in todo}))
    for migration in todo:
        if target is not None and migration.version > target:
            break
        if migration.version in applied:
            if applied[migration.version] != migration.checksum:
                raise MigrationError(
                    f"migration {migration.label} was changed after it was applied; "
                    "add a new numbered file instead of editing an applied one"
                )
            report.already_applied += 1
            continue
        _apply_one(cur, migration, lock_timeout)
        report.applied.append(migration)
        if on_apply is not None:
            on_apply(migration)
    return report


def _apply_one(
    cur: psycopg.Cursor[tuple[Any, ...]], migration: Migration, lock_timeout: timedelta
) -> None:
    try:
        with cur.connection.transaction():
            # No parameters: psycopg sends the file as one simple query, several statements and all.
            cur.execute(migration.sql)
            cur.execute(
                statements.RECORD_MIGRATION,
                (migration.version, migration.name, migration.checksum),
            )
    except psycopg.errors.LockNotAvailable:
        raise MigrationError(
            f"migration {migration.label} waited over {format_duration(lock_timeout)} for a lock "
            "held by live traffic and was rolled back; retry when the database is quieter, or "
            "raise --lock-timeout"
        ) from None
    except psycopg.Error as exc:
        raise MigrationError(
            f"migration {migration.label} failed and was rolled back: {exc}"
        ) from exc


def _apply_script(
    cur: psycopg.Cursor[tuple[Any, ...]], name: str, sql: bytes, lock_timeout: timedelta
) -> None:
    for attempt in range(1, _ROLE_RACE_ATTEMPTS + 1):
        try:
            with cur.connection.transaction():
                cur.execute(sql)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise MigrationError(
                f"{name} needs a role with CREATEROLE that owns the outbox schema (or a "
                f"superuser); nothing was changed: {exc.diag.message_primary}"
            ) from None
        except psycopg.errors.LockNotAvailable:
            raise MigrationError(
                f"{name} waited over {format_duration(lock_timeout)} for a lock held by live "
                "traffic and was rolled back; retry when the database is quieter"
            ) from None
        except psycopg.Error as exc:
            if attempt == _ROLE_RACE_ATTEMPTS or not _lost_role_race(exc):
                raise MigrationError(f"{name} failed and was rolled back: {exc}") from exc
            time.sleep(_ROLE_RACE_PAUSE_SECONDS * attempt)
        else:
            return


def _lost_role_race(exc: psycopg.Error) -> bool:
    """Did another database's migrator write the same shared catalog row at the same time?"""
    if isinstance(exc, psycopg.errors.UniqueViolation | psycopg.errors.DuplicateObject):
        return True
    # ALTER ROLE ... SET and GRANT on a shared row that another transaction just updated.
    return isinstance(exc, psycopg.errors.InternalError_) and "concurrently" in str(exc)


def _set_lock_timeout(cur: psycopg.Cursor[tuple[Any, ...]], value: timedelta) -> None:
    cur.execute(statements.SET_LOCK_TIMEOUT, (to_postgres_interval(value),))

"""The wheel carries the migrations, so `outbox migrate` works from an install, not a checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import psycopg
import pytest

from outbox.db.migrations import load_migrations

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "build",
            "--wheel",
            "--no-isolation",
            "--outdir",
            str(out),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (built,) = out.glob("outbox-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_every_migration_and_the_type_marker(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {f"outbox/sql/{m.label}.sql" for m in load_migrations()}
    assert expected <= names
    assert "outbox/py.typed" in names
    # The console's pages, style and script travel in the wheel, beside its code.
    assert {"outbox/web/templates/base.html", "outbox/web/static/console.js"} <= names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "outbox = outbox.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.mark.slow
def test_migrate_from_the_unpacked_wheel_outside_the_checkout(
    wheel: Path, tmp_path: Path, empty_db_url: str
) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site), "OUTBOX_DATABASE_URL": empty_db_url}
    where = subprocess.run(
        [sys.executable, "-c", "import outbox.db.migrations as m; print(m.default_sql_dir())"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()) == site / "outbox" / "sql"

    done = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    with psycopg.connect(empty_db_url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.schema_migrations").fetchone()
    assert row == (len(load_migrations()),)

"""Fixtures: a real PostgreSQL server per run, and a fresh database per test."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.observability import logs
from tests.support import postgres


def pytest_configure(config: pytest.Config) -> None:
    """The run's first process owns its throwaway server, if it needs one (support/postgres)."""
    if not hasattr(config, "workerinput"):  # not an xdist worker
        postgres.start_owned_throwaway()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the CPUs this process may use. Much of a test's time is
    spent waiting (on a subprocess it started, a broker, a socket, the clock in the data), not
    computing; measured on 2 cores, the suite took 11:37 with three workers against 14:34 with
    two, every test passing."""
    return len(os.sched_getaffinity(0)) + 1


@pytest.fixture(autouse=True)
def _logging_as_structlog_left_it() -> Iterator[None]:
    """No test inherits another's logging: a CLI run in process (click's CliRunner) configures
    structlog at its level and leaves it so, which filtered a later test's info lines out of
    ``capture_logs`` on the same xdist worker."""
    yield
    logs.unconfigure()


@pytest.fixture(scope="session")
def pg_server_info(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> postgres.Server:
    """The server every test of this run uses."""
    base = tmp_path_factory.getbasetemp()
    # xdist workers each get a subdirectory; their parent is shared by the whole run.
    shared: Path = base.parent if worker_id != "master" else base
    return postgres.find_server(shared)


@pytest.fixture(scope="session")
def pg_server(pg_server_info: postgres.Server) -> str:
    """The maintenance-database URL of that server."""
    return pg_server_info.url


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> str:
    return postgres.ensure_template(pg_server)


@pytest.fixture
def db_url(pg_server: str, template_db: str) -> Iterator[str]:
    """A fresh database with every migration applied, dropped after the test."""
    name = postgres.create_database(pg_server, template_db)
    yield postgres.with_dbname(pg_server, name)
    postgres.drop_database(pg_server, name)


@pytest.fixture
def empty_db_url(pg_server: str) -> Iterator[str]:
    """A fresh database with nothing in it, for migration tests."""
    name = postgres.create_database(pg_server, None)
    yield postgres.with_dbname(pg_server, name)
    postgres.drop_database(pg_server, name)


@pytest.fixture
def conn(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(db_url) as connection:
        yield connection


@pytest.fixture
async def aconn(db_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    async with await psycopg.AsyncConnection.connect(db_url) as connection:
        yield connection


@pytest.fixture
def cli_env(db_url: str) -> dict[str, str]:
    """The environment of an `outbox` subprocess pointed at this test's database."""
    return {**os.environ, "OUTBOX_DATABASE_URL": db_url}

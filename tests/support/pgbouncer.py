"""A real PgBouncer in front of a test's database, in transaction mode with a small pool.

The pool is deliberately small (2 server sessions by default) so that the clients of a test, two
`outbox run` processes with up to 10 connections each, really share server sessions: whatever one
client leaves in a session (a prepared statement, a SET, a LISTEN) is there for the next.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from tests.support.tools import require_tool

# PgBouncer refuses to run as root; a test run as root (CI in a container) runs it as this user.
UNPRIVILEGED_USER = "nobody"
START_TIMEOUT = 15.0


@dataclass
class PgBouncer:
    """A running PgBouncer: ``url`` reaches the test's database through it."""

    url: str
    log_path: Path
    proc: subprocess.Popen[bytes]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextmanager
def pgbouncer(
    db_url: str, *, pool_mode: str = "transaction", pool_size: int = 2
) -> Iterator[PgBouncer]:
    """PgBouncer in front of ``db_url``'s database; stopped and removed at the end.

    Skips the test (fails it under CI) when pgbouncer is not installed. A server on a unix
    socket works when PgBouncer's user may open the socket's directory.
    """
    binary = require_tool("pgbouncer")
    workdir = Path(tempfile.mkdtemp(prefix="outbox-pgbouncer-"))
    try:
        target = conninfo_to_dict(db_url)
        port = _free_port()
        ini = _write_files(workdir, target, port=port, pool_mode=pool_mode, pool_size=pool_size)
        log_path = workdir / "pgbouncer.log"
        with log_path.open("ab") as log:
            proc = _start(binary, ini, log)
        bouncer = PgBouncer(_client_url(target, port), log_path, proc)
        try:
            _wait_until_it_answers(bouncer)
            yield bouncer
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _write_files(
    workdir: Path, target: Mapping[str, object], *, port: int, pool_mode: str, pool_size: int
) -> Path:
    """pgbouncer.ini and its userlist; readable by PgBouncer's user only (they may hold a
    password from $OUTBOX_TEST_DATABASE_URL)."""
    user = str(target.get("user") or "postgres")
    dbname = str(target.get("dbname") or user)
    server = {key: str(target[key]) for key in ("host", "port", "password") if target.get(key)}
    server.setdefault("host", "127.0.0.1")
    entry = " ".join(f"{key}={value}" for key, value in {**server, "dbname": dbname}.items())
    ini = workdir / "pgbouncer.ini"
    userlist = workdir / "userlist.txt"
    userlist.write_text(f'"{user}" ""\n')
    ini.write_text(
        f"""[databases]
{dbname} = {entry}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {userlist}
pool_mode = {pool_mode}
default_pool_size = {pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
ignore_startup_parameters = extra_float_digits
"""
    )
    if os.geteuid() == 0:
        owner = pwd.getpwnam(UNPRIVILEGED_USER)
        for path in (workdir, ini, userlist):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    return ini


def _client_url(target: Mapping[str, object], port: int) -> str:
    """The test database's URL with PgBouncer's address; trust auth, so no password."""
    params = {k: str(v) for k, v in target.items() if v is not None and k != "password"}
    params.update(host="127.0.0.1", port=str(port))
    return make_conninfo(**params)


def _start(binary: str, ini: Path, log: IO[bytes]) -> subprocess.Popen[bytes]:
    command = [binary]
    if os.geteuid() == 0:
        command += ["-u", UNPRIVILEGED_USER]
    # In the foreground without a logfile, PgBouncer logs to stderr: the test's log file.
    return subprocess.Popen([*command, str(ini)], stdout=log, stderr=subprocess.STDOUT)


def _wait_until_it_answers(bouncer: PgBouncer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        if bouncer.proc.poll() is not None:
            raise RuntimeError(f"pgbouncer exited at start:\n{bouncer.log_text()}")
        try:
            with psycopg.connect(bouncer.url, connect_timeout=2, prepare_threshold=None) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"pgbouncer did not answer within {START_TIMEOUT}s:\n{bouncer.log_text()}"
                ) from None
            time.sleep(0.1)
        else:
            return


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # SIGTERM: PgBouncer closes every connection and exits at once
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)

"""A private PostgreSQL cluster for one test or bench, which it may crash and restart at will.

The shared server at 127.0.0.1:5432 serves tests running in parallel, so a test that stops its
database needs one of its own: ``initdb`` into a fresh directory, listen on a free loopback port
(and a unix socket in that directory), migrate one database, and remove it all at the end, on
failure too. ``stop(immediate=True)`` is ``pg_ctl stop -m immediate``: the postmaster and its
backends quit without a checkpoint, and the next start replays the WAL, as after a crash.

initdb and postgres refuse to run as root: as root (CI containers) every server command runs as
the ``postgres`` OS user through ``runuser``, in a directory that user owns. As anyone else (a
laptop) they run as that user.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Final

import psycopg

from outbox.db import migrations

# Crash-realistic but quick: fsync off only skips flushing the OS cache, which a process crash
# (all that `pg_ctl stop -m immediate` is) never loses; the WAL is still written and replayed.
SERVER_SETTINGS: Final = {
    "listen_addresses": "'127.0.0.1'",
    "fsync": "off",
    "full_page_writes": "off",
    # 3 dispatchers x (10 pooled + LISTEN) plus producers, checkers and spare room.
    "max_connections": "200",
    "shared_buffers": "64MB",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
}
DATABASE: Final = "outbox"
START_TIMEOUT: Final = 60  # seconds; crash recovery of a small cluster takes far less
OS_USER_WHEN_ROOT: Final = "postgres"


def find_bindir() -> Path:
    """The directory of initdb, pg_ctl and postgres: pg_config's, Debian's, or pgserver's."""
    candidates: list[Path] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        with suppress(subprocess.CalledProcessError, OSError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, check=True
            ).stdout
            candidates.append(Path(out.strip()))
    # Newest major version first.
    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=_major, reverse=True)
    candidates += debian
    with warnings.catch_warnings(), suppress(ImportError):
        warnings.simplefilter("ignore")  # platformdirs warns without XDG_RUNTIME_DIR
        import pgserver  # noqa: PLC0415 (only machines without a server need it)

        candidates.append(Path(pgserver.__file__).parent / "pginstall" / "bin")
    for bindir in candidates:
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    raise RuntimeError("no PostgreSQL server binaries (initdb, pg_ctl) found")


def _major(bindir: Path) -> int:
    version = bindir.parent.name
    return int(version) if version.isdigit() else 0


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PrivateCluster:
    """One initdb'd cluster in its own directory; see the module's docstring."""

    def __init__(self, bindir: Path | None = None) -> None:
        self.bindir = bindir or find_bindir()
        self._as_root = os.geteuid() == 0
        # Not under pytest's tmp_path: as root, that sits in a 0700 directory `postgres` cannot
        # enter.
        self.root = Path(tempfile.mkdtemp(prefix="outbox-cluster-"))
        self.data = self.root / "data"
        self.log_path = self.root / "server.log"
        self.port = free_port()
        self.starts = 0
        self.crashes = 0
        if self._as_root:
            try:
                user = pwd.getpwnam(OS_USER_WHEN_ROOT)
            except KeyError:
                shutil.rmtree(self.root, ignore_errors=True)
                raise RuntimeError(
                    f"as root, the server runs as the {OS_USER_WHEN_ROOT!r} OS user, which "
                    "does not exist (Debian's postgresql package creates it)"
                ) from None
            os.chown(self.root, user.pw_uid, user.pw_gid)

    # --- addresses ------------------------------------------------------------------------

    @property
    def admin_url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def url(self) -> str:
        """The migrated database, over TCP (what dispatchers and producers use)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{DATABASE}"

    # --- lifecycle ------------------------------------------------------------------------

    def create(self) -> PrivateCluster:
        """initdb, start, create and migrate the database."""
        self.run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        )
        settings = {
            **SERVER_SETTINGS,
            "port": str(self.port),
            "unix_socket_directories": f"'{self.root}'",
        }
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.writelines(f"{name} = {value}\n" for name, value in settings.items())
        self.start()
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DATABASE}")
        with psycopg.connect(self.url, autocommit=True) as conn:
            migrations.migrate(conn)
        return self

    def start(self) -> None:
        """Start the server and wait until it accepts connections (after any crash recovery)."""
        self.run(
            "pg_ctl",
            "-D",
            str(self.data),
            "-l",
            str(self.log_path),
            "-w",
            "-t",
            str(START_TIMEOUT),
            "start",
        )
        self.starts += 1

    def stop(self, *, immediate: bool = True) -> None:
        """``pg_ctl stop -m immediate`` (a crash: no checkpoint) or ``-m fast``."""
        mode = "immediate" if immediate else "fast"
        self.run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "stop")
        if immediate:
            self.crashes += 1

    def restart(self, *, down_for: float = 0.0) -> None:
        """Crash the server, stay down ``down_for`` seconds, start it again."""
        self.stop(immediate=True)
        time.sleep(down_for)
        self.start()

    def running(self) -> bool:
        done = self.run("pg_ctl", "-D", str(self.data), "status", check=False)
        return done.returncode == 0

    def destroy(self) -> None:
        """Stop the server if it runs and remove every file; never raises."""
        with suppress(Exception):
            if self.data.exists() and self.running():
                self.run(
                    "pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False
                )
        shutil.rmtree(self.root, ignore_errors=True)

    def server_log(self) -> str:
        """The server's log, for a failing test's message."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # --- helpers --------------------------------------------------------------------------

    def run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [str(self.bindir / program), *args]
        if self._as_root:
            command = _as_user(OS_USER_WHEN_ROOT, command)
        done = subprocess.run(
            command,
            cwd=self.root,
            capture_output=True,
            text=True,
            check=False,
            timeout=START_TIMEOUT + 30,
        )
        if check and done.returncode != 0:
            raise RuntimeError(
                f"{program} failed ({done.returncode}): {done.stderr.strip()}\n"
                f"--- server log ---\n{self.server_log()[-4000:]}"
            )
        return done


def _as_user(user: str, command: list[str]) -> list[str]:
    """``command`` run as ``user``: util-linux's runuser, else su (a busybox or BSD system)."""
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--", *command]
    return ["su", "-s", "/bin/sh", user, "-c", shlex.join(command)]


@contextmanager
def private_cluster() -> Iterator[PrivateCluster]:
    """A created, migrated, running cluster; stopped and removed on exit, failure included."""
    cluster = PrivateCluster()
    try:
        yield cluster.create()
    finally:
        cluster.destroy()

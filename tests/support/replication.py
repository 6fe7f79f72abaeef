"""A primary and a streaming standby of it, private to one test or bench, for failover.

The standby is a ``pg_basebackup -R`` copy of the primary that streams from it, optionally through
a :class:`TcpProxy` with latency (a standby in another zone). ``synchronous=True`` names it in
the primary's ``synchronous_standby_names`` once it streams, so every commit on the primary waits
for the standby's flush. That setting is made after the base backup, so the standby, once
promoted, does not wait for a standby of its own that does not exist.

Failover, as Patroni or an operator does it: ``kill_primary()`` (``pg_ctl stop -m immediate``, a
crash) then ``promote()`` (``pg_ctl promote``), and clients that list both hosts with
``target_session_attrs=read-write`` find the new primary by themselves (:attr:`url`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Final

import psycopg

from tests.support.cluster import DATABASE, START_TIMEOUT, PrivateCluster
from tests.support.tcp_proxy import TcpProxy

STANDBY_NAME: Final = "outbox_standby"
STREAM_TIMEOUT: Final = 30.0  # seconds for the standby to connect and stream


class ReplicatedPair:
    def __init__(self, *, synchronous: bool, delay: float = 0.0) -> None:
        self.synchronous = synchronous
        self.delay = delay
        self.primary = PrivateCluster()
        self.standby = PrivateCluster(self.primary.bindir)
        self._link: TcpProxy | None = None

    @property
    def url(self) -> str:
        """Both hosts, the writable one chosen at each connect: what producers and dispatchers
        use. A short connect_timeout, so a dead host costs seconds, not the OS's minutes."""
        return (
            f"postgresql://postgres@127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
            f"/{DATABASE}?target_session_attrs=read-write&connect_timeout=2"
        )

    def create(self) -> ReplicatedPair:
        self.primary.create()
        self._link = TcpProxy(self.primary.admin_url, delay=self.delay).start()
        self.standby.root.mkdir(exist_ok=True)
        self.standby.run(
            "pg_basebackup",
            "-D",
            str(self.standby.data),
            "-h",
            "127.0.0.1",
            "-p",
            str(self.primary.port),
            "-U",
            "postgres",
            "-X",
            "stream",
            "--checkpoint=fast",
            "--no-sync",
        )
        with (self.standby.data / "postgresql.conf").open("a") as conf:
            conf.write(f"port = {self.standby.port}\n")
            conf.write(f"unix_socket_directories = '{self.standby.root}'\n")
            conf.write("wal_retrieve_retry_interval = '100ms'\n")
        # Last line wins: replaces the primary_conninfo that -R wrote, to go through the link.
        with (self.standby.data / "postgresql.auto.conf").open("a") as auto:
            auto.write(
                f"primary_conninfo = 'host=127.0.0.1 port={self._link.port} user=postgres "
                f"application_name={STANDBY_NAME}'\n"
            )
        (self.standby.data / "standby.signal").touch()
        self.standby.start()
        self._wait_streaming()
        if self.synchronous:
            with psycopg.connect(self.primary.admin_url, autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'")
                conn.execute("SELECT pg_reload_conf()")
            self._wait_streaming(state="sync")
        return self

    def pause_replication(self) -> None:
        """The standby hears nothing more from the primary (a partition between them); with
        asynchronous replication the primary goes on committing what the standby will lack."""
        if self._link is not None:
            self._link.deafen()

    def set_on_standby(self, name: str, value: str) -> None:
        """A setting of the standby's, applied by a reload (``recovery_min_apply_delay``)."""
        with (self.standby.data / "postgresql.conf").open("a") as conf:
            conf.write(f"{name} = '{value}'\n")
        self.standby.run("pg_ctl", "-D", str(self.standby.data), "reload")

    def resume_replication(self) -> None:
        """Relay again after pause_replication(): the standby reconnects (within 100 ms, its
        wal_retrieve_retry_interval here) and catches up."""
        if self._link is not None:
            self._link.heal()

    def kill_primary(self) -> None:
        """Crash the primary, and drop the WAL still on its way to the standby: what a crash
        in another zone loses under asynchronous replication (the relay would deliver it)."""
        if self._link is not None:
            self._link.cut()
        self.primary.stop(immediate=True)

    def promote(self) -> None:
        self.standby.run(
            "pg_ctl", "-D", str(self.standby.data), "-w", "-t", str(START_TIMEOUT), "promote"
        )

    def destroy(self) -> None:
        if self._link is not None:
            self._link.cut()
        self.standby.destroy()
        self.primary.destroy()

    def _wait_streaming(self, state: str | None = None) -> None:
        deadline = time.monotonic() + STREAM_TIMEOUT
        query = "SELECT sync_state FROM pg_stat_replication WHERE application_name = %s"
        while time.monotonic() < deadline:
            with psycopg.connect(self.primary.admin_url, autocommit=True) as conn:
                row = conn.execute(query, (STANDBY_NAME,)).fetchone()
            if row is not None and (state is None or row[0] == state):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"the standby did not stream{f' as {state}' if state else ''} within "
            f"{STREAM_TIMEOUT:.0f} s\n--- standby log ---\n{self.standby.server_log()[-4000:]}"
        )


@contextmanager
def replicated_pair(*, synchronous: bool, delay: float = 0.0) -> Iterator[ReplicatedPair]:
    """A running primary and standby; both stopped and removed on exit, failure included."""
    pair = ReplicatedPair(synchronous=synchronous, delay=delay)
    try:
        yield pair.create()
    finally:
        with suppress(Exception):
            pair.destroy()

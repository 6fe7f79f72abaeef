"""A TCP proxy in front of PostgreSQL that a test can cut and heal (psycopg's test suite has one
like it): real connection failures for the dispatcher, while the server itself keeps running for
every other test. With ``delay`` it is also a slow network: each chunk is relayed that many
seconds after it arrived, each way (a standby in another zone, for synchronous replication)."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time
from typing import Self

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class TcpProxy:
    """Listens on 127.0.0.1 and relays each connection to the server of ``dsn``."""

    def __init__(self, dsn: str, *, delay: float = 0.0) -> None:
        self.delay = delay
        params = conninfo_to_dict(dsn)
        host = str(params.get("host") or "127.0.0.1")
        port = int(params.get("port") or 5432)
        # pgserver's throwaway server listens on a unix socket in its data directory.
        self._target: str | tuple[str, int] = (
            f"{host}/.s.PGSQL.{port}" if host.startswith("/") else (host, port)
        )
        self._dsn = dsn
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        # Relaying stops per direction while muted: "up" is client to server, "down" the reverse.
        self._muted = {"up": threading.Event(), "down": threading.Event()}
        self.port = 0

    @property
    def dsn(self) -> str:
        """The connection string that goes through the proxy."""
        return make_conninfo(self._dsn, host="127.0.0.1", port=str(self.port))

    def start(self) -> Self:
        listener = socket.create_server(("127.0.0.1", self.port))
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def cut(self) -> None:
        """Stop listening and drop every relayed connection."""
        with self._lock:
            listener, self._listener = self._listener, None
            doomed = list(self._sockets)
            self._sockets.clear()
        if listener is not None:
            # Wakes the accept thread (close alone would not), so the port is free to listen on.
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def heal(self) -> None:
        """Listen again, on the same port; relay again; drop the connections made while deaf."""
        if any(muted.is_set() for muted in self._muted.values()):
            for muted in self._muted.values():
                muted.clear()
            self.cut()
        self.start()

    def deafen(self) -> None:
        """Keep every connection open and accept new ones, but relay nothing, either way: a
        peer that went silent (the kernel still acknowledges, so only timeouts notice)."""
        self.mute("up")
        self.mute("down")

    def mute(self, direction: str) -> None:
        """Stop relaying ``"up"`` (to the server) or ``"down"`` (its answers), silently."""
        self._muted[direction].set()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.cut()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            family = socket.AF_UNIX if isinstance(self._target, str) else socket.AF_INET
            server = socket.socket(family, socket.SOCK_STREAM)
            try:
                server.connect(self._target)
            except OSError:
                client.close()
                server.close()
                continue
            if self.delay > 0 and family == socket.AF_INET:
                # Latency only: without this, Nagle and delayed ACKs add 40 ms of their own.
                for sock in (client, server):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                live = self._listener is listener
                if live:
                    self._sockets.update((client, server))
            if not live:
                # Cut while this one was connecting: cut() no longer knows these two sockets, so
                # close them here, or they leak (pytest fails the test on the ResourceWarning).
                client.close()
                server.close()
                return
            for a, b, direction in ((client, server, "up"), (server, client, "down")):
                args = (a, b, self._muted[direction])
                threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, muted: threading.Event) -> None:
        if self.delay > 0:
            self._pipe_late(source, sink, muted)
            return
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not muted.is_set():
                    sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def _pipe_late(
        self, source: socket.socket, sink: socket.socket, muted: threading.Event
    ) -> None:
        """Latency, not a narrow pipe: chunks queue with their due time, so they overlap in
        flight as on a long link, and arrive in order."""
        due: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def send() -> None:
            with contextlib.suppress(OSError):
                while (item := due.get())[1]:
                    time.sleep(max(0.0, item[0] - time.monotonic()))
                    sink.sendall(item[1])
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

        threading.Thread(target=send, daemon=True).start()
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if not muted.is_set():
                    due.put((time.monotonic() + self.delay, data))
        due.put((time.monotonic() + self.delay, b""))

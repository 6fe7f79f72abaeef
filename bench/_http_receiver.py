"""A fast loopback HTTP/1.1 receiver for the HTTP benchmarks, run in a process of its own.

The fake webhook receiver of the tests (a ThreadingHTTPServer with a ledger under one lock) is
built for faithful idempotency semantics, not speed: a throughput benchmark against it measures
the fake. This one parses just enough HTTP/1.1 (request line, Content-Length, keep-alive; no
chunked bodies) on one asyncio event loop and answers ``200 {}`` at once, or after ``--hold``
seconds (the memory benchmark's slow provider). It timestamps every request's arrival with
``time.monotonic()`` (CLOCK_MONOTONIC, system-wide on Linux, so comparable with the producer's
clock in another process) under its ``Outbox-Operation-Id`` header, when ``--stamp`` is given.

``GET /_stats`` answers its counters (and the stamps) as JSON; SIGTERM stops it.

Run by :class:`ReceiverProcess`; by hand: ``python bench/_http_receiver.py [--hold S] [--stamp]``
prints ``PORT <n>`` and serves until stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

HOST = "127.0.0.1"
# Dispatchers open dozens or hundreds of connections at once: a short backlog drops SYNs, and
# each dropped SYN costs a one-second retransmit.
BACKLOG = 4096
_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_HEAD_END = b"\r\n\r\n"


class Stats:
    """What the receiver saw; read through GET /_stats."""

    def __init__(self, stamp: bool) -> None:
        self.stamp = stamp
        self.requests = 0
        self.open_connections = 0
        self.max_open_connections = 0
        self.connections_accepted = 0
        self.holding = 0
        self.max_holding = 0
        self.first_at: float | None = None
        self.last_at: float | None = None
        self.arrivals: dict[str, float] = {}

    def as_json(self) -> bytes:
        return json.dumps(
            {
                "requests": self.requests,
                "max_open_connections": self.max_open_connections,
                "connections_accepted": self.connections_accepted,
                "max_holding": self.max_holding,
                "first_at": self.first_at,
                "last_at": self.last_at,
                "arrivals": self.arrivals if self.stamp else {},
            }
        ).encode()


class _Connection(asyncio.Protocol):
    def __init__(self, stats: Stats, hold: float) -> None:
        self._stats = stats
        self._hold = hold
        self._buf = bytearray()
        self._arrived = 0.0
        self._transport: asyncio.Transport | None = None
        self._close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stats = self._stats
        stats.connections_accepted += 1
        stats.open_connections += 1
        stats.max_open_connections = max(stats.max_open_connections, stats.open_connections)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stats.open_connections -= 1
        self._transport = None

    def data_received(self, data: bytes) -> None:
        if not self._buf:
            self._arrived = time.monotonic()  # the first bytes of a request
        self._buf += data
        while self._buf:
            end = self._buf.find(_HEAD_END)
            if end < 0:
                return
            length, op_id, close = _parse_head(bytes(self._buf[:end]))
            total = end + len(_HEAD_END) + length
            if len(self._buf) < total:
                return
            request_line = bytes(self._buf[: self._buf.find(b"\r\n")])
            del self._buf[:total]
            self._close_after = close
            self._handle(request_line, op_id, self._arrived)
            self._arrived = time.monotonic()

    def _handle(self, request_line: bytes, op_id: str | None, arrived: float) -> None:
        if request_line.startswith(b"GET /_stats"):
            body = self._stats.as_json()
            head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            self._write(head + str(len(body)).encode() + _HEAD_END + body)
            return
        stats = self._stats
        stats.requests += 1
        if stats.first_at is None:
            stats.first_at = arrived
        stats.last_at = arrived
        if stats.stamp and op_id is not None:
            stats.arrivals[op_id] = arrived
        if self._hold > 0:
            stats.holding += 1
            stats.max_holding = max(stats.max_holding, stats.holding)
            asyncio.get_running_loop().call_later(self._hold, self._release)
        else:
            self._write(_OK)

    def _release(self) -> None:
        self._stats.holding -= 1
        self._write(_OK)

    def _write(self, data: bytes) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)
            if self._close_after:
                self._transport.close()


def _parse_head(head: bytes) -> tuple[int, str | None, bool]:
    """Content-Length, the Outbox-Operation-Id header and whether to close after answering."""
    length = 0
    op_id: str | None = None
    close = False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value)
        elif lname == b"outbox-operation-id":
            op_id = value.strip().decode()
        elif lname == b"connection":
            close = value.strip().lower() == b"close"
    return length, op_id, close


async def serve(port: int, hold: float, stamp: bool) -> None:
    """Serve until SIGTERM or SIGINT; prints ``PORT <n>`` once listening."""
    loop = asyncio.get_running_loop()
    stats = Stats(stamp)
    server = await loop.create_server(
        lambda: _Connection(stats, hold), HOST, port, backlog=BACKLOG, reuse_address=True
    )
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    bound = server.sockets[0].getsockname()[1]
    print(f"PORT {bound}", flush=True)
    async with server:
        await stop.wait()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time a process has used so far (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ReceiverProcess:
    """The receiver in a subprocess of its own (its own core, its own GIL)."""

    def __init__(self, *, hold: float = 0.0, stamp: bool = False) -> None:
        args = [sys.executable, str(Path(__file__).resolve()), "--hold", str(hold)]
        if stamp:
            args.append("--stamp")
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)  # noqa: S603
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.stop()
            raise RuntimeError(f"the receiver did not start: {line!r}")
        self.port = int(line.split()[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}/hook"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> dict[str, Any]:
        """The receiver's counters (and arrival stamps, with ``stamp``)."""
        response = httpx.get(f"http://{HOST}:{self.port}/_stats", timeout=30)
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--hold", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--stamp", action="store_true", help="keep arrival times per operation")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.port, args.hold, args.stamp))


if __name__ == "__main__":
    main()

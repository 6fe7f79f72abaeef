"""A fake webhook provider: a real HTTP server on loopback that honours ``Idempotency-Key``.

It behaves like a careful provider following the IETF draft "The Idempotency-Key HTTP Header
Field": the first request with a key applies one business effect and saves its response; a
retry with the same body gets that response replayed (``Idempotent-Replayed: true``); a retry
with another body gets 422; a retry while the first is still being processed gets 409; keys
are forgotten ``key_retention`` seconds after their first request.

The receiver runs inside the pytest process, so its ledger of effects outlives a dispatcher
subprocess that a test SIGKILLs. Faults (delays, 5xx, connection resets, refused connections)
and holds let tests put the dispatcher in every awkward spot between "the provider applied the
effect" and "the dispatcher recorded it".
"""

from __future__ import annotations

import enum
import json
import re
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import urlsplit

HOST = "127.0.0.1"
# serve_forever checks for shutdown this often: refuse_connections() and stop() wait up to it.
_POLL_INTERVAL = 0.02
# How long stop() and refuse_connections() wait for handler threads to let go of connections.
_DRAIN_TIMEOUT = 5.0
_REPLAYED_HEADER = ("Idempotent-Replayed", "true")
_MAX_LINE = 65537


@dataclass(frozen=True)
class Effect:
    """One business effect the receiver applied (what outbox must never do twice per key).

    ``key`` is unquoted; header names are lower-case; ``at`` is ``time.monotonic()``.
    """

    effect_id: str
    key: str
    body: Any
    headers: dict[str, str]
    at: float


@dataclass(frozen=True)
class Received:
    """One request that arrived, whatever became of it.

    ``body`` is the parsed JSON (None for an empty body; the raw text when it is not JSON).
    ``status`` is None while the request is still being processed (held, delayed) and stays
    None when the connection was reset instead of answered. Header names are lower-case.
    """

    key: str | None
    body: Any
    headers: dict[str, str]
    status: int | None
    replayed: bool
    at: float


class FaultKind(enum.Enum):
    """Where a fault strikes: before the ledger is consulted, or after the effect is applied."""

    STATUS_BEFORE_APPLY = "status_before_apply"
    RESET_BEFORE_APPLY = "reset_before_apply"
    DELAY_AFTER_APPLY = "delay_after_apply"
    ERROR_500_AFTER_APPLY = "error_500_after_apply"
    RESET_AFTER_APPLY = "reset_after_apply"


_BEFORE_APPLY = frozenset({FaultKind.STATUS_BEFORE_APPLY, FaultKind.RESET_BEFORE_APPLY})


@dataclass(frozen=True)
class Fault:
    """A misbehaviour to inject; build one with the class methods, e.g. ``Fault.status(503)``.

    Before-apply faults hit any request carrying a key (a replay too): nothing is applied or
    saved. After-apply faults hit only a request that applies a new effect.
    """

    kind: FaultKind
    seconds: float = 0.0
    code: int = 500
    retry_after: int | None = None

    @classmethod
    def status(cls, code: int, retry_after: int | None = None) -> Fault:
        """Answer ``code`` without applying or saving; ``Retry-After: <seconds>`` when given."""
        if not 200 <= code <= 599:
            raise ValueError(f"status {code} is not a final HTTP status")
        return cls(FaultKind.STATUS_BEFORE_APPLY, code=code, retry_after=retry_after)

    @classmethod
    def error_500_before_apply(cls) -> Fault:
        """Answer 500 without applying or saving anything."""
        return cls.status(500)

    @classmethod
    def reset_before_apply(cls) -> Fault:
        """Reset the TCP connection without answering and without applying."""
        return cls(FaultKind.RESET_BEFORE_APPLY)

    @classmethod
    def delay_after_apply(cls, seconds: float) -> Fault:
        """Apply and save, then wait ``seconds`` before answering (the key stays in progress)."""
        return cls(FaultKind.DELAY_AFTER_APPLY, seconds=seconds)

    @classmethod
    def error_500_after_apply(cls) -> Fault:
        """Apply, save a 500 as the response and answer it (replays repeat the 500)."""
        return cls(FaultKind.ERROR_500_AFTER_APPLY)

    @classmethod
    def reset_after_apply(cls) -> Fault:
        """Apply and save the normal 201, then reset the connection without answering."""
        return cls(FaultKind.RESET_AFTER_APPLY)

    @property
    def before_apply(self) -> bool:
        """Whether the fault strikes before the idempotency ledger is consulted."""
        return self.kind in _BEFORE_APPLY


class Hold:
    """A pause between "effect applied and response saved" and "response sent".

    The next request with ``key`` that applies its effect sets ``arrived`` and then waits
    until ``release()`` is called or the receiver stops. As a context manager it releases on
    exit, so a failing test cannot leave a handler thread waiting.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.arrived = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        """Let the held request answer."""
        self._released.set()

    @property
    def released(self) -> bool:
        """Whether ``release()`` was called (or the receiver stopped)."""
        return self._released.is_set()

    def wait_released(self) -> None:
        """Block until released (called by the handler thread)."""
        self._released.wait()

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


def parse_idempotency_key(value: str | None) -> str | None:
    """The key in an ``Idempotency-Key`` header value, or None when absent or empty.

    The draft makes the value an RFC 8941 string (``"abc"``, with ``\\"`` and ``\\\\``
    escapes); bare values are accepted too, as many clients send them.
    """
    if value is None:
        return None
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r'\\(["\\])', r"\1", value[1:-1])
    return value or None


@dataclass(frozen=True)
class _Reply:
    status: int
    body: Any
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def replayed(self) -> bool:
        return _REPLAYED_HEADER in self.headers

    def as_replay(self) -> _Reply:
        return replace(self, headers=(*self.headers, _REPLAYED_HEADER))


def _error(status: int, message: str) -> _Reply:
    return _Reply(status, {"error": message})


@dataclass
class _Entry:
    """What the ledger remembers about one key."""

    body: Any
    reply: _Reply
    expires_at: float
    in_progress: bool = True

    def live(self, now: float) -> bool:
        # A key being processed is a lock: expiry (or forget_keys) takes effect once it is done.
        return self.in_progress or now < self.expires_at


@dataclass
class _Armed:
    fault: Fault
    key: str | None
    remaining: int


@dataclass(frozen=True)
class _Plan:
    """What a handler does with an admitted request; ``reply`` None means reset the connection."""

    reply: _Reply | None
    entry: _Entry | None = None  # set when this request applied the effect: it must complete it
    hold: Hold | None = None
    delay: float = 0.0


class _Ledger:
    """The provider's state: keys, effects, requests, armed faults and holds, under one lock."""

    def __init__(self, key_retention: float) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.stopping = threading.Event()
        self._retention = key_retention
        self._entries: dict[str, _Entry] = {}
        self._effects: list[Effect] = []
        self._received: list[Received] = []
        self._faults: list[_Armed] = []
        self._holds: dict[str, Hold] = {}
        self._all_holds: list[Hold] = []
        self._in_flight = 0

    # --- requests -------------------------------------------------------------------------

    def arrive(self, key: str | None, body: Any, headers: dict[str, str]) -> int:
        """Record a request as it arrives; the index lets ``answered`` fill in its outcome."""
        with self.cond:
            self._received.append(Received(key, body, headers, None, False, time.monotonic()))
            self._in_flight += 1
            return len(self._received) - 1

    def answered(self, index: int, reply: _Reply | None) -> None:
        """Record how request ``index`` ended (``reply`` None: reset or no answer)."""
        with self.cond:
            status = reply.status if reply else None
            replayed = reply.replayed if reply else False
            self._received[index] = replace(self._received[index], status=status, replayed=replayed)

    def finished(self) -> None:
        """A request's answer is out (or its connection reset): it no longer counts as busy."""
        with self.cond:
            self._in_flight -= 1
            self.cond.notify_all()

    def admit(self, key: str, body: Any, headers: dict[str, str]) -> _Plan:
        """Decide a valid request's fate, applying its effect if the key is new."""
        with self.cond:
            fault = self._take_fault(key, before_apply=True)
            if fault is not None:
                return _Plan(_before_apply_reply(fault))
            now = time.monotonic()
            entry = self._entries.get(key)
            if entry is not None and entry.live(now):
                return _Plan(_existing_reply(entry, body))
            return self._apply(key, body, headers, now)

    def complete(self, entry: _Entry) -> None:
        """End an entry's in-progress state: later requests get replays, not 409s."""
        with self.cond:
            entry.in_progress = False
            self.cond.notify_all()

    def _apply(self, key: str, body: Any, headers: dict[str, str], now: float) -> _Plan:
        fault = self._take_fault(key, before_apply=False)
        effect = Effect(f"wh_{len(self._effects) + 1}", key, body, headers, now)
        self._effects.append(effect)
        if fault is not None and fault.kind is FaultKind.ERROR_500_AFTER_APPLY:
            saved = _error(500, "injected 500 after apply")
        else:
            saved = _Reply(201, {"id": effect.effect_id, "key": key})
        entry = _Entry(body, saved, now + self._retention)
        self._entries[key] = entry
        self.cond.notify_all()
        reset = fault is not None and fault.kind is FaultKind.RESET_AFTER_APPLY
        delay = fault.seconds if fault is not None else 0.0
        return _Plan(None if reset else saved, entry, self._holds.pop(key, None), delay)

    def _take_fault(self, key: str, *, before_apply: bool) -> Fault | None:
        for armed in self._faults:
            if armed.fault.before_apply == before_apply and armed.key in (None, key):
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._faults.remove(armed)
                return armed.fault
        return None

    # --- test controls --------------------------------------------------------------------

    def inject(self, fault: Fault, key: str | None, times: int) -> None:
        """Arm ``fault`` for the next ``times`` matching requests."""
        if times < 1:
            raise ValueError("times must be at least 1")
        with self.cond:
            self._faults.append(_Armed(fault, key, times))

    def hold(self, key: str) -> Hold:
        """Arm a hold for the next request with ``key`` that applies its effect."""
        with self.cond:
            if key in self._holds:
                raise ValueError(f"a hold for {key!r} is already pending")
            held = self._holds[key] = Hold(key)
            self._all_holds.append(held)
            if self.stopping.is_set():
                held.release()
            return held

    def forget_keys(self) -> None:
        """Expire every key now (keys still in progress expire when they complete)."""
        with self.cond:
            for entry in self._entries.values():
                entry.expires_at = float("-inf")

    def stop(self) -> None:
        """Wake every held or delayed request so it answers now."""
        with self.cond:
            self.stopping.set()
            for held in self._all_holds:
                held.release()

    # --- reads ----------------------------------------------------------------------------

    def effects(self) -> list[Effect]:
        with self.cond:
            return list(self._effects)

    def received(self) -> list[Received]:
        with self.cond:
            return list(self._received)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate`` (evaluated under the lock) holds, or raise TimeoutError."""
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise TimeoutError(f"fake webhook: {what} not reached within {timeout}s")

    def idle(self) -> bool:
        """Whether no request is being processed (call with the lock held)."""
        return self._in_flight == 0

    def effect_total(self) -> int:
        """The number of effects (call with the lock held)."""
        return len(self._effects)


def _before_apply_reply(fault: Fault) -> _Reply | None:
    if fault.kind is FaultKind.RESET_BEFORE_APPLY:
        return None
    headers = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
    return _Reply(fault.code, {"error": f"injected {fault.code}"}, headers)


def _existing_reply(entry: _Entry, body: Any) -> _Reply:
    if entry.in_progress:
        return _error(409, "in progress")
    if entry.body != body:
        return _error(422, "idempotency key reused with another body")
    return entry.reply.as_replay()


class _Connections:
    """Open client connections, so the listener's end can also end keep-alive connections.

    Shares the ledger's lock. A socket leaves this registry before its descriptor is closed,
    so ``drop`` never shuts down a descriptor number the kernel has handed to someone else.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._busy: dict[socket.socket, bool] = {}
        self.accepted = 0

    def add(self, sock: socket.socket) -> None:
        with self._cond:
            self._busy[sock] = False
            self.accepted += 1

    def discard(self, sock: socket.socket) -> None:
        with self._cond:
            self._busy.pop(sock, None)
            self._cond.notify_all()

    @contextmanager
    def busy(self, sock: socket.socket) -> Iterator[None]:
        """Mark ``sock`` as serving a request, so ``drop(idle_only=True)`` leaves it alone."""
        self._mark(sock, busy=True)
        try:
            yield
        finally:
            self._mark(sock, busy=False)

    def _mark(self, sock: socket.socket, *, busy: bool) -> None:
        with self._cond:
            if sock in self._busy:
                self._busy[sock] = busy

    def drop(self, *, idle_only: bool) -> None:
        """Shut connections down (their handlers see EOF and exit) and wait until they close."""
        with self._cond:
            doomed = [s for s, busy in self._busy.items() if not (idle_only and busy)]
            for sock in doomed:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._cond.wait_for(lambda: not any(s in self._busy for s in doomed), _DRAIN_TIMEOUT)


class _Server(ThreadingHTTPServer):
    """The listener; a fresh one is made each time the receiver (re)starts listening."""

    daemon_threads = True  # a handler stuck on a dead client must never keep pytest alive
    allow_reuse_address = True  # rebind our port while old connections sit in TIME_WAIT
    # Dispatchers open dozens of connections at once; the default backlog of 5 drops their SYNs
    # and each dropped one costs a second-long retransmit.
    request_queue_size = 1024

    def __init__(
        self, port: int, ledger: _Ledger, connections: _Connections, hook_path: str
    ) -> None:
        self.ledger = ledger
        self.connections = connections
        self.hook_path = hook_path
        super().__init__((HOST, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, a DNS lookup that can stall.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = HOST, int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)  # before the descriptor closes: see _Connections
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up mid-answer is routine here (timeouts, resets); anything else is a
        # bug in this fake, so let socketserver print it.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """Serves one connection; keep-alive, so possibly many requests."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: Nagle would hold the second for the client's ACK.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: test output is for the tests."""

    def do_POST(self) -> None:
        """Serve a webhook delivery."""
        self._serve(self._decide)

    def do_GET(self) -> None:
        """Only POST is a delivery; other methods get 405 (and are still recorded)."""
        self._serve(lambda key, body, headers: _error(405, "method not allowed"))

    do_PUT = do_PATCH = do_DELETE = do_GET  # noqa: N815 (the names http.server dispatches to)

    def _serve(self, decide: Callable[[str | None, Any, dict[str, str]], _Reply | None]) -> None:
        # The body is read first, whatever happens next, so a keep-alive connection stays usable.
        raw = self._read_body()
        if raw is None:
            self.close_connection = True
            return
        key = parse_idempotency_key(self.headers.get("Idempotency-Key"))
        body = _parse_json(raw)
        headers = {name.lower(): str(value) for name, value in self.headers.items()}
        ledger = self.server.ledger
        with self.server.connections.busy(self.connection):
            recorded = body.text if isinstance(body, _InvalidJson) else body
            index = ledger.arrive(key, recorded, headers)
            try:
                self._answer(index, decide(key, body, headers))
            finally:
                ledger.finished()

    def _answer(self, index: int, reply: _Reply | None) -> None:
        # Recorded before the client can see the outcome, so a test that has its answer (or
        # its reset) also finds it in `received`.
        self.server.ledger.answered(index, reply)
        if reply is None:
            self._reset()
        else:
            self._send(reply)

    def _decide(self, key: str | None, body: Any, headers: dict[str, str]) -> _Reply | None:
        """The answer to a delivery (None: reset), after any hold or delay it must sit out."""
        rejection = self._validate(key, body)
        if rejection is not None:
            return rejection
        assert key is not None  # _validate rejected the request otherwise
        plan = self.server.ledger.admit(key, body, headers)
        self._sit_out(plan)
        return plan.reply

    def _validate(self, key: str | None, body: Any) -> _Reply | None:
        if urlsplit(self.path).path != self.server.hook_path:
            return _error(404, "not found")
        if key is None:
            return _error(400, "missing Idempotency-Key header")
        if isinstance(body, _InvalidJson):
            return _error(400, "body is not JSON")
        return None

    def _sit_out(self, plan: _Plan) -> None:
        """Wait out the plan's hold and delay, then end its key's in-progress state."""
        ledger = self.server.ledger
        try:
            if plan.hold is not None:
                plan.hold.arrived.set()
                plan.hold.wait_released()
            if plan.delay:
                ledger.stopping.wait(plan.delay)
        finally:
            # Completed before answering: a client that got the answer and retries at once
            # must see a replay, not a 409.
            if plan.entry is not None:
                ledger.complete(plan.entry)

    def _send(self, reply: _Reply) -> None:
        data = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # The client gave up (its timeout fired during a delay): the answer stands anyway.
            self.close_connection = True

    def _reset(self) -> None:
        """Close with SO_LINGER 0, so the kernel sends RST instead of FIN."""
        self.close_connection = True
        self.server.connections.discard(self.connection)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The descriptor really closes when finish() closes rfile; socketserver's later
        # shutdown(SHUT_WR) then fails quietly on the closed socket, so no FIN precedes the RST.
        self.connection.close()

    def _read_body(self) -> bytes | None:
        """The whole request body, or None when it cannot be read (the connection must close)."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        raw = self.rfile.read(length) if length > 0 else b""
        return raw if len(raw) == length else None

    def _read_chunked(self) -> bytes | None:
        chunks: list[bytes] = []
        while True:
            try:
                size = int(self.rfile.readline(_MAX_LINE).split(b";")[0], 16)
            except ValueError:
                return None
            if size == 0:
                break
            chunk = self.rfile.read(size + 2)  # the data and its CRLF
            if len(chunk) != size + 2:
                return None
            chunks.append(chunk[:size])
        while self.rfile.readline(_MAX_LINE) not in (b"\r\n", b"\n", b""):
            pass  # trailer fields: nothing here needs them
        return b"".join(chunks)


@dataclass(frozen=True)
class _InvalidJson:
    text: str


def _parse_json(raw: bytes) -> Any:
    """The parsed body (None when empty), or _InvalidJson carrying the raw text."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return _InvalidJson(raw.decode("utf-8", "replace"))


class FakeWebhookReceiver:
    """A loopback webhook provider that applies each idempotency key's effect once.

    Use as a context manager (or ``start()``/``stop()``); ``url`` is valid once started.
    Lifecycle calls (start, stop, refuse/accept_connections) belong to the test's thread;
    everything else is thread-safe.
    """

    def __init__(self, *, key_retention: float = 86400.0, path: str = "/hook") -> None:
        if not path.startswith("/"):
            raise ValueError("path must start with '/'")
        if key_retention < 0:
            raise ValueError("key_retention must not be negative")
        self.path = path
        self._ledger = _Ledger(key_retention)
        self._connections = _Connections(self._ledger.cond)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeWebhookReceiver:
        """Listen on an ephemeral loopback port."""
        if self._port is not None:
            raise RuntimeError("the receiver was already started")
        self._listen(0)
        return self

    def stop(self) -> None:
        """Release holds, cut delays short, stop listening and close every connection."""
        self._ledger.stop()
        self._unlisten()
        # Released requests answer before their connections are shut down.
        with suppress(TimeoutError):
            self._ledger.wait_for(self._ledger.idle, _DRAIN_TIMEOUT, "idle")
        self._connections.drop(idle_only=False)

    def __enter__(self) -> FakeWebhookReceiver:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def refuse_connections(self) -> None:
        """Stop listening: new connections get ECONNREFUSED.

        Idle keep-alive connections are closed too (a client's pooled connection would
        otherwise still reach us); requests being processed finish normally.
        """
        self._require_started()
        self._unlisten()
        self._connections.drop(idle_only=True)

    def accept_connections(self) -> None:
        """Listen again, on the same port as before."""
        port = self._require_started()
        if self._ledger.stopping.is_set():
            raise RuntimeError("the receiver was stopped")
        if self._server is None:
            self._listen(port)

    @property
    def port(self) -> int:
        """The loopback port (the same across refuse/accept_connections)."""
        return self._require_started()

    @property
    def url(self) -> str:
        """Where to POST deliveries: ``http://127.0.0.1:<port><path>``."""
        return f"http://{HOST}:{self.port}{self.path}"

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted right now."""
        return self._server is not None

    def _listen(self, port: int) -> None:
        server = _Server(port, self._ledger, self._connections, self.path)
        self._port = int(server.server_address[1])
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": _POLL_INTERVAL},
            name=f"fake-webhook:{self._port}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread

    def _unlisten(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()
        self._server = self._thread = None

    def _require_started(self) -> int:
        if self._port is None:
            raise RuntimeError("the receiver has not been started")
        return self._port

    # --- what happened --------------------------------------------------------------------

    @property
    def effects(self) -> list[Effect]:
        """A snapshot of the effects applied, in order."""
        return self._ledger.effects()

    @property
    def received(self) -> list[Received]:
        """A snapshot of every request that arrived, in order of arrival."""
        return self._ledger.received()

    @property
    def connections_accepted(self) -> int:
        """How many TCP connections were accepted (keep-alive reuses one for many requests)."""
        with self._ledger.cond:
            return self._connections.accepted

    def effect_count(self, key: str | None = None) -> int:
        """The number of effects applied, for ``key`` or in all."""
        return len(self.effects if key is None else self.effects_for(key))

    def effects_for(self, key: str) -> list[Effect]:
        """The effects applied for ``key``, in order."""
        return [e for e in self.effects if e.key == key]

    def received_for(self, key: str) -> list[Received]:
        """The requests that carried ``key``, in order of arrival."""
        return [r for r in self.received if r.key == key]

    def wait_for_effects(self, count: int, timeout: float = 5.0) -> list[Effect]:
        """Wait until at least ``count`` effects exist; raise TimeoutError otherwise."""
        ledger = self._ledger
        ledger.wait_for(lambda: ledger.effect_total() >= count, timeout, f"{count} effects")
        return self.effects

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request that has arrived is still being processed."""
        self._ledger.wait_for(self._ledger.idle, timeout, "idle")

    # --- misbehaviour ---------------------------------------------------------------------

    def inject(self, fault: Fault, *, key: str | None = None, times: int = 1) -> None:
        """Arm ``fault`` for the next ``times`` matching requests (``key`` None: any key).

        Faults strike in the order they were injected, one per request.
        """
        self._ledger.inject(fault, key, times)

    def hold(self, key: str) -> Hold:
        """Pause the next request with ``key`` that applies its effect; see :class:`Hold`."""
        return self._ledger.hold(key)

    def forget_keys(self) -> None:
        """Behave as if ``key_retention`` had passed for every key seen so far."""
        self._ledger.forget_keys()

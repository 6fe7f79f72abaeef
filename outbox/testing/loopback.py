"""What the loopback fakes (``outbox.testing.webhook``, ``outbox.testing.stripe``) share.

Each fake is a real HTTP server on loopback inside the pytest process, in front of a ledger
that records requests, remembers idempotency keys and arms faults and holds, all under one
lock. This module holds the parts whose logic is the same in both: the listener and its
lifecycle (start, stop, refuse and accept connections on the same port), the registry of open
connections (so keep-alive connections can be cut and real TCP resets sent), holds, the JSON
answer and the bad answers a malicious provider sends instead (:class:`BadAnswer`: huge, a
compression bomb, dribbled, or any bytes at all), and the ledger's bookkeeping of requests, keys,
faults and holds. What a request means (routing, validation, what an effect is, when a key
completes) stays in each fake.
"""

from __future__ import annotations

import decimal
import enum
import functools
import json
import socket
import socketserver
import struct
import sys
import threading
import time
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, Generic, Self, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

HOST = "127.0.0.1"
# serve_forever checks for shutdown this often: refuse_connections() and stop() wait up to it.
POLL_INTERVAL = 0.02
# How long stop() and refuse_connections() wait for handler threads to let go of connections.
DRAIN_TIMEOUT = 5.0
REPLAYED_HEADER = ("Idempotent-Replayed", "true")
_MAX_LINE = 65537
# A bad answer goes out in pieces of this size, so that stopping or a hang-up ends it soon.
_WIRE_PIECE = 64 * 1024

Headers = tuple[tuple[str, str], ...]


class Hold:
    """A pause between "effect applied and response saved" and "response sent".

    The next request with ``key`` that applies its effect sets ``arrived`` and then waits
    until ``release()`` is called or the fake stops; meanwhile its key is still in progress, so
    other requests with it get 409. As a context manager it releases on exit, so a failing test
    cannot leave a handler thread waiting.
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
        """Whether ``release()`` was called (or the fake stopped)."""
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


class BadAnswerKind(enum.Enum):
    """How a bad answer misbehaves; see the class methods of :class:`BadAnswer`."""

    PADDED = "padded"
    COMPRESSED = "compressed"
    DRIBBLED = "dribbled"
    RAW = "raw"


# Compression codings the fakes can send, and what "compressed" sends by default.
CODINGS = ("gzip", "deflate")
_SAME: Any = object()  # "the coding used": the honest Content-Encoding


@dataclass(frozen=True)
class BadAnswer:
    """The bytes a malicious provider sends instead of the answer it saved.

    The effect is applied and the normal answer saved (a replay gets that one); only this
    answer, on this connection, misbehaves. Build one with the class methods. Each pads the
    saved JSON with leading whitespace (still valid JSON: read whole, it is a success) unless it
    is ``raw``. What it leaves out: real providers' bombs are often HTML, and lie about lengths
    too; the HTTP framing here is always correct, since h11 below the client polices that.
    """

    kind: BadAnswerKind
    size: int = 0
    coding: str = "gzip"
    content_encoding: str | None = None
    chunked: bool = False
    interval: float = 0.0
    raw: bytes = b""

    @classmethod
    def padded(cls, size: int, *, chunked: bool = False) -> BadAnswer:
        """``size`` bytes of JSON, plain: with a Content-Length, or chunked without one."""
        _check_size(size)
        return cls(BadAnswerKind.PADDED, size=size, chunked=chunked)

    @classmethod
    def compressed(
        cls,
        size: int,
        *,
        coding: str = "gzip",
        content_encoding: str | None = _SAME,
        chunked: bool = False,
    ) -> BadAnswer:
        """``size`` bytes of JSON compressed with ``coding`` ("gzip" or "deflate"): a
        compression bomb, some size/1000 bytes on the wire (``1 << 30`` is about 1 MB). The
        ``Content-Encoding`` header says ``coding`` unless ``content_encoding`` says something
        else (None: no header, so the compressed bytes pass for the body itself)."""
        _check_size(size)
        if coding not in CODINGS:
            raise ValueError(f"coding must be one of {CODINGS}, not {coding!r}")
        header = coding if content_encoding is _SAME else content_encoding
        return cls(
            BadAnswerKind.COMPRESSED,
            size=size,
            coding=coding,
            content_encoding=header,
            chunked=chunked,
        )

    @classmethod
    def dribbled(cls, interval: float, size: int = 1 << 16) -> BadAnswer:
        """``size`` bytes of JSON with a Content-Length, one byte every ``interval`` seconds,
        until the client hangs up or the fake stops: every read gets a byte long before any
        read timeout, so only a deadline on the whole body ends it."""
        _check_size(size)
        if interval <= 0:
            raise ValueError("interval must be greater than zero")
        return cls(BadAnswerKind.DRIBBLED, size=size, interval=interval)

    @classmethod
    def raw_body(cls, body: bytes, *, content_encoding: str | None = None) -> BadAnswer:
        """``body`` as it is (an integer of 5,000 digits, JSON nested 100,000 deep, not JSON,
        a body that is not the coding ``content_encoding`` claims...)."""
        return cls(BadAnswerKind.RAW, raw=body, content_encoding=content_encoding)

    def wire(self, body: Any) -> Wire:
        """What goes out for a saved answer whose JSON body is ``body``."""
        coding = self.content_encoding
        encoding: Headers = () if coding is None else (("Content-Encoding", coding),)
        if self.kind is BadAnswerKind.RAW:
            return Wire(self.raw, encoding)
        text = json.dumps(body).encode()
        padding = max(0, self.size - len(text))
        if self.kind is BadAnswerKind.COMPRESSED:
            return Wire(compressed(text, padding, self.coding), encoding, chunked=self.chunked)
        return Wire(b" " * padding + text, chunked=self.chunked, interval=self.interval)


class BadAnswerFaults:
    """The fault constructors for bad answers, shared by the fakes' fault classes (StripeFault,
    WebhookFault; each defines ``bad_answer_after_apply``). Every one applies the effect and
    saves the normal answer (a replay gets that), then sends this request's answer as the
    :class:`BadAnswer` says: the provider acted, and only its answer misbehaves."""

    @classmethod
    def bad_answer_after_apply(cls, answer: BadAnswer) -> Self:
        """Apply and save the normal answer, then send it as ``answer`` says."""
        raise NotImplementedError

    @classmethod
    def huge_answer_after_apply(cls, size: int, *, chunked: bool = False) -> Self:
        """Apply and save, then answer ``size`` bytes of JSON (see BadAnswer.padded)."""
        return cls.bad_answer_after_apply(BadAnswer.padded(size, chunked=chunked))

    @classmethod
    def gzip_bomb_after_apply(
        cls,
        size: int,
        *,
        coding: str = "gzip",
        content_encoding: str | None = _SAME,
        chunked: bool = False,
    ) -> Self:
        """Apply and save, then answer ``size`` bytes of JSON compressed to about a thousandth
        of that, labelled honestly or not (see BadAnswer.compressed)."""
        answer = BadAnswer.compressed(
            size, coding=coding, content_encoding=content_encoding, chunked=chunked
        )
        return cls.bad_answer_after_apply(answer)

    @classmethod
    def dribble_after_apply(cls, interval: float, size: int = 1 << 16) -> Self:
        """Apply and save, then answer a byte every ``interval`` seconds (BadAnswer.dribbled)."""
        return cls.bad_answer_after_apply(BadAnswer.dribbled(interval, size))

    @classmethod
    def raw_answer_after_apply(cls, body: bytes, *, content_encoding: str | None = None) -> Self:
        """Apply and save, then answer ``body`` as it is (see BadAnswer.raw_body)."""
        answer = BadAnswer.raw_body(body, content_encoding=content_encoding)
        return cls.bad_answer_after_apply(answer)


class FaultKind(enum.Enum):
    """Where a fault strikes: before the ledger is consulted, or after the effect is applied."""

    STATUS_BEFORE_APPLY = "status_before_apply"
    RESET_BEFORE_APPLY = "reset_before_apply"
    DELAY_AFTER_APPLY = "delay_after_apply"
    ERROR_500_AFTER_APPLY = "error_500_after_apply"
    RESET_AFTER_APPLY = "reset_after_apply"
    BAD_ANSWER_AFTER_APPLY = "bad_answer_after_apply"


_BEFORE_APPLY: Final = frozenset({FaultKind.STATUS_BEFORE_APPLY, FaultKind.RESET_BEFORE_APPLY})


@dataclass(frozen=True)
class ApplyFault(BadAnswerFaults):
    """A fault of a fake whose faults strike before or after it applies the effect (the webhook
    receiver's, the HTTP APIs'); build one with the class methods, e.g. ``status(503)``.

    Before-apply faults hit any matching request (a replay too): nothing is applied or saved.
    After-apply faults hit only a request that applies a new effect.
    """

    kind: FaultKind
    seconds: float = 0.0
    code: int = 500
    retry_after: int | str | None = None
    answer: BadAnswer | None = None

    @classmethod
    def status(cls, code: int, retry_after: int | str | None = None) -> Self:
        """Answer ``code`` without applying or saving; ``Retry-After: <retry_after>`` when given
        (a string goes as it is: a date, or digits no int could hold)."""
        if not 200 <= code <= 599:
            raise ValueError(f"status {code} is not a final HTTP status")
        return cls(FaultKind.STATUS_BEFORE_APPLY, code=code, retry_after=retry_after)

    @classmethod
    def error_500_before_apply(cls) -> Self:
        """Answer 500 without applying or saving anything."""
        return cls.status(500)

    @classmethod
    def reset_before_apply(cls) -> Self:
        """Reset the TCP connection without answering and without applying."""
        return cls(FaultKind.RESET_BEFORE_APPLY)

    @classmethod
    def delay_after_apply(cls, seconds: float) -> Self:
        """Apply and save, then wait ``seconds`` before answering (the key stays in progress)."""
        return cls(FaultKind.DELAY_AFTER_APPLY, seconds=seconds)

    @classmethod
    def error_500_after_apply(cls) -> Self:
        """Apply, then answer 500; what the key keeps is the fake's (its class says)."""
        return cls(FaultKind.ERROR_500_AFTER_APPLY)

    @classmethod
    def reset_after_apply(cls) -> Self:
        """Apply and save the normal answer, then reset the connection without answering."""
        return cls(FaultKind.RESET_AFTER_APPLY)

    @classmethod
    def bad_answer_after_apply(cls, answer: BadAnswer) -> Self:
        """Apply and save the normal answer, then send it as ``answer`` says."""
        return cls(FaultKind.BAD_ANSWER_AFTER_APPLY, answer=answer)

    @property
    def before_apply(self) -> bool:
        """Whether the fault strikes before the idempotency ledger is consulted."""
        return self.kind in _BEFORE_APPLY


def _check_size(size: int) -> None:
    if size < 0:
        raise ValueError("size must not be negative")


@dataclass(frozen=True)
class Wire:
    """An answer's body as it goes out instead of its JSON: the bytes, the headers that describe
    them (Content-Encoding), chunked or with a Content-Length, and at once or a byte every
    ``interval`` seconds."""

    body: bytes
    headers: Headers = ()
    chunked: bool = False
    interval: float = 0.0


_SPACES = b" " * (1 << 20)
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff"  # no name, no time, best ratio
_ZLIB_HEADER = b"\x78\xda"  # deflate with a 32 KiB window, best ratio


def compressed(text: bytes, padding: int, coding: str) -> bytes:
    """``padding`` spaces then ``text``, compressed in ``coding``, built in time proportional to
    the compressed size (and one checksum pass over the padding, cached).

    Each MiB of spaces compresses, from a fresh state, to the same few hundred bytes, ending at
    a byte boundary (a full flush): so the raw deflate stream is that segment repeated, then the
    rest compressed afresh, and only the checksum needs the decoded bytes.
    """
    blocks, rest = divmod(padding, len(_SPACES))
    tail = b" " * rest + text
    end = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    stream = _space_segment() * blocks + end.compress(tail) + end.flush()
    if coding == "gzip":
        crc = zlib.crc32(tail, _space_checksum(blocks, "gzip"))
        size = (padding + len(text)) & 0xFFFFFFFF
        return _GZIP_HEADER + stream + struct.pack("<II", crc, size)
    adler = zlib.adler32(tail, _space_checksum(blocks, "deflate"))
    return _ZLIB_HEADER + stream + struct.pack(">I", adler)


@functools.cache
def _space_segment() -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -zlib.MAX_WBITS)
    return c.compress(_SPACES) + c.flush(zlib.Z_FULL_FLUSH)


@functools.lru_cache(maxsize=8)
def _space_checksum(blocks: int, coding: str) -> int:
    check = 0 if coding == "gzip" else 1
    for _ in range(blocks):
        check = zlib.crc32(_SPACES, check) if coding == "gzip" else zlib.adler32(_SPACES, check)
    return check


@dataclass(frozen=True)
class Reply:
    """An answer: its status, JSON body and extra headers; ``wire``, when set, is what goes out
    instead of the JSON (a fault's bad answer)."""

    status: int
    body: Any
    headers: Headers = ()
    wire: Wire | None = None

    def badly(self, answer: BadAnswer) -> Reply:
        """This answer, sent as ``answer`` says."""
        return replace(self, wire=answer.wire(self.body))

    @property
    def replayed(self) -> bool:
        return REPLAYED_HEADER in self.headers

    def as_replay(self, *extra: tuple[str, str]) -> Reply:
        """This answer as a replay: ``Idempotent-Replayed: true``, then ``extra`` headers."""
        return replace(self, headers=(*self.headers, REPLAYED_HEADER, *extra))


@dataclass(kw_only=True)
class KeyEntry:
    """What a ledger remembers about one idempotency key; each fake adds what it compares."""

    reply: Reply
    expires_at: float
    in_progress: bool = True

    def live(self, now: float) -> bool:
        # A key in progress is a lock: expiry (or forget_keys) takes effect once it is done.
        return self.in_progress or now < self.expires_at


@dataclass(frozen=True)
class Plan:
    """What a handler does with an admitted request; ``reply`` None means reset the connection."""

    reply: Reply | None
    entry: KeyEntry | None = None  # set when this request saved a key: it must complete it
    hold: Hold | None = None
    delay: float = 0.0


FaultT = TypeVar("FaultT")
ReceivedT = TypeVar("ReceivedT", bound="DataclassInstance")  # with `status` and `replayed`
EntryT = TypeVar("EntryT", bound=KeyEntry)


@dataclass
class _Armed(Generic[FaultT]):
    fault: FaultT
    key: str | None
    remaining: int


class Ledger(Generic[FaultT, ReceivedT, EntryT]):
    """A fake's requests, keys, armed faults and holds, under one lock; fakes add the rest.

    Methods a fake calls from inside its own ``with self.cond`` say "call with the lock held".
    """

    def __init__(self, name: str, key_retention: float) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.stopping = threading.Event()
        self._name = name
        self._retention = key_retention
        self._entries: dict[str, EntryT] = {}
        self._received: list[ReceivedT] = []
        self._in_flight = 0
        self.peak_in_flight = 0  # the most requests being processed at once
        self._faults: list[_Armed[FaultT]] = []
        self._holds: dict[str, Hold] = {}
        self._all_holds: list[Hold] = []

    # --- requests -------------------------------------------------------------------------

    def arrive(self, received: Callable[[float], ReceivedT]) -> int:
        """Record a request as it arrives (``received`` makes its record from the arrival
        time); the index lets ``answered`` fill in its outcome."""
        with self.cond:
            self._received.append(received(time.monotonic()))
            self._in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            return len(self._received) - 1

    def answered(self, index: int, reply: Reply | None) -> None:
        """Record how request ``index`` ended (``reply`` None: reset or no answer)."""
        with self.cond:
            status = reply.status if reply else None
            replayed = reply.replayed if reply else False
            self._received[index] = replace(
                self._received[index],
                status=status,
                replayed=replayed,
                answered_at=time.monotonic(),
            )

    def finished(self) -> None:
        """A request's answer is out (or its connection reset): it no longer counts as busy."""
        with self.cond:
            self._in_flight -= 1
            self.cond.notify_all()

    def complete(self, entry: KeyEntry) -> None:
        """End an entry's in-progress state: later requests get replays, not 409s."""
        with self.cond:
            entry.in_progress = False
            self.cond.notify_all()

    def sit_out(self, plan: Plan) -> None:
        """Wait out the plan's hold and delay (in a handler's thread), then end its key's
        in-progress state: completed before answering, so a client that got the answer and
        retries at once sees a replay, not the in-progress answer."""
        try:
            if plan.hold is not None:
                plan.hold.arrived.set()
                plan.hold.wait_released()
            if plan.delay:
                self.stopping.wait(plan.delay)
        finally:
            if plan.entry is not None:
                self.complete(plan.entry)

    def _live_entry(self, key: str, now: float) -> EntryT | None:
        """The entry that still governs ``key`` (call with the lock held)."""
        entry = self._entries.get(key)
        return entry if entry is not None and entry.live(now) else None

    def _take_fault(self, key: str | None, strikes: Callable[[FaultT], bool]) -> FaultT | None:
        """The first armed fault that ``strikes`` here for ``key``, used up once more."""
        for armed in self._faults:
            if strikes(armed.fault) and armed.key in (None, key):
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._faults.remove(armed)
                return armed.fault
        return None

    # --- test controls --------------------------------------------------------------------

    def inject(self, fault: FaultT, key: str | None, times: int) -> None:
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

    def received(self) -> list[ReceivedT]:
        with self.cond:
            return list(self._received)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate`` (evaluated under the lock) holds, or raise TimeoutError."""
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise TimeoutError(f"{self._name}: {what} not reached within {timeout}s")

    def idle(self) -> bool:
        """Whether no request is being processed (call with the lock held)."""
        return self._in_flight == 0


class Connections:
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
            self._cond.wait_for(lambda: not any(s in self._busy for s in doomed), DRAIN_TIMEOUT)


class LoopbackServer(ThreadingHTTPServer):
    """The listener; a fresh one is made each time a fake (re)starts listening."""

    daemon_threads = True  # a handler stuck on a dead client must never keep pytest alive
    allow_reuse_address = True  # rebind our port while old connections sit in TIME_WAIT
    # Dispatchers open dozens of connections at once; the default backlog of 5 drops their SYNs
    # and each dropped one costs a second-long retransmit.
    request_queue_size = 1024

    def __init__(
        self,
        port: int,
        ledger: Ledger[Any, Any, Any],
        connections: Connections,
        handler: type[JsonHandler],
    ) -> None:
        self.ledger = ledger
        self.connections = connections
        super().__init__((HOST, port), handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, a DNS lookup that can stall.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = HOST, int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)  # before the descriptor closes: see Connections
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up mid-answer is routine here (timeouts, resets); anything else is a
        # bug in a fake, so let socketserver print it.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class JsonHandler(BaseHTTPRequestHandler):
    """Serves one connection; keep-alive, so possibly many requests, each answered in JSON."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: Nagle would hold the second for the client's ACK.
    disable_nagle_algorithm = True
    # Whether a chunked request body is read; when not, the connection is closed instead.
    accepts_chunked = False
    server: LoopbackServer

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: test output is for the tests."""

    def _respond(
        self,
        received: Callable[[float], Any],
        decide: Callable[[], Reply | None],
        headers: Headers = (),
    ) -> None:
        """Record the request's arrival, answer what ``decide`` says (None: reset) with
        ``headers`` before the reply's own, and record the outcome."""
        ledger = self.server.ledger
        with self.server.connections.busy(self.connection):
            index = ledger.arrive(received)
            try:
                reply = decide()
                # Recorded before the client can see the outcome, so a test that has its
                # answer (or its reset) also finds it in `received`.
                ledger.answered(index, reply)
                if reply is None:
                    self._reset()
                else:
                    self._send(reply, headers)
            finally:
                ledger.finished()

    def _send(self, reply: Reply, headers: Headers) -> None:
        if reply.wire is not None:
            self._send_wire(reply, reply.wire, headers)
            return
        data = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in (*headers, *reply.headers):
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # The client gave up (its timeout fired during a delay): the answer stands anyway.
            self.close_connection = True

    def _send_wire(self, reply: Reply, wire: Wire, headers: Headers) -> None:
        """Send ``wire`` as the body: in pieces, so a client that hangs up (it should, past its
        cap) or a fake that stops ends it within one piece; the connection closes after it."""
        body = memoryview(wire.body)
        step = 1 if wire.interval else _WIRE_PIECE
        stopping = self.server.ledger.stopping
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            # Whatever the client reads of it, the connection is not reused (this sets
            # close_connection too).
            self.send_header("Connection", "close")
            if wire.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Content-Length", str(len(body)))
            for name, value in (*headers, *reply.headers, *wire.headers):
                self.send_header(name, value)
            self.end_headers()
            for start in range(0, len(body), step):
                piece = body[start : start + step]
                if wire.chunked:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                else:
                    self.wfile.write(piece)
                if wire.interval and stopping.wait(wire.interval):
                    return
            if wire.chunked:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:
            pass  # the client hung up, as a careful one does past its cap

    def _reset(self) -> None:
        """Close with SO_LINGER 0, so the kernel sends RST instead of FIN."""
        self.close_connection = True
        self.server.connections.discard(self.connection)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The descriptor really closes when finish() closes rfile; socketserver's later
        # shutdown(SHUT_WR) then fails quietly on the closed socket, so no FIN precedes the RST.
        self.connection.close()

    def _read_body(self) -> bytes | None:
        """The whole request body, or None when it cannot be read: the connection then closes.

        Handlers read it first, whatever happens next, so a keep-alive connection stays usable.
        """
        raw = self._read_raw_body()
        if raw is None:
            self.close_connection = True
        return raw

    def _read_raw_body(self) -> bytes | None:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return self._read_chunked() if self.accepts_chunked else None
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


class LoopbackFake(ABC, Generic[FaultT, ReceivedT]):
    """A fake's listener lifecycle and the test controls every fake has.

    Use as a context manager (or ``start()``/``stop()``). Lifecycle calls (start, stop,
    refuse/accept_connections) belong to the test's thread; everything else is thread-safe.
    """

    # How lifecycle errors name the fake ("the fake was already started") and its thread prefix.
    _noun = "fake"
    _thread_name = "fake"

    def __init__(self, ledger: Ledger[FaultT, ReceivedT, Any]) -> None:
        self._ledger = ledger
        self._connections = Connections(ledger.cond)
        self._server: LoopbackServer | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    @abstractmethod
    def _make_server(self, port: int) -> LoopbackServer:
        """A listener bound to ``port`` on loopback (0: an ephemeral port)."""

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> Self:
        """Listen on an ephemeral loopback port."""
        if self._port is not None:
            raise RuntimeError(f"the {self._noun} was already started")
        self._listen(0)
        return self

    def stop(self) -> None:
        """Release holds, cut delays short, stop listening and close every connection."""
        self._ledger.stop()
        self._unlisten()
        # Released requests answer before their connections are shut down.
        with suppress(TimeoutError):
            self._ledger.wait_for(self._ledger.idle, DRAIN_TIMEOUT, "idle")
        self._connections.drop(idle_only=False)

    def __enter__(self) -> Self:
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
            raise RuntimeError(f"the {self._noun} was stopped")
        if self._server is None:
            self._listen(port)

    @property
    def port(self) -> int:
        """The loopback port (the same across refuse/accept_connections)."""
        return self._require_started()

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted right now."""
        return self._server is not None

    def _listen(self, port: int) -> None:
        server = self._make_server(port)
        self._port = int(server.server_address[1])
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": POLL_INTERVAL},
            name=f"{self._thread_name}:{self._port}",
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
            raise RuntimeError(f"the {self._noun} has not been started")
        return self._port

    # --- what happened --------------------------------------------------------------------

    @property
    def received(self) -> list[ReceivedT]:
        """A snapshot of every request that arrived, in order of arrival."""
        return self._ledger.received()

    @property
    def connections_accepted(self) -> int:
        """How many TCP connections were accepted (keep-alive reuses one for many requests)."""
        with self._ledger.cond:
            return self._connections.accepted

    @property
    def peak_in_flight(self) -> int:
        """The most requests that were being processed at once, so far."""
        with self._ledger.cond:
            return self._ledger.peak_in_flight

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request that has arrived is still being processed."""
        self._ledger.wait_for(self._ledger.idle, timeout, "idle")

    # --- misbehaviour ---------------------------------------------------------------------

    def inject(self, fault: FaultT, *, key: str | None = None, times: int = 1) -> None:
        """Arm ``fault`` for the next ``times`` matching requests (``key`` None: any request).

        Faults strike in the order they were injected, one per request.
        """
        self._ledger.inject(fault, key, times)

    def hold(self, key: str) -> Hold:
        """Pause the next request with ``key`` that applies its effect; see :class:`Hold`."""
        return self._ledger.hold(key)

    def forget_keys(self) -> None:
        """Behave as if ``key_retention`` had passed for every key seen so far."""
        self._ledger.forget_keys()


@dataclass(frozen=True)
class InvalidJson:
    """A request body that is not JSON, as its text."""

    text: str


def parse_json_body(raw: bytes) -> Any:
    """A request body as a careful payment API parses it (None when empty): numbers with a
    point as Decimal, so 19.999999999999999999 and 20.0 are different bodies; InvalidJson
    when it is not JSON."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw, parse_float=decimal.Decimal)
    except (ValueError, RecursionError):
        return InvalidJson(raw.decode("utf-8", "replace"))

"""Provider answers, read within bounds: at most ``max_response_bytes`` of them, decoded size
included, and the whole body within the provider's timeout.

An HTTP provider's answer is held in memory whole while its reference is read from it, so a
broken or malicious provider must not choose how much that is. httpx alone cannot bound it: its
gzip decoder calls zlib without ``max_length``, so one 64 KiB read of a compression bomb expands
to some 64 MB before any caller sees a byte (a webhook's 1 MB of gzip that decoded to 1 GiB once
took the dispatcher to 12.6 GB and blocked its event loop for half a minute). And its timeouts
bound each read, not the body: an answer that dribbles a byte a second never times out.

:class:`AnswerLimits` installs itself on an ``httpx.AsyncClient`` as event hooks, so it bounds
every answer whatever the transport (an egress proxy from the environment included):

* every request asks only for the codings decoded here (``Accept-Encoding: gzip, deflate``);
* every answer's body is replaced by a stream that decodes gzip and deflate itself, in steps of
  at most :data:`READ_PIECE` bytes (zlib's ``max_length``), and counts the bytes received and
  the bytes decoded; past the cap it stops reading and raises :class:`ResponseTooLarge`, and the
  client closes the connection. A declared ``Content-Length`` past the cap is refused before a
  byte of the body is read;
* a coding not asked for, more than one compression layer, or a corrupt or truncated
  compressed body raise :class:`UndecodableResponse`;
* a body still arriving ``read_time`` seconds after its headers raises :class:`BodyTimeout` (a
  body that stops arriving altogether is httpx's own read timeout).

The provider answered in each case, so it may have acted: the providers classify these as
``unknown``. Messages say the cap and the status, never the body.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import ClassVar, Final, Protocol

import httpx

# Decoded bytes per decompression step: one step's output is all a compressed answer can add to
# memory before it is counted against the cap.
READ_PIECE: Final = 64 * 1024
# The content codings decoded here, and so the only ones asked for.
ACCEPT_ENCODING: Final = "gzip, deflate"
# A request may carry its own cap in this extension (a list page of the Stripe lookups does).
MAX_BYTES_EXTENSION: Final = "outbox.max_response_bytes"
# The longest reference taken from an answer. An identifier is short (Stripe's are under 40
# characters; 255 is the longest operation key outbox accepts); anything longer is no
# identifier, and the idempotency key serves instead, as for an answer that has none.
MAX_REFERENCE_CHARS: Final = 255
_GZIP_MAGIC: Final = b"\x1f\x8b"


class AnswerRefused(httpx.TransportError):
    """The answer was not read to its end; ``error_class`` says why, ``status`` is its HTTP
    status. The provider answered, so it may have acted."""

    error_class: ClassVar[str] = "unreadable_answer"

    def __init__(self, message: str, *, status: int, request: httpx.Request) -> None:
        super().__init__(message, request=request)
        self.status = status


class ResponseTooLarge(AnswerRefused):
    """The answer came to more bytes than its cap, received or decoded."""

    error_class: ClassVar[str] = "response_too_large"


class UndecodableResponse(AnswerRefused):
    """The answer's content coding was not asked for, or its compressed body is corrupt."""

    error_class: ClassVar[str] = "undecodable_response"


class BodyTimeout(httpx.ReadTimeout):
    """The answer's body was still arriving ``read_time`` seconds after its headers."""


@dataclass(slots=True)
class Tally:
    """What one provider's answers came to: bytes received (after the transfer coding, before
    the content coding) and bytes decoded, in all and for the largest answer. ``refused``
    counts the answers given up on (over the cap, undecodable, too slow)."""

    answers: int = 0
    wire_bytes: int = 0
    decoded_bytes: int = 0
    most_wire: int = 0
    most_decoded: int = 0
    refused: int = 0

    def add(self, wire: int, decoded: int, *, refused: bool) -> None:
        self.answers += 1
        self.wire_bytes += wire
        self.decoded_bytes += decoded
        self.most_wire = max(self.most_wire, wire)
        self.most_decoded = max(self.most_decoded, decoded)
        self.refused += refused


Hook = Callable[..., Awaitable[None]]


class AnswerLimits:
    """The bounds on one provider's answers; ``event_hooks`` goes to its ``httpx.AsyncClient``.

    ``max_bytes`` caps each answer (a request may set its own cap in the
    :data:`MAX_BYTES_EXTENSION` extension); ``read_time`` bounds, in seconds, how long its body
    may take after its headers. ``tally`` counts what was read.
    """

    def __init__(self, max_bytes: int, read_time: float) -> None:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        self.max_bytes = max_bytes
        self.read_time = read_time
        self.tally = Tally()

    @property
    def event_hooks(self) -> dict[str, list[Hook]]:
        return {"request": [self._ask], "response": [self._bound]}

    async def _ask(self, request: httpx.Request) -> None:
        # Whatever the configured headers say: only what _decoder decodes may come back.
        request.headers["Accept-Encoding"] = ACCEPT_ENCODING

    async def _bound(self, response: httpx.Response) -> None:
        request = response.request
        cap = request.extensions.get(MAX_BYTES_EXTENSION, self.max_bytes)
        codings = [
            c.strip().lower()
            for c in response.headers.get_list("content-encoding", split_commas=True)
        ]
        codings = [c for c in codings if c not in ("", "identity")]
        # httpx decodes by this header after the hooks: the body reaches it decoded already.
        if "content-encoding" in response.headers:
            del response.headers["content-encoding"]
        raw = response.stream
        if not isinstance(raw, httpx.AsyncByteStream):
            raise TypeError("AnswerLimits bounds the answers of an httpx.AsyncClient only")
        response.stream = _BoundedBody(
            raw,
            _decoder(codings),
            cap=cap,
            declared=_length(response),
            deadline=time.monotonic() + self.read_time,
            read_time=self.read_time,
            tally=self.tally,
            status=response.status_code,
            request=request,
        )


def reference(value: object) -> str | None:
    """``value`` (an answer's ``id``) as a reference, or None when it is none: a string of 1 to
    MAX_REFERENCE_CHARS printable characters, or an integer of at most as many digits. Anything
    else (an object, a list, a boolean, a number with a point, a string of thousands of
    characters or with control characters in it) is no identifier."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        if value.bit_length() > 4 * MAX_REFERENCE_CHARS:  # never turn a huge int into text
            return None
        text = str(value)
    elif isinstance(value, str):
        text = value
    else:
        return None
    if not 0 < len(text) <= MAX_REFERENCE_CHARS or not text.isprintable():
        return None
    return text


def _length(response: httpx.Response) -> int | None:
    value = response.headers.get("content-length", "").strip()
    # At most 19 digits: past that no body fits in memory, and int() is never asked for more.
    if value.isascii() and value.isdigit():
        return int(value) if len(value) <= 19 else 1 << 63
    return None


class _Decoder(Protocol):
    def take(self, data: bytes, limit: int) -> bytes:
        """Add ``data`` to the input; up to ``limit`` bytes of output (b"": it needs more)."""
        ...

    def finish(self) -> str | None:
        """Why the body is incomplete, or None."""
        ...


class _Identity:
    """No content coding: bytes received are bytes decoded (the wire count bounds them)."""

    def take(self, data: bytes, limit: int) -> bytes:
        return data

    def finish(self) -> str | None:
        return None


class _Inflate:
    """gzip (members in a row, as RFC 1952 allows) or deflate (zlib's format, or the raw one
    some servers send), never more than ``limit`` bytes of output per step."""

    def __init__(self, coding: str) -> None:
        self._coding = coding
        self._wbits = 16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS
        self._z = zlib.decompressobj(self._wbits)
        self._pending = b""  # input zlib has not taken yet
        self._fresh = True  # no output yet: a deflate body may still turn out to be raw
        self._ended = False  # the last member ended; what follows is ignored, as gzip(1) does

    def take(self, data: bytes, limit: int) -> bytes:
        if self._ended:
            return b""
        if data:
            self._pending = self._pending + data if self._pending else data
        while not self._ended and self._pending:
            if self._z.eof and not self._next_member():
                return b""
            pending = self._pending
            try:
                out = self._z.decompress(pending, limit)
            except zlib.error:
                if not (self._fresh and self._wbits == zlib.MAX_WBITS):
                    raise
                self._wbits = -zlib.MAX_WBITS  # "deflate" as raw deflate, as httpx allows
                self._z = zlib.decompressobj(self._wbits)
                continue
            self._pending = self._z.unused_data if self._z.eof else self._z.unconsumed_tail
            if out:
                self._fresh = False
                return out
            if not self._z.eof and self._pending == pending:
                return b""  # no progress (cannot happen with limit >= 1; never loop on it)
        return b""

    def _next_member(self) -> bool:
        """At the end of a member: start the next one if one follows (a gzip member's magic)."""
        if self._coding == "gzip" and self._pending.startswith(_GZIP_MAGIC):
            self._z = zlib.decompressobj(self._wbits)
            return True
        if self._coding == "gzip" and self._pending == _GZIP_MAGIC[:1]:
            return False  # the next member's magic may be split across reads
        self._ended = True
        return False

    def finish(self) -> str | None:
        if self._z.eof or self._ended:
            return None
        return f"the {self._coding} body ends before its compressed stream does"


class _Refuse:
    """A coding that cannot be read here: refused before a byte is decoded."""

    def __init__(self, why: str) -> None:
        self.why = why

    def take(self, data: bytes, limit: int) -> bytes:
        raise zlib.error(self.why)

    def finish(self) -> str | None:
        return self.why


def _decoder(codings: list[str]) -> _Decoder:
    if not codings:
        return _Identity()
    if len(codings) > 1:
        return _Refuse(f"{len(codings)} content codings in a row; at most one is read")
    coding = "gzip" if codings[0] == "x-gzip" else codings[0]
    if coding not in ("gzip", "deflate"):
        # Never quote it whole: a header is the provider's text.
        return _Refuse(f"content coding {coding[:32]!r} was not asked for ({ACCEPT_ENCODING})")
    return _Inflate(coding)


class _BoundedBody(httpx.AsyncByteStream):
    """An answer's body, decoded here and counted, refused past its cap or its deadline."""

    def __init__(
        self,
        raw: httpx.AsyncByteStream,
        decoder: _Decoder,
        *,
        cap: int,
        declared: int | None,
        deadline: float,
        read_time: float,
        tally: Tally,
        status: int,
        request: httpx.Request,
    ) -> None:
        self._raw = raw
        self._decoder = decoder
        self._cap = cap
        self._declared = declared
        self._deadline = deadline
        self._read_time = read_time
        self._tally = tally
        self._status = status
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        wire = decoded = 0
        refused = True
        try:
            if self._declared is not None and self._declared > self._cap:
                raise self._too_large("declares")  # not a byte of it read
            async for chunk in self._raw:
                wire += len(chunk)
                if wire > self._cap:
                    raise self._too_large("sent")
                if time.monotonic() > self._deadline:
                    raise BodyTimeout(
                        f"the answer's body took longer than {self._read_time:g}s",
                        request=self._request,
                    )
                data = chunk
                while True:
                    piece = self._take(data, min(READ_PIECE, self._cap + 1 - decoded))
                    data = b""
                    if not piece:
                        break
                    decoded += len(piece)
                    if decoded > self._cap:
                        raise self._too_large("decodes to")
                    yield piece
            why = self._decoder.finish()
            if why is not None:
                raise UndecodableResponse(why, status=self._status, request=self._request)
            refused = False
        finally:
            self._tally.add(wire, decoded, refused=refused)

    def _take(self, data: bytes, limit: int) -> bytes:
        try:
            return self._decoder.take(data, limit)
        except zlib.error as exc:
            raise UndecodableResponse(
                f"HTTP {self._status} answer undecodable: {exc}",
                status=self._status,
                request=self._request,
            ) from None

    def _too_large(self, verb: str) -> ResponseTooLarge:
        return ResponseTooLarge(
            f"HTTP {self._status} answer {verb} more than {self._cap} bytes (the cap, "
            "max_response_bytes); not read further",
            status=self._status,
            request=self._request,
        )

    async def aclose(self) -> None:
        await self._raw.aclose()

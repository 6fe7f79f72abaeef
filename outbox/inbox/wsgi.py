"""The inbox as WSGI middleware (Flask, Django, any WSGI app), the twin of asgi.py on threads.

For each declared route, the delivery is decided (``SyncInbox.deliver``) before the app sees it;
only a new delivery reaches the app, with its transaction open (``wsgi_delivery(request).conn``,
a psycopg ``Connection``): the app's business writes go there, and commit with the recorded
answer or not at all. The app's response is read to its end (or past ``max_response_bytes``),
its iterable closed, and buffered: the sender hears nothing before COMMIT succeeded, because a
worker acknowledges outcomes, not intentions. What is answered for each decision is
adapter.py's, as for the ASGI middleware (docs/design.md, "The inbox").
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from typing import Any, TypeVar
from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

from outbox.inbox.adapter import (
    DELIVERY,
    FAILED,
    REFUSED,
    BodyTooLarge,
    Buffered,
    CutShort,
    External,
    HandlerFailed,
    HTTPAdapter,
    is_json,
)
from outbox.inbox.core import Decision, Identity, Outcome
from outbox.inbox.external import RUNS, LeaseLost
from outbox.inbox.http import Headers
from outbox.inbox.sync import SyncClaim, SyncDelivery, SyncInbox

T = TypeVar("T", SyncDelivery, SyncClaim)


def wsgi_delivery(request: Any) -> SyncDelivery:
    """The delivery a handler runs for: ``wsgi_delivery(flask.request)`` (any object with an
    ``environ``, as werkzeug's and Django's requests have) or ``wsgi_delivery(environ)``."""
    return _found(request, SyncDelivery, "InboxWSGIMiddleware's declared routes")


def wsgi_claimed(request: Any) -> SyncClaim:
    """The claim a handler of an ``External`` route runs for: ``wsgi_claimed(flask.request)``."""
    return _found(request, SyncClaim, "an External route of InboxWSGIMiddleware")


def _found(request: Any, kind: type[T], where: str) -> T:
    environ = getattr(request, "environ", request)
    found = environ.get(DELIVERY)
    if not isinstance(found, kind):
        raise LookupError(f"this request did not come through {where}")  # noqa: TRY004
    return found


class InboxWSGIMiddleware(HTTPAdapter[WSGIApplication, SyncInbox]):
    """Wraps a WSGI ``app`` (docs/design.md, "The inbox", "WSGI apps"; the options are
    HTTPAdapter's, shared with the ASGI middleware)."""

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        handler = self.handler_for(environ["REQUEST_METHOD"], _path(environ))
        if handler is None:
            return self.app(environ, start_response)
        headers = _headers(environ)
        with self.spans.delivery(handler, headers) as span:
            started = time.monotonic()
            answer, decision = self._deliver(environ, headers, handler, span)
            answer = self.answered(handler, answer, decision, started, span)
        start_response(_status_line(answer.status), _framed(answer))
        return [answer.body]

    def _deliver(
        self, environ: WSGIEnvironment, headers: Headers, handler: str, span: Any
    ) -> tuple[Outcome, str]:
        try:
            body = _read_body(environ, self.max_body_bytes)
            identity = self.identity(headers, body, handler, span)
        except REFUSED as exc:
            return self.refused(exc)
        return self._decide(environ, body, identity, is_json=is_json(headers), span=span)

    def _decide(
        self, environ: WSGIEnvironment, body: bytes, identity: Identity, *, is_json: bool, span: Any
    ) -> tuple[Outcome, str]:
        mode = self.external.get(identity.handler)
        if mode is not None:
            return self._claim(environ, body, identity, mode, is_json=is_json, span=span)
        try:
            with self.inbox.deliver(identity, body, is_json=is_json) as d:
                if d.decision is not Decision.NEW:
                    return self.answer(d), d.decision.value
                return self._handle(environ, body, d)
        except FAILED as exc:
            return self.failed(exc, identity.handler, span)

    def _claim(
        self,
        environ: WSGIEnvironment,
        body: bytes,
        identity: Identity,
        mode: External,
        *,
        is_json: bool,
        span: Any,
    ) -> tuple[Outcome, str]:
        """External-effect mode, as InboxMiddleware._claim: the claim commits first; the app's
        answer and its writes on ``claim.transaction()`` commit together, fenced."""
        claim = self.inbox.claim(
            identity, body, is_json=is_json, lease=mode.lease, max_claims=mode.max_claims
        )
        try:
            with claim as c:
                if c.decision not in RUNS:
                    return self.answer(c), c.decision.value
                answer, decision = self._handle(environ, body, c)
                c.settle()
                return answer, decision
        except LeaseLost:  # from settle, or the handler's own transaction(): rolled back
            return self.lease_lost(identity.handler)
        except FAILED as exc:
            return self.failed(exc, identity.handler, span)

    def _handle(
        self, environ: WSGIEnvironment, body: bytes, d: SyncDelivery | SyncClaim
    ) -> tuple[Outcome, str]:
        """Run the app for a new delivery, its answer buffered until the inbox decides."""
        buffered = self.buffer()
        # The body was read here: the app reads it again from a copy, to its known length.
        inner = {**environ, "wsgi.input": io.BytesIO(body), "CONTENT_LENGTH": str(len(body))}
        inner[DELIVERY] = d
        started = time.monotonic()
        try:
            _run(self.app, inner, buffered)
        except LeaseLost:
            raise  # its claim was taken over: "in progress", not the handler's failure
        except Exception as exc:
            raise HandlerFailed() from exc
        return self.conclude(d, buffered.outcome(), started)


def _run(app: WSGIApplication, environ: WSGIEnvironment, buffered: Buffered) -> None:
    """Run ``app`` into ``buffered`` and close its iterable (PEP 3333: always, read to the end
    or not), inside the delivery's transaction, so that what its close does (Flask's teardown)
    runs before the COMMIT too."""

    def start_response(
        status: str, headers: list[tuple[str, str]], exc_info: object = None, /
    ) -> Callable[[bytes], object]:
        # Nothing was sent yet, so an error page may replace a started answer (PEP 3333).
        if buffered.started and exc_info is None:
            raise RuntimeError("start_response called a second time without exc_info")
        buffered.start(int(status.split(" ", 1)[0]), tuple(headers))
        return buffered.add

    chunks = app(environ, start_response)
    try:
        for chunk in chunks:
            if not buffered.add(chunk):
                break  # past what the inbox records: refused whatever follows
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _read_body(environ: WSGIEnvironment, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge past ``limit`` bytes, and CutShort when the
    input ends before its Content-Length, so that a truncated body is never decided or handled.
    Without a length, only a server that marks the input's end (``wsgi.input_terminated``, for
    a chunked body) has a body to read."""
    stream = environ["wsgi.input"]
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        raise CutShort from None  # no length a server would pass on: no whole body
    if length > limit:
        raise BodyTooLarge
    if not length and not environ.get("wsgi.input_terminated"):
        return b""
    wanted = length or limit + 1
    body = bytearray()
    while len(body) < wanted:
        chunk = stream.read(wanted - len(body))
        if not chunk:
            break
        body += chunk
    if len(body) > limit:
        raise BodyTooLarge
    if length and len(body) < length:
        raise CutShort
    return bytes(body)


def _headers(environ: WSGIEnvironment) -> dict[str, str]:
    """The request's headers by lower-case name, their values as the server gave them
    (latin-1 text, as asgi.py decodes them)."""
    found = {
        name[5:].replace("_", "-").lower(): value
        for name, value in environ.items()
        if name.startswith("HTTP_")
    }
    for name in ("CONTENT_TYPE", "CONTENT_LENGTH"):
        if name in environ:
            found[name.replace("_", "-").lower()] = environ[name]
    return found


def _path(environ: WSGIEnvironment) -> str:
    # WSGI gives the path's bytes as latin-1 text; routes are matched as ASGI's decoded path.
    raw = environ.get("PATH_INFO", "").encode("latin-1")
    return raw.decode("utf-8", errors="replace") or "/"


def _status_line(status: int) -> str:
    # Our own reason phrase, for the first answer and its replays alike (none is recorded).
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _framed(answer: Outcome) -> list[tuple[str, str]]:
    """The answer's headers as sent: its own Content-Length, whatever the app said."""
    headers = [(name, value) for name, value in answer.headers if name.lower() != "content-length"]
    headers.append(("Content-Length", str(len(answer.body))))
    return headers

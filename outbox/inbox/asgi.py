"""The inbox as pure ASGI middleware (Starlette, FastAPI, any ASGI app).

For each declared route, the delivery is decided before the app sees it; only a new delivery
reaches the app, with its transaction open (``delivery(request).conn``). The app's response is
buffered, never streamed: nothing may reach the sender before COMMIT, because a worker
acknowledges outcomes, not intentions. Pure ASGI rather than Starlette's BaseHTTPMiddleware,
because a sender that hangs up must not cancel a commit under way (docs/design.md, "The inbox").
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
import structlog

from outbox.inbox import meters
from outbox.inbox.core import (
    UNAVAILABLE,
    Decision,
    Delivery,
    Identity,
    Inbox,
    InvalidDelivery,
    Outcome,
    pairs_of,
)
from outbox.inbox.http import (
    Headers,
    KeyFrom,
    MissingIdentity,
    TenantFrom,
    problem,
    replay,
    stored_headers,
    traced,
)
from outbox.observability import tracing

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DELIVERY: Final = "outbox.inbox.delivery"
# How answers are given: as an HTTP API answers a client, or as a Cloud Tasks target must.
TRANSPORTS: Final = ("http", "cloudtasks")
# Decisions whose answer never changes, however often the delivery comes again.
FINAL: Final = frozenset(
    {"new", "replayed", "conflict", "invalid"}
)  # the key of scope["state"] that holds the Delivery
# What the app may answer in all, recorded or not: a response is buffered before COMMIT.
_RESPONSE_CAP: Final = 16 * 1024 * 1024
# Decisions whose 5xx no exception explains: their span's error.type is the status, as
# OpenTelemetry's HTTP conventions have it; a failure that raised has its class there instead.
_FAILED_BY_STATUS: Final = frozenset({"rolled_back", "abandoned"})
log = structlog.get_logger("outbox.inbox")


def delivery(request: Any) -> Delivery:
    """The delivery a handler runs for: ``delivery(request)`` (Starlette, FastAPI) or
    ``delivery(scope)``."""
    scope = getattr(request, "scope", request)
    found = scope.get("state", {}).get(DELIVERY)
    if not isinstance(found, Delivery):
        raise LookupError(  # noqa: TRY004  (a missing entry, not a wrong type)
            "this request did not come through InboxMiddleware's declared routes"
        )
    return found


class HandlerFailed(Exception):
    """The app raised while handling a new delivery: its transaction rolled back."""


@dataclass
class _Captured:
    status: int = 500
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    started: bool = False

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", ())]
            self.started = True
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if len(self.body) > _RESPONSE_CAP:
                raise RuntimeError("the response is larger than the inbox buffers")


class InboxMiddleware:
    """Wraps ``app``; ``routes`` maps ``"METHOD /path"`` to a handler name, the stable part of
    each delivery's identity (renaming a path keeps it; renaming a handler forgets its records).

    ``record_statuses`` are the 4xx a handler answers deterministically (recorded and replayed
    like a 2xx or 3xx); any other status, a raise or a response over ``max_response_bytes``
    rolls the handler's writes back and records nothing, so the sender delivers again."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        inbox: Inbox,
        routes: Mapping[str, str],
        key: KeyFrom | None = None,
        tenant: TenantFrom | None = None,
        record_statuses: frozenset[int] = frozenset({400, 404, 410, 422}),
        max_body_bytes: int = 1024 * 1024,
        max_response_bytes: int = 64 * 1024,
        retry_after: int = 1,
        keep_headers: frozenset[str] = frozenset(),
        transport: str = "http",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.transport = transport
        self.app = app
        self.inbox = inbox
        self.routes = {_route_key(route): name for route, name in routes.items()}
        self.key = key or KeyFrom.auto()
        self.tenant = tenant or TenantFrom.header()
        self.record_statuses = record_statuses
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = max_response_bytes
        self.retry_after = retry_after
        self.keep_headers = frozenset(name.lower() for name in keep_headers)
        self._spans = tracing.DeliverySpans()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http":
            handler = self.routes.get((scope["method"], scope["path"]))
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with self._spans.delivery(handler, headers) as span:
            started = time.monotonic()
            answer, decision = await self._deliver(scope, receive, headers, handler, span)
            if self.transport == "cloudtasks":
                answer = for_cloud_tasks(answer, decision)
            _show(handler, decision, answer, time.monotonic() - started, span)
            await _send(send, answer)

    async def _deliver(
        self, scope: Scope, receive: Receive, headers: Headers, handler: str, span: Any
    ) -> tuple[Outcome, str]:
        try:
            body = await _read_body(receive, self.max_body_bytes)
        except CutShort:
            # Nobody hears this answer; nothing was decided, recorded or handled.
            return problem(400, "delivery cut short", "the body never ended", "invalid"), "invalid"
        if body is None:
            detail = f"at most {self.max_body_bytes} bytes"
            return problem(413, "body too large", detail, "invalid"), "invalid"
        try:
            key = self.key.read(headers, body)
            identity = Identity(self.tenant.read(headers), handler, key)
        except MissingIdentity as exc:
            return problem(400, "no delivery identity", str(exc), "invalid"), "invalid"
        tracing.annotate(span, traced(identity))
        return await self._decide(
            scope, receive, body, identity, is_json=_is_json(headers), span=span
        )

    async def _decide(
        self,
        scope: Scope,
        receive: Receive,
        body: bytes,
        identity: Identity,
        *,
        is_json: bool,
        span: Any,
    ) -> tuple[Outcome, str]:
        handler = identity.handler
        try:
            async with self.inbox.deliver(identity, body, is_json=is_json) as d:
                if d.decision is not Decision.NEW:
                    return self._answer(d), d.decision.value
                return await self._handle(scope, receive, body, d)
        except InvalidDelivery as exc:
            return problem(400, "invalid delivery", str(exc), "invalid"), "invalid"
        except HandlerFailed as exc:
            # The exception's class only: its text may quote the payload.
            error = type(exc.__cause__).__name__
            log.error("inbox handler failed", handler=handler, error=error)  # noqa: TRY400
            tracing.failed(span, error)
            return problem(500, "handler failed", "nothing was recorded", "failed"), "failed"
        except UNAVAILABLE as exc:
            log.warning("inbox database unavailable", handler=handler, error=type(exc).__name__)
            tracing.failed(span, type(exc).__name__)
            detail = "nothing was recorded"
            answer = problem(503, "try again", detail, "unavailable", self.retry_after)
            return answer, "unavailable"
        except psycopg.Error as exc:
            # A statement or the COMMIT failed (a deferred constraint, OB006): rolled back.
            log.error("inbox delivery failed", handler=handler, sqlstate=exc.sqlstate)  # noqa: TRY400
            tracing.failed(span, type(exc).__name__)
            return problem(500, "not recorded", "the transaction failed", "failed"), "failed"

    async def _handle(
        self, scope: Scope, receive: Receive, body: bytes, d: Delivery
    ) -> tuple[Outcome, str]:
        """Run the app for a new delivery: its answer and "new" when recorded, "rolled_back"
        when not."""
        captured = _Captured()
        inner = dict(scope)
        inner["state"] = {**scope.get("state", {}), DELIVERY: d}
        started = time.monotonic()
        try:
            await self.app(inner, _replaying(body, receive), captured.send)
        except Exception as exc:
            raise HandlerFailed() from exc
        response = Outcome(captured.status, pairs_of(captured.headers), bytes(captured.body))
        recordable = 200 <= response.status < 400 or response.status in self.record_statuses
        if recordable and len(response.body) <= self.max_response_bytes:
            kept = stored_headers(response.headers, self.keep_headers)
            await d.complete(Outcome(response.status, kept, response.body))
            outcome = "committed"
        else:
            d.roll_back()
            outcome = "rolled_back"
            if recordable:
                response = problem(
                    500,
                    "response too large to record",
                    f"at most {self.max_response_bytes} bytes",
                    "failed",
                )
        meters.HANDLER_SECONDS.labels(d.identity.handler, outcome).observe(
            time.monotonic() - started
        )
        decision = "new" if outcome == "committed" else "rolled_back"
        marked = (*response.headers, ("Outbox-Inbox-Decision", decision))
        return Outcome(response.status, marked, response.body), decision

    def _answer(self, d: Delivery) -> Outcome:
        if d.decision is Decision.REPLAYED and d.recorded is not None:
            return replay(d.recorded)
        if d.decision is Decision.CONFLICT:
            return problem(422, "conflict", "this key was delivered with another body", "conflict")
        if d.decision is Decision.ABANDONED:
            detail = "given up after repeated claims: an operator releases it"
            return problem(503, "abandoned", detail, "abandoned", 300)
        return problem(
            409, "in progress", "this delivery is being handled", "in_progress", self.retry_after
        )


def _show(handler: str, decision: str, answer: Outcome, seconds: float, span: Any) -> None:
    """A delivery in the metrics, the log and its span."""
    meters.DELIVERIES.labels(handler, decision).inc()
    # The usual decisions at debug (a busy worker's every request); the rest at info.
    usual = decision in ("new", "replayed")
    (log.debug if usual else log.info)(
        "inbox delivery",
        handler=handler,
        decision=decision,
        status=answer.status,
        seconds=round(seconds, 4),
    )
    shown: tracing.Attributes = {
        "outbox.inbox.decision": decision,
        "http.response.status_code": answer.status,
    }
    tracing.annotate(span, shown)
    if answer.status >= 500 and decision in _FAILED_BY_STATUS:
        tracing.failed(span, str(answer.status))


def for_cloud_tasks(answer: Outcome, decision: str) -> Outcome:
    """The answer as a Cloud Tasks HTTP target gives it. Cloud Tasks deletes a task on a 2xx
    only, retries every other answer (429 and 503 with more backoff, honouring Retry-After) and
    has no dead-letter queue. So a final answer that is not a success (a recorded refusal, a
    conflict, a malformed delivery) is 200 with the real status in ``Outbox-Inbox-Status``, or
    the task would be retried until its retry limit for nothing; "in progress" is 429."""
    if decision == "in_progress":
        return Outcome(429, answer.headers, answer.body)
    if 400 <= answer.status < 500 and decision in FINAL:
        real = ("Outbox-Inbox-Status", str(answer.status))
        return Outcome(200, (*answer.headers, real), answer.body)
    return answer


def _route_key(route: str) -> tuple[str, str]:
    method, _, path = route.strip().partition(" ")
    if not path.startswith("/"):
        raise ValueError(f"a route is 'METHOD /path', not {route!r}")
    return method.upper(), path


def _is_json(headers: Headers) -> bool:
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


class CutShort(Exception):
    """The sender went away before the whole body arrived: a part is never a delivery."""


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None past ``limit`` bytes; raises CutShort when the sender
    hangs up before its last part, so that a truncated body is never decided or handled."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise CutShort
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            break
    return bytes(body)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body once, then waits on the real one (a disconnect)."""
    given = False

    async def inner() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return inner


async def _send(send: Send, answer: Outcome) -> None:
    headers = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in answer.headers
        if name.lower() != "content-length"
    ]
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})

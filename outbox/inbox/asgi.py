"""The inbox as pure ASGI middleware (Starlette, FastAPI, any ASGI app).

For each declared route, the delivery is decided before the app sees it; only a new delivery
reaches the app, with its transaction open (``delivery(request).conn``). The app's response is
buffered, never streamed: nothing may reach the sender before COMMIT, because a worker
acknowledges outcomes, not intentions. Pure ASGI rather than Starlette's BaseHTTPMiddleware,
because a sender that hangs up must not cancel a commit under way (docs/design.md, "The inbox").
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, TypeVar

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
from outbox.inbox.core import Decision, Delivery, Identity, Inbox, Outcome, pairs_of
from outbox.inbox.external import RUNS, Claim, LeaseLost
from outbox.inbox.http import Headers

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
T = TypeVar("T", Delivery, Claim)


def delivery(request: Any) -> Delivery:
    """The delivery a handler runs for: ``delivery(request)`` (Starlette, FastAPI) or
    ``delivery(scope)``."""
    return _found(request, Delivery, "InboxMiddleware's declared routes")


def claimed(request: Any) -> Claim:
    """The claim a handler of an ``External`` route runs for: ``claimed(request)``."""
    return _found(request, Claim, "an External route of InboxMiddleware")


def _found(request: Any, kind: type[T], where: str) -> T:
    scope = getattr(request, "scope", request)
    found = scope.get("state", {}).get(DELIVERY)
    if not isinstance(found, kind):
        raise LookupError(f"this request did not come through {where}")  # noqa: TRY004
    return found


@dataclass
class _Captured:
    buffered: Buffered

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = pairs_of([(bytes(k), bytes(v)) for k, v in message.get("headers", ())])
            self.buffered.start(int(message["status"]), headers)
        elif message["type"] == "http.response.body":
            self.buffered.add(message.get("body", b""))


class InboxMiddleware(HTTPAdapter[ASGIApp, Inbox]):
    """Wraps an ASGI ``app`` (docs/design.md, "The inbox"; the options are HTTPAdapter's,
    shared with the WSGI middleware)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = None
        if scope["type"] == "http":
            handler = self.handler_for(scope["method"], scope["path"])
        if handler is None:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        with self.spans.delivery(handler, headers) as span:
            started = time.monotonic()
            answer, decision = await self._deliver(scope, receive, headers, handler, span)
            await _send(send, self.answered(handler, answer, decision, started, span))

    async def _deliver(
        self, scope: Scope, receive: Receive, headers: Headers, handler: str, span: Any
    ) -> tuple[Outcome, str]:
        try:
            body = await _read_body(receive, self.max_body_bytes)
            identity = self.identity(headers, body, handler, span)
        except REFUSED as exc:
            return self.refused(exc)
        return await self._decide(
            scope, receive, body, identity, is_json=is_json(headers), span=span
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
        mode = self.external.get(identity.handler)
        if mode is not None:
            return await self._claim(
                scope, receive, body, identity, mode, is_json=is_json, span=span
            )
        try:
            async with self.inbox.deliver(identity, body, is_json=is_json) as d:
                if d.decision is not Decision.NEW:
                    return self.answer(d), d.decision.value
                return await self._handle(scope, receive, body, d)
        except FAILED as exc:
            return self.failed(exc, identity.handler, span)

    async def _claim(
        self,
        scope: Scope,
        receive: Receive,
        body: bytes,
        identity: Identity,
        mode: External,
        *,
        is_json: bool,
        span: Any,
    ) -> tuple[Outcome, str]:
        """External-effect mode: the claim commits first; the app's answer and its writes on
        ``claim.transaction()`` commit together, fenced by the claim's token."""
        claim = self.inbox.claim(
            identity, body, is_json=is_json, lease=mode.lease, max_claims=mode.max_claims
        )
        try:
            async with claim as c:
                if c.decision not in RUNS:
                    return self.answer(c), c.decision.value
                answer, decision = await self._handle(scope, receive, body, c)
                await c.settle()
                return answer, decision
        except LeaseLost:  # from settle, or the handler's own transaction(): rolled back
            return self.lease_lost(identity.handler)
        except FAILED as exc:
            return self.failed(exc, identity.handler, span)

    async def _handle(
        self, scope: Scope, receive: Receive, body: bytes, d: Delivery | Claim
    ) -> tuple[Outcome, str]:
        """Run the app for a new delivery, its answer buffered until the inbox decides."""
        captured = _Captured(self.buffer())
        inner = dict(scope)
        inner["state"] = {**scope.get("state", {}), DELIVERY: d}
        started = time.monotonic()
        try:
            await self.app(inner, _replaying(body, receive), captured.send)
        except LeaseLost:
            raise  # its claim was taken over: "in progress", not the handler's failure
        except Exception as exc:
            raise HandlerFailed() from exc
        return self.conclude(d, captured.buffered.outcome(), started)


async def _read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body; raises BodyTooLarge past ``limit`` bytes, and CutShort when the
    sender hangs up before its last part, so that a truncated body is never decided or handled."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise CutShort
        body += message.get("body", b"")
        if len(body) > limit:
            raise BodyTooLarge
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

"""The NATS JetStream provider, `type = "nats"` (docs/providers.md, "NATS JetStream"): each
operation one message on its action's subject, stored by the stream the action names, with the
stored key as Nats-Msg-Id, so that JetStream drops a repeat inside the stream's
duplicate_window and answers it with the original's sequence.

One connection per provider (outbox.providers.nats.link), every publish in flight on it at once
(nats-py multiplexes the acknowledgements on one inbox). Before a connection carries a publish,
the duplicate_window of every stream the actions use is checked against key_retention: at start
a refusal stops `outbox run`; on a later connection it pauses the provider (Failed transient,
pause=True) with the fix logged, so nothing is sent and nothing is lost, until the stream or the
config is fixed: the next probe connects and checks again. What each answer means is
outbox.providers.nats.faults'.

No lookup: JetStream finds a message by sequence or by its subject's last message, not by
Nats-Msg-Id, and a stream that removed the message (work queue, max_age, a purge) could not
prove its absence. An operation past its window goes to a person.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
import structlog

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core import payloads
from outbox.providers import building, queue_kit
from outbox.providers.base import (
    Failed,
    InvalidRequest,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)
from outbox.providers.nats import faults as nats_faults
from outbox.providers.nats.config import MSG_ID, NatsOptions, Route, nats_options
from outbox.providers.nats.link import Connection, Link

CONTENT_TYPE: Final = "application/json"
_HEADER_FRAMING: Final = len(b"NATS/1.0\r\n\r\n")

log = structlog.get_logger("outbox.providers")


def build(
    ps: ProviderSettings, environ: Mapping[str, str] | None = None, *, concurrency: int = 64
) -> NatsProvider:
    """The provider of ``ps``; ``concurrency`` publishes share its one connection."""
    del concurrency  # one connection carries them all, pipelined
    return NatsProvider(ps, nats_options(ps, environ))


class NatsProvider:
    def __init__(self, ps: ProviderSettings, options: NatsOptions) -> None:
        self._ps = ps
        self.options = options
        self._connection = Connection(ps, options)

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def key_retention(self) -> timedelta:
        return self.options.key_retention

    @property
    def actions(self) -> tuple[str, ...]:
        return tuple(a for a in self.options.routes if a != "*")

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        self._route(action)

    def check_key(self, action: str, key: str) -> None:
        """Refuse a key Nats-Msg-Id cannot carry (none outbox stores: every form fits)."""
        if building.key_problem(key) is None:
            problem = self.options.key.problem(self.options.key.wire(key))
            if problem is not None:
                raise InvalidRequest(problem)

    async def start(self) -> None:
        """Connect and check the windows: a ConfigError stops `outbox run`; a broker that does
        not answer is logged, and the first send connects and checks then."""
        try:
            await self._connection.get()
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 (down is no reason not to start)
            if nats_faults.refuses_credentials(exc):
                # The message says it all: no traceback (TRY400).
                log.error("NATS refuses the credentials", provider=self.name)  # noqa: TRY400
                return
            log.warning(
                "NATS does not answer; the streams' windows are checked on the first "
                "connection, and nothing is published before",
                provider=self.name,
                error_class=type(exc).__name__,
            )

    async def send(self, request: SendRequest) -> SendResult:
        message = self._message(request)
        if isinstance(message, Failed):
            return message
        route, body, headers = message
        link = await self._link()
        if isinstance(link, Failed):
            return link
        oversize = _oversize(link, body, headers)
        if oversize is not None:
            return oversize
        try:
            return await self._publish(link, route, body, headers)
        except Exception as exc:  # noqa: BLE001 (send never raises; the message may have left)
            return unknown("publish_failed", f"the publish raised {type(exc).__name__}")

    async def _link(self) -> Link | Failed:
        """The connection, or why there is none: nothing was sent."""
        try:
            return await self._connection.get()
        except ConfigError as exc:
            return transient("config_refused", str(exc), pause=True)
        except Exception as exc:  # noqa: BLE001 (whatever stopped the connection, nothing left)
            if nats_faults.refuses_credentials(exc):
                return transient("credentials", "NATS refused the credentials", pause=True)
            return transient("connect_refused", f"cannot connect to NATS ({type(exc).__name__})")

    def _message(self, request: SendRequest) -> tuple[Route, bytes, dict[str, str]] | Failed:
        """Where the operation goes, its body and headers; or why it cannot be sent."""
        try:
            route = self._route(request.action)
        except InvalidRequest as exc:
            return permanent("invalid_request", str(exc), not_sent=True, request_only=True)
        unfit = building.key_problem(request.idempotency_key)
        if unfit is not None:
            return unfit
        wire = self.options.key.wire(request.idempotency_key)
        problem = self.options.key.problem(wire)
        if problem is not None:
            return building.unsendable(problem)
        headers = queue_kit.message_headers(request)
        headers[MSG_ID] = wire
        headers["Content-Type"] = CONTENT_TYPE
        body = (request.payload_json or payloads.encode(request.payload)).encode()
        return route, body, headers

    async def _publish(
        self, link: Link, route: Route, body: bytes, headers: dict[str, str]
    ) -> SendResult:
        assert link.js is not None  # noqa: S101
        if link.closed.done():  # lost since it was handed out: nothing is written to it
            return transient("not_connected", "the connection to NATS was lost")
        denied = link.refused(route.subject)
        timeout = self.options.timeout.total_seconds()
        # Nats-Expected-Stream: a subject bound to another stream is refused, not stored there.
        ack = asyncio.ensure_future(
            link.js.publish(
                route.subject, body, timeout=timeout, stream=route.stream, headers=headers
            )
        )
        try:
            await asyncio.wait((ack, link.closed, denied), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not ack.done():
                ack.cancel()
        if ack.done() and not ack.cancelled():
            exc = ack.exception()
            if exc is None:
                answer = nats_faults.acknowledged(ack.result(), route.stream)
                return await self._ours(link, route, answer, headers, body)
            return await self._failed(exc, link, route)
        if denied.done():
            return transient(
                "permission_denied",
                f"NATS refuses these credentials to publish to {route.subject}",
                pause_action=True,
            )
        return unknown(
            "connection_lost",
            f"the connection to NATS was lost before JetStream acknowledged {route.subject}",
        )

    async def _ours(
        self, link: Link, route: Route, answer: SendResult, headers: Mapping[str, str], body: bytes
    ) -> SendResult:
        """A duplicate is a success only if the message JetStream kept under our Nats-Msg-Id is
        this operation's. Another producer on the stream (a second outbox database, whose derived
        keys are the same hash of the same identity, or any client) may hold the id: taking its
        message as ours would record a message that was never published (docs/providers.md,
        "One owner of the message ids")."""
        result = answer.result if isinstance(answer, Succeeded) else None
        if not (isinstance(answer, Succeeded) and result and result["duplicate"] and result["seq"]):
            return answer
        assert link.js is not None  # noqa: S101
        try:
            kept = await link.js.get_msg(route.stream, result["seq"])
        except nats.js.errors.NotFoundError:
            return await self._vanished(link, route, answer, result["seq"])
        except Exception as exc:  # noqa: BLE001 (not read: unknown, retried inside the window)
            why = f"reading {answer.reference} raised {type(exc).__name__}"
            return unknown("duplicate_unread", why)
        kept_headers = dict(kept.headers or {})
        return nats_faults.duplicate_of(answer, kept_headers, kept.data or b"", headers, body)

    async def _vanished(self, link: Link, route: Route, answer: Succeeded, seq: int) -> SendResult:
        """No message at the duplicate's sequence: whether the stream ever reached it."""
        assert link.js is not None  # noqa: S101
        try:
            info = await link.js.stream_info(route.stream)
        except Exception as exc:  # noqa: BLE001 (not read: unknown, retried inside the window)
            why = f"reading the stream {route.stream} raised {type(exc).__name__}"
            return unknown("duplicate_unread", why)
        return nats_faults.vanished(answer, seq, int(info.state.last_seq or 0))

    async def _failed(self, exc: BaseException, link: Link, route: Route) -> Failed:
        if isinstance(exc, (*nats_faults.NOT_SENT, nats.errors.MaxPayloadError)):
            return nats_faults.not_sent(exc)
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            return await self._no_responders(link, route)
        return nats_faults.publish_failed(exc, route.subject, route.stream)

    async def _no_responders(self, link: Link, route: Route) -> Failed:
        """Nothing took the subject: unroutable, unless the stream says it binds it (it is
        recovering or electing a leader, and the next try may be stored)."""
        assert link.js is not None  # noqa: S101
        try:
            info = await link.js.stream_info(route.stream)
        except nats.js.errors.NotFoundError:
            why = f"the stream {route.stream} does not exist"
            return nats_faults.unroutable(route.subject, route.stream, why)
        except Exception as exc:  # noqa: BLE001 (JetStream itself did not answer)
            return transient("no_responders", f"JetStream did not answer ({type(exc).__name__})")
        subjects = list(info.config.subjects or ())
        if any(nats_faults.subject_matches(p, route.subject) for p in subjects):
            return transient(
                "stream_unavailable",
                f"the stream {route.stream} takes {route.subject} but did not answer",
            )
        takes = ", ".join(subjects[:5]) + (", ..." if len(subjects) > 5 else "")
        why = f"the stream {route.stream} takes {takes or 'no subjects'}"
        return nats_faults.unroutable(route.subject, route.stream, why)

    def _route(self, action: str) -> Route:
        route = queue_kit.action_of(self.options.routes, action)
        if route is None:
            known = ", ".join(sorted(self.options.routes)) or "none"
            raise InvalidRequest(f"provider {self.name} has no action {action!r} (it has: {known})")
        return route

    async def aclose(self) -> None:
        await self._connection.aclose()


def _oversize(link: Link, body: bytes, headers: Mapping[str, str]) -> Failed | None:
    """The server refuses a message over max_payload by closing the connection, and every
    publish in flight on it with it: counted here, headers too (nats-py counts only the body)."""
    assert link.nc is not None  # noqa: S101 (set by _open)
    size = len(body) + _HEADER_FRAMING + sum(len(k) + len(v) + 4 for k, v in headers.items())
    if size <= link.nc.max_payload:
        return None
    return nats_faults.too_large(
        f"the message is {size} bytes with its headers; the server takes at most "
        f"{link.nc.max_payload} (max_payload)"
    )

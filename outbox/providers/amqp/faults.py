"""What RabbitMQ's answers and faults mean for an operation (docs/providers.md, "RabbitMQ").

A publish on a channel in confirm mode ends in one of: basic.ack (the broker took
responsibility: routed, and written to disk for a persistent message to a durable queue);
basic.return then basic.ack (a mandatory message no queue is bound for: NO_ROUTE, 312);
basic.nack (the broker refuses responsibility: a queue with x-overflow = reject-publish is full,
or a queue's process failed; nothing in that queue, though a fan-out's other queues may hold a
copy); the channel closed (404: no such exchange; 403: no write permission; 406: a message
over max_message_size); the connection closed; or no answer in time. Only the last two leave
the message's fate open.

The messages name the destination and the broker's own words, never the payload or a secret.
"""

from __future__ import annotations

import asyncio
import re
import socket
import ssl
from datetime import timedelta
from typing import Final

import aiormq.exceptions as amqp_errors

from outbox.providers.amqp.config import Route
from outbox.providers.base import Failed, permanent, transient, unknown

# How long a full reject-publish queue is given before the next try: long enough for
# consumers to drain some of it, short enough that the queue does not idle once they have.
FULL_QUEUE_RETRY: Final = timedelta(seconds=2)
# A memory or disk alarm lasts until the broker's operator (or its consumers) free the resource.
BLOCKED_RETRY: Final = timedelta(seconds=5)
NO_ROUTE: Final = 312
# The quarantine reason of a message no queue takes (a stable word, as nats and sqs write it).
REASON_UNROUTABLE: Final = "unroutable"
# The broker's words quoted in a message: its reply texts are short, but never unbounded.
_SAID_CHARS: Final = 300
_NO_EXCHANGE: Final = re.compile(r"no exchange '(.*)' in vhost")


def said(exc: BaseException) -> str:
    """The broker's or the socket's own words, for operators."""
    text = " ".join(str(a) for a in exc.args if isinstance(a, str | int)) or type(exc).__name__
    return text[:_SAID_CHARS]


def not_connected(exc: BaseException, broker: str, vhost: str) -> Failed:  # noqa: PLR0911 (a decision table)
    """A connection that could not be opened: nothing was sent."""
    if isinstance(exc, amqp_errors.ProbableAuthenticationError | amqp_errors.AuthenticationError):
        return transient(
            "credentials_refused",
            f"RabbitMQ at {broker} refused the login: {said(exc)}",
            pause=True,
        )
    if isinstance(exc, amqp_errors.InvalidFrameError) and "Connection.Close" in said(exc):
        # The broker answered connection.open with connection.close: the virtual host does
        # not exist, or the user may not use it (530 NOT_ALLOWED; aiormq drops the code).
        return transient(
            "vhost_refused",
            f"RabbitMQ at {broker} refused to open the virtual host {vhost!r}: it does not "
            "exist, or the user has no permission on it",
            pause=True,
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        return transient("tls_verify", f"the certificate of {broker} does not verify: {exc}")
    if isinstance(exc, TimeoutError):
        return transient("connect_timeout", f"no connection to {broker} in time")
    if isinstance(exc, socket.gaierror):
        return transient("dns", f"cannot resolve the host of {broker}: {said(exc)}")
    if isinstance(exc, ConnectionRefusedError) or _errno(exc) == 111:
        return transient("connect_refused", f"RabbitMQ at {broker} refused the connection")
    return transient("connect_failed", f"no connection to {broker}: {type(exc).__name__}")


def blocked(broker: str) -> Failed:
    """connection.blocked: a memory or disk alarm; the broker reads no publishes until it
    clears, so none is written."""
    return transient(
        "connection_blocked",
        f"RabbitMQ at {broker} blocked publishing (a memory or disk alarm); nothing sent",
        retry_after=BLOCKED_RETRY,
        spends_attempt=False,
    )


def returned(route: Route, reply_code: int | None, reply_text: str | None) -> Failed:
    """basic.return of a mandatory message: no queue is bound for it."""
    return permanent(
        "unroutable",
        f"RabbitMQ returned the message as unroutable ({reply_code} {reply_text}): no queue "
        f"is bound to exchange {route.exchange or 'amq.default'!r} for routing key "
        f"{route.routing_key!r}",
        request_only=True,
        reason=REASON_UNROUTABLE,
    )


def nacked(route: Route) -> Failed:
    """basic.nack: the broker refuses responsibility. RabbitMQ sends one when a queue with
    x-overflow = reject-publish (or reject-publish-dlx) is full, and when a queue's process
    failed; AMQP 0-9-1 carries no reason. Either way that queue did not take the message and
    the docs say the publisher may publish it again: backpressure, retried without spending the
    attempt. (Where the exchange fans out to queues that did take it, the retry gives them a
    second copy with the same message_id, which consumers drop.)"""
    return transient(
        "nack",
        f"RabbitMQ refused the message for {route.destination} (basic.nack): a queue it routes "
        "to is full with x-overflow = reject-publish, or unavailable",
        retry_after=FULL_QUEUE_RETRY,
        spends_attempt=False,
        request_only=True,
    )


def channel_closed(exc: amqp_errors.ChannelClosed, route: Route) -> Failed:
    """The broker closed the channel while this publish was on it. Every publish in flight on
    the channel sees the same close: only the one to the exchange it names is refused; for the
    others the close says nothing of their fate."""
    text = said(exc)
    if isinstance(exc, amqp_errors.ChannelNotFoundEntity):
        match = _NO_EXCHANGE.search(text)
        if match is not None and match.group(1) == route.exchange:
            return exchange_missing(route)
    if isinstance(exc, amqp_errors.ChannelAccessRefused) and _names(text, route):
        return transient(
            "access_refused",
            f"RabbitMQ refused the user write access to exchange "
            f"{route.exchange or 'amq.default'!r}: {text}",
            pause_action=True,
            request_only=True,
        )
    if isinstance(exc, amqp_errors.ChannelPreconditionFailed) and "max size" in text:
        return permanent(
            "message_too_large",
            f"RabbitMQ refused the message as larger than its max_message_size: {text}",
            request_only=True,
            reason="message_too_large",
        )
    return unknown(
        "channel_closed",
        f"RabbitMQ closed the channel before confirming the publish to {route.destination}: {text}",
    )


def exchange_missing(route: Route) -> Failed:
    return permanent(
        "exchange_not_found",
        f"RabbitMQ has no exchange {route.exchange!r} (404 NOT_FOUND) for routing key "
        f"{route.routing_key!r}: declare it, or fix the action's exchange",
        request_only=True,
        reason=REASON_UNROUTABLE,
    )


def after_publish(exc: BaseException, route: Route, broker: str) -> Failed:
    """A publish that may have left: its fate is open unless the broker said otherwise."""
    if isinstance(exc, amqp_errors.PublishError):
        frame = exc.frame
        return returned(
            route, getattr(frame, "reply_code", None), getattr(frame, "reply_text", None)
        )
    if isinstance(exc, amqp_errors.DeliveryError):
        return nacked(route)
    if isinstance(exc, amqp_errors.ChannelClosed):
        return channel_closed(exc, route)
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return unknown(
            "confirm_timeout", f"RabbitMQ at {broker} did not confirm the publish in time"
        )
    return unknown(
        "connection_lost",
        f"the connection to {broker} broke before the publish to {route.destination} was "
        f"confirmed: {type(exc).__name__}",
    )


def _names(text: str, route: Route) -> bool:
    return f"exchange '{route.exchange}'" in text or (
        not route.exchange and "exchange 'amq.default'" in text
    )


def _errno(exc: BaseException) -> int | None:
    if isinstance(exc, OSError):
        return exc.errno
    for arg in exc.args:
        if isinstance(arg, int):
            return arg
    return None

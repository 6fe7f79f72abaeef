"""The inbox for NATS JetStream consumers (the ``nats`` extra): ``consume`` pulls messages from
a durable consumer and settles each as JetStream expects once its transaction ended.

``ack`` what committed or was recorded before; ``nak(delay)`` what is in progress or failed, so
it comes again no sooner than ``retry_after``; ``term`` what can never succeed (a conflict, a
recorded refusal, a malformed message), so JetStream stops redelivering it. Never an ack before
COMMIT: a consumer that dies between COMMIT and ack leaves a message JetStream redelivers after
AckWait, and the redelivery is a replay (docs/design.md, "The inbox"). On a stop, the messages
cut short by the grace are ``nak``ed without delay (outbox.inbox.draining).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Unpack

import structlog
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig

from outbox.inbox.core import Inbox
from outbox.inbox.draining import DEFAULT_GRACE, draining
from outbox.inbox.queues import (
    ClaimHandle,
    Consumer,
    Handle,
    Options,
    Settled,
    Verdict,
    consumer_with,
    lower,
)

log = structlog.get_logger("outbox.inbox")


async def consume(
    js: JetStreamContext,
    consumer: Consumer,
    *,
    stream: str,
    durable: str,
    stop: asyncio.Event,
    subject: str | None = None,
    batch: int = 16,
    ack_wait: float = 30.0,
    grace: float = DEFAULT_GRACE,
) -> None:
    """Handle the messages of ``durable`` (created when missing) until ``stop`` is set or the
    task is cancelled, then drain: no more fetches, ``grace`` seconds for the messages under way,
    the rest given back. At most ``batch`` at once, each in its own task and transaction.
    :func:`consumer_of` makes a Consumer keyed as JetStream messages are."""
    config = ConsumerConfig(durable_name=durable, ack_wait=ack_wait)
    sub = await js.pull_subscribe(subject or "", durable=durable, stream=stream, config=config)
    try:
        async with draining(consumer, stop, grace) as in_flight:
            while room := await in_flight.room(batch):
                try:
                    messages = await sub.fetch(room, timeout=0.5)
                except (TimeoutError, NatsTimeout):
                    continue
                for msg in messages:
                    answer = functools.partial(_answer, msg)
                    in_flight.take(lower(msg.headers), msg.data, answer, msg.nak)
    finally:
        await sub.unsubscribe()


async def _answer(msg: Msg, settled: Settled) -> None:
    if settled.verdict is Verdict.ACK:
        await msg.ack()
    elif settled.verdict is Verdict.RETRY:
        await msg.nak(delay=settled.delay)
    else:
        await msg.term()


def consumer_of(
    inbox: Inbox, handler: str, handle: Handle | ClaimHandle, **options: Unpack[Options]
) -> Consumer:
    """A Consumer keyed by outbox's operation, else the publisher's ``Nats-Msg-Id`` (the id
    JetStream itself deduplicates by)."""
    return consumer_with("nats-msg-id", inbox, handler, handle, **options)

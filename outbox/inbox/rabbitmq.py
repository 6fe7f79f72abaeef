"""The inbox for RabbitMQ consumers (the ``amqp`` extra): ``consume`` takes a queue's messages
and settles each as RabbitMQ expects once its transaction ended.

``ack`` what committed or was recorded before; ``reject`` without requeue what can never succeed
(a conflict, a recorded refusal, a malformed message), so that it goes to the queue's
dead-letter exchange where one is set, and never comes back on its own; and for what is in
progress or failed, hold the message ``retry_after`` first, then ``nack`` with requeue, since
RabbitMQ has no delayed requeue (a quorum queue counts each requeue toward its delivery limit,
20 by default since 4.0: the hold keeps a slow first delivery from exhausting its copies). Never
an ack before COMMIT: a consumer that dies between the two leaves the message unacknowledged,
RabbitMQ delivers it again, and the redelivery replays (docs/design.md, "The inbox"). On a
stop, the messages cut short by the grace are ``nack``ed with requeue at once
(outbox.inbox.draining).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Unpack

from aio_pika.abc import AbstractIncomingMessage, AbstractQueue

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


async def consume(
    queue: AbstractQueue, consumer: Consumer, *, stop: asyncio.Event, grace: float = DEFAULT_GRACE
) -> None:
    """Handle ``queue``'s messages until ``stop`` is set or the task is cancelled, then drain:
    no more deliveries, ``grace`` seconds for the messages under way, the rest given back. As
    many at once as the channel's prefetch allows, each in its own task and transaction."""
    async with draining(consumer, stop, grace) as in_flight:

        async def on_message(message: AbstractIncomingMessage) -> None:
            answer = functools.partial(_answer, message)
            give_back = functools.partial(message.nack, requeue=True)
            in_flight.take(headers_of(message), message.body, answer, give_back)

        tag = await queue.consume(on_message)
        try:
            await stop.wait()
        finally:
            in_flight.close()
            await queue.cancel(tag)  # no more deliveries, before the drain


def headers_of(message: AbstractIncomingMessage) -> dict[str, str]:
    """The message's headers as text, lower-case, with its message_id as ``:message-id``."""
    found = {
        name: value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)
        for name, value in (message.headers or {}).items()
        if isinstance(value, str | bytes | int)
    }
    if message.message_id:
        found[":message-id"] = message.message_id
    return lower(found)


async def _answer(message: AbstractIncomingMessage, settled: Settled) -> None:
    if settled.verdict is Verdict.ACK:
        await message.ack()
    elif settled.verdict is Verdict.RETRY:
        await asyncio.sleep(settled.delay)
        await message.nack(requeue=True)
    else:
        await message.reject(requeue=False)


def consumer_of(
    inbox: Inbox, handler: str, handle: Handle | ClaimHandle, **options: Unpack[Options]
) -> Consumer:
    """A Consumer keyed by outbox's operation, else the publisher's ``message_id`` property."""
    return consumer_with(":message-id", inbox, handler, handle, **options)

"""The inbox for Amazon SQS consumers (the ``sqs`` extra): ``consume`` receives a queue's
messages and settles each as SQS allows once its transaction ended.

``DeleteMessage`` what committed or was recorded before. SQS has no reject: a message that can
never succeed (a conflict, a recorded refusal, a malformed message) is copied to the dead-letter
queue given (then deleted), or, without one, deleted (the inbox counted the conflict; a
malformed message is logged). What is in progress or failed gets ``ChangeMessageVisibility`` of
``retry_after``, so it comes back no sooner, and is never deleted. A consumer that dies between
COMMIT and delete leaves the message to reappear after its visibility timeout; the redelivery
replays (docs/design.md, "The inbox"). SQS's ``MessageId`` is new for every send, so it tells a
redelivery apart and nothing more: outbox's own messages carry their operation. On a stop, the
messages cut short by the grace get ``ChangeMessageVisibility`` of 0, to be received again at
once (outbox.inbox.draining).
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Mapping
from typing import Any, Unpack

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
    client: Any,
    queue_url: str,
    consumer: Consumer,
    *,
    stop: asyncio.Event,
    dead_letter_url: str | None = None,
    batch: int = 10,
    wait_seconds: int = 1,
    grace: float = DEFAULT_GRACE,
) -> None:
    """Handle the messages of ``queue_url`` with an aiobotocore SQS ``client`` until ``stop``
    is set or the task is cancelled, then drain: no more receives, ``grace`` seconds for the
    messages under way, the rest given back. At most ``batch`` at once, each in its own task and
    transaction."""
    async with draining(consumer, stop, grace) as in_flight:
        while room := await in_flight.room(batch):
            received = await client.receive_message(
                QueueUrl=queue_url,
                MaxNumberOfMessages=min(room, 10),  # SQS's most per receive
                WaitTimeSeconds=wait_seconds,
                MessageAttributeNames=["All"],
            )
            for message in received.get("Messages", []):
                body = str(message.get("Body", "")).encode()
                answer = functools.partial(_answer, client, queue_url, message, dead_letter_url)
                give_back = functools.partial(_give_back, client, queue_url, message)
                in_flight.take(headers_of(message), body, answer, give_back)


def headers_of(message: Mapping[str, Any]) -> dict[str, str]:
    """The message's string attributes, lower-case, with its MessageId as ``:message-id``."""
    found = {
        name: str(attribute["StringValue"])
        for name, attribute in message.get("MessageAttributes", {}).items()
        if "StringValue" in attribute
    }
    found[":message-id"] = str(message["MessageId"])
    return lower(found)


async def _answer(
    client: Any,
    queue_url: str,
    message: Mapping[str, Any],
    dead_letter_url: str | None,
    settled: Settled,
) -> None:
    receipt = message["ReceiptHandle"]
    if settled.verdict is Verdict.RETRY:
        seconds = min(43_200, max(0, math.ceil(settled.delay)))  # SQS's bounds: 0 to 12 h
        await client.change_message_visibility(
            QueueUrl=queue_url, ReceiptHandle=receipt, VisibilityTimeout=seconds
        )
        return
    if settled.verdict is Verdict.DROP and dead_letter_url is not None:
        await client.send_message(
            QueueUrl=dead_letter_url,
            MessageBody=message.get("Body", ""),
            MessageAttributes=message.get("MessageAttributes", {}),
        )
    await client.delete_message(QueueUrl=queue_url, ReceiptHandle=receipt)


async def _give_back(client: Any, queue_url: str, message: Mapping[str, Any]) -> None:
    await client.change_message_visibility(
        QueueUrl=queue_url, ReceiptHandle=message["ReceiptHandle"], VisibilityTimeout=0
    )


def consumer_of(
    inbox: Inbox, handler: str, handle: Handle | ClaimHandle, **options: Unpack[Options]
) -> Consumer:
    """A Consumer keyed by outbox's operation, else SQS's ``MessageId`` (new on every send: a
    redelivery key only)."""
    return consumer_with(":message-id", inbox, handler, handle, **options)

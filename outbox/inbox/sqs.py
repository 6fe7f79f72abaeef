"""The inbox for Amazon SQS consumers (the ``sqs`` extra): ``consume`` receives a queue's
messages and settles each as SQS allows once its transaction ended.

``DeleteMessage`` what committed or was recorded before. SQS has no reject: a message that can
never succeed (a conflict, a recorded refusal, a malformed message) is copied to the dead-letter
queue given (then deleted), or, without one, deleted (the inbox counted the conflict; a
malformed message is logged). What is in progress or failed gets ``ChangeMessageVisibility`` of
``retry_after``, so it comes back no sooner, and is never deleted. A consumer that dies between
COMMIT and delete leaves the message to reappear after its visibility timeout; the redelivery
replays (docs/design.md, "The inbox"). SQS's ``MessageId`` is new for every send, so it tells a
redelivery apart and nothing more: outbox's own messages carry their operation.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from typing import Any

from outbox.inbox.core import Inbox
from outbox.inbox.http import KeyFrom, TenantFrom
from outbox.inbox.queues import Consumer, Handle, Verdict, consumer_with, lower


async def consume(
    client: Any,
    queue_url: str,
    consumer: Consumer,
    *,
    stop: asyncio.Event,
    dead_letter_url: str | None = None,
    batch: int = 10,
    wait_seconds: int = 1,
) -> None:
    """Handle the messages of ``queue_url`` with an aiobotocore SQS ``client`` until ``stop``
    is set; each received batch runs concurrently, each message in its own transaction."""
    while not stop.is_set():
        answer = await client.receive_message(
            QueueUrl=queue_url,
            MaxNumberOfMessages=batch,
            WaitTimeSeconds=wait_seconds,
            MessageAttributeNames=["All"],
        )
        messages = answer.get("Messages", [])
        await asyncio.gather(
            *(_one(client, queue_url, m, consumer, dead_letter_url) for m in messages)
        )


def headers_of(message: Mapping[str, Any]) -> dict[str, str]:
    """The message's string attributes, lower-case, with its MessageId as ``:message-id``."""
    found = {
        name: str(attribute["StringValue"])
        for name, attribute in message.get("MessageAttributes", {}).items()
        if "StringValue" in attribute
    }
    found[":message-id"] = str(message["MessageId"])
    return lower(found)


async def _one(
    client: Any,
    queue_url: str,
    message: Mapping[str, Any],
    consumer: Consumer,
    dead_letter_url: str | None,
) -> None:
    body = str(message.get("Body", "")).encode()
    settled = await consumer.settle(headers_of(message), body)
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


def consumer_of(
    inbox: Inbox,
    handler: str,
    handle: Handle,
    *,
    retry_after: float = 1.0,
    key: KeyFrom | None = None,
    tenant: TenantFrom | None = None,
) -> Consumer:
    """A Consumer keyed by outbox's operation, else SQS's ``MessageId`` (new on every send: a
    redelivery key only)."""
    return consumer_with(
        ":message-id", inbox, handler, handle, retry_after=retry_after, key=key, tenant=tenant
    )

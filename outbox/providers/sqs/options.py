"""The options of `type = "sqs"` (docs/providers.md, "Queues").

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options
puts ``OPTIONS`` into PROVIDER_OPTIONS, so this module stays pure, declarations only, no client
library; config.py beside it reads a provider's table by them.

No credential is an option: the provider takes them from the standard AWS chain (the
environment's AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_SESSION_TOKEN, a profile of the
shared config files, a web identity token, the instance's or the task's role), never from the
config file.
"""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Boolean, Choice, Count, Opaque, Setting

# SQS's largest message since January 2026 (body and every attribute's name, type and value):
# a queue's own MaximumMessageSize may be lower, and the provider reads it at start.
MAX_MESSAGE_BYTES: Final = 1 << 20

OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "region",
        Opaque("AWS region name, such as `eu-west-1`"),
        "The region of the queues, where requests are signed and sent.",
    ),
    Setting(
        "endpoint_url",
        Opaque("`https://` URL (`http://` only to loopback, or with allow_insecure)"),
        "Another SQS endpoint: a VPC interface endpoint, LocalStack or moto.",
        default=None,
        default_doc="the region's public endpoint",
    ),
    Setting(
        "profile",
        Opaque("profile name of the shared AWS config files"),
        "The profile whose credentials (or role_arn, credential_process...) the provider uses; "
        "never keys in this file.",
        default=None,
        default_doc="the standard chain (AWS_PROFILE, the environment, the instance role)",
    ),
    Setting(
        "allow_insecure",
        Boolean(),
        "Send signed requests over http:// to a host other than loopback, which is refused "
        "otherwise (a signature is no secret, but the messages are in clear text).",
        default=False,
    ),
    Setting(
        "key_form",
        Choice(("sha256", "stored")),
        "How the idempotency key travels as a FIFO queue's MessageDeduplicationId: its SHA-256 "
        "in hex (64 characters, so every key fits SQS's 128 characters of punctuation and "
        "alphanumerics), or as stored (an application's key that does not fit is refused).",
        default="sha256",
    ),
    Setting(
        "max_message_bytes",
        Count(most=MAX_MESSAGE_BYTES, unit="bytes"),
        "The largest message sent, body and attributes counted as SQS counts them; a larger "
        "one is refused before it is sent. A queue's lower MaximumMessageSize, read at start, "
        "wins.",
        default=MAX_MESSAGE_BYTES,
    ),
    Setting(
        "actions",
        Opaque('table of actions (docs/providers.md, "Amazon SQS")'),
        "Per action: queue_url, message_group (FIFO queues) and delay_seconds (standard "
        'queues). `"*"` takes any other action.',
        env=False,
    ),
)

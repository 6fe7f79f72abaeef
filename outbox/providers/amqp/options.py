"""The options of `type = "amqp"` (docs/providers.md, "Queues": RabbitMQ).

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options
puts ``OPTIONS`` into PROVIDER_OPTIONS, so this module stays pure, declarations only, no client
library; config.py beside it reads a provider's table by them."""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Count, Opaque, Setting

# A publish in flight on a channel that the broker closes (a publish to an exchange deleted
# since it was checked) loses its confirmation; four channels keep that to a quarter of the
# publishes in flight, and pipelining on each already carries thousands a second.
DEFAULT_CHANNELS: Final = 4

OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "url",
        Opaque("`amqp://` or `amqps://` URL: host, port and virtual host, no credentials"),
        "The broker, as `amqp://host:5672/vhost` (the virtual host percent-encoded: `%2F` is "
        "`/`, which an empty path also means). A user or password in it is refused: they come "
        "from `username` and `password`.",
    ),
    Setting(
        "username",
        Opaque("text"),
        "The user outbox logs in as. Without `username` and `password`, RabbitMQ's guest/guest, "
        "which the broker only takes from loopback, and outbox only sends to a loopback host.",
        default=None,
        default_doc="`guest`, on a loopback host only",
    ),
    Setting(
        "password",
        Opaque('`{env = "VAR"}` or `{file = "/path"}`'),
        "The user's password, read from the environment or a file (under systemd, relative to "
        "$CREDENTIALS_DIRECTORY), never written in the config file and never logged.",
        default=None,
        default_doc="`guest`, on a loopback host only",
        env=False,
    ),
    Setting(
        "ca_file",
        Opaque("path"),
        "The CA certificates that sign the broker's certificate, for `amqps://`; without it, "
        "the system's trust store. The broker's name is always verified.",
        default=None,
        default_doc="the system's",
    ),
    Setting(
        "actions",
        Opaque('table of actions (docs/providers.md, "RabbitMQ")'),
        'Per action (`"*"`: any other): `exchange` (`""`, the default, routes by queue '
        "name), `routing_key` (required), `mandatory` (true: an unroutable message is returned "
        "and the operation quarantined), `persistent` (true: delivery_mode 2) and `unroutable` "
        '(`"quarantine"`, or `"succeed"` where a message nobody is bound for is fine).',
        env=False,
    ),
    Setting(
        "key_form",
        Opaque("`stored`, `uuid` or `sha256`"),
        "How the key is written into the message_id property: as stored (outbox's own keys are "
        "68 characters), as a version 8 UUID of it, or as its SHA-256 in hex, for consumers "
        "whose deduplication store takes only those.",
        default="stored",
    ),
    Setting(
        "channels",
        Count(most=64),
        "The channels publishes are spread over, on one connection; each carries many "
        "publishes in flight (publisher confirms, pipelined).",
        default=DEFAULT_CHANNELS,
        default_doc=f"{DEFAULT_CHANNELS}, at most `dispatcher.concurrency`",
    ),
)

"""The options of `type = "nats"` (docs/providers.md, "Queues": NATS JetStream).

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options
puts ``OPTIONS`` into PROVIDER_OPTIONS, so this module stays pure, declarations only, no client
library; config.py beside it reads a provider's table by them."""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Boolean, Choice, FileName, Opaque, Setting

# The NATS server's own default address: a broker on this host, as `nats-server -js` starts it.
DEFAULT_SERVERS: Final = ("nats://127.0.0.1:4222",)

OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "servers",
        Opaque(
            "array of `nats://` or `tls://` URLs, no credentials (or one text, comma-separated)"
        ),
        "The servers of the cluster, tried in turn on each connection (a lost connection is "
        "opened again on the next publish, and the streams' windows checked again).",
        default=DEFAULT_SERVERS,
    ),
    Setting(
        "actions",
        Opaque('table of actions: `{subject = "...", stream = "..."}`'),
        "Per action: the literal subject its messages are published to, and the stream that "
        'must store them (sent as Nats-Expected-Stream). `"*"` takes any other action.',
        env=False,
    ),
    Setting(
        "creds_file",
        FileName(),
        "A NATS credentials file (a user JWT and its NKey seed, as `nsc` writes it); relative: "
        "in `$CREDENTIALS_DIRECTORY`.",
        default=None,
        default_doc="none",
    ),
    Setting(
        "token",
        Opaque('`{env = "VAR"}` or `{file = "/path"}`'),
        "An authentication token, read from the environment or a file.",
        default=None,
        default_doc="none",
        env=False,
    ),
    Setting(
        "user",
        Opaque('text, or `{env = "VAR"}` or `{file = "/path"}`'),
        "A user name, with `password`.",
        default=None,
        default_doc="none",
        env=False,
    ),
    Setting(
        "password",
        Opaque('`{env = "VAR"}` or `{file = "/path"}`'),
        "The user's password, read from the environment or a file.",
        default=None,
        default_doc="none",
        env=False,
    ),
    Setting(
        "tls",
        Opaque("table: `ca_file`, `cert_file`, `key_file`"),
        "TLS to the servers: the CA that signs them, and a client certificate for mutual TLS. "
        "Implied by `tls://` URLs.",
        default=None,
        default_doc="none (TLS only where the server requires it, with the system's CAs)",
        env=False,
    ),
    Setting(
        "domain",
        Opaque("text"),
        "The JetStream domain of the streams (a leaf node's), if not the local one.",
        default=None,
        default_doc="none",
    ),
    Setting(
        "key_form",
        Choice(("stored", "uuid", "sha256")),
        "How the stored key travels in Nats-Msg-Id: as stored (1 to 255 visible ASCII "
        "characters, which a header value carries), or a UUID or SHA-256 of it.",
        default="stored",
    ),
    Setting(
        "allow_insecure",
        Boolean(),
        "Send a token or password over plain `nats://` to a host other than loopback, which is "
        "refused otherwise.",
        default=False,
    ),
)

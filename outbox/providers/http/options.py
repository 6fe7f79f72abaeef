"""The options of `type = "http"` and of its preset `type = "webhook"` (docs/providers.md, "The
http type", "Webhook").

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options puts
them into PROVIDER_OPTIONS, so this module stays pure, declarations only; config.py beside it
reads a provider's table by them."""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Boolean, Opaque, Setting
from outbox.providers.kit import ALLOW_INSECURE, MAX_RESPONSE_BYTES

_HEADERS: Final = Setting(
    "headers",
    Opaque("table of strings"),
    "Headers sent with every request, in plain sight: a secret-looking one "
    "(Authorization, *token*, Cookie...) is refused here.",
    default=None,
    default_doc="none",
    env=False,
)
_SECRET_HEADERS: Final = Setting(
    "secret_headers",
    Opaque('table of `{env = "VAR"}` or `{file = "/path"}`'),
    "Headers whose values are secrets, read from the environment or a file (under "
    "systemd, relative to $CREDENTIALS_DIRECTORY) and never logged.",
    default=None,
    default_doc="none",
    env=False,
)


OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "base_url",
        Opaque("`http://` or `https://` URL, no credentials, no query"),
        "The API's scheme, host and optional path prefix; each action's path is below "
        "it, and no payload value can change the host.",
    ),
    _HEADERS,
    _SECRET_HEADERS,
    Setting(
        "key",
        Opaque('table (docs/providers.md, "Keys")'),
        "Where the idempotency key travels (a header, quoted or not, or a body field), "
        "in which form, and the length and characters the provider takes; each action "
        "may change it.",
        default=None,
        default_doc="the `Idempotency-Key` header, unquoted, as stored",
        env=False,
    ),
    Setting(
        "actions",
        Opaque('table of actions (docs/providers.md, "Actions")'),
        "Per action: method, path template, body, reference, key_retention, key, "
        'status overrides and lookup. `"*"` takes any other action.',
        env=False,
    ),
    Setting(
        "outbox_headers",
        Boolean(),
        "Send the Outbox-Operation-Id, -Action, -Attempt, -Tenant-Id and "
        "-Correlation-Id headers, as the webhook type does (a third party learns the "
        "tenant ids from them).",
        default=False,
    ),
    ALLOW_INSECURE,
    MAX_RESPONSE_BYTES,
)

WEBHOOK_OPTIONS: Final[tuple[Setting, ...]] = (
    Setting(
        "url",
        Opaque("`http://` or `https://` URL, no credentials"),
        "Where each operation is POSTed.",
    ),
    _HEADERS,
    _SECRET_HEADERS,
    Setting(
        "reference_field",
        Opaque("text"),
        "The JSON field of a 2xx answer that identifies the effect (the operation's "
        "provider_ref); without it, the idempotency key.",
        default="id",
    ),
    ALLOW_INSECURE,
    MAX_RESPONSE_BYTES,
    Setting(
        "lookup",
        Opaque('table (docs/providers.md, "Lookups")'),
        "How reconciliation asks the receiver whether an in-doubt operation's effect "
        "exists (a path below the URL's origin, such as `/effects?key={key}`): without "
        "one, a person decides.",
        default=None,
        default_doc="none",
        env=False,
    ),
)

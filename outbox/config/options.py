"""The options each built-in provider type reads, besides the keys every provider has
(ProviderSettings): declared here for the http, webhook and stripe types, gathered from each queue
family's options.py for the others. outbox.config.loader reads a provider's table with them,
outbox.config.reference documents them, and each type's factory checks and reads its own.

Apart from outbox.config.settings so that outbox.config, which plug-ins import, loads no
provider family: a family's options.py imports outbox.config.schema, which loads outbox.config.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Final

from outbox.config.schema import (
    Boolean,
    Count,
    Opaque,
    Secret,
    Setting,
)
from outbox.config.settings import DEFAULT_MAX_RESPONSE_BYTES
from outbox.providers.amqp import options as amqp_options
from outbox.providers.cloudtasks import options as cloudtasks_options
from outbox.providers.nats import options as nats_options
from outbox.providers.sqs import options as sqs_options

# The options of both HTTP providers.
_ALLOW_INSECURE: Final = Setting(
    "allow_insecure",
    Boolean(),
    "Send secrets (secret headers, the API key) over http:// to a host other than loopback, "
    "which is refused otherwise.",
    default=False,
)
_MAX_RESPONSE_BYTES: Final = Setting(
    "max_response_bytes",
    Count(unit="bytes"),
    "The most of one answer read, counted as decoded, so a compressed answer cannot expand past "
    "it: an answer is held in memory whole while its reference is read, and 1 MiB is hundreds "
    "of times a webhook's or a Stripe object's answer, yet the 64 calls in flight of the "
    "default concurrency hold at most 64 MiB of answers. A longer answer is *unknown*.",
    default=DEFAULT_MAX_RESPONSE_BYTES,
)

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

# The options each built-in provider type reads (besides the keys of ProviderSettings), which
# its factory (outbox.providers.registry) checks and reads; a plug-in's type takes any options.
# On loading, only the values that are not text are read (so that the environment's text reads
# as the file would give it); the rest stay as written.
PROVIDER_OPTIONS: Final[Mapping[str, tuple[Setting, ...]]] = MappingProxyType(
    {
        "webhook": (
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
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
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
        ),
        "http": (
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
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
        ),
        "stripe": (
            Setting(
                "api_key",
                Secret(
                    "the API key",
                    carries="the key itself",
                    kind_of_value="an API key",
                    example_env="STRIPE_API_KEY",
                ),
                "The secret or restricted key; under systemd, LoadCredential=<provider name>:... "
                "needs neither key.",
                default_doc="the file `<provider name>` in `$CREDENTIALS_DIRECTORY`",
            ),
            Setting(
                "api_base",
                Opaque("`http://` or `https://` URL"),
                "Stripe's API, or a test double of it.",
                default="https://api.stripe.com",
            ),
            Setting(
                "stripe_account",
                Opaque("text (`acct_...`)"),
                "The Connect account every operation of the provider acts for (Stripe-Account).",
                default=None,
                default_doc="none: the platform's own",
            ),
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
            Setting(
                "redact_fields",
                Opaque("array of field names"),
                "Fields never kept in an operation's result, at any depth: client_secret "
                "confirms a payment from any browser.",
                default=("client_secret",),
                env=False,
            ),
            Setting(
                "stripe_version",
                Opaque("Stripe API version, a date and a name"),
                "The API version requests are sent in (Stripe-Version): the one stripe-python "
                "16.1 was built for, never the SDK's default, which moves with each release. "
                "An operation keeps the version of its first send.",
                default="2026-10-28.endive",
            ),
            Setting(
                "operation_accounts",
                Boolean(),
                "Whether an operation may name its own Connect account (the payload's top-level "
                "stripe_account): any producer of the provider can then act for any account "
                "the platform's key reaches.",
                default=False,
            ),
        ),
        "noop": (),
        "nats": nats_options.OPTIONS,
        "amqp": amqp_options.OPTIONS,
        "sqs": sqs_options.OPTIONS,
        "cloudtasks": cloudtasks_options.OPTIONS,
    }
)

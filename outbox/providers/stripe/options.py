"""The options of `type = "stripe"` (docs/providers.md, "Stripe").

Declared as outbox.config declares every key (outbox.config.schema): outbox.config.options puts
``OPTIONS`` into PROVIDER_OPTIONS, so this module stays pure, declarations only, no client
library; the registry reads a provider's table by them."""

from __future__ import annotations

from typing import Final

from outbox.config.schema import Boolean, Opaque, Secret, Setting
from outbox.providers.kit import ALLOW_INSECURE, MAX_RESPONSE_BYTES

OPTIONS: Final[tuple[Setting, ...]] = (
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
    ALLOW_INSECURE,
    MAX_RESPONSE_BYTES,
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
)

"""Builds the configured providers: the built-in types, and plug-ins from the entry point group
``outbox.providers`` (a callable taking ProviderSettings and returning a Provider)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import re
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Final

from outbox.config.schema import file_keys
from outbox.config.secrets import read_secret
from outbox.config.settings import DEFAULT_CONCURRENCY, ConfigError, ProviderSettings
from outbox.providers.base import Provider
from outbox.providers.http import config as http_config
from outbox.providers.http import options as http_declared
from outbox.providers.http.provider import HttpProvider
from outbox.providers.http.webhook import (
    DEFAULT_REFERENCE_FIELD,
    WebhookOptions,
    WebhookProvider,
    preset,
)
from outbox.providers.kit import ANY_ACTION, reject_unknown
from outbox.providers.noop import NoopProvider
from outbox.providers.shards import connection_cap
from outbox.providers.stripe import options as stripe_declared
from outbox.providers.stripe.provider import (
    DEFAULT_REDACTED,
    DEFAULT_STRIPE_VERSION,
    StripeOptions,
    StripeProvider,
)

ENTRY_POINT_GROUP: Final = "outbox.providers"
# The queue types (docs/providers.md, "Queues"): the module that builds each, which exposes
# ``build(ps, environ, *, concurrency) -> Provider``, and the top-level package of its client
# library, an optional extra of the same name.
QUEUE_TYPES: Final[Mapping[str, tuple[str, str]]] = {
    "nats": ("nats.provider", "nats"),
    "amqp": ("amqp.provider", "aio_pika"),
    "sqs": ("sqs.provider", "aiobotocore"),
    "cloudtasks": ("cloudtasks.provider", "google"),
}
Factory = Callable[[ProviderSettings], Provider]

# The options each built-in type takes: declared once, in its family's options.py.
_WEBHOOK_KEYS: Final = tuple(file_keys(http_declared.WEBHOOK_OPTIONS))
_STRIPE_KEYS: Final = tuple(file_keys(stripe_declared.OPTIONS))
# Stripe's API versions: a date, and since 2024-09-30 a release name (2026-10-28.endive).
_STRIPE_VERSION: Final = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}(\.[a-z]+)?")
DEFAULT_STRIPE_API: Final = "https://api.stripe.com"


def build_providers(
    settings: Mapping[str, ProviderSettings],
    environ: Mapping[str, str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> dict[str, Provider]:
    """One provider per configured name; ConfigError names the key of any problem.

    ``concurrency`` is the dispatcher's (``dispatcher.concurrency``): the most calls the
    providers may have in flight, which sizes their connection pools.
    """
    return {name: _build(ps, environ, concurrency) for name, ps in settings.items()}


# Types that never look anything up (no `lookup` method; tests/unit/test_registry.py keeps this
# true): reconciliation has no use for one of them, nor for its secrets.
_WITHOUT_LOOKUP: Final = frozenset({"noop", "nats", "amqp", "sqs"})


def may_look_up(ps: ProviderSettings) -> bool:
    """Whether the provider ``ps`` configures may have a lookup, from its settings alone: false
    for a type that has none, and for a webhook or `http` provider none of whose settings name a
    ``lookup``. Then `outbox reconcile check` does not build it, nor read its secrets, to learn
    that a person decides (outbox/cli/operator.py). A Stripe or Cloud Tasks provider, or a
    plug-in, may: it must be built to be asked."""
    if ps.type in _WITHOUT_LOOKUP:
        return False
    if ps.type == "webhook":
        return "lookup" in ps.options
    if ps.type == "http":
        actions = ps.options.get("actions")
        if not isinstance(actions, Mapping):
            return True  # a malformed table: building it says what is wrong
        return any(not isinstance(t, Mapping) or "lookup" in t for t in actions.values())
    return True


def _build(ps: ProviderSettings, environ: Mapping[str, str] | None, concurrency: int) -> Provider:
    if ps.type == "http":
        return HttpProvider(ps.name, http_config.http_options(ps, environ, concurrency=concurrency))
    if ps.type == "webhook":
        return WebhookProvider(ps.name, webhook_options(ps, environ, concurrency=concurrency))
    if ps.type == "noop":
        reject_unknown(ps, ())
        return NoopProvider(ps.name, ps.key_retention)
    if ps.type == "stripe":
        return StripeProvider(ps.name, stripe_options(ps, environ, concurrency=concurrency))
    if ps.type in QUEUE_TYPES:
        return _queue(ps, environ, concurrency)
    return _plugin(ps.type, ps.name)(ps)


def _queue(ps: ProviderSettings, environ: Mapping[str, str] | None, concurrency: int) -> Provider:
    """A queue provider, whose client library is an optional extra: imported only when a
    provider of its type is configured, and named with the install command when missing."""
    module_name, client = QUEUE_TYPES[ps.type]
    try:
        module = importlib.import_module(f"outbox.providers.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith(client):
            raise
        raise ConfigError(
            f'providers.{ps.name}.type = "{ps.type}" needs its client library ({exc.name}), '
            f"which is not installed: pip install 'outbox[{ps.type}]'",
            key=f"providers.{ps.name}.type",
        ) from None
    provider: Provider = module.build(ps, environ, concurrency=concurrency)
    return provider


def webhook_options(
    ps: ProviderSettings,
    environ: Mapping[str, str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> WebhookOptions:
    """The webhook settings of ``ps``, checked, with secret headers read from their source; its
    connection pool sized for the calls the dispatcher (``concurrency``) may send it at once."""
    reject_unknown(ps, _WEBHOOK_KEYS)
    where = f"providers.{ps.name}"
    url = ps.options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.url must be an http:// or https:// URL")
    headers, secret_values = http_config.read_headers(ps, environ)
    allow_insecure = http_config.allow_insecure(ps)
    http_config.check_endpoint(
        url, where, carries_secrets=bool(secret_values), allow_insecure=allow_insecure
    )
    options = WebhookOptions(
        url=url,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        headers=headers,
        secret_headers=secret_values,
        reference_field=str(ps.options.get("reference_field", DEFAULT_REFERENCE_FIELD)),
        max_connections=connection_cap(concurrency, ps.max_in_flight),
        max_response_bytes=http_config.max_response_bytes(ps),
    )
    if "lookup" not in ps.options:
        return options
    action = preset(options).actions[ANY_ACTION]
    lookup = http_config.lookup_spec(ps.options["lookup"], action, f"{where}.lookup")
    return dataclasses.replace(options, lookup=lookup)


def stripe_options(
    ps: ProviderSettings,
    environ: Mapping[str, str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> StripeOptions:
    """The Stripe settings of ``ps``, the API key read from the environment or a file; its
    connections sized for the calls the dispatcher (``concurrency``) may send it at once."""
    reject_unknown(ps, _STRIPE_KEYS)
    where = f"providers.{ps.name}"
    env = os.environ if environ is None else environ
    if "api_key_env" in ps.options:
        spec: Mapping[str, str] = {"env": str(ps.options["api_key_env"])}
    elif "api_key_file" in ps.options:
        spec = {"file": str(ps.options["api_key_file"])}
    elif env.get("CREDENTIALS_DIRECTORY"):  # systemd LoadCredential=<provider name>:...
        spec = {"file": ps.name}
    else:
        raise ConfigError(f"{where} needs api_key_env or api_key_file (never the key itself)")
    api_base = str(ps.options.get("api_base", DEFAULT_STRIPE_API))
    if not api_base.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.api_base must be an http:// or https:// URL")
    # The API key travels in every request: never in clear text to another host.
    http_config.check_endpoint(
        api_base,
        where,
        carries_secrets=True,
        allow_insecure=http_config.allow_insecure(ps),
        setting="api_base",
    )
    account = ps.options.get("stripe_account")
    return StripeOptions(
        api_key=read_secret(spec, key=f"{where}.api_key", environ=env),
        api_base=api_base,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        stripe_account=None if account is None else str(account),
        max_connections=connection_cap(concurrency, ps.max_in_flight),
        max_response_bytes=http_config.max_response_bytes(ps),
        redact_fields=_redact_fields(ps),
        stripe_version=_stripe_version(ps),
        operation_accounts=_operation_accounts(ps),
    )


def _operation_accounts(ps: ProviderSettings) -> bool:
    value = ps.options.get("operation_accounts", False)
    if not isinstance(value, bool):
        where = f"providers.{ps.name}.operation_accounts"
        raise ConfigError(f"{where} must be true or false", key=where)
    return value


def _stripe_version(ps: ProviderSettings) -> str:
    """The pinned API version: ``stripe_version``, or outbox's default (never the SDK's, which
    moves with every SDK release)."""
    version = ps.options.get("stripe_version", DEFAULT_STRIPE_VERSION)
    if not isinstance(version, str) or not _STRIPE_VERSION.fullmatch(version):
        where = f"providers.{ps.name}.stripe_version"
        raise ConfigError(
            f'{where} must be a Stripe API version such as "{DEFAULT_STRIPE_VERSION}"', key=where
        )
    return version


def _redact_fields(ps: ProviderSettings) -> tuple[str, ...]:
    """The fields never kept of Stripe's answers: ``redact_fields``, or the default."""
    fields = ps.options.get("redact_fields", DEFAULT_REDACTED)
    if not isinstance(fields, list | tuple) or not all(
        isinstance(f, str) and f.strip() for f in fields
    ):
        raise ConfigError(
            f"providers.{ps.name}.redact_fields must be a list of field names",
            key=f"providers.{ps.name}.redact_fields",
        )
    return tuple(f.strip() for f in fields)


def _plugin(type_name: str, provider_name: str) -> Factory:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == type_name:
            factory: Factory = ep.load()
            return factory
    raise ConfigError(
        f"providers.{provider_name}.type: unknown provider type {type_name!r}; built in: http, "
        f"webhook, stripe, noop, nats, amqp, sqs, cloudtasks; plug-ins register in the entry "
        f"point group {ENTRY_POINT_GROUP}"
    )

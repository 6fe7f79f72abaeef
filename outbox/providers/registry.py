"""Builds the configured providers: the built-in types, and plug-ins from the entry point group
``outbox.providers`` (a callable taking ProviderSettings and returning a Provider)."""

from __future__ import annotations

import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from importlib.metadata import entry_points
from typing import Any, Final

from outbox.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_RESPONSE_BYTES,
    PROVIDER_KEYS,
    PROVIDER_OPTIONS,
    ConfigError,
    ProviderSettings,
    read_secret,
)
from outbox.providers.base import Provider
from outbox.providers.noop import NoopProvider
from outbox.providers.shards import connection_cap
from outbox.providers.stripe import (
    DEFAULT_REDACTED,
    DEFAULT_STRIPE_VERSION,
    StripeOptions,
    StripeProvider,
)
from outbox.providers.webhook import DEFAULT_REFERENCE_FIELD, WebhookOptions, WebhookProvider
from outbox.settings_schema import file_keys

ENTRY_POINT_GROUP: Final = "outbox.providers"
Factory = Callable[[ProviderSettings], Provider]

# The options each built-in type takes: declared once, in outbox.config (PROVIDER_OPTIONS).
_WEBHOOK_KEYS: Final = tuple(file_keys(PROVIDER_OPTIONS["webhook"]))
_STRIPE_KEYS: Final = tuple(file_keys(PROVIDER_OPTIONS["stripe"]))
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


def _build(ps: ProviderSettings, environ: Mapping[str, str] | None, concurrency: int) -> Provider:
    if ps.type == "webhook":
        return WebhookProvider(ps.name, webhook_options(ps, environ, concurrency=concurrency))
    if ps.type == "noop":
        _reject_unknown(ps, ())
        return NoopProvider(ps.name, ps.key_retention)
    if ps.type == "stripe":
        return StripeProvider(ps.name, stripe_options(ps, environ, concurrency=concurrency))
    return _plugin(ps.type, ps.name)(ps)


def webhook_options(
    ps: ProviderSettings,
    environ: Mapping[str, str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> WebhookOptions:
    """The webhook settings of ``ps``, checked, with secret headers read from their source; its
    connection pool sized for the calls the dispatcher (``concurrency``) may send it at once."""
    _reject_unknown(ps, _WEBHOOK_KEYS)
    where = f"providers.{ps.name}"
    url = ps.options.get("url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ConfigError(f"{where}.url must be an http:// or https:// URL")
    secrets = _string_map(
        ps.options.get("secret_headers", {}), f"{where}.secret_headers", allow_tables=True
    )
    headers = _string_map(ps.options.get("headers", {}), f"{where}.headers")
    for name, value in headers.items():
        _check_header(name, value, f"{where}.headers.{name}")
        if _SECRET_HEADER.search(name):  # secrets come from the environment or files only
            raise ConfigError(
                f"{where}.headers.{name} looks like a secret: move it to "
                "secret_headers (read from the environment or a file)"
            )
    secret_values = {
        name: read_secret(spec, key=f"{where}.secret_headers.{name}", environ=environ)
        for name, spec in secrets.items()
    }
    for name, value in secret_values.items():
        _check_header(name, value, f"{where}.secret_headers.{name}")
    _check_endpoint(
        url, where, carries_secrets=bool(secret_values), allow_insecure=_allow_insecure(ps)
    )
    return WebhookOptions(
        url=url,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        headers=headers,
        secret_headers=secret_values,
        reference_field=str(ps.options.get("reference_field", DEFAULT_REFERENCE_FIELD)),
        max_connections=connection_cap(concurrency, ps.max_in_flight),
        max_response_bytes=_max_response_bytes(ps),
    )


def stripe_options(
    ps: ProviderSettings,
    environ: Mapping[str, str] | None = None,
    *,
    concurrency: int = DEFAULT_CONCURRENCY,
) -> StripeOptions:
    """The Stripe settings of ``ps``, the API key read from the environment or a file; its
    connections sized for the calls the dispatcher (``concurrency``) may send it at once."""
    _reject_unknown(ps, _STRIPE_KEYS)
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
    _check_endpoint(api_base, where, carries_secrets=True, allow_insecure=_allow_insecure(ps))
    account = ps.options.get("stripe_account")
    return StripeOptions(
        api_key=read_secret(spec, key=f"{where}.api_key", environ=env),
        api_base=api_base,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        stripe_account=None if account is None else str(account),
        max_connections=connection_cap(concurrency, ps.max_in_flight),
        max_response_bytes=_max_response_bytes(ps),
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


def _max_response_bytes(ps: ProviderSettings) -> int:
    """The provider's cap on one answer's bytes. A config file's value was checked on loading
    (outbox.config); this checks settings built in Python."""
    value = ps.options.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"providers.{ps.name}.max_response_bytes must be a positive integer (bytes), "
            f"not {value!r}",
            key=f"providers.{ps.name}.max_response_bytes",
        )
    return value


# A header field name (RFC 9110 token), and a value without CR, LF, NUL or other controls: a
# CR/LF in a secret started the daemon fine, then every request failed to be built.
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE_BAD: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_SECRET_HEADER: Final = re.compile(
    r"authorization|cookie|api[-_]?key|token|secret|password", re.IGNORECASE
)
_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def _check_header(name: str, value: str, key: str) -> None:
    if not _HEADER_NAME.fullmatch(name):
        raise ConfigError(f"{key}: {name!r} is not an HTTP header name", key=key)
    if _HEADER_VALUE_BAD.search(value) or not value.isascii():  # never quoted: it may be secret
        raise ConfigError(
            f"{key}: the value holds a line break, a control character or "
            "non-ASCII text, which no HTTP header may carry",
            key=key,
        )


def _check_endpoint(url: str, where: str, *, carries_secrets: bool, allow_insecure: bool) -> None:
    """No credentials in the URL; no secret over clear text to another host."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{where}.url holds credentials (user:password@): put them in "
            "secret_headers instead, where they are never logged"
        )
    host = (parts.hostname or "").lower()
    if carries_secrets and parts.scheme == "http" and host not in _LOOPBACK and not allow_insecure:
        raise ConfigError(
            f"{where}: http:// to {host}, and the requests carry secrets in "
            "clear text: use https://, or set allow_insecure = true"
        )


def _allow_insecure(ps: ProviderSettings) -> bool:
    value = ps.options.get("allow_insecure", False)
    if not isinstance(value, bool):
        raise ConfigError(f"providers.{ps.name}.allow_insecure must be true or false")
    return value


def _string_map(value: object, where: str, *, allow_tables: bool = False) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table")
    for key, item in value.items():
        if not (isinstance(item, str) or (allow_tables and isinstance(item, Mapping))):
            raise ConfigError(f"{where}.{key} must be a string")
    return dict(value)


def _reject_unknown(ps: ProviderSettings, valid: tuple[str, ...]) -> None:
    for key in ps.options:
        if key not in valid:
            allowed = ", ".join((*PROVIDER_KEYS, *valid))
            raise ConfigError(
                f"providers.{ps.name}.{key} is not a {ps.type} provider setting; valid: {allowed}"
            )


def _plugin(type_name: str, provider_name: str) -> Factory:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == type_name:
            factory: Factory = ep.load()
            return factory
    raise ConfigError(
        f"providers.{provider_name}.type: unknown provider type {type_name!r}; built in: "
        f"webhook, stripe, noop; plug-ins register in the entry point group {ENTRY_POINT_GROUP}"
    )

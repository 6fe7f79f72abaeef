"""What the queue providers share (docs/providers.md, "Queues"): the identity every message
carries, the reading of their per-action tables, and the check of a configured key window against
the queue's own.

A queue's idempotency key is its message id (JetStream's Nats-Msg-Id, AMQP's message_id, SQS's
MessageDeduplicationId, a Cloud Tasks task name): the queue, or its consumers, recognise a repeat
by it. outbox sends the stored key in the form the queue takes (outbox.providers.kit.KeySpec) and,
in every message, the operation's identity as headers or attributes, so that a consumer can
deduplicate by the operation id outside the queue's window and join the producer's trace.

Pure of any client library: each queue's module brings its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Final, TypeVar

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.durations import format_duration
from outbox.providers.base import SendRequest
from outbox.providers.kit import ANY_ACTION, header_safe, intent_headers

T = TypeVar("T")

# The names of the identity every message carries, as headers (NATS, AMQP) or message attributes
# (SQS) or task headers (Cloud Tasks). The key itself is the message id, in the queue's own place.
OPERATION_ID: Final = "Outbox-Operation-Id"
ACTION: Final = "Outbox-Action"
ATTEMPT: Final = "Outbox-Attempt"
TENANT_ID: Final = "Outbox-Tenant-Id"
CORRELATION_ID: Final = "Outbox-Correlation-Id"
IDEMPOTENCY_KEY: Final = "Outbox-Idempotency-Key"
TRACEPARENT: Final = "traceparent"  # W3C Trace Context, as consumers' tracers read it


def message_headers(request: SendRequest, *, wire_key: str | None = None) -> dict[str, str]:
    """The operation's identity for one message: its id, action, attempt, tenant, correlation id
    and traceparent where it has them, its origin and fingerprint (kit.intent_headers), and
    ``wire_key`` (the key as the queue received it) where the queue's own id field is not
    readable by every consumer. Values are header-safe (outbox.providers.kit.header_safe): any
    text a producer stored arrives percent-encoded rather than breaking the header."""
    headers = {
        OPERATION_ID: str(request.operation_id),
        ACTION: header_safe(request.action),
        ATTEMPT: str(request.attempt),
        TENANT_ID: header_safe(request.tenant_id),
    }
    if request.correlation_id:
        headers[CORRELATION_ID] = header_safe(request.correlation_id)
    if request.traceparent:
        headers[TRACEPARENT] = header_safe(request.traceparent)
    if wire_key is not None:
        headers[IDEMPOTENCY_KEY] = wire_key
    # A message's body is always the payload as stored: the fingerprint can be checked.
    headers.update(intent_headers(request.intent, body_is_payload=True))
    return headers


def action_tables(
    ps: ProviderSettings, valid: Iterable[str], *, required: Iterable[str] = ()
) -> dict[str, Mapping[str, Any]]:
    """The provider's ``actions``: per action name (``"*"`` for any action not named), its table,
    each key known (``valid``) and the ``required`` ones present. ConfigError names the key."""
    where = f"providers.{ps.name}.actions"
    actions = ps.options.get("actions")
    if not isinstance(actions, Mapping) or not actions:
        raise ConfigError(
            f"{where} must be a table of at least one action (its name, or "
            f'"{ANY_ACTION}" for every action not named)',
            key=where,
        )
    known = tuple(valid)
    tables: dict[str, Mapping[str, Any]] = {}
    for name, table in actions.items():
        at = f"{where}.{_dotted(name)}"
        if not isinstance(table, Mapping):
            raise ConfigError(f"{at} must be a table", key=at)
        for key in table:
            if key not in known:
                raise ConfigError(f"{at}.{key} is not known; valid: {', '.join(known)}", key=at)
        for key in required:
            if key not in table:
                raise ConfigError(f"{at}.{key} is required", key=f"{at}.{key}")
        tables[str(name)] = table
    return tables


def action_of(tables: Mapping[str, T], action: str) -> T | None:
    """The configuration of ``action``: its own, else that of ``"*"``, else None (the operation
    is refused before anything is sent)."""
    return tables.get(action, tables.get(ANY_ACTION))


def text(
    table: Mapping[str, Any],
    key: str,
    where: str,
    *,
    default: str | None = None,
    check: Callable[[str], str | None] | None = None,
) -> str | None:
    """A non-empty string option, or ``default``; ``check`` returns why a value is refused."""
    value = table.get(key, default)
    if value is None:
        return None
    at = f"{where}.{key}"
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{at} must be a non-empty string", key=at)
    problem = check(value) if check is not None else None
    if problem is not None:
        raise ConfigError(f"{at} {problem}", key=at)
    return value


def required_text(
    table: Mapping[str, Any],
    key: str,
    where: str,
    *,
    check: Callable[[str], str | None] | None = None,
) -> str:
    value = text(table, key, where, check=check)
    if value is None:
        raise ConfigError(f"{where}.{key} is required", key=f"{where}.{key}")
    return value


def boolean(table: Mapping[str, Any], key: str, where: str, *, default: bool) -> bool:
    value = table.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false", key=f"{where}.{key}")
    return value


def check_window(ps: ProviderSettings, window: timedelta, what: str) -> None:
    """Refuse a configured key_retention longer than the queue's own window (``what`` names it:
    "the stream ORDERS's duplicate_window"): a retry after the queue forgot the key would be a
    second message, which outbox promised not to send."""
    if ps.key_retention > window:
        key = f"providers.{ps.name}.key_retention"
        raise ConfigError(
            f"{key} ({format_duration(ps.key_retention)}) is longer than {what} "
            f"({format_duration(window)}): a retry after it would be a second message; set "
            f"{key} to at most {format_duration(window)} (and retention_margin below it), or "
            "lengthen the queue's window",
            key=key,
        )


def _dotted(name: object) -> str:
    text = str(name)
    return text if text.replace("_", "").replace("-", "").isalnum() else f'"{text}"'

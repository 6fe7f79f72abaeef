"""What the inbox reads from an HTTP delivery and answers to it: the identity from its headers,
the headers a recorded response may keep, and the answer for each decision (docs/design.md,
"The inbox": in progress is 409 with Retry-After, a conflict 422, a malformed delivery 400)."""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from outbox.inbox.core import Outcome

Headers = Mapping[str, str]  # lower-case names

# Headers a recorded response keeps: what describes the representation and where it lives.
# Never a cookie, a credential, a hop-by-hop field or the date of the first answer.
STORED_HEADERS: Final = frozenset(
    {
        "content-type",
        "content-encoding",
        "content-language",
        "content-location",
        "location",
        "etag",
        "last-modified",
        "link",
        "cache-control",
        "expires",
        "vary",
    }
)
NEVER_STORED: Final = frozenset(
    {
        "set-cookie",
        "set-cookie2",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "cookie",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "date",
        "server",
    }
)
# A foreign sender's key: an RFC 8941 string (as outbox's webhook sends it) or a bare token.
_SF_STRING: Final = re.compile(r'"((?:[^"\\]|\\["\\])*)"')
_DIGITS: Final = re.compile(r"[0-9]{1,19}")


class MissingIdentity(ValueError):
    """The delivery names no key or no tenant where one is required (HTTP 400)."""


def stored_headers(
    headers: tuple[tuple[str, str], ...], extra: frozenset[str] = frozenset()
) -> tuple[tuple[str, str], ...]:
    """The response headers a record keeps, in their order: the allowed ones, never a refused
    one even when ``extra`` names it."""
    keep = (STORED_HEADERS | extra) - NEVER_STORED
    return tuple((name, value) for name, value in headers if name.lower() in keep)


@dataclass(frozen=True)
class KeyFrom:
    """Where a delivery's key comes from. ``auto`` (the default) takes outbox's own identity,
    the operation (``Outbox-Operation-Id``), so that every key generation of one operation,
    ``reconcile retry`` included, finds one record; else the ``Idempotency-Key`` header; else
    the task name Cloud Tasks sends (``X-CloudTasks-TaskName``), the same on every retry."""

    read: Callable[[Headers], str | None]

    @staticmethod
    def auto() -> KeyFrom:
        def read(headers: Headers) -> str | None:
            operation = headers.get("outbox-operation-id")
            if operation is not None and _DIGITS.fullmatch(operation):
                return f"op:{int(operation)}"
            found = _header_key(headers, "idempotency-key")
            if found is None and (task := headers.get("x-cloudtasks-taskname")):
                return f"task:{task}"
            return found

        return KeyFrom(read)

    @staticmethod
    def header(name: str) -> KeyFrom:
        lower = name.lower()
        return KeyFrom(lambda headers: _header_key(headers, lower))


@dataclass(frozen=True)
class TenantFrom:
    """Where a delivery's tenant comes from: a header, percent-decoded as outbox's providers
    encode it (``Outbox-Tenant-Id``), or one tenant for every delivery."""

    read: Callable[[Headers], str | None]

    @staticmethod
    def header(name: str = "Outbox-Tenant-Id") -> TenantFrom:
        lower = name.lower()

        def read(headers: Headers) -> str | None:
            value = headers.get(lower)
            return None if value is None else urllib.parse.unquote(value, errors="strict")

        return TenantFrom(read)

    @staticmethod
    def constant(tenant_id: str) -> TenantFrom:
        return TenantFrom(lambda headers: tenant_id)


def _header_key(headers: Headers, name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    quoted = _SF_STRING.fullmatch(value.strip())
    text = quoted.group(1).replace('\\"', '"').replace("\\\\", "\\") if quoted else value.strip()
    return f"key:{text}" if text else None


def replay(outcome: Outcome) -> Outcome:
    """The recorded outcome, marked as a replay (Stripe's convention)."""
    marks = (("Idempotent-Replayed", "true"), ("Outbox-Inbox-Decision", "replayed"))
    return Outcome(outcome.status, outcome.headers + marks, outcome.body)


def problem(
    status: int, title: str, detail: str, decision: str, retry_after: int | None = None
) -> Outcome:
    """An RFC 9457 problem answer."""
    body = json.dumps({"title": title, "status": status, "detail": detail}).encode()
    headers: tuple[tuple[str, str], ...] = (
        ("Content-Type", "application/problem+json"),
        ("Outbox-Inbox-Decision", decision),
    )
    if retry_after is not None:
        headers += (("Retry-After", str(retry_after)),)
    return Outcome(status, headers, body)

"""What every HTTP provider shares: its clients, the identity headers, and the reading of answers
and transport errors into outbox's failure classes (docs/providers.md, "Answers").

An answer is read within bounds (outbox.providers.answers); a status line, never a body, goes
into a message, since a provider's error body may echo the payload back.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import httpx

from outbox.providers.answers import AnswerLimits, BodyTimeout
from outbox.providers.base import Failed, SendRequest, SendResult, permanent, transient, unknown
from outbox.providers.kit import header_safe, retry_after_value

# Statuses that say the provider did not act and may be asked again: a request with this key is
# in progress (409), rate limited (429), timed out waiting for the request itself (408), too early
# (425).
TRANSIENT_STATUSES: Final = frozenset({408, 409, 425, 429})
# The provider refuses our credentials (the secret headers): the provider pauses, as Stripe's
# does on a 401, and nothing is spent or quarantined (provider_limits, reason "credentials").
REFUSED_CREDENTIALS: Final = frozenset({401, 403})
# An idle keep-alive connection is closed after this many seconds (httpx's default, stated): after
# a burst of a thousand slow calls the thousand sockets to the receiver do not linger, while a
# steady stream reuses its connections instead of opening (and, over TLS, handshaking) anew.
KEEPALIVE_EXPIRY: Final = 5.0


def client(
    *,
    size: int,
    tls: ssl.SSLContext,
    timeout: timedelta,
    headers: Mapping[str, str],
    limits: AnswerLimits,
    transport: httpx.AsyncBaseTransport | None,
) -> httpx.AsyncClient:
    """One pool of ``size`` connections; the bounds hook into it, so they hold whatever the
    transport (a given one, or a proxy's from the environment)."""
    return httpx.AsyncClient(
        verify=tls,
        timeout=httpx.Timeout(timeout.total_seconds()),
        headers=dict(headers),
        transport=transport,
        event_hooks=limits.event_hooks,
        follow_redirects=False,  # a redirect would replay the request somewhere unconfigured
        # Every connection may stay open for the next call while calls keep coming; idle ones
        # close after KEEPALIVE_EXPIRY.
        limits=httpx.Limits(
            max_connections=size, max_keepalive_connections=size, keepalive_expiry=KEEPALIVE_EXPIRY
        ),
    )


def identity_headers(request: SendRequest) -> dict[str, str]:
    """Whose operation this is and which attempt: a receiver shared by tenants decides what each
    may do (the webhook preset sends them; an `http` provider with ``outbox_headers``)."""
    headers = {
        "Outbox-Operation-Id": str(request.operation_id),
        "Outbox-Action": header_safe(request.action),
        "Outbox-Attempt": str(request.attempt),
        "Outbox-Tenant-Id": header_safe(request.tenant_id),
    }
    if request.correlation_id:
        headers["Outbox-Correlation-Id"] = header_safe(request.correlation_id)
    return headers


def default_class(status: int) -> str:
    """The class of a status no override names (the IETF Idempotency-Key draft's reading):
    2xx done; 401 and 403 credentials; 408, 409, 425 and 429 transient; other 3xx and 4xx
    permanent; every 5xx unknown (a gateway may answer 502/503/504 after the receiver acted)."""
    if 200 <= status < 300:
        return "done"
    if status in REFUSED_CREDENTIALS:
        return "credentials"
    if status in TRANSIENT_STATUSES:
        return "in_use" if status == 409 else "transient"
    if 300 <= status < 500:
        return "permanent"
    return "unknown"


def fallback(status: int, exc: Exception) -> SendResult:
    """The class of an answer whose details could not be read."""
    note = f"HTTP {status} (answer unreadable: {type(exc).__name__})"
    kind = default_class(status)
    if kind == "done":
        return unknown("unreadable_success", note, http_status=status)
    if kind == "credentials":
        return transient(f"http_{status}", note, http_status=status, pause=True)
    if kind in ("transient", "in_use"):
        return transient(f"http_{status}", note, http_status=status)
    if kind == "permanent":
        return permanent(f"http_{status}", note, http_status=status)
    return unknown(f"http_{status}", note, http_status=status)


def classify_exception(exc: httpx.HTTPError) -> Failed:
    # Only failures before the request left this host are transient.
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc).__name__}")
    if isinstance(exc, BodyTimeout):
        return unknown("timeout", f"no answer in time: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return unknown("timeout", f"no answer in time: {type(exc).__name__}")
    return unknown("transport_error", f"connection failed after sending: {type(exc).__name__}")


def json_body(response: httpx.Response) -> Any:
    """The answer's JSON, or None when it has none: not JSON, nested past the decoder's depth,
    or holding an integer past Python's 4,300 digits (a ValueError that is no
    JSONDecodeError)."""
    try:
        return response.json()
    except (ValueError, RecursionError):
        return None


def json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The answer's JSON object, or None when it is not one."""
    body = json_body(response)
    return body if isinstance(body, dict) else None


def reason(response: httpx.Response) -> str:
    # The status line only: a receiver's error body may echo the payload back.
    return f"HTTP {response.status_code} {response.reason_phrase}".strip()


def request_id(response: httpx.Response) -> str | None:
    found: str | None = response.headers.get("request-id") or response.headers.get("x-request-id")
    return found


def retry_after(response: httpx.Response) -> timedelta | None:
    return retry_after_value(response.headers.get("retry-after"))

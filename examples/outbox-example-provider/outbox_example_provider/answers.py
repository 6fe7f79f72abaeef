"""What Relay's answers mean to outbox: each HTTP status and transport failure as a result.

The rule that decides them: a failure before the request left this host is TRANSIENT (no key
window starts); one after it may have been acted on is UNKNOWN (outbox retries with the same
key only while Relay still remembers it, 72 hours). Relay documents that a 409 (the key in use)
and a 429 (rate limited) did nothing, so they are TRANSIENT and spend no attempt.
"""

from __future__ import annotations

import email.utils
import re
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import httpx
from outbox.providers.answers import reference
from outbox.providers.base import (
    Failed,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)

# Longest Retry-After honoured: a misconfigured API must not park operations for days.
MAX_RETRY_AFTER: Final = timedelta(hours=1)
_SECONDS: Final = re.compile(r"[0-9]{1,9}")
_WORD: Final = re.compile(r"[a-z0-9_]{1,64}")
# Relay did not act, and said so: retried without spending the attempt budget.
_NOT_ACTED: Final = frozenset({409, 429})
# Relay timed out waiting for our request, or asks us to wait: nothing happened either.
_RETRY_LATER: Final = frozenset({408, 425})
_REFUSED_CREDENTIALS: Final = frozenset({401, 403})


def classify(response: httpx.Response, key: str) -> SendResult:
    """The result of Relay's answer to a send with ``key``."""
    status = response.status_code
    details: dict[str, Any] = {
        "http_status": status,
        "request_id": response.headers.get("x-request-id"),
    }
    if 200 <= status < 300:
        body = _json_object(response)
        # A 2xx says Relay accepted the message; without an id it is still known by its key.
        ref = reference(body.get("id")) if body else None
        return Succeeded(ref or key, body, status, details["request_id"])
    why = _reason(response)
    if status in _REFUSED_CREDENTIALS:
        return transient(f"http_{status}", why, pause=True, **details)
    retry_after = _retry_after(response)
    if status in _NOT_ACTED:
        return transient(
            f"http_{status}",
            why,
            retry_after=retry_after,
            request_only=True,
            spends_attempt=False,
            **details,
        )
    if status in _RETRY_LATER:
        return transient(f"http_{status}", why, retry_after=retry_after, **details)
    if 300 <= status < 500:
        return permanent(f"http_{status}", why, **details)
    # 5xx: Relay (or a gateway in front of it) may have acted.
    return unknown(f"http_{status}", why, retry_after=retry_after, **details)


def transport_failure(exc: httpx.HTTPError) -> Failed:
    """A failure with no answer: TRANSIENT only when no connection was made."""
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc).__name__}")
    if isinstance(exc, httpx.TimeoutException):
        return unknown("timeout", f"no answer in time: {type(exc).__name__}")
    return unknown("transport_error", f"the connection failed after sending: {type(exc).__name__}")


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _reason(response: httpx.Response) -> str:
    """The HTTP status and Relay's error code, never its message (it may quote the text)."""
    body = _json_object(response)
    error = body.get("error") if body else None
    code = error.get("code") if isinstance(error, dict) else None
    shown = f" {code}" if isinstance(code, str) and _WORD.fullmatch(code) else ""
    return f"HTTP {response.status_code}{shown}"


def _retry_after(response: httpx.Response) -> timedelta | None:
    """Retry-After in seconds or as an HTTP date, at most MAX_RETRY_AFTER."""
    value = response.headers.get("retry-after", "").strip()
    if _SECONDS.fullmatch(value):
        return min(timedelta(seconds=int(value)), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return min(max(when - datetime.now(UTC), timedelta(0)), MAX_RETRY_AFTER)

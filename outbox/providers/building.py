"""Requests that cannot be built are recorded as not sent, never as "connection failed after
sending" (issue 21).

A provider builds each request from its stored row, and that can fail before the first byte is
written. Both HTTP providers catch each way at the point where they build:

* The row's idempotency key is not one outbox makes (1 to 255 visible ASCII characters, as
  enqueue checks and as every later generation stays): only a row written behind enqueue's back
  has one. Its request could not be built, or (an empty key, which the Stripe SDK leaves out)
  would travel with no key at all.
* httpx cannot encode a value: header values are ASCII (a UnicodeEncodeError, a ValueError).
* h11, writing the request's head, refuses a value HTTP/1.1 cannot carry (CR, LF, NUL, a space
  or tab at either end): httpx.LocalProtocolError, raised before it writes anything; and a URL
  of a scheme no transport speaks is refused before any connection (UnsupportedProtocol).

Such an attempt is permanent, since the row would fail the same way every time, and not sent:
the operation is quarantined as ``unencodable_request``, no key window starts, and the provider
never saw its key. The message names the header or the cause, never a value (a header may hold a
secret). Before, h11's refusal read as an attempt that may have reached the provider, retried
until its key window closed and then sent to reconciliation.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import httpx

from outbox.core.model import FailureClass
from outbox.core.policy import REASON_UNENCODABLE_REQUEST
from outbox.providers.base import Failed

# What the transport refuses before it writes anything.
NOT_WRITTEN: Final = (httpx.LocalProtocolError, httpx.UnsupportedProtocol)
# What building a request raises for a value it cannot encode (UnicodeEncodeError included).
BUILD_ERRORS: Final = (ValueError, TypeError, RecursionError)

# The keys outbox makes and enqueue takes (sql/0004): visible ASCII, at most Stripe's 255.
_KEY: Final = re.compile(r"[!-~]{1,255}")
# A header value every hop carries (RFC 9110 field-value, ASCII only): visible characters,
# spaces and tabs only between them.
_FIELD_VALUE: Final = re.compile(r"(?:[!-~]+(?:[ \t]+[!-~]+)*)?")


class Unbuilt(Exception):
    """Raised where a request turned out to be impossible to build, with what to record."""

    def __init__(self, failure: Failed) -> None:
        super().__init__(failure.message)
        self.failure = failure


def unsendable(message: str) -> Failed:
    """A request that could not be built: permanent, not sent, this request's own trouble (the
    provider's circuit breaker does not count it)."""
    return Failed(
        FailureClass.PERMANENT,
        REASON_UNENCODABLE_REQUEST,
        message,
        not_sent=True,
        request_only=True,
        reason=REASON_UNENCODABLE_REQUEST,
    )


def key_problem(key: object) -> Failed | None:
    """None for a key a request can carry as outbox sends it; otherwise what to record."""
    if isinstance(key, str) and _KEY.fullmatch(key):
        return None
    return unsendable(
        "the request cannot be built: its idempotency key is not 1 to 255 "
        "visible ASCII characters, as outbox makes them (a row written behind "
        "enqueue's back?)"
    )


def not_built(exc: BaseException, headers: Mapping[str, str] | None = None) -> Failed:
    """What to record when building or writing the request raised ``exc``; ``headers`` are the
    request's own (not the configured ones), searched for the one that could not be carried."""
    name = unfit_header(headers or {})
    cause = f"the {name} header cannot carry its value" if name else "it cannot be encoded"
    return unsendable(f"the request cannot be built: {cause} ({type(exc).__name__})")


def unfit_header(headers: Mapping[str, str]) -> str | None:
    """The name of the first header whose value HTTP cannot carry as it is, or None."""
    for name, value in headers.items():
        if not isinstance(value, str) or not _FIELD_VALUE.fullmatch(value):
            return name
    return None

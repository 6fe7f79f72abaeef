"""The webhook provider: POST the payload as JSON with the stored Idempotency-Key.

Response classes follow the IETF Idempotency-Key draft: 2xx success; 409 transient (a request
with that key is in progress); 429 and 503 transient, honouring Retry-After; 422 and other 4xx
permanent; 500, 502, 504, timeouts and resets after sending unknown; a refused connection
transient (nothing was sent).
"""

from __future__ import annotations

import email.utils
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from outbox.providers.base import (
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)

DEFAULT_REFERENCE_FIELD = "id"
# Statuses that say the provider did not act and may be asked again.
_TRANSIENT_STATUSES = frozenset({409, 429, 503})
# Longest Retry-After we honour: a misconfigured receiver must not park operations for days.
MAX_RETRY_AFTER = timedelta(hours=1)


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    """A webhook provider's settings, secrets already read from their env or file source."""

    url: str
    timeout: timedelta
    key_retention: timedelta
    headers: Mapping[str, str] = field(default_factory=dict)
    secret_headers: Mapping[str, str] = field(default_factory=dict)
    reference_field: str = DEFAULT_REFERENCE_FIELD

    def __repr__(self) -> str:
        secret_names = sorted(self.secret_headers)
        return f"WebhookOptions(url={self.url!r}, secret_headers={secret_names!r})"


class WebhookProvider:
    """POSTs each operation to one URL; the action travels as a header."""

    def __init__(
        self, name: str, options: WebhookOptions, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._name = name
        self._options = options
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(options.timeout.total_seconds()),
            headers={**options.headers, **options.secret_headers},
            transport=transport,
            follow_redirects=False,  # a redirect would replay the POST somewhere unconfigured
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Any action is an event name and any JSON object a body: nothing to refuse locally."""

    async def send(self, request: SendRequest) -> SendResult:
        headers = {
            # The draft's structured-field string form.
            "Idempotency-Key": f'"{request.idempotency_key}"',
            "Outbox-Operation-Id": str(request.operation_id),
            "Outbox-Action": request.action,
            "Outbox-Attempt": str(request.attempt),
        }
        if request.correlation_id:
            headers["Outbox-Correlation-Id"] = request.correlation_id
        try:
            response = await self._client.post(
                self._options.url, json=request.payload, headers=headers
            )
        except httpx.HTTPError as exc:
            return _classify_exception(exc)
        return self._classify_response(response, request)

    async def aclose(self) -> None:
        await self._client.aclose()

    def _classify_response(self, response: httpx.Response, request: SendRequest) -> SendResult:
        status = response.status_code
        request_id = response.headers.get("request-id") or response.headers.get("x-request-id")
        details: dict[str, Any] = {"http_status": status, "request_id": request_id}
        if 200 <= status < 300:
            body = _json_object(response)
            reference = body.get(self._options.reference_field) if body else None
            # A receiver that answers without a reference still knows the effect by its key.
            ref = str(reference) if reference not in (None, "") else request.idempotency_key
            return Succeeded(ref, body, status, request_id)
        if status in _TRANSIENT_STATUSES:
            return transient(
                f"http_{status}", _reason(response), retry_after=_retry_after(response), **details
            )
        if 400 <= status < 500 or 300 <= status < 400:
            return permanent(f"http_{status}", _reason(response), **details)
        return unknown(f"http_{status}", _reason(response), **details)


def _classify_exception(exc: httpx.HTTPError) -> SendResult:
    # Only failures before the request left this host are transient.
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc).__name__}")
    if isinstance(exc, httpx.TimeoutException):
        return unknown("timeout", f"no answer in time: {type(exc).__name__}")
    return unknown("transport_error", f"connection failed after sending: {type(exc).__name__}")


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def _reason(response: httpx.Response) -> str:
    # The status line only: a receiver's error body may echo the payload back.
    return f"HTTP {response.status_code} {response.reason_phrase}".strip()


def _retry_after(response: httpx.Response) -> timedelta | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    if value.strip().isdigit():
        delay = timedelta(seconds=int(value))
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        # An HTTP date is relative to our clock, not the database's: the best we have.
        delay = when - datetime.now(UTC)
    return max(timedelta(0), min(delay, MAX_RETRY_AFTER))

"""The webhook provider: POST the payload as JSON with the stored Idempotency-Key.

The body is the payload exactly as stored: PostgreSQL's JSON text of it (``payload_json``), so
that every number reaches the receiver as it was enqueued (``19.999999999999999999``, not 20.0).

Response classes follow the IETF Idempotency-Key draft: 2xx success; 409 (a request with that
key is in progress), 408, 425 and 429 transient, honouring Retry-After; 401 and 403 pause the
provider (our credentials are refused: nothing is spent); 422 and other 4xx permanent; every 5xx
(503 included: a gateway may answer it after the receiver acted), timeouts and resets after
sending unknown, retried with the same key only inside the key window; a refused connection
transient (nothing was sent); a request that cannot be built, or whose head h11 refuses to
write, permanent and not sent (outbox.providers.building). An answer is read within bounds
(outbox.providers.answers): one over ``max_response_bytes``, undecodable or too slow is unknown,
since the receiver answered and so may have acted. The reference of a 2xx is its
``reference_field`` when that is an identifier (``answers.reference``), else the idempotency
key.
"""

from __future__ import annotations

import email.utils
import re
import ssl
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import httpx

from outbox import payloads
from outbox.config import DEFAULT_CONCURRENCY, DEFAULT_MAX_RESPONSE_BYTES
from outbox.providers import building
from outbox.providers.answers import AnswerLimits, AnswerRefused, BodyTimeout, Tally, reference
from outbox.providers.base import (
    Failed,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)
from outbox.providers.shards import Shards, shard_sizes

DEFAULT_REFERENCE_FIELD = "id"
# Statuses that say the provider did not act and may be asked again: a request with this key is
# in progress (409), rate limited (429), timed out waiting for the request itself (408), too early
# (425).
_TRANSIENT_STATUSES = frozenset({408, 409, 425, 429})
# The receiver refuses our credentials (the secret headers): the provider pauses, as Stripe's
# does on a 401, and nothing is spent or quarantined (provider_limits, reason "credentials").
_REFUSED_CREDENTIALS = frozenset({401, 403})
# Longest Retry-After we honour: a misconfigured receiver must not park operations for days.
MAX_RETRY_AFTER = timedelta(hours=1)
_JSON_TYPE: Final = {"Content-Type": "application/json"}
# What _header_safe leaves as it is when it percent-encodes: visible ASCII but "%".
_HEADER_SAFE: Final = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
# Retry-After in seconds, in ASCII digits only (str.isdigit also takes "²", which int refuses).
_SECONDS = re.compile(r"[0-9]+")
# An idle keep-alive connection is closed after this many seconds (httpx's default, stated): after
# a burst of a thousand slow calls the thousand sockets to the receiver do not linger, while a
# steady stream reuses its connections instead of opening (and, over TLS, handshaking) anew.
KEEPALIVE_EXPIRY: Final = 5.0


@dataclass(frozen=True, slots=True)
class WebhookOptions:
    """A webhook provider's settings, secrets already read from their env or file source."""

    url: str
    timeout: timedelta
    key_retention: timedelta
    headers: Mapping[str, str] = field(default_factory=dict)
    secret_headers: Mapping[str, str] = field(default_factory=dict)
    reference_field: str = DEFAULT_REFERENCE_FIELD
    # Connections to the receiver at once: as many as the dispatcher may have calls in flight to
    # it (see connection_cap), so that no call waits for a connection behind the others.
    max_connections: int = DEFAULT_CONCURRENCY
    # The most bytes of one answer read, decoded (see outbox.providers.answers).
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

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
        # The bounds hook into each client, so they hold whatever the transport (a given one, or
        # a proxy's from the environment); the body's deadline is the call's timeout.
        self._limits = AnswerLimits(options.max_response_bytes, options.timeout.total_seconds())
        # The body is JSON; a Content-Type among the configured headers still wins, as it did
        # over httpx's own for json=.
        configured = {h.lower() for h in (*options.headers, *options.secret_headers)}
        self._content_type = {} if "content-type" in configured else _JSON_TYPE
        # A given transport is one pool: it cannot be split.
        sizes = [options.max_connections] if transport else shard_sizes(options.max_connections)
        # One TLS context for all the clients: each client would load the CA bundle into a
        # context of its own, 0.8 MB apiece (105 MB for the 128 clients of concurrency 1,024).
        tls = httpx.create_ssl_context()
        self._shards = Shards([self._client_of(size, tls, transport) for size in sizes], sizes)

    def _client_of(
        self, size: int, tls: ssl.SSLContext, transport: httpx.AsyncBaseTransport | None
    ) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            verify=tls,
            timeout=httpx.Timeout(self._options.timeout.total_seconds()),
            headers={**self._options.headers, **self._options.secret_headers},
            transport=transport,
            event_hooks=self._limits.event_hooks,
            follow_redirects=False,  # a redirect would replay the POST somewhere unconfigured
            # Every connection may stay open for the next call while calls keep coming; idle
            # ones close after KEEPALIVE_EXPIRY.
            limits=httpx.Limits(
                max_connections=size,
                max_keepalive_connections=size,
                keepalive_expiry=KEEPALIVE_EXPIRY,
            ),
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    @property
    def tally(self) -> Tally:
        """The bytes its answers came to, received and decoded (for tests and benchmarks)."""
        return self._limits.tally

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Any action is an event name and any JSON object a body: nothing to refuse locally."""

    async def send(self, request: SendRequest) -> SendResult:
        with self._shards.take() as client:
            built = self._build(client, request)
            if not isinstance(built, httpx.Request):
                return built
            try:
                response = await client.send(built)
            except AnswerRefused as exc:
                return unknown(exc.error_class, str(exc), http_status=exc.status)
            except building.NOT_WRITTEN as exc:
                # h11 refused to write the head: nothing left this host.
                return building.not_built(exc, _headers(request))
            except httpx.HTTPError as exc:
                return _classify_exception(exc)
        try:
            return self._classify_response(response, request)
        except Exception as exc:  # noqa: BLE001 (an odd answer must not lose a classified status)
            return _fallback(response.status_code, exc)

    def _build(self, client: httpx.AsyncClient, request: SendRequest) -> httpx.Request | Failed:
        """The request, or, when it cannot be built, what to record: not sent
        (outbox.providers.building). Only an exception's type is kept, since its text may quote
        the payload or a header."""
        problem = building.key_problem(request.idempotency_key)
        if problem is not None:
            return problem
        own: dict[str, str] = {}
        try:
            own = _headers(request)
            return client.build_request(
                "POST",
                self._options.url,
                content=_body(request),
                headers={**self._content_type, **own},
            )
        except building.BUILD_ERRORS as exc:
            return building.not_built(exc, own)

    async def aclose(self) -> None:
        for client in self._shards.clients:
            await client.aclose()

    def _classify_response(self, response: httpx.Response, request: SendRequest) -> SendResult:
        status = response.status_code
        request_id = response.headers.get("request-id") or response.headers.get("x-request-id")
        details: dict[str, Any] = {"http_status": status, "request_id": request_id}
        if 200 <= status < 300:
            body = _json_object(response)
            ref = reference(body.get(self._options.reference_field)) if body else None
            # A receiver that answers without a reference (or with something that is no
            # identifier) still knows the effect by its key.
            return Succeeded(ref or request.idempotency_key, body, status, request_id)
        retry_after = _retry_after(response)
        if status in _REFUSED_CREDENTIALS:
            # Our secret headers are refused: every operation would be, so the provider pauses
            # (its breaker opens, reason credentials) and this one keeps its attempt.
            return transient(f"http_{status}", _reason(response), pause=True, **details)
        if status in _TRANSIENT_STATUSES:
            # 409 (the key is in use) and 429 (slow down) concern this request, not the
            # receiver's health; 408 and 425 may.
            return transient(
                f"http_{status}",
                _reason(response),
                retry_after=retry_after,
                request_only=status in (409, 429),
                **details,
            )
        if 400 <= status < 500 or 300 <= status < 400:
            return permanent(f"http_{status}", _reason(response), **details)
        if response.headers.get("idempotent-replayed") == "true":
            # An error the receiver saved for this key: retries get only this answer again, so
            # the operation goes to reconciliation; the receiver itself answered.
            return unknown(
                f"http_{status}", _reason(response), reconcile=True, request_only=True, **details
            )
        # 5xx: a gateway may answer 502/503/504 after the receiver acted, so the key window
        # starts here; Retry-After still paces the retry.
        return unknown(f"http_{status}", _reason(response), retry_after=retry_after, **details)


def _body(request: SendRequest) -> bytes:
    """The payload as stored (PostgreSQL's JSON text), or written exactly from the decoded
    object for a request built without it."""
    text = request.payload_json
    if text is None:
        text = payloads.encode(request.payload)
    return text.encode()


def _headers(request: SendRequest) -> dict[str, str]:
    headers = {
        "Idempotency-Key": _sf_string(request.idempotency_key),
        "Outbox-Operation-Id": str(request.operation_id),
        "Outbox-Action": _header_safe(request.action),
        "Outbox-Attempt": str(request.attempt),
        # Whose operation this is: a receiver shared by tenants decides what each may do.
        "Outbox-Tenant-Id": _header_safe(request.tenant_id),
    }
    if request.correlation_id:
        headers["Outbox-Correlation-Id"] = _header_safe(request.correlation_id)
    return headers


def _sf_string(value: str) -> str:
    """An RFC 8941 string, as the Idempotency-Key draft wants: quoted, with \\ and \" escaped."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _header_safe(value: str) -> str:
    """An identity as a header value. A header carries visible ASCII with spaces only between
    (RFC 9110), and a tenant id, an action or a correlation id may be any text but control
    characters (sql/0028). One a header cannot carry as it is (a character past ASCII, a control
    in a row older than that check, a space at either end), or one that holds a "%", travels
    percent-encoded as UTF-8 (RFC 3986, the value-chars of RFC 8187 without their charset
    prefix), spaces as %20: "café" as caf%C3%A9, " acme" as %20acme, "50%" as 50%25. A receiver
    can always percent-decode a value and get the text back, and no two identities arrive the
    same."""
    if value.isascii() and value.isprintable() and "%" not in value and value.strip(" ") == value:
        return value
    return urllib.parse.quote(value, safe=_HEADER_SAFE)


def _fallback(status: int, exc: Exception) -> SendResult:
    """The class of an answer whose details could not be read."""
    note = f"HTTP {status} (answer unreadable: {type(exc).__name__})"
    if 200 <= status < 300:
        return unknown("unreadable_success", note, http_status=status)
    if status in _REFUSED_CREDENTIALS:
        return transient(f"http_{status}", note, http_status=status, pause=True)
    if status in _TRANSIENT_STATUSES:
        return transient(f"http_{status}", note, http_status=status)
    if 400 <= status < 500:
        return permanent(f"http_{status}", note, http_status=status)
    return unknown(f"http_{status}", note, http_status=status)


def _classify_exception(exc: httpx.HTTPError) -> SendResult:
    # Only failures before the request left this host are transient.
    if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc).__name__}")
    if isinstance(exc, BodyTimeout):
        return unknown("timeout", f"no answer in time: {exc}")
    if isinstance(exc, httpx.TimeoutException):
        return unknown("timeout", f"no answer in time: {type(exc).__name__}")
    return unknown("transport_error", f"connection failed after sending: {type(exc).__name__}")


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The 2xx answer's JSON object, or None when it has none: not JSON, not an object, nested
    past the decoder's depth, or holding an integer past Python's 4,300 digits (a ValueError
    that is no JSONDecodeError). The answer was a success either way."""
    try:
        body = response.json()
    except (ValueError, RecursionError):
        return None
    return body if isinstance(body, dict) else None


def _reason(response: httpx.Response) -> str:
    # The status line only: a receiver's error body may echo the payload back.
    return f"HTTP {response.status_code} {response.reason_phrase}".strip()


def _retry_after(response: httpx.Response) -> timedelta | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    if _SECONDS.fullmatch(value.strip()):
        cap = int(MAX_RETRY_AFTER.total_seconds())
        # Digits past the cap's own are past the cap: never int() thousands of them (it raises).
        digits = value.strip().lstrip("0")
        seconds = cap if len(digits) > len(str(cap)) else min(int(digits or "0"), cap)
        delay = timedelta(seconds=seconds)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC with no claim about the local zone
            when = when.replace(tzinfo=UTC)
        # An HTTP date is relative to our clock, not the database's: the best we have.
        delay = when - datetime.now(UTC)
    return max(timedelta(0), min(delay, MAX_RETRY_AFTER))

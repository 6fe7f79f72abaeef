"""The Stripe provider: v1 create calls with the stored idempotency key, and lookups for the
reconciler.

Stripe keeps an idempotency key for at least 24 hours and replays the saved answer of a request
that began executing (500s included); requests that failed validation, were rate limited or
collided with a concurrent request on the same key are not saved and may be retried. The error
map follows from that (see ``classify``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import httpx
import stripe

from outbox.config import DEFAULT_CONCURRENCY
from outbox.providers.base import (
    Failed,
    Found,
    InvalidRequest,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)
from outbox.providers.shards import Shards, shard_sizes

# action -> the StripeClient.v1 service whose create call it names
ACTIONS: Final = {
    "payment_intents.create": "payment_intents",
    "refunds.create": "refunds",
    "customers.create": "customers",
    "transfers.create": "transfers",
    "payouts.create": "payouts",
    "invoices.create": "invoices",
    "subscriptions.create": "subscriptions",
}
# Stripe allows 50 metadata keys; these two are ours, merged under the payload's own.
METADATA_OPERATION_ID: Final = "outbox_operation_id"
METADATA_IDEMPOTENCY_KEY: Final = "outbox_idempotency_key"
_METADATA_LIMIT: Final = 50
# A first 500 is retried after this long: Stripe may still roll the request forward or back.
# If the retry replays the saved 500, the operation goes to reconciliation.
SETTLE_DELAY: Final = timedelta(seconds=30)
# The lookup searches objects created this long around the attempts: the database's clock and
# Stripe's may disagree.
LOOKUP_SLACK: Final = timedelta(hours=1)
LOOKUP_PAGE: Final = 100

# The SDK logs request bodies (and so payloads) at debug level, to its logger and, when
# stripe.log or $STRIPE_LOG says so, straight to stderr; nothing of it is ever wanted.
logging.getLogger("stripe").addFilter(lambda record: record.levelno >= logging.WARNING)
stripe.log = None
stripe._util.STRIPE_LOG = None  # read once, when the SDK was imported


@dataclass(frozen=True, slots=True)
class StripeOptions:
    api_key: str
    api_base: str
    timeout: timedelta
    key_retention: timedelta
    stripe_account: str | None = None
    # Calls to Stripe at once: as many as the dispatcher may have in flight to it (see
    # shards.connection_cap). One SDK client's pool holds at most 100 (httpx's default).
    max_connections: int = DEFAULT_CONCURRENCY

    def __repr__(self) -> str:
        return f"StripeOptions(api_base={self.api_base!r}, stripe_account={self.stripe_account!r})"


class StripeProvider:
    """Creates Stripe objects through the official SDK's async calls."""

    def __init__(self, name: str, options: StripeOptions) -> None:
        self._name = name
        self._options = options
        # One SDK client per shard: the SDK takes no pool limits, but a shard never has more
        # calls in flight than its size, well within httpx's default keep-alive of 20.
        sizes = shard_sizes(options.max_connections)
        self._https = [stripe.HTTPXClient(timeout=options.timeout.total_seconds()) for _ in sizes]
        clients = [
            stripe.StripeClient(
                options.api_key,
                base_addresses={"api": options.api_base},
                stripe_account=options.stripe_account,
                http_client=http,
                max_network_retries=0,  # outbox owns retries, with the stored key and its window
            )
            for http in self._https
        ]
        self._shards = Shards(clients, sizes)

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        if action not in ACTIONS:
            raise InvalidRequest(f"stripe cannot do {action!r}; it can do {', '.join(ACTIONS)}")
        metadata = payload.get("metadata", {})
        if not isinstance(metadata, Mapping):
            raise InvalidRequest("the payload's metadata must be an object")
        taken = sorted(k for k in metadata if str(k).startswith("outbox_"))
        if taken:
            # The reconciler finds an effect by these keys: a copied value would point it at
            # another operation's object.
            raise InvalidRequest(f"the payload's metadata may not set {', '.join(taken)}")
        if len(metadata) + 2 > _METADATA_LIMIT:
            raise InvalidRequest(
                f"the payload has {len(metadata)} metadata keys; Stripe allows {_METADATA_LIMIT} "
                "and outbox adds 2"
            )

    async def send(self, request: SendRequest) -> SendResult:
        params = dict(request.payload)
        params["metadata"] = {
            **dict(params.get("metadata", {})),
            METADATA_OPERATION_ID: str(request.operation_id),
            METADATA_IDEMPOTENCY_KEY: request.idempotency_key,
        }
        with self._shards.take() as client:
            service = getattr(client.v1, ACTIONS[request.action])
            try:
                created = await service.create_async(
                    params=params, options={"idempotency_key": request.idempotency_key}
                )
            except stripe.StripeError as exc:
                return classify(exc)
        response = created.last_response
        return Succeeded(
            str(created.id),
            created.to_dict(),
            http_status=response.code if response else None,
            request_id=response.request_id if response else None,
        )

    async def lookup(
        self,
        action: str,
        operation_id: int,
        idempotency_key: str,
        first_sent_at: datetime,
        last_attempt_at: datetime,
    ) -> Found | None:
        """The object the operation created under any of its key generations, found by its
        metadata among the objects created around its attempts; None if there is none. Lists,
        never search: the Search API can lag by an hour, so it cannot prove an absence."""
        params: dict[str, Any] = {"limit": LOOKUP_PAGE, "created": {
            "gte": int((first_sent_at - LOOKUP_SLACK).timestamp()),
            "lte": int((last_attempt_at + LOOKUP_SLACK).timestamp())}}  # fmt: skip
        if action == "subscriptions.create":
            params["status"] = "all"  # canceled subscriptions are left out otherwise
        family = _key_family(idempotency_key)
        matches: list[str] = []
        with self._shards.take() as client:
            service = getattr(client.v1, ACTIONS[action])
            page = await service.list_async(params=params)
            async for obj in page.auto_paging_iter():
                metadata = obj.to_dict().get("metadata") or {}
                # The id alone could be another database's operation: the key must match too.
                if (
                    metadata.get(METADATA_OPERATION_ID) == str(operation_id)
                    and _key_family(str(metadata.get(METADATA_IDEMPOTENCY_KEY))) == family
                ):
                    matches.append(str(obj.id))
        if not matches:
            return None
        matches.reverse()  # lists are newest first: the earliest object is the effect
        return Found(matches[0], tuple(matches[1:]))

    async def aclose(self) -> None:
        for http in self._https:
            await http.close_async()  # type: ignore[no-untyped-call]


def classify(exc: stripe.StripeError) -> Failed:  # noqa: PLR0911 (a decision table)
    """What a Stripe error leads to. Stripe-Should-Retry, when present, is honoured first."""
    status = exc.http_status
    details: dict[str, Any] = {"http_status": status, "request_id": exc.request_id}
    message = _message(exc)
    if isinstance(exc, stripe.APIConnectionError):
        return _connection_failure(exc)
    if isinstance(exc, stripe.AuthenticationError | stripe.PermissionError):
        return transient(f"http_{status}", message, pause=True, **details)
    if isinstance(exc, stripe.IdempotencyError):
        return permanent("idempotency_error", "the same key came with other parameters: the "
                         "payload changed after enqueue (a producer bug?)", **details)  # fmt: skip
    should_retry = _should_retry(exc)
    if status == 500:
        replayed = (exc.headers or {}).get("idempotent-replayed") == "true"
        # A saved 500 is all this key will ever get: reconcile instead of burning attempts.
        return unknown("http_500", message, retry_after=SETTLE_DELAY, reconcile=replayed,
                       request_only=replayed, **details)  # fmt: skip
    if should_retry is False:
        return permanent(_error_class(exc), message, **details)
    if status in (409, 429) or isinstance(exc, stripe.RateLimitError):
        # The key is in use, or this account is rate limited: no word on Stripe's health.
        return transient(_error_class(exc), message, request_only=True, **details)
    if status in (502, 503, 504):
        # A gateway may answer these after Stripe acted: retry with the same key, but the key
        # window starts here.
        return unknown(_error_class(exc), message, **details)
    if should_retry is True or status is None or status >= 500:
        return unknown(_error_class(exc), message, **details)
    return permanent(_error_class(exc), message, **details)  # 400, 402, 404 and the other 4xx


def _connection_failure(exc: stripe.APIConnectionError) -> Failed:
    # The SDK wraps the transport's exception: only a failure to connect proves nothing was sent.
    if isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc.__cause__).__name__}")
    if isinstance(exc.__cause__, httpx.TimeoutException):
        return unknown("timeout", f"no answer in time: {type(exc.__cause__).__name__}")
    cause = type(exc.__cause__).__name__ if exc.__cause__ else "unknown"
    return unknown("connection_error", f"the connection failed after sending: {cause}")


def _should_retry(exc: stripe.StripeError) -> bool | None:
    value = (exc.headers or {}).get("stripe-should-retry")
    return None if value is None else value == "true"


def _error_class(exc: stripe.StripeError) -> str:
    code = getattr(exc.error, "code", None) if exc.error else None
    return f"http_{exc.http_status}" + (f"_{code}" if code else "")


def _message(exc: stripe.StripeError) -> str:
    # The type and code, never the message body: Stripe echoes parameters (and key prefixes).
    kind = getattr(exc.error, "type", None) if exc.error else None
    code = getattr(exc.error, "code", None) if exc.error else None
    parts = [f"HTTP {exc.http_status}" if exc.http_status else type(exc).__name__, kind, code]
    return " ".join(p for p in parts if p)


def _key_family(key: str) -> str:
    """The key without its generation suffix: every generation of one operation shares it."""
    return re.sub(r":r[0-9]+$", "", key)

"""The Stripe provider: v1 create calls with the stored idempotency key, and lookups for the
reconciler.

Stripe keeps an idempotency key for at least 24 hours and replays the saved answer of a request
that began executing (500s included); requests that failed validation, were rate limited or
collided with a concurrent request on the same key are not saved and may be retried. The error
map follows from that (see ``classify``).

Every number of the payload reaches Stripe as its exact decimal text: ``0.0000001``, never the
SDK's ``1E-7`` (it writes a Decimal with ``str``) or a float's rounding (see ``_form``). Every
answer is read within bounds (outbox.providers.answers) by an SDK HTTP client of outbox's own
(``_SDKClient``): one over ``max_response_bytes``, undecodable or too slow is unknown, and so is
a 2xx the SDK cannot parse, since Stripe answered and so may have acted (the retry with the same
key replays its answer).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import ssl
from collections.abc import Awaitable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any, Final

import httpx
import stripe

from outbox.config.settings import DEFAULT_CONCURRENCY, DEFAULT_MAX_RESPONSE_BYTES
from outbox.core import payloads
from outbox.providers import building
from outbox.providers.answers import (
    MAX_BYTES_EXTENSION,
    AnswerLimits,
    AnswerRefused,
    BodyTimeout,
    Tally,
    reference,
)
from outbox.providers.base import (
    Failed,
    Found,
    InvalidRequest,
    LookupRequest,
    NotFound,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)
from outbox.providers.kit import retry_after_value
from outbox.providers.shards import Shards, shard_sizes
from outbox.providers.stripe import states as stripe_states
from outbox.providers.stripe.actions import ACTIONS, TARGET
from outbox.providers.stripe.lookup import (
    EVENTS_KEPT,
    LOOKUPS,
    METADATA_IDEMPOTENCY_KEY,
    METADATA_OPERATION_ID,
    Match,
    Stripe,
    Window,
    not_found,
    retrieve_object,
    search_events,
    search_objects,
)

# The payload field that names the connected account an operation is sent for (Connect), when
# the provider allows it (operation_accounts): sent as Stripe-Account, never as a parameter.
OPERATION_ACCOUNT: Final = "stripe_account"
_ACCOUNT: Final = re.compile(r"acct_[A-Za-z0-9]{1,64}")
# Stripe allows 50 metadata keys; two are ours (stripe/lookup.py), merged under the payload's own.
_METADATA_LIMIT: Final = 50
# A first 500 is retried after this long: Stripe may still roll the request forward or back.
# If the retry replays the saved 500, the operation goes to reconciliation.
SETTLE_DELAY: Final = timedelta(seconds=30)
# The lookup searches objects created this long around the attempts: the database's clock and
# Stripe's may disagree.
LOOKUP_SLACK: Final = timedelta(hours=1)
# The Stripe API version every request is sent in, unless the config pins another
# (stripe_version): the one stripe-python 16.1 was built for. Not the SDK's own default, which
# moves with each SDK release and would change what queued payloads mean (README, "Stripe API
# version"). An operation keeps the version of its first send for its retries and lookups.
DEFAULT_STRIPE_VERSION: Final = "2026-10-28.endive"
# Never kept of an answer, by default: a PaymentIntent's or SetupIntent's client_secret lets
# whoever holds it confirm the payment from a browser; it belongs to the customer's page only.
DEFAULT_REDACTED: Final = ("client_secret",)
REDACTED: Final = "[redacted by outbox]"
# The cap on a lookup's list page, when max_response_bytes is smaller: a page holds LOOKUP_PAGE
# objects, and each may carry 50 metadata keys of 500 characters (some 30 KB), so 16 MiB holds a
# page of objects five times that size. A lookup reads one page at a time.
LIST_PAGE_BYTES: Final = 16 << 20

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
    # The most bytes of one answer read, decoded (see outbox.providers.answers).
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    # Fields of Stripe's answers never stored in an operation's result, at any depth.
    redact_fields: tuple[str, ...] = DEFAULT_REDACTED
    stripe_version: str = DEFAULT_STRIPE_VERSION
    # Whether an operation may name its connected account (OPERATION_ACCOUNT in the payload).
    operation_accounts: bool = False

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
        self._limits = AnswerLimits(options.max_response_bytes, options.timeout.total_seconds())
        # The SDK's own HTTPXClient loads its CA bundle once per client; one context serves all.
        tls = ssl.create_default_context(cafile=stripe.ca_bundle_path)
        list_cap = max(options.max_response_bytes, LIST_PAGE_BYTES)
        self._https = [_SDKClient(self._client(tls), list_cap) for _ in sizes]
        clients = [
            stripe.StripeClient(
                options.api_key,
                base_addresses={"api": options.api_base},
                stripe_account=options.stripe_account,
                stripe_version=options.stripe_version,
                http_client=http,
                max_network_retries=0,  # outbox owns retries, with the stored key and its window
            )
            for http in self._https
        ]
        self._shards = Shards(clients, sizes)

    @property
    def name(self) -> str:
        return self._name

    def _client(self, tls: ssl.SSLContext) -> httpx.AsyncClient:
        # What stripe.HTTPXClient builds (an environment's proxy is honoured), bounded.
        return httpx.AsyncClient(
            verify=tls,
            timeout=httpx.Timeout(self._options.timeout.total_seconds()),
            event_hooks=self._limits.event_hooks,
            follow_redirects=False,
        )

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    @property
    def api_version(self) -> str:
        """The version new operations are sent in (an operation keeps its first send's)."""
        return self._options.stripe_version

    @property
    def actions(self) -> frozenset[str]:
        """Every action it can do: each keeps its own metric label
        (outbox.observability.metric_labels)."""
        return frozenset(ACTIONS)

    @property
    def tally(self) -> Tally:
        """The bytes its answers came to, received and decoded (for tests and benchmarks)."""
        return self._limits.tally

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        if action not in ACTIONS:
            raise InvalidRequest(f"stripe cannot do {action!r}; it can do {', '.join(ACTIONS)}")
        if ACTIONS[action].is_change:
            ACTIONS[action].target_of(payload)
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
        if OPERATION_ACCOUNT in payload:
            self._check_account(payload[OPERATION_ACCOUNT])

    def _check_account(self, account: object) -> None:
        if not self._options.operation_accounts:
            # A producer must not send on another account's behalf unless the operator says so.
            raise InvalidRequest(
                f"the payload names a {OPERATION_ACCOUNT}; this provider "
                "sends for one account (operation_accounts = false)"
            )
        if not isinstance(account, str) or not _ACCOUNT.fullmatch(account):
            raise InvalidRequest(
                f"the payload's {OPERATION_ACCOUNT} must be a connected account id (acct_...)"
            )

    def scope(self, action: str, payload: Mapping[str, Any]) -> str:
        """Where an operation's requests go: its account (the payload's, the config's, or the
        platform's own) and the key's mode. Stored with its first send (sql/0023)."""
        account = payload.get(OPERATION_ACCOUNT) or self._options.stripe_account or "platform"
        return f"{account} {_mode(self._options.api_key)}"

    def _account(self, payload: Mapping[str, Any]) -> str | None:
        account = payload.get(OPERATION_ACCOUNT)
        return account if isinstance(account, str) else self._options.stripe_account

    async def send(self, request: SendRequest) -> SendResult:
        act = ACTIONS.get(request.action)
        if act is None:  # check() refuses it first; send never raises all the same
            return building.unsendable(f"Stripe has no action {request.action!r} in outbox")
        # What cannot be built is recorded as not sent (outbox.providers.building): a key no
        # request can carry (an empty one the SDK would leave out), a payload the form cannot
        # hold, a value the SDK, httpx or h11 refuses before anything is written.
        params = _params(request, act.is_change)
        if isinstance(params, Failed):
            return params
        target = (str(request.payload[TARGET]),) if act.is_change else ()
        with self._shards.take() as client:
            call = act.resolve(client.v1)
            handover = _Handover()
            token = _HANDOVER.set(handover)
            try:
                version = request.api_version or self._options.stripe_version
                options: Any = {
                    "idempotency_key": request.idempotency_key,
                    "stripe_version": version,
                    "stripe_account": self._account(request.payload),
                }
                created = await call(*target, params=params, options=options)
            except building.Unbuilt as exc:  # httpx could not build it, h11 not write it
                return exc.failure
            except Exception as exc:  # noqa: BLE001 (an answer the SDK chokes on must not raise)
                return _raised(exc, handover)
            finally:
                _HANDOVER.reset(token)
        try:
            return _succeeded(created, request.idempotency_key, self._options.redact_fields)
        except Exception as exc:  # noqa: BLE001 (likewise: an object with no last_response...)
            return unknown("unreadable_success", _choked(exc))

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        """The object the operation created under any of its keys: looked for among the
        objects created around its attempts (narrowed by the list filters its payload allows),
        then among the events of their creation, which name the key that caused them and which
        Stripe lists for 30 days, deleted objects included. Lists, never search: the Search API
        can lag by an hour, so it cannot prove an absence. Each source reads at most
        LOOKUP_MAX_PAGES pages: a search cut short proves nothing (``NotFound.complete``)."""
        since = request.first_sent_at - LOOKUP_SLACK
        until = request.search_until + LOOKUP_SLACK
        elsewhere = self._sent_elsewhere(request)
        if elsewhere is not None:
            return NotFound((), since, until, complete=False, reason=elsewhere)
        with self._shards.take() as client:
            api = Stripe(
                client,
                request.api_version or self._options.stripe_version,
                self._account(request.payload),
                request.pace,
            )
            if ACTIONS[request.action].is_change:
                return await _changed(api, request, (since, until))
            searchable = LOOKUPS[request.action]
            match = Match(request.operation_id, request.keys, request.idempotency_key)
            objects = await search_objects(api, searchable, request.payload, match, (since, until))
            if objects.matches:
                return self._found(request.action, objects.matches)
            events_since = max(since, request.checked_now - EVENTS_KEPT)
            events = await search_events(api, searchable, match, (events_since, until))
            if events.matches:
                reference = events.matches[0][0]
                current = await retrieve_object(api, searchable.service, reference)
                return self._found(request.action, [(reference, current), *events.matches[1:]])
        return not_found(objects, events, since, until, events_since)

    def _sent_elsewhere(self, request: LookupRequest) -> str | None:
        """Why this provider cannot search where the operation was sent, or None."""
        here = self.scope(request.action, request.payload)
        if request.sent_scope is None or request.sent_scope == here:
            return None
        return (
            f"it was sent to {request.sent_scope}, and this provider now reaches {here}: "
            "search there, with the account and key it was sent with"
        )

    @staticmethod
    def _found(action: str, matches: list[tuple[str, dict[str, Any]]]) -> Found:
        (reference, effect), *others = matches
        # Found is not done: a declined PaymentIntent exists too (stripe/states.py).
        decided, state, details = stripe_states.verdict(action, effect)
        return Found(reference, tuple(ref for ref, _ in others), decided, state, details)

    async def aclose(self) -> None:
        for http in self._https:
            await http.close_async()


def _params(request: SendRequest, is_change: bool) -> dict[str, Any] | Failed:
    """The call's parameters, or why it cannot be built (not sent)."""
    problem = building.key_problem(request.idempotency_key)
    if problem is not None:
        return problem
    # Neither the account nor a change's target is a parameter of the call.
    taken = {OPERATION_ACCOUNT, TARGET} if is_change else {OPERATION_ACCOUNT}
    try:
        params: dict[str, Any] = _form({k: v for k, v in request.payload.items() if k not in taken})
    except _Unsendable as exc:
        # The message is ours: it never quotes the payload.
        return building.unsendable(f"the payload cannot be sent: {exc}")
    except RecursionError:
        return building.unsendable("the payload cannot be sent: it nests too deep")
    if not is_change:  # how the reconciler finds what a create made
        params["metadata"] = {
            **dict(params.get("metadata") or {}),
            METADATA_OPERATION_ID: str(request.operation_id),
            METADATA_IDEMPOTENCY_KEY: request.idempotency_key,
        }
    return params


def _raised(exc: Exception, handover: _Handover) -> Failed:
    """What an exception of the SDK's call means: where it came before the SDK handed its
    request to the HTTP client, nothing left this host."""
    if not handover.done:
        return building.not_built(exc)
    if isinstance(exc, stripe.StripeError):
        return classify(exc)
    # The params are plain text by now, and the request was handed over, so this is the answer:
    # nested too deep for the SDK's objects, say. Stripe answered, so it may have acted.
    return unknown("unreadable_success", _choked(exc))


class _Handover:
    """Whether the SDK handed this call's request to the HTTP client (_SDKClient)."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False


# The send under way in this task, if any: _SDKClient marks it when the SDK hands it a request.
_HANDOVER: ContextVar[_Handover | None] = ContextVar("outbox_stripe_handover", default=None)


class _SDKClient(stripe.HTTPClient):
    """The SDK's HTTP client (its documented extension point), on an httpx client that reads
    every answer within bounds; a lookup's list page (a GET) may have LIST_PAGE_BYTES. Like
    ``stripe.HTTPXClient`` it turns any failure into APIConnectionError, the cause kept, but it
    posts the form as ``content=`` (httpx deprecates ``data=<str>``) and offers no streaming,
    which no call of outbox's asks for."""

    name = "httpx"

    def __init__(self, client: httpx.AsyncClient, list_cap: int) -> None:
        super().__init__()
        self._client = client
        self._list_extensions = {MAX_BYTES_EXTENSION: list_cap}

    async def request_async(
        self, method: str, url: str, headers: Mapping[str, str], post_data: Any = None
    ) -> tuple[bytes, int, Mapping[str, str]]:
        extensions = self._list_extensions if method.lower() == "get" else None
        handover = _HANDOVER.get()
        if handover is not None:
            handover.done = True
        # Building the request and writing its head fail before anything is sent: raised as
        # Unbuilt, which the SDK lets through (it retries and wraps only APIConnectionError).
        try:
            built = self._client.build_request(
                method, url, headers=headers, content=post_data, extensions=extensions
            )
        except building.BUILD_ERRORS as exc:
            raise building.Unbuilt(building.not_built(exc, headers)) from exc
        try:
            response = await self._client.send(built)
        except building.NOT_WRITTEN as exc:
            raise building.Unbuilt(building.not_built(exc, headers)) from exc
        except Exception as exc:
            raise stripe.APIConnectionError(  # type: ignore[no-untyped-call]  # the SDK's own
                f"Network error: a {type(exc).__name__} was raised", should_retry=True
            ) from exc
        return response.content, response.status_code, response.headers

    async def close_async(self) -> None:
        await self._client.aclose()

    def sleep_async(self, secs: float) -> Awaitable[None]:
        return asyncio.sleep(secs)


# The most digits after the point a number may have: PostgreSQL's numeric keeps no more, so every
# stored payload's numbers fit.
_MAX_FRACTION_DIGITS: Final = 16383


class _Unsendable(ValueError):
    """A payload value Stripe's form cannot carry exactly; the message never quotes it."""


def _form(value: Any) -> Any:
    """``value`` with every number as the exact decimal text Stripe's form takes.

    The SDK writes each leaf with ``str``: a Decimal as ``1E-7``, a float rounded or as
    ``1e+16``, an integer past 4,300 digits not at all (a ValueError escaping the call).
    Here a Decimal becomes its plain text (``format(d, "f")``: ``0.0000001``, ``20.0`` stays
    ``20.0``), a float the plain text of its shortest repr, an integer its digits; booleans,
    strings and None are left to the SDK (``true``, as is, left out). A number past the limits
    of ``_plain``, one that is not finite, or a value JSON does not have is refused.
    """
    if value is None or isinstance(value, str | bool):
        return value
    if isinstance(value, int):
        return _integer_text(value)
    if isinstance(value, Decimal):
        return _plain(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Unsendable("it holds a number that is not finite")
        return _plain(Decimal(repr(value)))
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise _Unsendable("it holds an object key that is not a string")
        return {k: _form(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_form(v) for v in value]
    raise _Unsendable(f"it holds a {type(value).__name__}, which is not a JSON value")


def _integer_text(value: int) -> str:
    # Over 4 bits a digit: a longer integer is refused before it is ever turned into text.
    limit = payloads.MAX_NUMBER_DIGITS
    text = str(value) if value.bit_length() <= 4 * limit else ""
    if not text or len(text) - text.startswith("-") > limit:
        raise _Unsendable(f"it holds an integer of more than {limit} digits")
    return text


def _plain(value: Decimal) -> str:
    """The limits are the stored payloads' own, checked before the text is written (so that
    ``1E-99999999`` from a hand-built request is never expanded): less than 1e100 in
    magnitude (payloads.MAX_NUMBER_DIGITS), at most _MAX_FRACTION_DIGITS after the point."""
    if not value.is_finite():
        raise _Unsendable("it holds a number that is not finite")
    if value and value.adjusted() >= payloads.MAX_NUMBER_DIGITS:
        raise _Unsendable(f"it holds a number of 1e{payloads.MAX_NUMBER_DIGITS} or more")
    exponent = value.as_tuple().exponent
    assert isinstance(exponent, int)  # noqa: S101 (finite, so never "n", "N" or "F")
    if -exponent > _MAX_FRACTION_DIGITS:
        raise _Unsendable(f"it holds a number of more than {_MAX_FRACTION_DIGITS} decimals")
    return format(value, "f")


def _succeeded(created: Any, key: str, redact: tuple[str, ...] = DEFAULT_REDACTED) -> Succeeded:
    """The result of a created object: the JSON Stripe sent, less the ``redact`` fields. Its id
    is the reference when it is an identifier (``answers.reference``); otherwise the idempotency
    key serves, as on the webhook."""
    response = created.last_response
    try:
        body = _redacted(_answer(created), frozenset(redact))
    except RecursionError:  # nested past what Python walks: the outcome, without its body
        body = None
    return Succeeded(
        reference(body.get("id")) or key,
        body,
        http_status=response.code if response else None,
        request_id=response.request_id if response else None,
    )


def _answer(created: Any) -> Any:
    """The answer as Stripe wrote it. The SDK's objects turn ``*_decimal`` fields into Decimal,
    which no JSON encoder writes, and the result was then dropped whole; the raw body has them
    as Stripe's own strings."""
    response = created.last_response
    raw = getattr(response, "body", None)
    if isinstance(raw, str | bytes):
        try:
            return json.loads(raw)
        except ValueError:
            pass
    return created.to_dict()


def _redacted(value: Any, fields: frozenset[str]) -> Any:
    if isinstance(value, dict):
        return {
            k: REDACTED if k in fields and v is not None else _redacted(v, fields)
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_redacted(v, fields) for v in value]
    return value


def _choked(exc: Exception) -> str:
    return f"the answer could not be read: {type(exc).__name__}"


def classify(exc: stripe.StripeError) -> Failed:  # noqa: PLR0911 (a decision table)
    """What a Stripe error leads to. Stripe-Should-Retry, when present, is honoured, except that
    a 5xx is never permanent: Stripe may have acted."""
    status = exc.http_status
    details: dict[str, Any] = {"http_status": status, "request_id": exc.request_id}
    message = _message(exc)
    if isinstance(exc, stripe.APIConnectionError):
        return _connection_failure(exc)
    if status is not None and 200 <= status < 300:
        # The SDK raises on a 2xx only when it cannot parse it (not JSON, an integer past
        # 4,300 digits...): Stripe answered, so it may have acted, and the retry with the same
        # key replays the answer. Never permanent: that would quarantine a charge that exists.
        return unknown("unreadable_success", f"HTTP {status} answer unreadable", **details)
    if isinstance(exc, stripe.AuthenticationError):  # 401: the key itself is refused
        return transient(f"http_{status}", message, pause=True, **details)
    if isinstance(exc, stripe.PermissionError):
        # 403: a restricted key without this permission (payouts, say): this action waits,
        # the others go on.
        return transient(f"http_{status}", message, pause_action=True, request_only=True, **details)
    if isinstance(exc, stripe.IdempotencyError):
        return permanent(
            "idempotency_error",
            "the same key came with other parameters: the "
            "payload changed after enqueue (a producer bug?)",
            **details,
        )
    should_retry = _should_retry(exc)
    if status in (409, 429) or isinstance(exc, stripe.RateLimitError):
        # The key is in use by a request still running, the object is locked (lock_timeout),
        # or this account is rate limited: Stripe did not act, whatever Should-Retry says, and
        # said nothing of its health. Retried without spending the attempt budget.
        # A Retry-After (from Stripe or a proxy before it) is a floor for the backoff.
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        return transient(
            _error_class(exc),
            message,
            request_only=True,
            spends_attempt=False,
            retry_after=retry_after_value(headers.get("retry-after")),
            **details,
        )
    if status == 500:
        replayed = (exc.headers or {}).get("idempotent-replayed") == "true"
        # A saved 500 is all this key will ever get: reconcile instead of burning attempts.
        return unknown(
            "http_500",
            message,
            retry_after=SETTLE_DELAY,
            reconcile=replayed,
            request_only=replayed,
            **details,
        )
    if status is not None and status >= 500 and should_retry is False:
        # Stripe may have acted, and says a retry will not help (its answer is saved): never
        # permanent, which would let a person replay a charge that exists. The check decides.
        return unknown(_error_class(exc), message, reconcile=True, **details)
    if should_retry is False:
        return permanent(_error_class(exc), message, **details)
    if status in (502, 503, 504):
        # A gateway may answer these after Stripe acted: retry with the same key, but the key
        # window starts here.
        return unknown(_error_class(exc), message, **details)
    if should_retry is True or status is None or status >= 500:
        return unknown(_error_class(exc), message, **details)
    if isinstance(exc, stripe.CardError):
        return _declined(exc, message, details)
    return permanent(_error_class(exc), message, **details)  # 400, 404 and the other 4xx


def _declined(exc: stripe.CardError, message: str, details: dict[str, Any]) -> Failed:
    """A 402: the card was declined, and Stripe saved the answer, so the key will never get
    another. Quarantined as provider_declined, like a decline a reconciliation check finds, with
    what the on-call engineer and the business act on: the decline and advice codes (never the
    message, which may echo parameters) and the PaymentIntent the decline left."""
    error = exc.error
    intent = getattr(error, "payment_intent", None)
    found = {name: getattr(error, name, None) for name in _CARD_CODES}
    found |= {
        "payment_intent": getattr(intent, "id", None),
        "charge": getattr(error, "charge", None),
    }
    # A broken or hostile answer must not write what it likes into last_error: words only.
    words = {
        name: value
        for name, value in found.items()
        if isinstance(value, str) and _WORD.fullmatch(value)
    }
    full = "; ".join([message, *(f"{name} {value}" for name, value in words.items())])
    return permanent(
        _error_class(exc),
        full,
        reference=words.get("payment_intent"),
        reason="provider_declined",
        **details,
    )


# The parts of a card error an operator acts on (docs.stripe.com/declines/codes).
_CARD_CODES: Final = ("decline_code", "advice_code", "network_decline_code")
_WORD: Final = re.compile(r"[A-Za-z0-9_]{1,64}")


async def _changed(api: Stripe, request: LookupRequest, window: Window) -> Found | NotFound:
    """A change is decided by its target as it is now: done, refused, undecided, or not
    happened (a complete not-found: it may be sent again)."""
    act = ACTIONS[request.action]
    target = act.target_of(request.payload)
    obj = await retrieve_object(api, act.service, target)
    decided, state, details = stripe_states.change_verdict(request.action, obj)
    if decided is None:
        return NotFound((f"{act.service} {target} ({state})",), *window)
    return Found(target, (), decided, state, details)


def _mode(api_key: str) -> str:
    """The mode a key acts in, by its documented prefix (sk_live_, rk_test_...)."""
    for mode in ("live", "test"):
        if api_key.startswith((f"sk_{mode}_", f"rk_{mode}_")):
            return mode
    return "unknown mode"


def _connection_failure(exc: stripe.APIConnectionError) -> Failed:
    # The SDK wraps the transport's exception: only a failure to connect proves nothing was sent.
    if isinstance(exc.__cause__, AnswerRefused):
        # Stripe answered (too much, undecodably): it may have acted.
        refused = exc.__cause__
        return unknown(refused.error_class, str(refused), http_status=refused.status)
    if isinstance(exc.__cause__, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout):
        return transient("connect_failed", f"could not connect: {type(exc.__cause__).__name__}")
    if isinstance(exc.__cause__, BodyTimeout):
        return unknown("timeout", f"no answer in time: {exc.__cause__}")
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

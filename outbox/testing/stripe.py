"""A fake Stripe API: a real HTTP server on loopback that keeps Stripe's idempotency semantics.

The real ``stripe`` SDK talks to it through ``StripeClient(api_key, base_addresses={"api":
fake.url})``. It speaks the v1 wire format (form-encoded bodies with ``metadata[k]=v`` and
``items[0][price]=p``, JSON answers, ``Request-Id`` headers, Stripe's error JSON) for creating,
retrieving and listing a handful of resources, and implements the idempotency rules Stripe
documents:

* the first POST with an ``Idempotency-Key`` executes and its status and body are saved, 500s
  included once execution began;
* the same key with the same endpoint and parameters replays the saved answer
  (``Idempotent-Replayed: true``, ``Original-Request: <first request id>``) and creates nothing;
* the same key with other parameters gets 400 ``idempotency_error``;
* the same key while the first request still executes gets 409 ``idempotency_key_in_use``;
* validation failures, 401s, 429s and other injected statuses are not saved;
* keys are pruned ``key_retention`` seconds after first use, after which the same key creates a
  second object: the duplicate that outbox exists to prevent.

The server runs inside the pytest process, so its ledger outlives a dispatcher subprocess a test
kills. Faults and holds put a client in every awkward spot between "Stripe created the object"
and "the client learned about it", including a 200 that a malicious or broken API sends instead
of the object it created (huge, a compression bomb, dribbled, or any bytes at all).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self
from urllib.parse import parse_qsl, urlsplit

from outbox.testing.loopback import (
    HOST,
    BadAnswer,
    BadAnswerFaults,
    Headers,
    Hold,
    JsonHandler,
    KeyEntry,
    Ledger,
    LoopbackFake,
    LoopbackServer,
    Plan,
    Reply,
)
from outbox.testing.stripe_changes import change, changes

__all__ = [
    "DEFAULT_API_KEY",
    "HOST",
    "RESOURCES",
    "BadAnswer",
    "FakeStripe",
    "Hold",
    "Resource",
    "StripeFault",
    "StripeFaultKind",
    "StripeRequest",
    "mask_api_key",
    "parse_form",
]

DEFAULT_API_KEY = "sk_test_fake"
_SHOULD_RETRY = ("Stripe-Should-Retry", "true")
# Statuses that Stripe marks as worth retrying when an injected fault does not say otherwise.
_RETRYABLE_STATUSES = frozenset({409, 429, 503})
_MAX_LIMIT = 100
# The API version the fake's events are written in (what its answers are shaped like).
_API_VERSION = "2024-06-20"
_DEFAULT_LIMIT = 10


@dataclass(frozen=True)
class Resource:
    """One v1 resource the fake serves: its URL name, ``object`` value, id prefix, defaults."""

    name: str
    object: str
    prefix: str
    defaults: tuple[tuple[str, Any], ...] = ()
    event: str = ""  # the type of the event its creation makes; "": none
    creatable: bool = True


RESOURCES: dict[str, Resource] = {
    r.name: r
    for r in (
        Resource(
            "payment_intents",
            "payment_intent",
            "pi",
            (("status", "requires_payment_method"),),
            "payment_intent.created",
        ),
        Resource("refunds", "refund", "re", (("status", "succeeded"),), "refund.created"),
        Resource("customers", "customer", "cus", (), "customer.created"),
        Resource("transfers", "transfer", "tr", (("reversed", False),), "transfer.created"),
        Resource("payouts", "payout", "po", (("status", "pending"),), "payout.created"),
        Resource("invoices", "invoice", "in", (("status", "draft"),), "invoice.created"),
        Resource(
            "subscriptions",
            "subscription",
            "sub",
            (("status", "active"),),
            "customer.subscription.created",
        ),
        Resource(
            "setup_intents",
            "setup_intent",
            "seti",
            (("status", "requires_payment_method"),),
            "setup_intent.created",
        ),
        # Stripe makes no event of a Checkout Session's creation: it is found by its list only.
        Resource("checkout/sessions", "checkout.session", "cs_test", (("status", "open"),)),
        # Listed, never created: each creation above makes one, naming the key that caused it.
        Resource("events", "event", "evt", creatable=False),
    )
}
# Top-level parameters echoed as integers: the form encoding turned them into strings.
_INTEGER_PARAMS = frozenset(
    {"amount", "application_fee_amount", "days_until_due", "trial_period_days"}
)
# Parameters that shape a list request rather than filter on an object field.
_LIST_CONTROLS = frozenset({"limit", "starting_after", "ending_before", "created", "expand"})
_CREATED_OPS: dict[str, Callable[[int, int], bool]] = {
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
}


@dataclass(frozen=True)
class StripeRequest:
    """One request that arrived, whatever became of it.

    ``path`` has no query string; ``params`` is the parsed form body (POST) or query (GET),
    nested like the SDK's params (``{"metadata": {"k": "v"}}``), every leaf a string.
    ``status`` is None while the request is being processed and stays None when the connection
    was reset. ``account`` is the ``Stripe-Account`` header; ``at`` is ``time.monotonic()``;
    ``version`` the ``Stripe-Version`` header.
    """

    method: str
    path: str
    idempotency_key: str | None
    params: dict[str, Any]
    status: int | None
    replayed: bool
    request_id: str
    account: str | None
    at: float
    answered_at: float | None = None  # time.monotonic() when answered or reset
    version: str | None = None


class StripeFaultKind(enum.Enum):
    """What a fault does; see the class methods of :class:`StripeFault`."""

    STATUS = "status"
    RESET_BEFORE_APPLY = "reset_before_apply"
    ERROR_500_BEFORE_APPLY = "error_500_before_apply"
    ERROR_500_AFTER_APPLY = "error_500_after_apply"
    DELAY_AFTER_APPLY = "delay_after_apply"
    RESET_AFTER_APPLY = "reset_after_apply"
    BAD_ANSWER_AFTER_APPLY = "bad_answer_after_apply"


# Faults that strike before the idempotency ledger is consulted (any request, a replay too);
# the others strike only a POST that executes, i.e. would create an object.
_BEFORE_LEDGER = frozenset({StripeFaultKind.STATUS, StripeFaultKind.RESET_BEFORE_APPLY})


@dataclass(frozen=True)
class StripeFault(BadAnswerFaults):
    """A misbehaviour to inject; build one with the class methods, e.g.
    ``StripeFault.status(429, ...)``.

    ``status`` and ``reset_before_apply`` hit any matching request (GETs and replays too) and
    save nothing. The others hit only a POST that executes, so a replay is never disturbed; the
    bad answers (``huge_answer_after_apply``, ``gzip_bomb_after_apply``, ``dribble_after_apply``,
    ``raw_answer_after_apply``) come from :class:`BadAnswerFaults`.
    """

    kind: StripeFaultKind
    http_status: int = 500
    error_type: str = "api_error"
    error_code: str | None = None
    message: str | None = None
    should_retry: bool | None = None
    retry_after: int | None = None
    seconds: float = 0.0
    answer: BadAnswer | None = None

    @classmethod
    def status(
        cls,
        code: int,
        *,
        error_type: str,
        code_str: str | None = None,
        should_retry: bool | None = None,
        retry_after: int | None = None,
        message: str | None = None,
    ) -> StripeFault:
        """Answer ``code`` with Stripe's error JSON before executing; nothing is saved.

        ``code_str`` becomes ``error.code`` (``card_declined``, ``rate_limit``...).
        ``should_retry`` None sends ``Stripe-Should-Retry: true`` for 409, 429 and 503 and no
        header otherwise; True or False sends that value. ``retry_after`` adds ``Retry-After``.
        """
        if not 400 <= code <= 599:
            raise ValueError(f"status {code} is not an error status")
        return cls(
            StripeFaultKind.STATUS,
            http_status=code,
            error_type=error_type,
            error_code=code_str,
            message=message,
            should_retry=_default_should_retry(code) if should_retry is None else should_retry,
            retry_after=retry_after,
        )

    @classmethod
    def reset_before_apply(cls) -> StripeFault:
        """Reset the TCP connection without answering and without executing."""
        return cls(StripeFaultKind.RESET_BEFORE_APPLY)

    @classmethod
    def error_500_before_apply(cls) -> StripeFault:
        """Create nothing, save a 500 ``api_error`` and answer it: Stripe rolled back."""
        return cls(StripeFaultKind.ERROR_500_BEFORE_APPLY)

    @classmethod
    def error_500_after_apply(cls) -> StripeFault:
        """Create the object, save a 500 ``api_error`` and answer it: Stripe rolled forward."""
        return cls(StripeFaultKind.ERROR_500_AFTER_APPLY)

    @classmethod
    def delay_after_apply(cls, seconds: float) -> StripeFault:
        """Create and save the 200, then wait ``seconds`` before answering.

        The key is complete during the wait (the answer is only slow on the wire), so a client
        that timed out and retries gets the saved answer replayed at once.
        """
        if seconds < 0:
            raise ValueError("seconds must not be negative")
        return cls(StripeFaultKind.DELAY_AFTER_APPLY, seconds=seconds)

    @classmethod
    def reset_after_apply(cls) -> StripeFault:
        """Create and save the 200, then reset the connection without answering."""
        return cls(StripeFaultKind.RESET_AFTER_APPLY)

    @classmethod
    def bad_answer_after_apply(cls, answer: BadAnswer) -> Self:
        """Create and save the 200, then send it as ``answer`` says."""
        return cls(StripeFaultKind.BAD_ANSWER_AFTER_APPLY, answer=answer)

    @property
    def before_ledger(self) -> bool:
        """Whether the fault strikes before the idempotency ledger is consulted."""
        return self.kind in _BEFORE_LEDGER


def _default_should_retry(code: int) -> bool | None:
    # None: no header at all, which is what Stripe sends on most errors.
    return True if code in _RETRYABLE_STATUSES else None


# --- wire format ----------------------------------------------------------------------------

_FORM_NAME = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])*)")
_FORM_INDEX = re.compile(r"\[([^\[\]]*)\]")


def parse_form(text: str) -> dict[str, Any]:
    """Stripe's form encoding back to nested params.

    ``metadata[k]=v`` becomes ``{"metadata": {"k": "v"}}``; ``expand[0]=a`` (what
    stripe-python sends) and ``expand[]=a`` become lists; metadata keys that look like numbers
    stay keys. Leaves stay strings; on a clash (``a=1&a[b]=2``) the later pair wins.
    """
    root: dict[str, Any] = {}
    for name, value in parse_qsl(text, keep_blank_values=True):
        match = _FORM_NAME.fullmatch(name)
        parts = [match[1], *_FORM_INDEX.findall(match[2])] if match else [name]
        _assign(root, parts, value)
    return _children(root)


def _assign(node: dict[str, Any], parts: list[str], value: str) -> None:
    *path, last = parts
    for part in path:
        name = part or str(len(node))  # "[]": a new element each time
        child = node.get(name)
        if not isinstance(child, dict):
            child = node[name] = {}
        node = child
    node[last or str(len(node))] = value


def _children(node: dict[str, Any]) -> dict[str, Any]:
    return {
        k: _listify(v, keep_keys=k == "metadata") if isinstance(v, dict) else v
        for k, v in node.items()
    }


def _listify(node: dict[str, Any], *, keep_keys: bool) -> Any:
    """``node`` with its index-keyed dicts turned into lists (metadata keys are kept)."""
    children = _children(node)
    if keep_keys or not all(k.isdecimal() for k in children):
        return children
    return [children[k] for k in sorted(children, key=int)]


def mask_api_key(key: str) -> str:
    """The key as Stripe shows it in errors: its ``sk_test_`` prefix and last four characters."""
    match = re.match(r"[a-z]{2,}_(?:test_|live_)?", key)
    prefix = match[0] if match else ""
    secret = key[len(prefix) :]
    return f"{prefix}****{secret[-4:] if len(secret) > 4 else ''}"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _error(
    status: int,
    error_type: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> Reply:
    """Stripe's v1 error JSON: ``{"error": {"type", "message", "code"?, "param"?}}``."""
    error: dict[str, str] = {"type": error_type, "message": message}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    return Reply(status, {"error": error}, headers)


def _invalid(message: str, *, code: str | None = None, param: str | None = None) -> Reply:
    return _error(400, "invalid_request_error", message, code=code, param=param)


def _api_error_500() -> Reply:
    # No Stripe-Should-Retry: a retry would only replay the saved 500.
    return _error(500, "api_error", "An unknown error occurred. (injected by the fake)")


class _ParamError(Exception):
    """A parameter failed validation: answered as 400 ``invalid_request_error``, never saved."""

    def __init__(
        self, message: str, param: str, code: str | None = "parameter_invalid_integer"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def reply(self) -> Reply:
        return _invalid(self.message, code=self.code, param=self.param)


def _integer(value: Any, param: str, *, low: int | None = None, high: int | None = None) -> int:
    if not isinstance(value, str) or not re.fullmatch(r"-?\d+", value):
        raise _ParamError(f"Invalid integer: {value}", param)
    number = int(value)
    if low is not None and number < low:
        raise _ParamError(f"This value must be greater than or equal to {low}.", param)
    if high is not None and number > high:
        raise _ParamError(f"This value must be less than or equal to {high}.", param)
    return number


def _validate_create(resource: Resource, params: dict[str, Any]) -> None:
    """Minimal checks: a PaymentIntent needs a positive integer amount and a currency."""
    if resource.name != "payment_intents":
        return
    for required in ("amount", "currency"):
        if params.get(required) in (None, ""):
            raise _ParamError(
                f"Missing required param: {required}.", required, code="parameter_missing"
            )
    _integer(params["amount"], "amount", low=1)


# Stripe's test payment methods whose confirmation the issuer declines (docs.stripe.com/testing).
DECLINING_PAYMENT_METHODS = {
    "pm_card_chargeDeclined": "generic_decline",
    "pm_card_visa_chargeDeclined": "generic_decline",
    "pm_card_chargeDeclinedInsufficientFunds": "insufficient_funds",
}
# What Stripe advises after a decline (advice_code), where it says anything.
_ADVICE = {"insufficient_funds": "try_again_later"}


def _confirmed(params: dict[str, Any]) -> dict[str, Any]:
    """A PaymentIntent's state after its create, as Stripe leaves it: never confirmed
    (``requires_payment_method``, or ``requires_confirmation`` with a payment method), or
    confirmed with ``confirm=true``: ``succeeded`` (``requires_capture`` with manual capture),
    or declined, back to ``requires_payment_method`` with ``last_payment_error`` set."""
    method = params.get("payment_method")
    if params.get("confirm") != "true":
        return {
            "status": "requires_confirmation" if method else "requires_payment_method",
            "last_payment_error": None,
        }
    decline = DECLINING_PAYMENT_METHODS.get(str(method))
    if decline is not None:
        error = {
            "type": "card_error",
            "code": "card_declined",
            "decline_code": decline,
            "message": "Your card was declined.",
            "charge": _new_id("ch"),
        }
        if decline in _ADVICE:
            error["advice_code"] = _ADVICE[decline]
        return {"status": "requires_payment_method", "last_payment_error": error}
    manual = params.get("capture_method") == "manual"
    return {"status": "requires_capture" if manual else "succeeded", "last_payment_error": None}


def _subscription_items(items: Any) -> dict[str, Any]:
    """A subscription's items as Stripe answers them: a list object of subscription_items, each
    with its price and plan, whose amounts come as decimal strings (``unit_amount_decimal``),
    which stripe-python turns into Decimal."""
    data = []
    for item in items if isinstance(items, list) else []:
        price = str(item.get("price", "price_default")) if isinstance(item, dict) else "price"
        data.append(
            {
                "object": "subscription_item",
                "id": _new_id("si"),
                "quantity": 1,
                "price": {
                    "object": "price",
                    "id": price,
                    "unit_amount": 1000,
                    "unit_amount_decimal": "1000.5",
                },
                "plan": {"object": "plan", "id": price, "amount": 1000, "amount_decimal": "1000.5"},
            }
        )
    return {"object": "list", "data": data, "has_more": False, "url": "/v1/subscription_items"}


def _declined(obj: dict[str, Any]) -> Reply | None:
    """The 402 card_error of a declined confirmation, the PaymentIntent in it. Stripe had begun
    executing, so the answer is saved under the key like any other, and the object exists."""
    error = obj.get("last_payment_error") if obj.get("object") == "payment_intent" else None
    if not error:
        return None
    return Reply(402, {"error": {**error, "payment_intent": copy.deepcopy(obj)}})


def _echo(params: dict[str, Any]) -> dict[str, Any]:
    """The params as object fields: integers where Stripe has integers, no request controls."""
    fields: dict[str, Any] = {}
    for name, value in params.items():
        if name == "expand":
            continue
        is_int = name in _INTEGER_PARAMS and isinstance(value, str) and value.lstrip("-").isdigit()
        fields[name] = int(value) if is_int else value
    return fields


@dataclass(frozen=True)
class _Route:
    resource: Resource
    object_id: str | None
    verb: str | None = None  # /v1/payment_intents/pi_1/capture


def _route(path: str) -> _Route | None:
    match = re.fullmatch(r"/v1/((?:checkout/)?[a-z_]+)(?:/([^/]+)(?:/([a-z_]+))?)?", path)
    if match is None or match[1] not in RESOURCES:
        return None
    return _Route(RESOURCES[match[1]], match[2], match[3])


def _change_of(method: str, route: _Route | None) -> str | None:
    """The state change a request asks for (stripe_changes), or None."""
    if route is None or route.object_id is None:
        return None
    if method == "DELETE" and route.verb is None and route.resource.name == "subscriptions":
        return "cancel"
    verb = route.verb or "update"
    return verb if method == "POST" and changes(route.resource.name, verb) else None


@dataclass(frozen=True)
class _Request:
    """What the handler parsed from one HTTP request."""

    method: str
    path: str
    key: str | None
    params: dict[str, Any]
    account: str | None
    authorization: str | None
    request_id: str
    version: str | None = None

    def received(self, at: float) -> StripeRequest:
        """Its record in ``received``, as it arrived at ``at``, before any outcome."""
        return StripeRequest(
            self.method,
            self.path,
            self.key,
            self.params,
            None,
            False,
            self.request_id,
            self.account,
            at,
            version=self.version,
        )


@dataclass(frozen=True)
class _ListQuery:
    """A list request's parameters, validated."""

    limit: int
    created: tuple[tuple[str, int], ...]
    filters: tuple[tuple[str, str], ...]
    starting_after: str | None
    ending_before: str | None

    @classmethod
    def parse(cls, params: dict[str, Any]) -> _ListQuery:
        """Validate ``params``; raise _ParamError naming the bad one."""
        limit = params.get("limit")
        filters = tuple(
            (k, v) for k, v in params.items() if k not in _LIST_CONTROLS and isinstance(v, str)
        )
        return cls(
            limit=_DEFAULT_LIMIT
            if limit is None
            else _integer(limit, "limit", low=1, high=_MAX_LIMIT),
            created=_created_bounds(params.get("created")),
            filters=filters,
            starting_after=params.get("starting_after") or None,
            ending_before=params.get("ending_before") or None,
        )

    def matches(self, obj: dict[str, Any]) -> bool:
        """Whether ``obj`` passes the created bounds and the field filters."""
        created = int(obj["created"])
        for op, bound in self.created:
            if not (created == bound if op == "eq" else _CREATED_OPS[op](created, bound)):
                return False
        return all(str(obj.get(name)) == value for name, value in self.filters)

    def page(self, newest_first: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], bool]:
        """The page and ``has_more``; cursors are positions in the unfiltered list."""
        if self.ending_before is not None:
            before = newest_first[: _position(newest_first, self.ending_before, "ending_before")]
            rows = [o for o in before if self.matches(o)]
            return rows[-self.limit :], len(rows) > self.limit
        start = 0
        if self.starting_after is not None:
            start = _position(newest_first, self.starting_after, "starting_after") + 1
        rows = [o for o in newest_first[start:] if self.matches(o)]
        return rows[: self.limit], len(rows) > self.limit


def _created_bounds(created: Any) -> tuple[tuple[str, int], ...]:
    """``created=<t>`` or ``created[gte]=<t>`` (and gt, lt, lte) as (operator, seconds) pairs."""
    if created is None:
        return ()
    if not isinstance(created, dict):
        return (("eq", _integer(created, "created")),)
    for op in created:
        if op not in _CREATED_OPS:
            raise _ParamError(f"Received unknown parameter: created[{op}]", f"created[{op}]", None)
    return tuple((op, _integer(value, f"created[{op}]")) for op, value in created.items())


def _position(rows: list[dict[str, Any]], object_id: str, param: str) -> int:
    for index, obj in enumerate(rows):
        if obj["id"] == object_id:
            return index
    raise _ParamError(f"No such object: '{object_id}'", param, code="resource_missing")


@dataclass
class _Entry(KeyEntry):
    """What the ledger remembers about one idempotency key: what a retry must repeat."""

    path: str
    params: dict[str, Any]
    request_id: str


class _Ledger(Ledger[StripeFault, StripeRequest, _Entry]):
    """The API's state: keys, objects, requests, armed faults and holds, under one lock."""

    def __init__(self, api_key: str, key_retention: float, clock: Callable[[], float]) -> None:
        super().__init__("fake stripe", key_retention)
        self._clock = clock
        self._api_key = api_key
        self._objects: list[dict[str, Any]] = []
        self._by_id: dict[str, dict[str, Any]] = {}
        self._events: list[dict[str, Any]] = []
        self._account_of: dict[str, str | None] = {}  # the Stripe-Account each was made under
        self._endless = False  # every list page says has_more, as a broken API might
        self._restricted: frozenset[str] = frozenset()  # resources the key may not touch

    # --- requests -------------------------------------------------------------------------

    def admit(self, request: _Request) -> Plan:
        """Decide a request's fate, creating an object if it is a POST that executes."""
        with self.cond:
            rejection = self._authenticate(request.authorization)
            if rejection is not None:
                return Plan(rejection)
            fault = self._take_fault(request.key, lambda f: f.before_ledger)
            if fault is not None:
                return Plan(_status_reply(fault))
            route = _route(request.path)
            if route is not None and route.resource.name in self._restricted:
                return Plan(_forbidden(route.resource))
            return self._routed(route, request)

    def _routed(self, route: _Route | None, request: _Request) -> Plan:
        if request.method == "GET" and route is not None and route.verb is None:
            return Plan(self._read(route, request.params, request.account))
        creatable = route is not None and route.resource.creatable
        if request.method == "POST" and route is not None and creatable and not route.object_id:
            return self._post(route.resource, request)
        verb = _change_of(request.method, route)
        if verb is not None and route is not None and route.object_id is not None:
            return self._change(route.resource, route.object_id, verb, request)
        message = f"Unrecognized request URL ({request.method}: {request.path})."
        return Plan(_error(404, "invalid_request_error", message))

    def _authenticate(self, authorization: str | None) -> Reply | None:
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return _error(
                401,
                "invalid_request_error",
                "You did not provide an API key. You need to provide your API key in the "
                "Authorization header, using Bearer auth (e.g. 'Authorization: Bearer "
                "YOUR_SECRET_KEY').",
            )
        if key != self._api_key:
            # Never echo the key: error messages end up in logs.
            message = f"Invalid API Key provided: {mask_api_key(key)}"
            return _error(401, "invalid_request_error", message)
        return None

    def _post(self, resource: Resource, request: _Request) -> Plan:
        now = time.monotonic()
        if request.key is not None:
            entry = self._live_entry(request.key, now)
            if entry is not None:
                return Plan(_existing_reply(entry, request))
        try:
            _validate_create(resource, request.params)
        except _ParamError as invalid:
            return Plan(invalid.reply())

        def create() -> Reply:
            obj = self._create(resource, request)
            return _declined(obj) or Reply(200, copy.deepcopy(obj))

        return self._execute(create, request, now)

    def _change(self, resource: Resource, object_id: str, verb: str, request: _Request) -> Plan:
        """A state change of an existing object, under the same idempotency rules."""
        now = time.monotonic()
        if request.key is not None:
            entry = self._live_entry(request.key, now)
            if entry is not None:
                return Plan(_existing_reply(entry, request))
        obj = self._by_id.get(object_id)
        if (
            obj is None
            or obj["object"] != resource.object
            or obj.get("deleted")
            or self._account_of.get(object_id) != request.account
        ):
            message = f"No such {resource.object}: '{object_id}'"
            return Plan(
                _error(404, "invalid_request_error", message, code="resource_missing", param="id")
            )
        target = obj

        def apply() -> Reply:
            status, body = change(resource.name, verb, target, request.params, _confirmed)
            declined = _declined(target) if verb == "confirm" else None
            return declined or Reply(status, copy.deepcopy(body))

        return self._execute(apply, request, now)

    def _execute(self, make: Callable[[], Reply], request: _Request, now: float) -> Plan:
        """Apply the request (unless a fault rolls back), save the answer under the key."""
        fault = self._take_fault(request.key, lambda f: not f.before_ledger)
        kind = fault.kind if fault is not None else None
        saved = _api_error_500()
        if kind is not StripeFaultKind.ERROR_500_BEFORE_APPLY:
            made = make()
            if kind is not StripeFaultKind.ERROR_500_AFTER_APPLY:
                saved = made
        entry = hold = None
        if request.key is not None:
            entry = _Entry(
                request.path,
                request.params,
                request.request_id,
                reply=saved,
                expires_at=now + self._retention,
            )
            self._entries[request.key] = entry
            hold = self._holds.pop(request.key, None)
        self.cond.notify_all()
        reply = None if kind is StripeFaultKind.RESET_AFTER_APPLY else saved
        if reply is not None and fault is not None and fault.answer is not None:
            reply = reply.badly(fault.answer)
        return Plan(reply, entry, hold, fault.seconds if fault is not None else 0.0)

    def _create(self, resource: Resource, request: _Request) -> dict[str, Any]:
        params = request.params
        obj: dict[str, Any] = {**dict(resource.defaults), **_echo(params)}
        if resource.name == "payment_intents":
            obj.pop("confirm", None)  # a request control, no field of the object
            obj.update(_confirmed(params))
        if resource.name == "subscriptions":
            obj["items"] = _subscription_items(obj.get("items"))
        metadata = obj.get("metadata")
        obj.update(
            id=_new_id(resource.prefix),
            object=resource.object,
            created=int(self._clock()),
            livemode=False,
            metadata=metadata if isinstance(metadata, dict) else {},
        )
        if resource.name == "payment_intents":  # as Stripe makes it: the id, then a secret
            obj["client_secret"] = f"{obj['id']}_secret_{secrets.token_hex(12)}"
        self._objects.append(obj)
        self._by_id[obj["id"]] = obj
        self._account_of[obj["id"]] = request.account
        # As Stripe records it: the object as created, and the request with its key.
        event = {
            "id": _new_id("evt"),
            "object": "event",
            "type": resource.event,
            "created": obj["created"],
            "livemode": False,
            "api_version": _API_VERSION,
            "data": {"object": copy.deepcopy(obj)},
            "request": {"id": request.request_id, "idempotency_key": request.key},
        }
        self._events.append(event)
        self._account_of[event["id"]] = request.account
        return obj

    def _read(self, route: _Route, params: dict[str, Any], account: str | None) -> Reply:
        resource = route.resource
        if route.object_id is not None:
            obj = self._by_id.get(route.object_id)
            if obj is not None and obj.get("deleted") and resource.name == "customers":
                return Reply(200, {"id": obj["id"], "object": "customer", "deleted": True})
            if (
                obj is None
                or obj["object"] != resource.object
                or obj.get("deleted")
                or self._account_of.get(obj["id"]) != account
            ):
                message = f"No such {resource.object}: '{route.object_id}'"
                return _error(
                    404, "invalid_request_error", message, code="resource_missing", param="id"
                )
            return Reply(200, obj)
        params = dict(params)
        status = params.pop("status", None) if resource.name == "subscriptions" else None
        if status not in (None, "all"):
            params["status"] = status
        try:
            query = _ListQuery.parse(params)
            listed = [
                o
                for o in self._newest_first(resource)
                if self._account_of.get(o["id"]) == account
                and not o.get("deleted")
                # Stripe leaves canceled subscriptions out unless status says otherwise.
                and (status is not None or o.get("status") != "canceled")
            ]
            if self._endless:  # a broken API: the first page again, and always more
                query = dataclasses.replace(query, starting_after=None, ending_before=None)
            data, has_more = query.page(listed)
            has_more = has_more or self._endless
        except _ParamError as invalid:
            return invalid.reply()
        url = f"/v1/{resource.name}"
        return Reply(200, {"object": "list", "data": data, "has_more": has_more, "url": url})

    def _newest_first(self, resource: Resource) -> list[dict[str, Any]]:
        rows = self._events if resource.name == "events" else self._objects
        mine = [o for o in reversed(rows) if o["object"] == resource.object]
        # Stable sort: objects created in the same second stay newest first.
        return sorted(mine, key=lambda o: int(o["created"]), reverse=True)

    # --- test controls --------------------------------------------------------------------

    def set_api_key(self, api_key: str) -> None:
        """Accept ``api_key`` (and only it) from now on."""
        if not api_key:
            raise ValueError("api_key must not be empty")
        with self.cond:
            self._api_key = api_key

    def api_key(self) -> str:
        with self.cond:
            return self._api_key

    # --- reads ----------------------------------------------------------------------------

    def objects(self) -> list[dict[str, Any]]:
        with self.cond:
            return copy.deepcopy(self._objects)

    def update(self, object_id: str, fields: dict[str, Any]) -> None:
        with self.cond:
            if object_id not in self._by_id:
                raise KeyError(object_id)
            self._by_id[object_id].update(copy.deepcopy(fields))
            if "created" in fields:  # a test dating the object back: its creation's event too
                for event in self._events:
                    if event["data"]["object"]["id"] == object_id:
                        event["created"] = fields["created"]

    def seed(self, resource: Resource, count: int, fields: dict[str, Any]) -> None:
        with self.cond:
            for _ in range(count):
                request = _Request(
                    "POST",
                    f"/v1/{resource.name}",
                    None,
                    copy.deepcopy(fields),
                    None,
                    None,
                    _new_id("req"),
                )
                self._create(resource, request)

    def delete(self, object_id: str) -> None:
        with self.cond:
            obj = self._by_id[object_id]
            if obj["object"] not in ("customer", "invoice"):
                raise ValueError(f"Stripe deletes customers and draft invoices: {obj['object']}")
            obj["deleted"] = True

    def events(self) -> list[dict[str, Any]]:
        with self.cond:
            return copy.deepcopy(self._events)

    def restrict(self, resources: frozenset[str]) -> None:
        with self.cond:
            self._restricted = resources

    def set_endless(self, endless: bool) -> None:
        with self.cond:
            self._endless = endless

    def count(self, object_type: str | None) -> int:
        """The number of objects of ``object_type`` or in all (call with the lock held)."""
        objs = self._objects
        return len(objs) if object_type is None else sum(o["object"] == object_type for o in objs)


def _forbidden(resource: Resource) -> Reply:
    """What Stripe answers a restricted key without the permission: 403, nothing executed or
    saved (docs.stripe.com/keys#limit-access)."""
    message = (
        f"The provided key 'rk_test_***' does not have the required permissions for this "
        f"endpoint. Having the 'rak_{resource.object}_write' permission would allow this "
        "request to continue."
    )
    return _error(403, "invalid_request_error", message)


def _status_reply(fault: StripeFault) -> Reply | None:
    if fault.kind is StripeFaultKind.RESET_BEFORE_APPLY:
        return None
    headers: list[tuple[str, str]] = []
    if fault.should_retry is not None:
        headers.append(("Stripe-Should-Retry", str(fault.should_retry).lower()))
    if fault.retry_after is not None:
        headers.append(("Retry-After", str(fault.retry_after)))
    message = fault.message or f"Injected {fault.http_status} from the fake Stripe API."
    return _error(
        fault.http_status, fault.error_type, message, code=fault.error_code, headers=tuple(headers)
    )


def _existing_reply(entry: _Entry, request: _Request) -> Reply:
    key = request.key
    if entry.in_progress:
        # Stripe answers 409 with type invalid_request_error here; stripe-python maps any 409
        # to APIError whatever the type, and retries it.
        message = (
            "There is currently another in-progress request using this Idempotent Key (that "
            "probably means you submitted twice, and the other request is still going "
            f"through): {key}. Please try again later."
        )
        return _error(
            409,
            "invalid_request_error",
            message,
            code="idempotency_key_in_use",
            headers=(_SHOULD_RETRY,),
        )
    if entry.path != request.path:
        message = (
            "Keys for idempotent requests can only be used for the same endpoint they were "
            f"first used for ('{entry.path}' vs '{request.path}'). Try using a key other than "
            f"'{key}' if you meant to execute a different request."
        )
        return _error(400, "idempotency_error", message)
    if entry.params != request.params:
        message = (
            "Keys for idempotent requests can only be used with the same parameters they were "
            f"first used with. Try using a key other than '{key}' if you meant to execute a "
            "different request."
        )
        return _error(400, "idempotency_error", message)
    return entry.reply.as_replay(("Original-Request", entry.request_id))


# --- HTTP -----------------------------------------------------------------------------------


class _Server(LoopbackServer):
    """The listener, typed for the handler: its ledger is the Stripe one."""

    ledger: _Ledger


class _Handler(JsonHandler):
    """Serves one connection; a chunked body closes it (stripe-python sends Content-Length)."""

    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server dispatches to this name)
        """Serve a request; the ledger routes on method and path."""
        self._serve()

    do_POST = do_DELETE = do_PUT = do_PATCH = do_GET  # noqa: N815 (http.server's names)

    def _serve(self) -> None:
        raw = self._read_body()
        if raw is None:
            return
        request = self._parse(raw)
        self._respond(request.received, lambda: self._decide(request), _headers(request))

    def _decide(self, request: _Request) -> Reply | None:
        """The answer (None: reset), after any hold or delay it must sit out."""
        plan = self.server.ledger.admit(request)
        self._sit_out(plan)
        return plan.reply

    def _parse(self, raw: bytes) -> _Request:
        url = urlsplit(self.path)
        form = raw.decode("utf-8", "replace") if self.command == "POST" else url.query
        key = (self.headers.get("Idempotency-Key") or "").strip() or None
        return _Request(
            method=self.command,
            path=url.path,
            key=key,
            params=parse_form(form),
            account=self.headers.get("Stripe-Account"),
            authorization=self.headers.get("Authorization"),
            request_id=f"req_{secrets.token_hex(7)}",
            version=self.headers.get("Stripe-Version"),
        )

    def _sit_out(self, plan: Plan) -> None:
        """Wait out the plan's hold, complete its key, then wait out its delay."""
        ledger = self.server.ledger
        try:
            if plan.hold is not None:
                plan.hold.arrived.set()
                plan.hold.wait_released()
        finally:
            # Completed before answering: a client that got the answer and retries at once
            # must see a replay, not a 409. A delay models a slow wire, not slow execution.
            if plan.entry is not None:
                ledger.complete(plan.entry)
        if plan.delay:
            ledger.stopping.wait(plan.delay)


def _headers(request: _Request) -> Headers:
    """What every answer carries: ``Request-Id``, and a POST's ``Idempotency-Key`` echoed."""
    request_id = ("Request-Id", request.request_id)
    if request.method == "POST" and request.key is not None:
        return (request_id, ("Idempotency-Key", request.key))
    return (request_id,)


# --- the fake -------------------------------------------------------------------------------


class FakeStripe(LoopbackFake[StripeFault, StripeRequest]):
    """A loopback Stripe v1 API that creates each idempotency key's object once.

    Use as a context manager (or ``start()``/``stop()``); ``url`` is valid once started and is
    what ``StripeClient(base_addresses={"api": fake.url})`` needs. ``clock`` gives the unix
    time stamped into ``created`` (tests pass their own to get distinct values without sleeping).
    Lifecycle calls (start, stop, refuse/accept_connections) belong to the test's thread;
    everything else is thread-safe. The lifecycle, ``received``, ``connections_accepted``,
    ``wait_idle``, ``inject``, ``hold`` and ``forget_keys`` come from :class:`LoopbackFake`.
    """

    _thread_name = "fake-stripe"
    _ledger: _Ledger

    def __init__(
        self,
        *,
        api_key: str = DEFAULT_API_KEY,
        key_retention: float = 86400.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not api_key:
            raise ValueError("api_key must not be empty")
        if key_retention < 0:
            raise ValueError("key_retention must not be negative")
        super().__init__(_Ledger(api_key, key_retention, clock))

    def _make_server(self, port: int) -> _Server:
        return _Server(port, self._ledger, self._connections, _Handler)

    @property
    def url(self) -> str:
        """The API base address: ``http://127.0.0.1:<port>`` (paths start with ``/v1``)."""
        return f"http://{HOST}:{self.port}"

    # --- authentication -------------------------------------------------------------------

    @property
    def api_key(self) -> str:
        """The secret key requests must carry as ``Authorization: Bearer <key>``."""
        return self._ledger.api_key()

    def set_api_key(self, api_key: str) -> None:
        """Rotate the accepted key: requests with the old one get 401 from now on."""
        self._ledger.set_api_key(api_key)

    # --- what happened --------------------------------------------------------------------

    def objects(self, resource: str | None = None) -> list[dict[str, Any]]:
        """Copies of every object created, in order; ``resource`` is a URL name (``refunds``)."""
        object_type = _object_type(resource)
        return [o for o in self._ledger.objects() if object_type in (None, o["object"])]

    def object_count(self, resource: str | None = None) -> int:
        """The number of objects created, of ``resource`` or in all."""
        return len(self.objects(resource))

    def update_object(self, object_id: str, **fields: Any) -> None:
        """Change an object after its creation, as later events do at Stripe: a customer
        authenticates (``status="succeeded"``), a refund fails, a subscription expires. A new
        ``created`` dates the object and its creation's event back, as if made earlier."""
        self._ledger.update(object_id, fields)

    def seed_objects(self, resource: str, count: int, **fields: Any) -> None:
        """Create ``count`` objects of ``resource`` at once, as other requests without a key
        would have (and their events): the crowd a lookup searches through."""
        self._ledger.seed(RESOURCES[resource], count, fields)

    def delete_object(self, object_id: str) -> None:
        """Delete a customer (retrieved as ``{"deleted": true}`` after) or a draft invoice
        (404 after): either drops out of lists, its creation's event stays."""
        self._ledger.delete(object_id)

    def events(self) -> list[dict[str, Any]]:
        """Copies of every event, in order of creation."""
        return self._ledger.events()

    def restrict_key(self, *resources: str) -> None:
        """Make the key a restricted key without permission for ``resources`` (URL names):
        their requests get Stripe's 403, the others go through. No arguments: unrestricted."""
        for name in resources:
            _object_type(name)
        self._ledger.restrict(frozenset(resources))

    def answer_lists_endlessly(self, endless: bool = True) -> None:
        """Make every list answer its first page again and say ``has_more``, whatever the
        cursor: a broken API that would keep a naive pager reading for ever."""
        self._ledger.set_endless(endless)

    def objects_with_metadata(self, key: str, value: str) -> list[dict[str, Any]]:
        """The objects whose ``metadata[key]`` is ``value``, in order of creation."""
        return [o for o in self._ledger.objects() if o["metadata"].get(key) == value]

    def received_for(self, key: str) -> list[StripeRequest]:
        """The requests that carried idempotency key ``key``, in order of arrival."""
        return [r for r in self.received if r.idempotency_key == key]

    def wait_for_objects(
        self, count: int, resource: str | None = None, timeout: float = 5.0
    ) -> list[dict[str, Any]]:
        """Wait until at least ``count`` objects (of ``resource``) exist; TimeoutError if not."""
        object_type = _object_type(resource)
        ledger = self._ledger
        ledger.wait_for(lambda: ledger.count(object_type) >= count, timeout, f"{count} objects")
        return self.objects(resource)


def _object_type(resource: str | None) -> str | None:
    if resource is None:
        return None
    if resource not in RESOURCES:
        raise ValueError(f"unknown resource {resource!r}; expected one of {sorted(RESOURCES)}")
    return RESOURCES[resource].object

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
and "the client learned about it".
"""

from __future__ import annotations

import copy
import enum
import json
import re
import secrets
import socket
import socketserver
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any
from urllib.parse import parse_qsl, urlsplit

HOST = "127.0.0.1"
DEFAULT_API_KEY = "sk_test_fake"
# serve_forever checks for shutdown this often: refuse_connections() and stop() wait up to it.
_POLL_INTERVAL = 0.02
# How long stop() and refuse_connections() wait for handler threads to let go of connections.
_DRAIN_TIMEOUT = 5.0
_REPLAYED_HEADER = ("Idempotent-Replayed", "true")
_SHOULD_RETRY = ("Stripe-Should-Retry", "true")
# Statuses that Stripe marks as worth retrying when an injected fault does not say otherwise.
_RETRYABLE_STATUSES = frozenset({409, 429, 503})
_MAX_LIMIT = 100
_DEFAULT_LIMIT = 10


@dataclass(frozen=True)
class Resource:
    """One v1 resource the fake serves: its URL name, ``object`` value, id prefix, defaults."""

    name: str
    object: str
    prefix: str
    defaults: tuple[tuple[str, Any], ...] = ()


RESOURCES: dict[str, Resource] = {
    r.name: r
    for r in (
        Resource(
            "payment_intents", "payment_intent", "pi", (("status", "requires_payment_method"),)
        ),
        Resource("refunds", "refund", "re", (("status", "succeeded"),)),
        Resource("customers", "customer", "cus"),
        Resource("transfers", "transfer", "tr", (("reversed", False),)),
        Resource("payouts", "payout", "po", (("status", "pending"),)),
        Resource("invoices", "invoice", "in", (("status", "draft"),)),
        Resource("subscriptions", "subscription", "sub", (("status", "active"),)),
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
class Received:
    """One request that arrived, whatever became of it.

    ``path`` has no query string; ``params`` is the parsed form body (POST) or query (GET),
    nested like the SDK's params (``{"metadata": {"k": "v"}}``), every leaf a string.
    ``status`` is None while the request is being processed and stays None when the connection
    was reset. ``account`` is the ``Stripe-Account`` header; ``at`` is ``time.monotonic()``.
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


class FaultKind(enum.Enum):
    """What a fault does; see the class methods of :class:`Fault`."""

    STATUS = "status"
    RESET_BEFORE_APPLY = "reset_before_apply"
    ERROR_500_BEFORE_APPLY = "error_500_before_apply"
    ERROR_500_AFTER_APPLY = "error_500_after_apply"
    DELAY_AFTER_APPLY = "delay_after_apply"
    RESET_AFTER_APPLY = "reset_after_apply"


# Faults that strike before the idempotency ledger is consulted (any request, a replay too);
# the others strike only a POST that executes, i.e. would create an object.
_BEFORE_LEDGER = frozenset({FaultKind.STATUS, FaultKind.RESET_BEFORE_APPLY})


@dataclass(frozen=True)
class Fault:
    """A misbehaviour to inject; build one with the class methods, e.g. ``Fault.status(429, ...)``.

    ``status`` and ``reset_before_apply`` hit any matching request (GETs and replays too) and
    save nothing. The others hit only a POST that executes, so a replay is never disturbed.
    """

    kind: FaultKind
    http_status: int = 500
    error_type: str = "api_error"
    error_code: str | None = None
    message: str | None = None
    should_retry: bool | None = None
    retry_after: int | None = None
    seconds: float = 0.0

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
    ) -> Fault:
        """Answer ``code`` with Stripe's error JSON before executing; nothing is saved.

        ``code_str`` becomes ``error.code`` (``card_declined``, ``rate_limit``...).
        ``should_retry`` None sends ``Stripe-Should-Retry: true`` for 409, 429 and 503 and no
        header otherwise; True or False sends that value. ``retry_after`` adds ``Retry-After``.
        """
        if not 400 <= code <= 599:
            raise ValueError(f"status {code} is not an error status")
        return cls(
            FaultKind.STATUS,
            http_status=code,
            error_type=error_type,
            error_code=code_str,
            message=message,
            should_retry=_default_should_retry(code) if should_retry is None else should_retry,
            retry_after=retry_after,
        )

    @classmethod
    def reset_before_apply(cls) -> Fault:
        """Reset the TCP connection without answering and without executing."""
        return cls(FaultKind.RESET_BEFORE_APPLY)

    @classmethod
    def error_500_before_apply(cls) -> Fault:
        """Create nothing, save a 500 ``api_error`` and answer it: Stripe rolled back."""
        return cls(FaultKind.ERROR_500_BEFORE_APPLY)

    @classmethod
    def error_500_after_apply(cls) -> Fault:
        """Create the object, save a 500 ``api_error`` and answer it: Stripe rolled forward."""
        return cls(FaultKind.ERROR_500_AFTER_APPLY)

    @classmethod
    def delay_after_apply(cls, seconds: float) -> Fault:
        """Create and save the 200, then wait ``seconds`` before answering.

        The key is complete during the wait (the answer is only slow on the wire), so a client
        that timed out and retries gets the saved answer replayed at once.
        """
        if seconds < 0:
            raise ValueError("seconds must not be negative")
        return cls(FaultKind.DELAY_AFTER_APPLY, seconds=seconds)

    @classmethod
    def reset_after_apply(cls) -> Fault:
        """Create and save the 200, then reset the connection without answering."""
        return cls(FaultKind.RESET_AFTER_APPLY)

    @property
    def before_ledger(self) -> bool:
        """Whether the fault strikes before the idempotency ledger is consulted."""
        return self.kind in _BEFORE_LEDGER


def _default_should_retry(code: int) -> bool | None:
    # None: no header at all, which is what Stripe sends on most errors.
    return True if code in _RETRYABLE_STATUSES else None


class Hold:
    """A pause between "object created and response saved" and "response sent".

    The next POST with ``key`` that executes sets ``arrived`` and then waits until
    ``release()`` is called or the fake stops; meanwhile its key is still executing, so other
    requests with it get 409. As a context manager it releases on exit.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.arrived = threading.Event()
        self._released = threading.Event()

    def release(self) -> None:
        """Let the held request answer."""
        self._released.set()

    @property
    def released(self) -> bool:
        """Whether ``release()`` was called (or the fake stopped)."""
        return self._released.is_set()

    def wait_released(self) -> None:
        """Block until released (called by the handler thread)."""
        self._released.wait()

    def __enter__(self) -> Hold:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


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


@dataclass(frozen=True)
class _Reply:
    status: int
    body: Any
    headers: tuple[tuple[str, str], ...] = ()

    @property
    def replayed(self) -> bool:
        return _REPLAYED_HEADER in self.headers

    def as_replay(self, original_request: str) -> _Reply:
        extra = (_REPLAYED_HEADER, ("Original-Request", original_request))
        return replace(self, headers=(*self.headers, *extra))


def _error(
    status: int,
    error_type: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: tuple[tuple[str, str], ...] = (),
) -> _Reply:
    """Stripe's v1 error JSON: ``{"error": {"type", "message", "code"?, "param"?}}``."""
    error: dict[str, str] = {"type": error_type, "message": message}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    return _Reply(status, {"error": error}, headers)


def _invalid(message: str, *, code: str | None = None, param: str | None = None) -> _Reply:
    return _error(400, "invalid_request_error", message, code=code, param=param)


def _api_error_500() -> _Reply:
    # No Stripe-Should-Retry: a retry would only replay the saved 500.
    return _error(500, "api_error", "An unknown error occurred. (injected by the fake)")


class _ParamError(Exception):
    """A parameter failed validation: answered as 400 ``invalid_request_error``, never saved."""

    def __init__(
        self, message: str, param: str, code: str | None = "parameter_invalid_integer"
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def reply(self) -> _Reply:
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


def _route(path: str) -> _Route | None:
    match = re.fullmatch(r"/v1/([a-z_]+)(?:/([^/]+))?", path)
    if match is None or match[1] not in RESOURCES:
        return None
    return _Route(RESOURCES[match[1]], match[2])


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


# --- the ledger -----------------------------------------------------------------------------


@dataclass
class _Entry:
    """What the ledger remembers about one idempotency key."""

    path: str
    params: dict[str, Any]
    reply: _Reply
    request_id: str
    expires_at: float
    in_progress: bool = True

    def live(self, now: float) -> bool:
        # A key being executed is a lock: expiry (or forget_keys) takes effect once it is done.
        return self.in_progress or now < self.expires_at


@dataclass
class _Armed:
    fault: Fault
    key: str | None
    remaining: int


@dataclass(frozen=True)
class _Plan:
    """What a handler does with a request; ``reply`` None means reset the connection."""

    reply: _Reply | None
    entry: _Entry | None = None  # set when this request saved a key: it must complete it
    hold: Hold | None = None
    delay: float = 0.0


@dataclass
class _State:
    """Everything the ledger's lock guards, apart from faults and holds."""

    api_key: str
    entries: dict[str, _Entry] = field(default_factory=dict)
    objects: list[dict[str, Any]] = field(default_factory=list)
    by_id: dict[str, dict[str, Any]] = field(default_factory=dict)
    received: list[Received] = field(default_factory=list)
    in_flight: int = 0


class _Ledger:
    """The API's state: keys, objects, requests, armed faults and holds, under one lock."""

    def __init__(self, api_key: str, key_retention: float, clock: Callable[[], float]) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.stopping = threading.Event()
        self._retention = key_retention
        self._clock = clock
        self._state = _State(api_key)
        self._faults: list[_Armed] = []
        self._holds: dict[str, Hold] = {}
        self._all_holds: list[Hold] = []

    # --- requests -------------------------------------------------------------------------

    def arrive(self, request: _Request) -> int:
        """Record a request as it arrives; the index lets ``answered`` fill in its outcome."""
        with self.cond:
            self._state.received.append(
                Received(
                    request.method,
                    request.path,
                    request.key,
                    request.params,
                    None,
                    False,
                    request.request_id,
                    request.account,
                    time.monotonic(),
                )
            )
            self._state.in_flight += 1
            return len(self._state.received) - 1

    def answered(self, index: int, reply: _Reply | None) -> None:
        """Record how request ``index`` ended (``reply`` None: reset)."""
        with self.cond:
            received = self._state.received
            status = reply.status if reply else None
            replayed = reply.replayed if reply else False
            received[index] = replace(received[index], status=status, replayed=replayed)

    def finished(self) -> None:
        """A request's answer is out (or its connection reset): it no longer counts as busy."""
        with self.cond:
            self._state.in_flight -= 1
            self.cond.notify_all()

    def admit(self, request: _Request) -> _Plan:
        """Decide a request's fate, creating an object if it is a POST that executes."""
        with self.cond:
            rejection = self._authenticate(request.authorization)
            if rejection is not None:
                return _Plan(rejection)
            fault = self._take_fault(request.key, before_ledger=True)
            if fault is not None:
                return _Plan(_status_reply(fault))
            route = _route(request.path)
            if request.method == "GET" and route is not None:
                return _Plan(self._read(route, request.params))
            if request.method == "POST" and route is not None and route.object_id is None:
                return self._post(route.resource, request)
            message = f"Unrecognized request URL ({request.method}: {request.path})."
            return _Plan(_error(404, "invalid_request_error", message))

    def complete(self, entry: _Entry) -> None:
        """End an entry's executing state: later requests get replays, not 409s."""
        with self.cond:
            entry.in_progress = False
            self.cond.notify_all()

    def _authenticate(self, authorization: str | None) -> _Reply | None:
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
        if key != self._state.api_key:
            # Never echo the key: error messages end up in logs.
            message = f"Invalid API Key provided: {mask_api_key(key)}"
            return _error(401, "invalid_request_error", message)
        return None

    def _post(self, resource: Resource, request: _Request) -> _Plan:
        now = time.monotonic()
        if request.key is not None:
            entry = self._state.entries.get(request.key)
            if entry is not None and entry.live(now):
                return _Plan(_existing_reply(entry, request))
        try:
            _validate_create(resource, request.params)
        except _ParamError as invalid:
            return _Plan(invalid.reply())
        return self._execute(resource, request, now)

    def _execute(self, resource: Resource, request: _Request, now: float) -> _Plan:
        """Create the object (unless a fault rolls back), save the answer under the key."""
        fault = self._take_fault(request.key, before_ledger=False)
        kind = fault.kind if fault is not None else None
        saved = _api_error_500()
        if kind is not FaultKind.ERROR_500_BEFORE_APPLY:
            obj = self._create(resource, request.params)
            if kind is not FaultKind.ERROR_500_AFTER_APPLY:
                saved = _Reply(200, obj)
        entry = hold = None
        if request.key is not None:
            expires_at = now + self._retention
            entry = _Entry(request.path, request.params, saved, request.request_id, expires_at)
            self._state.entries[request.key] = entry
            hold = self._holds.pop(request.key, None)
        self.cond.notify_all()
        reply = None if kind is FaultKind.RESET_AFTER_APPLY else saved
        return _Plan(reply, entry, hold, fault.seconds if fault is not None else 0.0)

    def _create(self, resource: Resource, params: dict[str, Any]) -> dict[str, Any]:
        obj: dict[str, Any] = {**dict(resource.defaults), **_echo(params)}
        metadata = obj.get("metadata")
        obj.update(
            id=_new_id(resource.prefix),
            object=resource.object,
            created=int(self._clock()),
            livemode=False,
            metadata=metadata if isinstance(metadata, dict) else {},
        )
        self._state.objects.append(obj)
        self._state.by_id[obj["id"]] = obj
        return obj

    def _read(self, route: _Route, params: dict[str, Any]) -> _Reply:
        resource = route.resource
        if route.object_id is not None:
            obj = self._state.by_id.get(route.object_id)
            if obj is None or obj["object"] != resource.object:
                message = f"No such {resource.object}: '{route.object_id}'"
                return _error(
                    404, "invalid_request_error", message, code="resource_missing", param="id"
                )
            return _Reply(200, obj)
        try:
            query = _ListQuery.parse(params)
            data, has_more = query.page(self._newest_first(resource))
        except _ParamError as invalid:
            return invalid.reply()
        url = f"/v1/{resource.name}"
        return _Reply(200, {"object": "list", "data": data, "has_more": has_more, "url": url})

    def _newest_first(self, resource: Resource) -> list[dict[str, Any]]:
        mine = [o for o in reversed(self._state.objects) if o["object"] == resource.object]
        # Stable sort: objects created in the same second stay newest first.
        return sorted(mine, key=lambda o: int(o["created"]), reverse=True)

    def _take_fault(self, key: str | None, *, before_ledger: bool) -> Fault | None:
        for armed in self._faults:
            if armed.fault.before_ledger == before_ledger and armed.key in (None, key):
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._faults.remove(armed)
                return armed.fault
        return None

    # --- test controls --------------------------------------------------------------------

    def set_api_key(self, api_key: str) -> None:
        """Accept ``api_key`` (and only it) from now on."""
        if not api_key:
            raise ValueError("api_key must not be empty")
        with self.cond:
            self._state.api_key = api_key

    def api_key(self) -> str:
        with self.cond:
            return self._state.api_key

    def inject(self, fault: Fault, key: str | None, times: int) -> None:
        """Arm ``fault`` for the next ``times`` matching requests."""
        if times < 1:
            raise ValueError("times must be at least 1")
        with self.cond:
            self._faults.append(_Armed(fault, key, times))

    def hold(self, key: str) -> Hold:
        """Arm a hold for the next POST with ``key`` that executes."""
        with self.cond:
            if key in self._holds:
                raise ValueError(f"a hold for {key!r} is already pending")
            held = self._holds[key] = Hold(key)
            self._all_holds.append(held)
            if self.stopping.is_set():
                held.release()
            return held

    def forget_keys(self) -> None:
        """Prune every key now (keys still executing are pruned when they complete)."""
        with self.cond:
            for entry in self._state.entries.values():
                entry.expires_at = float("-inf")

    def stop(self) -> None:
        """Wake every held or delayed request so it answers now."""
        with self.cond:
            self.stopping.set()
            for held in self._all_holds:
                held.release()

    # --- reads ----------------------------------------------------------------------------

    def objects(self) -> list[dict[str, Any]]:
        with self.cond:
            return copy.deepcopy(self._state.objects)

    def received(self) -> list[Received]:
        with self.cond:
            return list(self._state.received)

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        """Wait until ``predicate`` (evaluated under the lock) holds, or raise TimeoutError."""
        with self.cond:
            if not self.cond.wait_for(predicate, timeout):
                raise TimeoutError(f"fake stripe: {what} not reached within {timeout}s")

    def idle(self) -> bool:
        """Whether no request is being processed (call with the lock held)."""
        return self._state.in_flight == 0

    def count(self, object_type: str | None) -> int:
        """The number of objects of ``object_type`` or in all (call with the lock held)."""
        objs = self._state.objects
        return len(objs) if object_type is None else sum(o["object"] == object_type for o in objs)


def _status_reply(fault: Fault) -> _Reply | None:
    if fault.kind is FaultKind.RESET_BEFORE_APPLY:
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


def _existing_reply(entry: _Entry, request: _Request) -> _Reply:
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
    return entry.reply.as_replay(entry.request_id)


# --- HTTP -----------------------------------------------------------------------------------


class _Connections:
    """Open client connections, so the listener's end can also end keep-alive connections.

    Shares the ledger's lock. A socket leaves this registry before its descriptor is closed,
    so ``drop`` never shuts down a descriptor number the kernel has handed to someone else.
    """

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._busy: dict[socket.socket, bool] = {}
        self.accepted = 0

    def add(self, sock: socket.socket) -> None:
        with self._cond:
            self._busy[sock] = False
            self.accepted += 1

    def discard(self, sock: socket.socket) -> None:
        with self._cond:
            self._busy.pop(sock, None)
            self._cond.notify_all()

    @contextmanager
    def busy(self, sock: socket.socket) -> Iterator[None]:
        """Mark ``sock`` as serving a request, so ``drop(idle_only=True)`` leaves it alone."""
        self._mark(sock, busy=True)
        try:
            yield
        finally:
            self._mark(sock, busy=False)

    def _mark(self, sock: socket.socket, *, busy: bool) -> None:
        with self._cond:
            if sock in self._busy:
                self._busy[sock] = busy

    def drop(self, *, idle_only: bool) -> None:
        """Shut connections down (their handlers see EOF and exit) and wait until they close."""
        with self._cond:
            doomed = [s for s, busy in self._busy.items() if not (idle_only and busy)]
            for sock in doomed:
                with suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._cond.wait_for(lambda: not any(s in self._busy for s in doomed), _DRAIN_TIMEOUT)


class _Server(ThreadingHTTPServer):
    """The listener; a fresh one is made each time the fake (re)starts listening."""

    daemon_threads = True  # a handler stuck on a dead client must never keep pytest alive
    allow_reuse_address = True  # rebind our port while old connections sit in TIME_WAIT
    # Dispatchers open dozens of connections at once; the default backlog of 5 drops their SYNs
    # and each dropped one costs a second-long retransmit.
    request_queue_size = 1024

    def __init__(self, port: int, ledger: _Ledger, connections: _Connections) -> None:
        self.ledger = ledger
        self.connections = connections
        super().__init__((HOST, port), _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, a DNS lookup that can stall.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = HOST, int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        self.connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        self.connections.discard(request)  # before the descriptor closes: see _Connections
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients hanging up mid-answer is routine here (timeouts, resets); anything else is a
        # bug in this fake, so let socketserver print it.
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    """Serves one connection; keep-alive, so possibly many requests."""

    protocol_version = "HTTP/1.1"
    # Headers and body go out in two writes: Nagle would hold the second for the client's ACK.
    disable_nagle_algorithm = True
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        """Stay quiet: test output is for the tests."""

    def do_GET(self) -> None:
        """Serve a request; the ledger routes on method and path."""
        self._serve()

    do_POST = do_DELETE = do_PUT = do_PATCH = do_GET  # noqa: N815 (http.server's names)

    def _serve(self) -> None:
        # The body is read first, whatever happens next, so a keep-alive connection stays usable.
        raw = self._read_body()
        if raw is None:
            self.close_connection = True
            return
        request = self._parse(raw)
        ledger = self.server.ledger
        with self.server.connections.busy(self.connection):
            index = ledger.arrive(request)
            try:
                plan = ledger.admit(request)
                self._sit_out(plan)
                # Recorded before the client can see the outcome, so a test that has its
                # answer (or its reset) also finds it in `received`.
                ledger.answered(index, plan.reply)
                if plan.reply is None:
                    self._reset()
                else:
                    self._send(plan.reply, request)
            finally:
                ledger.finished()

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
        )

    def _sit_out(self, plan: _Plan) -> None:
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

    def _send(self, reply: _Reply, request: _Request) -> None:
        data = json.dumps(reply.body).encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Request-Id", request.request_id)
            if request.method == "POST" and request.key is not None:
                self.send_header("Idempotency-Key", request.key)
            for name, value in reply.headers:
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            # The client gave up (its timeout fired during a delay): the answer stands anyway.
            self.close_connection = True

    def _reset(self) -> None:
        """Close with SO_LINGER 0, so the kernel sends RST instead of FIN."""
        self.close_connection = True
        self.server.connections.discard(self.connection)
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        # The descriptor really closes when finish() closes rfile; socketserver's later
        # shutdown(SHUT_WR) then fails quietly on the closed socket, so no FIN precedes the RST.
        self.connection.close()

    def _read_body(self) -> bytes | None:
        """The whole body (stripe-python always sends Content-Length), or None: close."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        raw = self.rfile.read(length) if length > 0 else b""
        return raw if len(raw) == length else None


# --- the fake -------------------------------------------------------------------------------


class FakeStripe:
    """A loopback Stripe v1 API that creates each idempotency key's object once.

    Use as a context manager (or ``start()``/``stop()``); ``url`` is valid once started and is
    what ``StripeClient(base_addresses={"api": fake.url})`` needs. ``clock`` gives the unix
    time stamped into ``created`` (tests pass their own to get distinct values without sleeping).
    Lifecycle calls (start, stop, refuse/accept_connections) belong to the test's thread;
    everything else is thread-safe.
    """

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
        self._ledger = _Ledger(api_key, key_retention, clock)
        self._connections = _Connections(self._ledger.cond)
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._port: int | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def start(self) -> FakeStripe:
        """Listen on an ephemeral loopback port."""
        if self._port is not None:
            raise RuntimeError("the fake was already started")
        self._listen(0)
        return self

    def stop(self) -> None:
        """Release holds, cut delays short, stop listening and close every connection."""
        self._ledger.stop()
        self._unlisten()
        # Released requests answer before their connections are shut down.
        with suppress(TimeoutError):
            self._ledger.wait_for(self._ledger.idle, _DRAIN_TIMEOUT, "idle")
        self._connections.drop(idle_only=False)

    def __enter__(self) -> FakeStripe:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def refuse_connections(self) -> None:
        """Stop listening: new connections get ECONNREFUSED.

        Idle keep-alive connections are closed too (a client's pooled connection would
        otherwise still reach us); requests being processed finish normally.
        """
        self._require_started()
        self._unlisten()
        self._connections.drop(idle_only=True)

    def accept_connections(self) -> None:
        """Listen again, on the same port as before."""
        port = self._require_started()
        if self._ledger.stopping.is_set():
            raise RuntimeError("the fake was stopped")
        if self._server is None:
            self._listen(port)

    @property
    def port(self) -> int:
        """The loopback port (the same across refuse/accept_connections)."""
        return self._require_started()

    @property
    def url(self) -> str:
        """The API base address: ``http://127.0.0.1:<port>`` (paths start with ``/v1``)."""
        return f"http://{HOST}:{self.port}"

    @property
    def listening(self) -> bool:
        """Whether new connections are accepted right now."""
        return self._server is not None

    def _listen(self, port: int) -> None:
        server = _Server(port, self._ledger, self._connections)
        self._port = int(server.server_address[1])
        thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": _POLL_INTERVAL},
            name=f"fake-stripe:{self._port}",
            daemon=True,
        )
        thread.start()
        self._server, self._thread = server, thread

    def _unlisten(self) -> None:
        server, thread = self._server, self._thread
        if server is None or thread is None:
            return
        server.shutdown()
        server.server_close()
        thread.join()
        self._server = self._thread = None

    def _require_started(self) -> int:
        if self._port is None:
            raise RuntimeError("the fake has not been started")
        return self._port

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

    def objects_with_metadata(self, key: str, value: str) -> list[dict[str, Any]]:
        """The objects whose ``metadata[key]`` is ``value``, in order of creation."""
        return [o for o in self._ledger.objects() if o["metadata"].get(key) == value]

    @property
    def received(self) -> list[Received]:
        """A snapshot of every request that arrived, in order of arrival."""
        return self._ledger.received()

    def received_for(self, key: str) -> list[Received]:
        """The requests that carried idempotency key ``key``, in order of arrival."""
        return [r for r in self.received if r.idempotency_key == key]

    @property
    def connections_accepted(self) -> int:
        """How many TCP connections were accepted (keep-alive reuses one for many requests)."""
        with self._ledger.cond:
            return self._connections.accepted

    def wait_for_objects(
        self, count: int, resource: str | None = None, timeout: float = 5.0
    ) -> list[dict[str, Any]]:
        """Wait until at least ``count`` objects (of ``resource``) exist; TimeoutError if not."""
        object_type = _object_type(resource)
        ledger = self._ledger
        ledger.wait_for(lambda: ledger.count(object_type) >= count, timeout, f"{count} objects")
        return self.objects(resource)

    def wait_idle(self, timeout: float = 5.0) -> None:
        """Wait until no request that has arrived is still being processed."""
        self._ledger.wait_for(self._ledger.idle, timeout, "idle")

    # --- misbehaviour ---------------------------------------------------------------------

    def inject(self, fault: Fault, *, key: str | None = None, times: int = 1) -> None:
        """Arm ``fault`` for the next ``times`` matching requests (``key`` None: any request).

        Faults strike in the order they were injected, one per request.
        """
        self._ledger.inject(fault, key, times)

    def hold(self, key: str) -> Hold:
        """Pause the next POST with ``key`` that executes; see :class:`Hold`."""
        return self._ledger.hold(key)

    def forget_keys(self) -> None:
        """Behave as if ``key_retention`` had passed for every key seen so far."""
        self._ledger.forget_keys()


def _object_type(resource: str | None) -> str | None:
    if resource is None:
        return None
    if resource not in RESOURCES:
        raise ValueError(f"unknown resource {resource!r}; expected one of {sorted(RESOURCES)}")
    return RESOURCES[resource].object

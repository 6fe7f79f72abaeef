"""A fake HTTP API whose routes and idempotency semantics come from a profile.

Each real API that takes an idempotency key differs in a handful of choices: where the key
travels (a header, a body field), how long and of which characters it may be, how long it is
kept, whether a replay must repeat the body, what a replay answers (the saved answer, or the
resource's current state), what a request gets while the first with its key is still being
processed, and whether a 500 after the effect is saved. An :class:`ApiProfile` states those
choices and lists its :class:`Route` objects; :class:`FakeHttpApi` serves any profile on
loopback, with the ledger, faults, holds, refused connections and forgotten keys of
``outbox.testing.loopback`` (used the way ``outbox.testing.webhook`` uses them).

What a route does is a handler: ``handler(ctx, request)`` returns a :class:`Reply` when it
rejects the request (nothing applied, nothing saved under the key) or :class:`Applied` when it
applied a business effect (one :class:`ApiEffect`, and the answer saved under the key). Handlers
keep their resources in the :class:`Store` and run under the ledger's lock.

Bodies are parsed as a careful payment API parses them: numbers with a point as
``decimal.Decimal``, so ``19.999999999999999999`` and ``20.0`` are different bodies (as floats
they would be one).
"""

from __future__ import annotations

import copy
import enum
import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar
from urllib.parse import parse_qsl, urlsplit

from outbox.testing.loopback import (
    HOST,
    REPLAYED_HEADER,
    ApplyFault,
    Connections,
    FaultKind,
    Headers,
    InvalidJson,
    JsonHandler,
    KeyEntry,
    Ledger,
    LoopbackFake,
    LoopbackServer,
    Plan,
    Reply,
    parse_json_body,
)

__all__ = [
    "ApiCall",
    "ApiEffect",
    "ApiFault",
    "ApiFaultKind",
    "ApiProfile",
    "ApiRequest",
    "Applied",
    "Context",
    "ErrorAfterApply",
    "FakeHttpApi",
    "KeySpec",
    "Route",
    "Store",
    "replayed",
]

HOUR = 3600.0
DAY = 24 * HOUR
T = TypeVar("T")


# --- what happened --------------------------------------------------------------------------


@dataclass(frozen=True)
class ApiCall:
    """One request that arrived, whatever became of it.

    ``raw_key`` is the key as received (the header's value, or the body field); ``key`` is what
    the API made of it (an RFC 8941 string unquoted, say). ``route`` is the name of the route it
    matched (None: no route). ``body`` is the parsed JSON, numbers with a point as Decimal (None
    for an empty body; the raw text when it is not JSON). ``status`` is None while the request
    is being processed and stays None when the connection was reset instead. Header names are
    lower-case; ``at`` and ``answered_at`` are ``time.monotonic()``.
    """

    method: str
    path: str
    query: dict[str, str]
    route: str | None
    raw_key: str | None
    key: str | None
    body: Any
    headers: dict[str, str]
    status: int | None
    replayed: bool
    at: float
    answered_at: float | None = None
    raw: bytes = b""


@dataclass(frozen=True)
class ApiEffect:
    """One business effect the API applied: what outbox must never cause twice per key.

    ``effect_id`` is the id of the resource the effect made or changed (an order, a capture, a
    payment); ``status`` is the answer's status as the API first decided it (a refusal is an
    effect too where the API records it: Adyen's 200 "Refused", Checkout.com's 201 "Declined").
    """

    effect_id: str
    route: str
    key: str | None
    body: Any
    headers: dict[str, str]
    status: int
    at: float


# --- faults ---------------------------------------------------------------------------------


# The APIs' fault kinds are those every fake that applies effects has.
ApiFaultKind = FaultKind


@dataclass(frozen=True)
class ApiFault(ApplyFault):
    """A misbehaviour to inject; build one with the class methods, e.g. ``ApiFault.status(503)``.

    Before-apply faults hit the next matching request of any route (a lookup or a replay too):
    nothing is applied or saved; ``status`` answers in the API's error shape. After-apply
    faults hit only a request that applies an effect; the bad answers come from
    :class:`BadAnswerFaults`. What a 500 after apply leaves under the key is the profile's
    choice (:class:`ErrorAfterApply`).
    """


# --- what a profile is made of --------------------------------------------------------------


@dataclass(frozen=True)
class ApiRequest:
    """A request as a route's handler sees it: ``params`` are the path's ``{name}`` parts,
    ``query`` the query string (first value of each name), ``key`` the parsed key (None when
    absent, or on a route that applies no effect)."""

    method: str
    path: str
    params: dict[str, str]
    query: dict[str, str]
    body: Any
    headers: dict[str, str]
    key: str | None


@dataclass(frozen=True)
class Applied:
    """A handler's report that it applied an effect on resource ``resource_id``."""

    reply: Reply
    resource_id: str


class Store:
    """A fake API's resources, by kind and id; touched only under the ledger's lock."""

    def __init__(self) -> None:
        self._tables: dict[str, dict[str, dict[str, Any]]] = {}
        self._counters: dict[str, int] = {}

    def new_id(self, prefix: str, width: int = 0) -> str:
        """``prefix`` then the next number for it, zero-padded to ``width`` digits."""
        count = self._counters[prefix] = self._counters.get(prefix, 0) + 1
        return f"{prefix}{count:0{width}d}"

    def put(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Store ``obj`` (which has an ``id``) as a ``kind``; return it."""
        self._tables.setdefault(kind, {})[obj["id"]] = obj
        return obj

    def get(self, kind: str, object_id: str) -> dict[str, Any] | None:
        return self._tables.get(kind, {}).get(object_id)

    def all(self, kind: str) -> list[dict[str, Any]]:
        """Every ``kind``, oldest first."""
        return list(self._tables.get(kind, {}).values())


@dataclass(frozen=True)
class Context:
    """What a handler may use besides the request.

    ``take_outcome()`` returns the outcome armed with ``FakeHttpApi.set_outcome`` for this
    request (or None): call it only when about to apply, since it uses the outcome up.
    ``resource_for(route, key)`` is the resource a key made on a route while the key is kept.
    """

    store: Store
    take_outcome: Callable[[], str | None]
    resource_for: Callable[[str, str], str | None]


Handler = Callable[[Context, ApiRequest], "Reply | Applied"]
Current = Callable[[Store, str, ApiRequest], Reply]


@dataclass(frozen=True)
class Route:
    """A method and path pattern (``{name}`` matches one path segment) and what serves it.

    ``effect`` routes take the idempotency key; ``retention`` and ``max_key_length`` override
    the profile's for this route; ``current``, when set, is what a replay answers (the
    resource's current state, as PayPal does) instead of the saved answer.
    """

    method: str
    pattern: str
    name: str
    handler: Handler
    effect: bool = False
    retention: float | None = None
    max_key_length: int | None = None
    current: Current | None = None

    def match(self, path: str) -> dict[str, str] | None:
        found = _compiled(self.pattern).fullmatch(path)
        return None if found is None else found.groupdict()


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", pattern)
    regex = "".join(
        f"(?P<{part}>[^/]+)" if index % 2 else re.escape(part) for index, part in enumerate(parts)
    )
    return re.compile(regex)


def _bare(value: str) -> str | None:
    return value.strip() or None


@dataclass(frozen=True)
class KeySpec:
    """Where the key travels and what it may be.

    ``name`` is a header (case-insensitive) or, with ``in_body``, a top-level JSON field;
    ``parse`` turns the received value into the key (None: absent); ``characters``, when set,
    must match the whole key.
    """

    name: str
    max_length: int
    in_body: bool = False
    characters: re.Pattern[str] | None = None
    parse: Callable[[str], str | None] = _bare

    def raw(self, headers: dict[str, str], body: Any) -> str | None:
        """The key as received, or None when absent."""
        if not self.in_body:
            return headers.get(self.name.lower())
        value = body.get(self.name) if isinstance(body, dict) else None
        return value if isinstance(value, str) else None

    def problem(self, key: str, max_length: int | None = None) -> str | None:
        """ "too_long", "characters", or None when the key is acceptable."""
        if len(key) > (max_length or self.max_length):
            return "too_long"
        if self.characters is not None and not self.characters.fullmatch(key):
            return "characters"
        return None


class ErrorAfterApply(enum.Enum):
    """What a 500 after the effect leaves under the key."""

    SAVED = "saved"  # the 500 is the key's answer: replays repeat it (IETF draft, Stripe)
    TRANSIENT = "transient"  # the key keeps the real answer: only this response was a 500
    FORGOTTEN = "forgotten"  # nothing is kept: a retry with the key applies a second effect


def replayed(reply: Reply, *headers: tuple[str, str]) -> Reply:
    """``reply`` marked as a replay (in ``ApiCall.replayed``), with ``headers`` added."""
    return _Replay(reply.status, reply.body, (*reply.headers, *headers), reply.wire)


@dataclass(frozen=True)
class _Replay(Reply):
    """A replay, whether or not the API says so in a header."""

    @property
    def replayed(self) -> bool:
        return True


class ApiProfile:
    """One API's routes and idempotency semantics; subclass per API and override replies.

    The defaults are the IETF draft's: a key is required, another body gets 422, a request
    while the first is processed gets 409, replays say ``Idempotent-Replayed: true``, and a 500
    after apply is saved. Error bodies default to ``{"error": message}``.
    """

    name: ClassVar[str] = "api"
    key: ClassVar[KeySpec] = KeySpec("Idempotency-Key", 255)
    retention: ClassVar[float] = DAY
    outcomes: ClassVar[frozenset[str]] = frozenset()
    compare_body: ClassVar[bool] = True  # False: a replay answers whatever the body
    replay_headers: ClassVar[Headers] = (REPLAYED_HEADER,)
    echo_key: ClassVar[bool] = False  # answers to keyed requests repeat the key's header
    error_after_apply: ClassVar[ErrorAfterApply] = ErrorAfterApply.SAVED

    def routes(self) -> tuple[Route, ...]:
        raise NotImplementedError

    def error(self, status: int, message: str) -> Reply:
        """An error answer in the API's shape."""
        return Reply(status, {"error": message})

    def missing_key(self, request: ApiRequest) -> Reply | None:
        """The answer to an effect request without a key (None: apply it, unprotected)."""
        return self.error(400, f"missing {self.key.name}")

    def bad_key(self, key: str, problem: str) -> Reply:
        """The answer to a key that is too long (``problem`` "too_long") or has characters
        the API refuses ("characters")."""
        return self.error(400, f"{self.key.name} is invalid ({problem})")

    def in_progress(self, request: ApiRequest) -> Reply:
        return self.error(409, "a request with this key is in progress")

    def mismatch(self, request: ApiRequest) -> Reply:
        return self.error(422, "idempotency key reused with another request")

    def server_error(self) -> Reply:
        """What a 500 after apply answers."""
        return self.error(500, "internal error")

    def injected(self, status: int) -> Reply:
        """What an injected status (``ApiFault.status``) answers."""
        return self.error(status, f"injected {status}")

    def no_route(self, method: str, path: str, *, path_known: bool) -> Reply:
        if path_known:
            return self.error(405, f"{method} is not allowed on {path}")
        return self.error(404, f"no route for {method} {path}")

    def bad_json(self) -> Reply:
        return self.error(400, "the body is not JSON")

    def check_key(self, route: Route, request: ApiRequest) -> Reply | None:
        """The rejection of an effect request's key, or None when it may proceed."""
        if request.key is None:
            return self.missing_key(request)
        problem = self.key.problem(request.key, route.max_key_length)
        return None if problem is None else self.bad_key(request.key, problem)


# --- the ledger -----------------------------------------------------------------------------


@dataclass
class _Entry(KeyEntry):
    """What the ledger remembers about one key on one route."""

    route: str
    path: str
    body: Any
    resource_id: str


@dataclass
class _ArmedOutcome:
    outcome: str
    key: str | None
    remaining: int


def _slot(route: str, key: str) -> str:
    """Keys are scoped to their route: the same key on two routes is two keys."""
    return f"{route}\x00{key}"


class _Ledger(Ledger[ApiFault, ApiCall, _Entry]):
    """The API's state: keys, resources, effects, requests, faults, holds, under one lock."""

    def __init__(self, profile: ApiProfile, key_retention: float | None) -> None:
        super().__init__(f"fake {profile.name}", profile.retention)
        self.profile = profile
        self.store = Store()
        self._override = key_retention
        self._effects: list[ApiEffect] = []
        self._outcomes: list[_ArmedOutcome] = []

    def admit(self, route: Route, request: ApiRequest) -> Plan:
        """Decide an admitted request's fate, applying its effect if its key is new."""
        with self.cond:
            fault = self._take_fault(request.key, lambda f: f.before_apply)
            if fault is not None:
                return Plan(self._before_apply_reply(fault))
            now = time.monotonic()
            if route.effect and request.key is not None:
                entry = self._live_entry(_slot(route.name, request.key), now)
                if entry is not None:
                    return Plan(self._existing(route, entry, request))
            result = route.handler(self._context(request.key), request)
            if isinstance(result, Applied):
                return self._applied(route, request, result, now)
            return Plan(result)

    def _context(self, key: str | None) -> Context:
        return Context(self.store, lambda: self._take_outcome(key), self._resource_for)

    def _before_apply_reply(self, fault: ApiFault) -> Reply | None:
        if fault.kind is ApiFaultKind.RESET_BEFORE_APPLY:
            return None
        reply = self.profile.injected(fault.code)
        if fault.retry_after is None:
            return reply
        return Reply(
            reply.status, reply.body, (*reply.headers, ("Retry-After", str(fault.retry_after)))
        )

    def _existing(self, route: Route, entry: _Entry, request: ApiRequest) -> Reply:
        profile = self.profile
        if entry.in_progress:
            return profile.in_progress(request)
        if profile.compare_body and (entry.path, entry.body) != (request.path, request.body):
            return profile.mismatch(request)
        if route.current is not None:
            return replayed(route.current(self.store, entry.resource_id, request))
        return replayed(entry.reply, *profile.replay_headers)

    def _applied(self, route: Route, request: ApiRequest, applied: Applied, now: float) -> Plan:
        fault = self._take_fault(request.key, lambda f: not f.before_apply)
        kind = fault.kind if fault is not None else None
        effect = ApiEffect(
            applied.resource_id,
            route.name,
            request.key,
            request.body,
            request.headers,
            applied.reply.status,
            now,
        )
        self._effects.append(effect)
        answer, saved, forget = self._answers(applied.reply, kind)
        entry = self._save(route, request, applied.resource_id, saved, now)
        if entry is not None and forget:
            entry.expires_at = float("-inf")  # forgotten once it completes
        self.cond.notify_all()
        hold = self._holds.pop(request.key, None) if request.key is not None else None
        delay = fault.seconds if fault is not None else 0.0
        return Plan(_sent(answer, fault), entry, hold, delay)

    def _answers(self, reply: Reply, kind: ApiFaultKind | None) -> tuple[Reply, Reply, bool]:
        """What an applied request answers, what its key saves, and whether the key is
        forgotten, given the after-apply fault's ``kind``."""
        if kind is not ApiFaultKind.ERROR_500_AFTER_APPLY:
            return reply, reply, False
        error, policy = self.profile.server_error(), self.profile.error_after_apply
        saved = error if policy is ErrorAfterApply.SAVED else reply
        return error, saved, policy is ErrorAfterApply.FORGOTTEN

    def _save(
        self, route: Route, request: ApiRequest, resource_id: str, saved: Reply, now: float
    ) -> _Entry | None:
        if request.key is None:
            return None
        retention = self._override
        if retention is None:
            retention = route.retention if route.retention is not None else self._retention
        entry = _Entry(
            route.name,
            request.path,
            request.body,
            resource_id,
            reply=saved,
            expires_at=now + retention,
        )
        self._entries[_slot(route.name, request.key)] = entry
        return entry

    def _resource_for(self, route: str, key: str) -> str | None:
        entry = self._live_entry(_slot(route, key), time.monotonic())
        return None if entry is None else entry.resource_id

    def _take_outcome(self, key: str | None) -> str | None:
        for armed in self._outcomes:
            if armed.key in (None, key):
                armed.remaining -= 1
                if armed.remaining == 0:
                    self._outcomes.remove(armed)
                return armed.outcome
        return None

    # --- test controls and reads ----------------------------------------------------------

    def arm_outcome(self, outcome: str, key: str | None, times: int) -> None:
        if outcome not in self.profile.outcomes:
            known = ", ".join(sorted(self.profile.outcomes)) or "none"
            raise ValueError(f"{self.profile.name} has no outcome {outcome!r} (known: {known})")
        if times < 1:
            raise ValueError("times must be at least 1")
        with self.cond:
            self._outcomes.append(_ArmedOutcome(outcome, key, times))

    def effects(self) -> list[ApiEffect]:
        with self.cond:
            return list(self._effects)

    def effect_total(self) -> int:
        """The number of effects (call with the lock held)."""
        return len(self._effects)

    def edit(self, change: Callable[[Store], T]) -> T:
        with self.cond:
            return change(self.store)


def _sent(answer: Reply, fault: ApiFault | None) -> Reply | None:
    """What goes out for an applied request's ``answer`` (None: reset the connection)."""
    if fault is None:
        return answer
    if fault.kind is ApiFaultKind.RESET_AFTER_APPLY:
        return None
    return answer if fault.answer is None else answer.badly(fault.answer)


# --- HTTP -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Incoming:
    """A request as read off the wire, before routing."""

    method: str
    path: str
    query: dict[str, str]
    body: Any
    headers: dict[str, str]
    raw_key: str | None
    key: str | None
    raw: bytes = field(repr=False)

    @classmethod
    def read(
        cls, method: str, target: str, headers: dict[str, str], raw: bytes, spec: KeySpec
    ) -> Self:
        url = urlsplit(target)
        query: dict[str, str] = {}
        for name, value in parse_qsl(url.query, keep_blank_values=True):
            query.setdefault(name, value)
        body = parse_json_body(raw)
        raw_key = spec.raw(headers, body)
        key = spec.parse(raw_key) if raw_key is not None else None
        return cls(method, url.path, query, body, headers, raw_key, key, raw)

    def record(self, route: str | None) -> Callable[[float], ApiCall]:
        body = self.body.text if isinstance(self.body, InvalidJson) else self.body

        def make(at: float) -> ApiCall:
            return ApiCall(
                self.method,
                self.path,
                self.query,
                route,
                self.raw_key,
                self.key,
                body,
                self.headers,
                None,
                False,
                at,
                raw=self.raw,
            )

        return make

    def request(self, route: Route, params: dict[str, str]) -> ApiRequest:
        key = self.key if route.effect else None
        return ApiRequest(self.method, self.path, params, self.query, self.body, self.headers, key)


class _Server(LoopbackServer):
    """The listener, typed for the handler: its ledger is the profile's."""

    ledger: _Ledger

    def __init__(self, port: int, ledger: _Ledger, connections: Connections) -> None:
        self.routes = ledger.profile.routes()
        super().__init__(port, ledger, connections, _Handler)

    def find(self, method: str, path: str) -> tuple[Route, dict[str, str]] | Reply:
        """The route serving ``method`` on ``path`` and its path parameters, or the answer."""
        path_known = False
        for route in self.routes:
            params = route.match(path)
            if params is not None:
                if route.method == method:
                    return route, params
                path_known = True
        return self.ledger.profile.no_route(method, path, path_known=path_known)


class _Handler(JsonHandler):
    """Serves one connection; chunked bodies are read, as some clients send them."""

    accepts_chunked = True
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 (http.server dispatches to this name)
        """Serve a request; the profile's routes decide what it means."""
        self._serve()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_GET  # noqa: N815 (http.server's names)

    def _serve(self) -> None:
        raw = self._read_body()
        if raw is None:
            return
        profile = self.server.ledger.profile
        headers = {name.lower(): str(value) for name, value in self.headers.items()}
        incoming = _Incoming.read(self.command, self.path, headers, raw, profile.key)
        found = self.server.find(incoming.method, incoming.path)
        route = None if isinstance(found, Reply) else found[0]
        echo: Headers = ()
        if profile.echo_key and incoming.raw_key is not None and not profile.key.in_body:
            echo = ((profile.key.name, incoming.raw_key),)
        self._respond(
            incoming.record(route.name if route else None),
            lambda: self._decide(incoming, found),
            echo,
        )

    def _decide(
        self, incoming: _Incoming, found: tuple[Route, dict[str, str]] | Reply
    ) -> Reply | None:
        """The answer (None: reset), after any hold or delay it must sit out."""
        if isinstance(found, Reply):
            return found
        profile = self.server.ledger.profile
        route, params = found
        if isinstance(incoming.body, InvalidJson):
            return profile.bad_json()
        request = incoming.request(route, params)
        if route.effect:
            rejection = profile.check_key(route, request)
            if rejection is not None:
                return rejection
        plan = self.server.ledger.admit(route, request)
        self.server.ledger.sit_out(plan)
        return plan.reply


# --- the fake -------------------------------------------------------------------------------


class FakeHttpApi(LoopbackFake[ApiFault, ApiCall]):
    """A loopback server for ``profile``: applies each idempotency key's effect once.

    Use as a context manager (or ``start()``/``stop()``); ``url`` is valid once started.
    ``key_retention`` (seconds) overrides every route's documented default. The lifecycle,
    ``received``, ``wait_idle``, ``inject``, ``hold``, ``forget_keys`` and
    ``refuse/accept_connections`` come from :class:`LoopbackFake`.
    """

    _noun = "fake API"
    _ledger: _Ledger

    def __init__(self, profile: ApiProfile, *, key_retention: float | None = None) -> None:
        if key_retention is not None and key_retention < 0:
            raise ValueError("key_retention must not be negative")
        self.profile = profile
        self._thread_name = f"fake-{profile.name}"
        super().__init__(_Ledger(profile, key_retention))

    def _make_server(self, port: int) -> _Server:
        return _Server(port, self._ledger, self._connections)

    @property
    def url(self) -> str:
        """The base URL, ``http://127.0.0.1:<port>`` (routes are paths under it)."""
        return f"http://{HOST}:{self.port}"

    # --- what happened --------------------------------------------------------------------

    @property
    def effects(self) -> list[ApiEffect]:
        """A snapshot of the effects applied, in order."""
        return self._ledger.effects()

    def effects_for(self, key: str, route: str | None = None) -> list[ApiEffect]:
        """The effects applied for ``key`` (on ``route``, or any), in order."""
        return [e for e in self.effects if e.key == key and route in (None, e.route)]

    def effect_count(self, key: str | None = None, route: str | None = None) -> int:
        """The number of effects applied, for ``key`` (None: any) on ``route`` (None: any)."""
        return sum(1 for e in self.effects if key in (None, e.key) and route in (None, e.route))

    def wait_for_effects(self, count: int, timeout: float = 5.0) -> list[ApiEffect]:
        """Wait until at least ``count`` effects exist; raise TimeoutError otherwise."""
        ledger = self._ledger
        ledger.wait_for(lambda: ledger.effect_total() >= count, timeout, f"{count} effects")
        return self.effects

    def received_for(self, key: str) -> list[ApiCall]:
        """The requests that carried ``key``, in order of arrival."""
        return [r for r in self.received if r.key == key]

    def objects(self, kind: str) -> list[dict[str, Any]]:
        """Copies of the resources of ``kind`` (e.g. "orders"), oldest first."""
        return self._ledger.edit(lambda store: copy.deepcopy(store.all(kind)))

    def object(self, kind: str, object_id: str) -> dict[str, Any] | None:
        """A copy of one resource, or None."""
        return self._ledger.edit(lambda store: copy.deepcopy(store.get(kind, object_id)))

    # --- test controls --------------------------------------------------------------------

    def set_outcome(self, outcome: str, *, key: str | None = None, times: int = 1) -> None:
        """Make the next ``times`` effects (with ``key``, or any) end as ``outcome`` (one of
        ``profile.outcomes``, e.g. "refused"), whatever the body asks."""
        self._ledger.arm_outcome(outcome, key, times)

    def edit(self, change: Callable[[Store], T]) -> T:
        """Run ``change`` on the resources under the ledger's lock; return what it returns."""
        return self._ledger.edit(change)

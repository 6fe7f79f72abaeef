"""The `http` provider: any HTTP API that takes an idempotency key, described by configuration.

Per action (outbox.providers.http.spec, docs/providers.md): the method, a target below the base
URL filled from the payload (each value percent-encoded whole, so it can neither add a path step
nor reach another host), which part of the payload is the body, where the key travels and in
which form, how long the provider keeps keys, where the reference is in the answer, and which
answers mean what. The webhook type is a preset of it (outbox.providers.http.webhook).

A body that is the whole payload goes exactly as stored (``payload_json``); a part of it, or one
with the key written into it, is written exactly from the decoded payload (numbers as
``Decimal``), so no amount is rounded on its way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

import httpx

from outbox.config.settings import DEFAULT_CONCURRENCY, DEFAULT_MAX_RESPONSE_BYTES
from outbox.core import payloads
from outbox.core.json_pointer import MISSING
from outbox.core.model import FailureClass
from outbox.providers import building
from outbox.providers.answers import AnswerLimits, AnswerRefused, Tally, reference
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
from outbox.providers.http import wire as http_wire
from outbox.providers.http.lookup import Asker, look_up
from outbox.providers.http.spec import ActionSpec
from outbox.providers.kit import ANY_ACTION, intent_headers
from outbox.providers.shards import Shards, shard_sizes

_JSON_TYPE: Final = {"Content-Type": "application/json"}
REASON_DECLINED: Final = "provider_declined"


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """An `http` provider's settings, secrets already read from their env or file source."""

    base_url: str  # scheme, host, port and an optional path prefix; no query
    timeout: timedelta
    key_retention: timedelta
    actions: Mapping[str, ActionSpec]
    headers: Mapping[str, str] = field(default_factory=dict)
    secret_headers: Mapping[str, str] = field(default_factory=dict)
    # Send Outbox-Operation-Id, -Action, -Attempt, -Tenant-Id and -Correlation-Id: for a
    # receiver of one's own, not for a third party, which learns the tenants' names from them.
    outbox_headers: bool = False
    # Connections to the provider at once: as many as the dispatcher may have calls in flight to
    # it (see shards.connection_cap), so that no call waits for a connection behind the others.
    max_connections: int = DEFAULT_CONCURRENCY
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __repr__(self) -> str:
        names = sorted(self.secret_headers)
        return f"HttpOptions(base_url={self.base_url!r}, secret_headers={names!r})"


class HttpProvider:
    """Sends each operation as its action's configuration says; ``send`` never raises."""

    def __init__(
        self, name: str, options: HttpOptions, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._name = name
        self._options = options
        self._base = options.base_url.rstrip("/")
        self._limits = AnswerLimits(options.max_response_bytes, options.timeout.total_seconds())
        # The body is JSON; a Content-Type among the configured headers still wins.
        configured = {h.lower() for h in (*options.headers, *options.secret_headers)}
        self._content_type = {} if "content-type" in configured else _JSON_TYPE
        sizes = [options.max_connections] if transport else shard_sizes(options.max_connections)
        # One TLS context for all the clients: each would load the CA bundle into one of its
        # own, 0.8 MB apiece (105 MB for the 128 clients of concurrency 1,024).
        tls = httpx.create_ssl_context()
        headers = {**options.headers, **options.secret_headers}
        clients = [
            http_wire.client(
                size=size,
                tls=tls,
                timeout=options.timeout,
                headers=headers,
                limits=self._limits,
                transport=transport,
            )
            for size in sizes
        ]
        self._shards = Shards(clients, sizes)

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    @property
    def action_key_retention(self) -> Mapping[str, timedelta]:
        """How long the provider keeps each action's keys; "*" for every action not named
        (docs/design.md, "Provider interface")."""
        return {name: spec.key_retention for name, spec in self._options.actions.items()}

    @property
    def actions(self) -> frozenset[str]:
        return frozenset(a for a in self._options.actions if a != ANY_ACTION)

    @property
    def tally(self) -> Tally:
        """The bytes its answers came to, received and decoded (for tests and benchmarks)."""
        return self._limits.tally

    def spec(self, action: str) -> ActionSpec | None:
        actions = self._options.actions
        return actions.get(action) or actions.get(ANY_ACTION)

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Refuse, before anything is sent, what this provider could never send: an action it
        has no configuration for, a payload without a value its URL needs or its body part."""
        spec = self._spec_of(action)
        spec.target.render(payload, key="k", operation_id=0)
        if spec.body is not None:
            _part(spec, payload, "k")
        if spec.lookup is not None:
            # An operation its lookup cannot ask about could never be reconciled on its own.
            try:
                spec.lookup.target.render(payload, key="k", operation_id=0)
                if spec.lookup.match is not None:
                    spec.lookup.match.render(payload, key="k", operation_id=0, escape=False)
            except InvalidRequest as exc:
                raise InvalidRequest(f"its lookup cannot be made: {exc}") from None

    def scope(self, action: str, payload: Mapping[str, Any]) -> str:
        """Where and how an operation's key goes: stored with its first send, so that a lookup
        after a change of base_url or of the key's settings says it proves nothing."""
        spec = self.spec(action)
        if spec is None:
            return self._base
        key = spec.key
        place = f"header {key.header} {key.quoting}" if key.header else f"field {key.field}"
        return f"{self._base} {place} {key.form}"

    def check_key(self, action: str, key: str) -> None:
        """Refuse a key the provider would refuse: too long, or of characters it does not take
        (an application's own key; the derived ones fit by the action's key form)."""
        spec = self._spec_of(action)
        if building.key_problem(key) is not None:
            return  # no key outbox makes: send records it as a request it cannot build
        problem = spec.key.problem(spec.key.wire(key))
        if problem is not None:
            raise InvalidRequest(problem)

    def _spec_of(self, action: str) -> ActionSpec:
        spec = self.spec(action)
        if spec is None:
            known = ", ".join(sorted(self.actions)) or "none"
            raise InvalidRequest(
                f"provider {self._name} has no action {action!r} (it has: {known})"
            )
        return spec

    async def send(self, request: SendRequest) -> SendResult:
        spec = self.spec(request.action)
        if spec is None:
            return building.unsendable(f"provider {self._name} has no action {request.action!r}")
        result = await self._send(spec, request)
        if not spec.retry_unknown and isinstance(result, Failed) and _unknown(result):
            # The provider keeps no answer but a success under the key: a retry could act
            # twice, so reconciliation decides (docs/providers.md, "retry_unknown").
            return dataclasses.replace(result, reconcile=True)
        return result

    async def _send(self, spec: ActionSpec, request: SendRequest) -> SendResult:
        with self._shards.take() as client:
            built = self._build(client, spec, request)
            if not isinstance(built, httpx.Request):
                return built
            response = await self._exchange(client, built, spec, request)
        if isinstance(response, Failed):
            return response
        try:
            return _classify(spec, response, spec.key.wire(request.idempotency_key))
        except Exception as exc:  # noqa: BLE001 (an odd answer must not lose a classified status)
            return http_wire.fallback(response.status_code, exc)

    async def _exchange(
        self,
        client: httpx.AsyncClient,
        built: httpx.Request,
        spec: ActionSpec,
        request: SendRequest,
    ) -> httpx.Response | Failed:
        try:
            return await client.send(built)
        except AnswerRefused as exc:
            return unknown(exc.error_class, str(exc), http_status=exc.status)
        except building.NOT_WRITTEN as exc:
            wire = spec.key.wire(request.idempotency_key)  # valid: the request was built
            return building.not_built(exc, self._own_headers(spec, request, wire))
        except httpx.HTTPError as exc:
            return http_wire.classify_exception(exc)

    def _build(
        self, client: httpx.AsyncClient, spec: ActionSpec, request: SendRequest
    ) -> httpx.Request | Failed:
        """The request, or what to record when it cannot be built: not sent
        (outbox.providers.building). Only an exception's type is kept, since its text may quote
        the payload or a header."""
        problem = building.key_problem(request.idempotency_key)
        if problem is not None:
            return problem
        wire = spec.key.wire(request.idempotency_key)
        key_refused = spec.key.problem(wire)
        if key_refused is not None:
            return building.unsendable(f"the request cannot be built: {key_refused}")
        own: dict[str, str] = {}
        try:
            target = spec.target.render(
                request.payload, key=wire, operation_id=request.operation_id
            )
            own = self._own_headers(spec, request, wire)
            content = _body(spec, request, wire)
            headers = {**(self._content_type if content is not None else {}), **own}
            return client.build_request(
                spec.method, self._base + target, content=content, headers=headers
            )
        except InvalidRequest as exc:
            return building.unsendable(f"the request cannot be built: {exc}")
        except building.BUILD_ERRORS as exc:
            return building.not_built(exc, own)

    def _own_headers(self, spec: ActionSpec, request: SendRequest, wire: str) -> dict[str, str]:
        headers: dict[str, str] = {}
        if spec.key.header is not None:
            headers[spec.key.header] = spec.key.header_value(wire)
        if self._options.outbox_headers:
            headers.update(http_wire.identity_headers(request))
            verbatim = spec.body is not None and not spec.body.tokens and spec.key.field is None
            headers.update(intent_headers(request.intent, body_is_payload=verbatim))
        return headers

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        """The operation's effect, by its action's lookup (docs/providers.md, "Lookups");
        raises when it cannot tell, or when the action has none."""
        spec = self.spec(request.action)
        if spec is None or spec.lookup is None:
            raise LookupError(f"action {request.action!r} has no lookup")
        with self._shards.take() as client:
            asker = Asker(client, self._base, spec, request, self._options.timeout.total_seconds())
            found = await look_up(asker)
        sent = request.sent_scope
        if isinstance(found, NotFound) and sent not in (None, self.scope(request.action, {})):
            why = "the base URL or the key's settings changed since the first send"
            return dataclasses.replace(found, complete=False, reason=why)
        return found

    def retries_unknown(self, action: str) -> bool:
        """Whether an operation of ``action`` that may have reached the provider may be sent
        again inside its key window (``retry_unknown``)."""
        spec = self.spec(action)
        return spec is None or spec.retry_unknown

    def looks_up(self, action: str | None) -> bool:
        """Whether reconciliation can ask about this action's operations (None: any action's)."""
        if action is None:
            return any(spec.lookup is not None for spec in self._options.actions.values())
        spec = self.spec(action)
        return spec is not None and spec.lookup is not None

    async def aclose(self) -> None:
        for client in self._shards.clients:
            await client.aclose()


def _unknown(result: Failed) -> bool:
    return result.failure is FailureClass.UNKNOWN and not result.not_sent


def _body(spec: ActionSpec, request: SendRequest, wire: str) -> bytes | None:
    if spec.body is None:
        return None
    if not spec.body.tokens and spec.key.field is None:
        # The whole payload as stored (PostgreSQL's JSON text): every number as enqueued.
        text = request.payload_json
        return (text if text is not None else payloads.encode(request.payload)).encode()
    return payloads.encode(_part(spec, request.payload, wire)).encode()


def _part(spec: ActionSpec, payload: Mapping[str, Any], wire: str) -> Any:
    """The body's JSON value: the payload's part, with the key written into it where it
    travels there. Raises InvalidRequest for a payload that cannot make one."""
    assert spec.body is not None  # noqa: S101 (the callers' condition)
    part = spec.body.read(payload)
    if part is MISSING:
        raise InvalidRequest(f"the payload has no {spec.body.text}, the request's body")
    if spec.key.field is None:
        return part
    if not isinstance(part, Mapping):
        raise InvalidRequest("the request's body must be a JSON object to carry the key")
    try:
        return spec.key.field.with_value(part, wire)
    except TypeError:
        raise InvalidRequest(f"the body has no object at {spec.key.field} for the key") from None


def _classify(spec: ActionSpec, response: httpx.Response, wire: str) -> SendResult:
    status = response.status_code
    body = http_wire.json_body(response)
    details: dict[str, Any] = {"http_status": status, "request_id": http_wire.request_id(response)}
    kind = spec.classify(status, body) or http_wire.default_class(status)
    ref = reference(spec.reference.read(body)) if body is not None else None
    if kind == "done":
        # An answer without a reference (or with something that is no identifier) still names
        # the effect by its key.
        result = body if isinstance(body, dict) else None
        return Succeeded(ref or wire, result, status, details["request_id"])
    if kind == "refused":
        # The provider acted and said no (a decline): the object it left is kept.
        why = http_wire.reason(response)
        return permanent(f"http_{status}", why, reference=ref, reason=REASON_DECLINED, **details)
    return _failure(kind, response, details)


def _failure(kind: str, response: httpx.Response, details: dict[str, Any]) -> Failed:
    """What an answer that confirms no effect leads to."""
    status, why = response.status_code, http_wire.reason(response)
    if kind == "credentials":
        return transient(f"http_{status}", why, pause=True, **details)
    if kind in ("in_use", "transient"):
        # 409 (the key is in use) and 429 (slow down) concern this request, not the provider's
        # health; 408 and 425 may.
        # Neither looked at the request: the attempt is not spent (docs/design.md, "Attempts").
        only = kind == "in_use" or status == 429
        after = http_wire.retry_after(response)
        return transient(
            f"http_{status}",
            why,
            retry_after=after,
            request_only=only,
            spends_attempt=not only,
            **details,
        )
    if kind == "permanent":
        return permanent(f"http_{status}", why, **details)
    if response.headers.get("idempotent-replayed") == "true":
        # An error the provider saved for this key: retries get only this answer again, so the
        # operation goes to reconciliation; the provider itself answered.
        return unknown(f"http_{status}", why, reconcile=True, request_only=True, **details)
    # A gateway may answer 502/503/504 after the provider acted, so the key window starts here;
    # Retry-After still paces the retry.
    return unknown(f"http_{status}", why, retry_after=http_wire.retry_after(response), **details)

"""What the inbox's HTTP middlewares share, whatever interface their server speaks (ASGI in
asgi.py, WSGI in wsgi.py): which requests are deliveries, their identity, the answer for each
decision, which responses are recorded and with which headers, and how a Cloud Tasks target
answers (docs/design.md, "The inbox"). The middlewares only read bodies, run the app and send;
so the two cannot answer one delivery differently.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final, Generic, TypeVar

import psycopg
import structlog

from outbox.inbox import meters
from outbox.inbox.contracts import ContractBreach, ContractUnknown
from outbox.inbox.core import (
    UNAVAILABLE,
    BaseDelivery,
    Decision,
    Identity,
    InvalidDelivery,
    Outcome,
)
from outbox.inbox.external import BaseClaim
from outbox.inbox.http import (
    Headers,
    KeyFrom,
    MissingIdentity,
    TenantFrom,
    identity_of,
    problem,
    replay,
    stored_headers,
    traced,
)
from outbox.observability import tracing

# The key of the ASGI scope's "state" and of the WSGI environ that holds the Delivery.
DELIVERY: Final = "outbox.inbox.delivery"
# How answers are given: as an HTTP API answers a client, or as a Cloud Tasks target must.
TRANSPORTS: Final = ("http", "cloudtasks")
# Decisions whose answer never changes, however often the delivery comes again.
FINAL: Final = frozenset(
    {"new", "reclaimed", "replayed", "conflict", "invalid", "contract_violation"}
)
# How soon a delivery whose contract this database has not published may come again (seconds):
# the receiving service's contracts are pushed by its own deploy.
CONTRACT_RETRY_AFTER: Final = 30
# What the app may answer in all when the inbox will not record it (a 5xx, an unlisted 4xx,
# passed on as the app gave it): a response is buffered before COMMIT.
RESPONSE_CAP: Final = 16 * 1024 * 1024
# Decisions whose 5xx no exception explains: their span's error.type is the status, as
# OpenTelemetry's HTTP conventions have it; a failure that raised has its class there instead.
_FAILED_BY_STATUS: Final = frozenset({"rolled_back", "abandoned"})
log = structlog.get_logger("outbox.inbox")

AppT = TypeVar("AppT")
InboxT = TypeVar("InboxT")


class HandlerFailed(Exception):
    """The app raised while handling a new delivery: its transaction rolled back."""


class CutShort(Exception):
    """The sender went away before the whole body arrived: a part is never a delivery."""


class BodyTooLarge(Exception):
    """The body is longer than the middleware reads (``max_body_bytes``)."""


# What is answered before the app, with nothing decided: the body or the identity.
REFUSED: Final = (CutShort, BodyTooLarge, MissingIdentity, UnicodeDecodeError)
# What ends a delivery without the app's answer: each is answered by ``HTTPAdapter.failed``.
FAILED: Final = (
    InvalidDelivery,
    ContractBreach,
    ContractUnknown,
    HandlerFailed,
    *UNAVAILABLE,
    psycopg.Error,
)


@dataclass(frozen=True)
class External:
    """A route in external-effect mode (outbox.inbox.external), for a handler that calls out
    before it can answer: its claim commits at once with a ``lease`` a heartbeat renews, and
    after ``max_claims`` claims without an outcome the record is abandoned. The handler reads
    its claim with ``claimed(request)``: ``downstream_key(step)`` for its own outbound calls,
    ``await transaction()`` for the writes that commit with its answer."""

    handler: str
    lease: timedelta = timedelta(seconds=30)
    max_claims: int = 5

    def __post_init__(self) -> None:
        if self.lease < timedelta(seconds=1):
            raise ValueError("an external route's lease is at least 1 second")
        if self.max_claims < 1:
            raise ValueError("an external route's max_claims is at least 1")


@dataclass
class Buffered:
    """The app's response, held back: nothing reaches the sender before COMMIT. A response
    the inbox records is read only to one byte past ``record_limit`` (anything longer is
    refused); any other, which is passed on as the app gave it, to RESPONSE_CAP."""

    record_limit: int
    record_statuses: frozenset[int]  # the 4xx recorded besides 2xx and 3xx
    status: int = 500
    headers: tuple[tuple[str, str], ...] = ()
    body: bytearray = field(default_factory=bytearray)
    started: bool = False

    def start(self, status: int, headers: tuple[tuple[str, str], ...]) -> None:
        self.status, self.headers, self.started = status, headers, True

    def add(self, chunk: bytes) -> bool:
        """Keep ``chunk``; False once the rest is not worth reading."""
        if self.full():
            return False
        self.body += chunk
        if len(self.body) > RESPONSE_CAP:
            raise RuntimeError("the response is larger than the inbox buffers")
        return not self.full()

    def full(self) -> bool:
        return recordable(self.status, self.record_statuses) and len(self.body) > self.record_limit

    def outcome(self) -> Outcome:
        return Outcome(self.status, self.headers, bytes(self.body))


def recordable(status: int, record_statuses: frozenset[int]) -> bool:
    """Whether a response is an outcome to record and replay: a 2xx or 3xx, or a 4xx the route
    answers deterministically. Anything else rolls the handler's writes back."""
    return 200 <= status < 400 or status in record_statuses


class HTTPAdapter(Generic[AppT, InboxT]):
    """Wraps ``app``; ``routes`` maps ``"METHOD /path"`` to a handler name, the stable part of
    each delivery's identity (renaming a path keeps it; renaming a handler forgets its records),
    or to ``External(name, ...)`` for a handler that calls out before it can answer.

    ``record_statuses`` are the 4xx a handler answers deterministically (recorded and replayed
    like a 2xx or 3xx); any other status, a raise or a response over ``max_response_bytes``
    rolls the handler's writes back and records nothing, so the sender delivers again."""

    def __init__(
        self,
        app: AppT,
        *,
        inbox: InboxT,
        routes: Mapping[str, str | External],
        key: KeyFrom | None = None,
        tenant: TenantFrom | None = None,
        record_statuses: frozenset[int] = frozenset({400, 404, 410, 422}),
        max_body_bytes: int = 1024 * 1024,
        max_response_bytes: int = 64 * 1024,
        retry_after: int = 1,
        keep_headers: frozenset[str] = frozenset(),
        transport: str = "http",
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport is one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self.transport = transport
        self.app = app
        self.inbox = inbox
        self.routes = {_route_key(route): _name(mode) for route, mode in routes.items()}
        # The handlers in external-effect mode, by name.
        self.external = {m.handler: m for m in routes.values() if isinstance(m, External)}
        plain = {m for m in routes.values() if isinstance(m, str)}
        if both := sorted(plain & set(self.external)):
            # One identity, one mode: a record's claim and transaction protocols do not mix.
            raise ValueError(f"a handler is External on every route or on none: {both}")
        self.key = key or KeyFrom.auto()
        self.tenant = tenant or TenantFrom.header()
        self.record_statuses = record_statuses
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = max_response_bytes
        self.retry_after = retry_after
        self.keep_headers = frozenset(name.lower() for name in keep_headers)
        self.spans = tracing.DeliverySpans()  # one per delivery, linked to the sender's

    def handler_for(self, method: str, path: str) -> str | None:
        """The declared handler of a request, or None for one the inbox lets through."""
        return self.routes.get((method, path))

    def identity(self, headers: Headers, body: bytes, handler: str, span: Any) -> Identity:
        """The delivery's identity (MissingIdentity when it has none), shown on its span."""
        key = self.key.read(headers, body)
        identity = identity_of(self.tenant.read(headers), handler, key, headers)
        tracing.annotate(span, traced(identity))
        return identity

    def refused(self, exc: Exception) -> tuple[Outcome, str]:
        """The answer to a delivery that cannot be decided (one of REFUSED)."""
        if isinstance(exc, CutShort):
            # Nobody hears this answer; nothing was decided, recorded or handled.
            return problem(400, "delivery cut short", "the body never ended", "invalid"), "invalid"
        if isinstance(exc, BodyTooLarge):
            detail = f"at most {self.max_body_bytes} bytes"
            return problem(413, "body too large", detail, "invalid"), "invalid"
        return problem(400, "no delivery identity", str(exc), "invalid"), "invalid"

    def buffer(self) -> Buffered:
        return Buffered(self.max_response_bytes, self.record_statuses)

    def conclude(
        self, d: BaseDelivery[Any] | BaseClaim, response: Outcome, started: float
    ) -> tuple[Outcome, str]:
        """Record the app's answer to a new delivery, or roll its writes back: its answer and
        its decision ("new", or "reclaimed" for an external claim) when recorded, "rolled_back"
        when not."""
        is_outcome = recordable(response.status, self.record_statuses)
        if is_outcome and len(response.body) <= self.max_response_bytes:
            kept = stored_headers(response.headers, self.keep_headers)
            d.keep(Outcome(response.status, kept, response.body))
            outcome = "committed"
        else:
            d.roll_back()
            outcome = "rolled_back"
            if is_outcome:
                response = problem(
                    500,
                    "response too large to record",
                    f"at most {self.max_response_bytes} bytes",
                    "failed",
                )
        meters.HANDLER_SECONDS.labels(d.identity.handler, outcome).observe(
            time.monotonic() - started
        )
        decision = d.decision.value if outcome == "committed" else "rolled_back"
        # One mark, the inbox's: not a second beside the problem's, nor the app's own.
        own = tuple((n, v) for n, v in response.headers if n.lower() != "outbox-inbox-decision")
        marked = (*own, ("Outbox-Inbox-Decision", decision))
        return Outcome(response.status, marked, response.body), decision

    def answer(self, d: BaseDelivery[Any] | BaseClaim) -> Outcome:
        """The answer to a delivery that is not new: nothing of the app runs."""
        if d.decision is Decision.REPLAYED and d.recorded is not None:
            return replay(d.recorded)
        if d.decision is Decision.CONFLICT:
            return problem(422, "conflict", "this key was delivered with another body", "conflict")
        if d.decision is Decision.ABANDONED:
            detail = "given up after repeated claims: an operator releases it"
            return problem(503, "abandoned", detail, "abandoned", 300)
        retry_after = self.retry_after
        if isinstance(d, BaseClaim) and d.retry_after is not None:  # what is left of its lease
            retry_after = max(1, math.ceil(d.retry_after.total_seconds()))
        return problem(
            409, "in progress", "this delivery is being handled", "in_progress", retry_after
        )

    def lease_lost(self, handler: str) -> tuple[Outcome, str]:
        """The answer when another delivery reclaimed this one's claim before it could record:
        its writes were rolled back, and the lease's owner records (docs/design.md)."""
        log.warning("inbox lease lost", handler=handler)
        detail = "another delivery holds this claim now"
        return problem(409, "in progress", detail, "in_progress", self.retry_after), "in_progress"

    def failed(self, exc: Exception, handler: str, span: Any) -> tuple[Outcome, str]:
        """The answer to a delivery that ended in one of FAILED: nothing was recorded."""
        if isinstance(exc, ContractBreach | ContractUnknown):
            return self._off_contract(exc, handler)
        if not isinstance(exc, InvalidDelivery):
            cause = exc.__cause__ if isinstance(exc, HandlerFailed) else exc
            tracing.failed(span, type(cause).__name__)
        if isinstance(exc, InvalidDelivery):
            return problem(400, "invalid delivery", str(exc), "invalid"), "invalid"
        if isinstance(exc, HandlerFailed):
            # The exception's class only: its text may quote the payload.
            error = type(exc.__cause__).__name__
            log.error("inbox handler failed", handler=handler, error=error)
            return problem(500, "handler failed", "nothing was recorded", "failed"), "failed"
        if isinstance(exc, UNAVAILABLE):
            log.warning("inbox database unavailable", handler=handler, error=type(exc).__name__)
            detail = "nothing was recorded"
            answer = problem(503, "try again", detail, "unavailable", self.retry_after)
            return answer, "unavailable"
        # A statement or the COMMIT failed (a deferred constraint, OB006): rolled back.
        sqlstate = exc.sqlstate if isinstance(exc, psycopg.Error) else None
        log.error("inbox delivery failed", handler=handler, sqlstate=sqlstate)
        return problem(500, "not recorded", "the transaction failed", "failed"), "failed"

    def _off_contract(
        self, exc: ContractBreach | ContractUnknown, handler: str
    ) -> tuple[Outcome, str]:
        """A body that breaks the contract its sender names: a conflict of input (422), never
        run, never retried. One this database cannot check: later (503), never taken unchecked.
        Nothing recorded either way; the reason names the contract, a path and a rule."""
        if isinstance(exc, ContractBreach):
            log.warning("inbox contract violation", handler=handler, reason=str(exc))
            answer = problem(422, "contract violation", str(exc), "contract_violation")
            return answer, "contract_violation"
        log.warning("inbox contract unknown", handler=handler, reason=str(exc))
        retry = max(self.retry_after, CONTRACT_RETRY_AFTER)
        return problem(503, "contract unknown", str(exc), "contract_unknown", retry), (
            "contract_unknown"
        )

    def answered(
        self, handler: str, answer: Outcome, decision: str, started: float, span: Any
    ) -> Outcome:
        """The answer as this transport gives it, counted, logged and shown on its span."""
        if self.transport == "cloudtasks":
            answer = for_cloud_tasks(answer, decision)
        meters.DELIVERIES.labels(handler, decision).inc()
        # The usual decisions at debug (a busy worker's every request); the rest at info.
        usual = decision in ("new", "replayed")
        (log.debug if usual else log.info)(
            "inbox delivery",
            handler=handler,
            decision=decision,
            status=answer.status,
            seconds=round(time.monotonic() - started, 4),
        )
        shown: tracing.Attributes = {
            "outbox.inbox.decision": decision,
            "http.response.status_code": answer.status,
        }
        tracing.annotate(span, shown)
        if answer.status >= 500 and decision in _FAILED_BY_STATUS:
            tracing.failed(span, str(answer.status))
        return answer


def for_cloud_tasks(answer: Outcome, decision: str) -> Outcome:
    """The answer as a Cloud Tasks HTTP target gives it. Cloud Tasks deletes a task on a 2xx
    only, retries every other answer (429 and 503 with more backoff, honouring Retry-After) and
    has no dead-letter queue. So a final answer that is not a success (a recorded refusal, a
    conflict, a malformed delivery) is 200 with the real status in ``Outbox-Inbox-Status``, or
    the task would be retried until its retry limit for nothing; "in progress" is 429."""
    if decision == "in_progress":
        return Outcome(429, answer.headers, answer.body)
    if 400 <= answer.status < 500 and decision in FINAL:
        real = ("Outbox-Inbox-Status", str(answer.status))
        return Outcome(200, (*answer.headers, real), answer.body)
    return answer


def is_json(headers: Headers) -> bool:
    """Whether the body is digested as JSON (its canonical text) rather than as bytes."""
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _name(mode: str | External) -> str:
    return mode.handler if isinstance(mode, External) else mode


def _route_key(route: str) -> tuple[str, str]:
    method, _, path = route.strip().partition(" ")
    if not path.startswith("/"):
        raise ValueError(f"a route is 'METHOD /path', not {route!r}")
    return method.upper(), path

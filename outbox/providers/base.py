"""The provider interface: what the dispatcher asks of Stripe, a webhook, or a third-party plug-in.

Results are named for what they lead to, not for where they came from: ``Succeeded``,
``Transient`` (the provider did not act: retry), ``Permanent`` (another attempt will not help:
quarantine), ``Unknown`` (the provider may have acted: retry only within the key window).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final, Protocol, runtime_checkable

from outbox.core.model import FailureClass


@dataclass(frozen=True, slots=True)
class SendRequest:
    """One attempt to deliver one operation.

    ``payload`` is the decoded object: integers as ``int``, every other number as
    ``decimal.Decimal``, so that no amount is rounded through a float on its way.
    ``payload_json`` is the payload exactly as stored (PostgreSQL's JSON text of it): a provider
    that sends JSON sends this, and the provider receives the numbers as they were enqueued. None
    only where a request was built by hand; ``outbox.core.payloads.encode`` writes ``payload`` then.
    """

    operation_id: int
    tenant_id: str
    operation_type: str
    operation_key: str
    action: str
    payload: Mapping[str, Any]
    idempotency_key: str
    correlation_id: str | None
    attempt: int
    payload_json: str | None = None
    # The provider API version to send with: the one of the operation's first send, or None
    # (never sent: the provider's configured version).
    api_version: str | None = None
    # The W3C traceparent the producer's enqueue stored, if any: a queue provider passes it on
    # in the message's headers, so that a consumer's span joins the producer's trace.
    traceparent: str | None = None
    # What the sender's database holds of this operation, sent with it so that a receiver can
    # tell operations of different databases apart and check the body against enqueue's
    # fingerprint (outbox.providers.kit.intent_headers). None where a request was built by hand.
    intent: Intent | None = None


@dataclass(frozen=True, slots=True)
class Intent:
    """Which database's operation this is and enqueue's fingerprint of it (sql/0045).

    ``fingerprint`` is SHA-256 of ``provider``, action, the payload's JSON text and
    ``ordering_key`` (docs/design.md, "The inbox"): given the same four, a receiver computes the
    same bytes from the body it got."""

    origin: str  # outbox.origin(): the public id of the sender's database
    fingerprint: bytes
    provider: str
    ordering_key: str | None
    # The contract the payload was enqueued under, "<type>/v<N>" (sql/0053), which a receiver
    # checks the body against; None for a type without contracts.
    contract: str | None = None


@dataclass(frozen=True, slots=True)
class Succeeded:
    """The provider accepted the request; ``reference`` identifies the effect there."""

    reference: str
    result: Mapping[str, Any] | None = None
    http_status: int | None = None
    request_id: str | None = None


# The longest Failed.message kept: enough for any reason outbox writes and a provider's
# explanation, not for a body a provider echoed back.
MESSAGE_CHARS: Final = 2000


@dataclass(frozen=True, slots=True)
class Failed:
    """The provider did not confirm the effect. ``failure`` says what that leads to."""

    failure: FailureClass
    error_class: str  # short and stable, e.g. "http_503", "timeout", "connect_refused"
    message: str  # for operators; never the payload or a secret
    http_status: int | None = None
    request_id: str | None = None
    retry_after: timedelta | None = None  # the provider's own hint, honoured by the backoff
    # The provider will only ever repeat this answer for this key (a saved indeterminate error):
    # retrying burns attempts, so the operation goes to reconciliation.
    reconcile: bool = False
    # The provider refuses our credentials (401/403): every operation would fail the same way,
    # so the provider's circuit breaker opens (reason "credentials") and this operation keeps
    # its attempt.
    pause: bool = False
    # This request's own trouble, not the provider's: its key is in use (409), it was rate
    # limited (429), or the provider replayed an answer saved for this key. The provider
    # answered, so its circuit breaker does not count the failure.
    request_only: bool = False
    # False: the provider said it did not act and did not look at the request (rate limited,
    # the key in use by a request still running): the attempt does not count toward
    # max_attempts, for policy.UNSPENT_FOR after enqueue (docs/design.md, "Attempts").
    spends_attempt: bool = True
    # The provider refuses this action to our credentials (a 403 of a restricted key missing
    # one permission): that action pauses (provider_limits.ActionPauses), not the provider, and
    # this operation keeps its attempt. A refusal of the credentials themselves is ``pause``.
    pause_action: bool = False
    # The provider's object the failure left behind (a declined PaymentIntent exists at Stripe):
    # kept as the operation's provider_ref, for the person who looks into it.
    reference: str | None = None
    # The quarantine reason when more precise than permanent_failure (provider_declined).
    reason: str | None = None
    # Nothing of the request left this host: it could not be built (outbox.providers.building).
    # Recorded as not sent whatever ``failure`` says: no key window starts.
    not_sent: bool = False

    def __post_init__(self) -> None:
        # The message often quotes the provider's own words (an error description, a status
        # text), and a broken or hostile provider can make those a megabyte: stored in every
        # attempt row and logged on every retry, that bloats the database and floods the logs.
        if len(self.message) > MESSAGE_CHARS:
            cut = len(self.message) - MESSAGE_CHARS
            object.__setattr__(
                self, "message", f"{self.message[:MESSAGE_CHARS]}… ({cut:,} characters cut)"
            )

    @property
    def may_have_reached_provider(self) -> bool:
        # A transient failure means the provider did not act, so its key window has not begun.
        return not self.not_sent and self.failure is not FailureClass.TRANSIENT


def transient(error_class: str, message: str, **details: Any) -> Failed:
    return Failed(FailureClass.TRANSIENT, error_class, message, **details)


def permanent(error_class: str, message: str, **details: Any) -> Failed:
    return Failed(FailureClass.PERMANENT, error_class, message, **details)


def unknown(error_class: str, message: str, **details: Any) -> Failed:
    return Failed(FailureClass.UNKNOWN, error_class, message, **details)


SendResult = Succeeded | Failed


class Verdict(enum.StrEnum):
    """What the object a lookup found means for its operation. Finding an object is not finding
    the effect: a declined PaymentIntent exists too."""

    DONE = "done"  # the effect happened: the operation succeeded
    REFUSED = "refused"  # the provider acted and said no (a decline): back to quarantine
    UNDECIDED = "undecided"  # its state decides nothing yet: reconciling, for a person


@dataclass(frozen=True, slots=True)
class Found:
    """The object an operation created, found at its provider by the reconciler, with what its
    state means. A provider that cannot tell leaves ``verdict`` DONE: an object exists."""

    reference: str
    duplicates: tuple[str, ...] = ()  # more objects that carry the same operation id
    verdict: Verdict = Verdict.DONE
    state: str | None = None  # the object's own status word (``requires_payment_method``)
    # Why, for the operator and the quarantine: a decline's code, decline_code and message.
    details: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NotFound:
    """No object of the operation at its provider: where the lookup looked, and how sure it is.
    ``complete`` False means the search stopped short (its page cap, a source that cannot cover
    the window): it proves nothing, and the check is undecided with ``reason``."""

    sources: tuple[str, ...]  # what was searched: "payment_intents (customer)", "events"
    since: datetime
    until: datetime
    complete: bool = True
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class LookupRequest:
    """What the reconciler knows of an operation it asks about (sql/0023)."""

    action: str
    operation_id: int
    idempotency_key: str  # the current generation's
    # Every key the operation's attempts carried that may have reached the provider, exactly.
    keys: frozenset[str]
    first_sent_at: datetime  # the first attempt of any generation that may have been sent
    last_attempt_at: datetime
    # The window's end, before any slack: the last attempt or the previous check if later, so
    # that each re-check searches further.
    search_until: datetime
    checked_now: datetime  # the database's clock, for the provider's own retention of records
    payload: Mapping[str, Any] = field(default_factory=dict)  # empty if it cannot be decoded
    api_version: str | None = None  # the one its first send used (None: the configured one)
    sent_scope: str | None = None  # where its first send went, as the provider's scope named it
    # Awaited before each request the lookup makes: the provider's rate limit (None: no limit).
    pace: Callable[[], Awaitable[None]] | None = None


class InvalidRequest(Exception):
    """Raised by ``Provider.check`` for an operation this provider can never send."""


@runtime_checkable
class Provider(Protocol):
    """A configured external system. ``send`` must not raise: every outcome is a result."""

    @property
    def name(self) -> str: ...

    @property
    def key_retention(self) -> timedelta:
        """How long the provider remembers an idempotency key."""
        ...

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Raise InvalidRequest if this operation cannot be sent, before anything is sent."""
        ...

    async def send(self, request: SendRequest) -> SendResult: ...

    async def aclose(self) -> None: ...


# A provider may also declare ``scope(action, payload) -> str``: where a send of that operation
# goes (a Stripe account and the key's mode). The first send's is stored, and a lookup that
# would search elsewhere says so rather than "not found" (LookupRequest.sent_scope).
# A provider may also declare ``api_version``, the version of its API it sends requests in: an
# operation's first send stores it, and its retries and lookups use that one (SendRequest).
# A provider may also declare ``async start() -> None``: awaited by `outbox run` before its first
# claim, to check the configuration against the live system (a JetStream stream's
# duplicate_window). It raises outbox.config.ConfigError to refuse to start (exit 2, its message
# said); a system that is merely down is no reason: it logs, and sends fail transient meanwhile.
# A provider may also declare ``actions``, a collection of the action names it knows: each keeps
# its own label in the metrics. Other actions share at most
# outbox.observability.metric_labels.MAX_OTHER_ACTIONS labels per provider, then "other"
# (a row's action is the producer's choice).


@runtime_checkable
class Lookup(Protocol):
    """A provider that can tell whether an operation's effect exists (for reconciliation)."""

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        """The effect of any key generation of the operation, or what was searched in vain;
        raises if it cannot tell."""
        ...


def asks(provider: object, action: str | None = None) -> bool:
    """Whether reconciliation can ask ``provider`` about ``action``'s operations (None: about
    any of them). A Lookup may declare ``looks_up(action: str | None) -> bool`` when only some
    actions have a lookup (an `http` provider's); without it, every action has one."""
    if not isinstance(provider, Lookup):
        return False
    looks_up = getattr(provider, "looks_up", None)
    return True if looks_up is None else bool(looks_up(action))

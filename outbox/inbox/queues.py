"""The inbox for queue consumers: one message, decided, handled and settled as a queue expects.

A queue has no response to replay: what a consumer gives back is a verdict on the message.
``settle`` turns the inbox's decision into one (docs/design.md, "The inbox"): acknowledge what
committed or was recorded before; drop (terminate, dead-letter) what can never succeed, a
conflict, a recorded refusal, a malformed message; retry later what is in progress or failed,
never acknowledging work that did not commit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any, Final, TypedDict, Unpack, cast

import structlog

from outbox.inbox import meters
from outbox.inbox.contracts import ContractBreach, ContractUnknown
from outbox.inbox.core import (
    UNAVAILABLE,
    Decision,
    Delivery,
    Identity,
    Inbox,
    InvalidDelivery,
    Outcome,
)
from outbox.inbox.external import RUNS, Claim, LeaseLost
from outbox.inbox.http import KeyFrom, MissingIdentity, TenantFrom, identity_of, traced
from outbox.observability import tracing

# What a queue handler's outcome is recorded as: a success, or a refusal (Refuse).
ACCEPTED: Final = Outcome(200, (), b"")
REFUSED_STATUS: Final = 422
ABANDONED_RETRY: Final = 300.0  # seconds: an abandoned record waits for a person
# Seconds: a contract this database has not published yet comes with the receiver's deploy.
CONTRACT_RETRY: Final = 30.0
log = structlog.get_logger("outbox.inbox")

Handle = Callable[[Delivery, bytes], Awaitable[None]]
# An external-effect handler's: it calls out under claim.downstream_key(step) and writes what
# must commit with its outcome on ``await claim.transaction()``.
ClaimHandle = Callable[[Claim, bytes], Awaitable[None]]


@dataclass(frozen=True)
class Claiming:
    """A consumer in external-effect mode (outbox.inbox.external): each message's claim
    commits at once with ``lease``, renewed while its handler runs; after ``max_claims``
    claims without an outcome the record is abandoned."""

    lease: timedelta = timedelta(seconds=30)
    max_claims: int = 5


class Refuse(Exception):
    """Raised by a handler for a message it will never accept (an unknown currency): what the
    handler wrote is undone, the refusal is recorded like a success and the message dropped;
    every copy of it is dropped the same way."""


class Verdict(StrEnum):
    ACK = "ack"  # done: committed now, or recorded before
    RETRY = "retry"  # give it back, to come again after `delay`
    DROP = "drop"  # never: terminate or dead-letter it


@dataclass(frozen=True)
class Settled:
    verdict: Verdict
    decision: str  # the metric label: a Decision, or invalid, failed, unavailable
    delay: float = 0.0  # seconds, for RETRY
    reason: str | None = None  # why an invalid message was dropped; never its content
    error: str | None = None  # what failed, for the span's error.type: a class, "abandoned"


@dataclass(frozen=True)
class Consumer:
    """One handler's way of taking messages: which inbox, what runs for a new message, where
    the identity comes from, and how soon a message given back may come again."""

    inbox: Inbox
    handler: str
    handle: Handle | ClaimHandle  # a ClaimHandle exactly when ``claiming`` is set
    key: KeyFrom
    tenant: TenantFrom
    retry_after: float = 1.0
    is_json: bool = True
    claiming: Claiming | None = None  # external-effect mode
    # Its spans' tracer, fetched once for every message this consumer takes.
    spans: tracing.DeliverySpans = field(
        default_factory=tracing.DeliverySpans, compare=False, repr=False
    )

    async def settle(self, headers: Mapping[str, str], body: bytes) -> Settled:
        """Decide one message (``headers`` with lower-case names), run ``handle`` for a new one
        in its transaction, and say what to do with the message once this returns, which is
        after COMMIT. Never raises: a message without an identity, or one the database refuses,
        is dropped with the reason; a failure of anything else is a retry. One span, linked to
        the ``traceparent`` the message carries, shows the decision and the verdict."""
        with self.spans.delivery(self.handler, headers) as span:
            settled = await self._settled(headers, body, span)
            tracing.annotate(span, _shown(settled))
            if settled.error is not None:
                tracing.failed(span, settled.error)
        return _counted(self.handler, settled)

    async def _settled(self, headers: Mapping[str, str], body: bytes, span: Any) -> Settled:
        try:
            return await self._identified(headers, body, span)
        except UNAVAILABLE as exc:
            error = type(exc).__name__
            log.warning("inbox database unavailable", handler=self.handler, error=error)
            return Settled(Verdict.RETRY, "unavailable", self.retry_after, error=error)
        except Exception as exc:  # noqa: BLE001 (a handler's bug must not stop the consumer)
            # The class only: an exception's text may quote the message.
            error = type(exc).__name__
            log.error("inbox handler failed", handler=self.handler, error=error)  # noqa: TRY400
            return Settled(Verdict.RETRY, "failed", self.retry_after, error=error)

    async def _identified(self, headers: Mapping[str, str], body: bytes, span: Any) -> Settled:
        try:
            key = self.key.read(headers, body)
            identity = identity_of(self.tenant.read(headers), self.handler, key, headers)
            tracing.annotate(span, traced(identity))
            return await self._decide(identity, body)
        except ContractBreach as exc:
            # A conflict of input: no copy of it will ever keep the contract. Dropped, and said
            # where and by which rule (never the value).
            log.warning("inbox contract violation", handler=self.handler, reason=str(exc))
            return Settled(Verdict.DROP, "contract_violation", reason=str(exc))
        except ContractUnknown as exc:  # never taken unchecked, never dropped: later
            log.warning("inbox contract unknown", handler=self.handler, reason=str(exc))
            delay = max(self.retry_after, CONTRACT_RETRY)
            return Settled(Verdict.RETRY, "contract_unknown", delay, reason=str(exc))
        except (MissingIdentity, InvalidDelivery) as exc:
            # No copy of it can ever be taken: dropped, and said why (the reasons name fields
            # and pointers, never the message's content).
            log.warning("inbox message dropped", handler=self.handler, reason=str(exc))
            return Settled(Verdict.DROP, "invalid", reason=str(exc))

    async def _decide(self, identity: Identity, body: bytes) -> Settled:
        if self.claiming is not None:
            return await self._claim(identity, body, self.claiming)
        async with self.inbox.deliver(identity, body, is_json=self.is_json) as d:
            if d.decision is Decision.NEW:
                outcome = await self._run(d, body)
                await d.complete(outcome)
                return _ran(outcome, Decision.NEW)
            return self._not_run(d.decision, d.recorded, None)

    async def _claim(self, identity: Identity, body: bytes, claiming: Claiming) -> Settled:
        """External-effect mode: the claim commits first; the outcome commits with the
        handler's writes on ``claim.transaction()``, fenced by the claim's token."""
        claim = self.inbox.claim(
            identity,
            body,
            is_json=self.is_json,
            lease=claiming.lease,
            max_claims=claiming.max_claims,
        )
        try:
            async with claim as c:
                if c.decision not in RUNS:
                    return self._not_run(c.decision, c.recorded, c.retry_after)
                try:
                    await cast(ClaimHandle, self.handle)(c, body)
                    outcome = ACCEPTED
                except Refuse as refusal:
                    await c.discard()  # a refusal keeps none of the handler's writes
                    outcome = refused(refusal)
                c.keep(outcome)
                await c.settle()
                return _ran(outcome, c.decision)
        except LeaseLost:  # reclaimed meanwhile: its owner records; this copy comes again
            log.warning("inbox lease lost", handler=self.handler)
            return Settled(Verdict.RETRY, Decision.IN_PROGRESS.value, self.retry_after)

    def _not_run(
        self, decision: Decision, recorded: Outcome | None, retry_after: timedelta | None
    ) -> Settled:
        """The verdict on a message whose handler does not run."""
        if decision is Decision.REPLAYED and recorded is not None:
            final = Verdict.ACK if recorded.status < 400 else Verdict.DROP
            return Settled(final, Decision.REPLAYED.value)
        if decision is Decision.CONFLICT:
            return Settled(Verdict.DROP, Decision.CONFLICT.value)
        if decision is Decision.ABANDONED:  # a person releases it; until then, rarely
            abandoned = Decision.ABANDONED.value
            return Settled(Verdict.RETRY, abandoned, ABANDONED_RETRY, error=abandoned)
        delay = self.retry_after  # in progress: in external mode, what is left of the lease
        if retry_after is not None:
            delay = max(self.retry_after, retry_after.total_seconds())
        return Settled(Verdict.RETRY, Decision.IN_PROGRESS.value, delay)

    async def _run(self, d: Delivery, body: bytes) -> Outcome:
        if d.conn is None:  # a new delivery always holds its transaction
            raise RuntimeError("a new delivery without its connection")
        try:
            # A savepoint: a refusal undoes what the handler wrote before it.
            async with d.conn.transaction():
                await cast(Handle, self.handle)(d, body)
        except Refuse as refusal:
            return refused(refusal)
        return ACCEPTED


def refused(refusal: Refuse) -> Outcome:
    """A refusal as recorded: its words, bounded."""
    return Outcome(REFUSED_STATUS, (), str(refusal).encode()[:65536])


def _ran(outcome: Outcome, decision: Decision) -> Settled:
    """The verdict on a message whose handler ran and whose outcome committed."""
    return Settled(Verdict.ACK if outcome is ACCEPTED else Verdict.DROP, decision.value)


def _shown(settled: Settled) -> tracing.Attributes:
    """What a message's span shows of its settlement."""
    shown: dict[str, str | int] = {
        "outbox.inbox.decision": settled.decision,
        "outbox.inbox.verdict": settled.verdict.value,
    }
    if settled.reason is not None:
        shown["outbox.inbox.reason"] = settled.reason
    return shown


def _counted(handler: str, settled: Settled) -> Settled:
    meters.DELIVERIES.labels(handler, settled.decision).inc()
    return settled


def lower(headers: Mapping[str, str] | None) -> dict[str, str]:
    return {name.lower(): value for name, value in (headers or {}).items()}


def message_key(id_header: str) -> KeyFrom:
    """outbox's identity when the message has it (``KeyFrom.auto``), else the broker's or the
    publisher's message id, read from ``id_header`` (lower-case): ``msg:<id>``."""
    auto = KeyFrom.auto()

    def read(headers: Mapping[str, str], body: bytes) -> str | None:
        found = auto.source(headers, body)
        if found is None and (message_id := headers.get(id_header)):
            return f"msg:{message_id}"
        return found

    return KeyFrom(read)


class Options(TypedDict, total=False):
    """What a broker's ``consumer_of`` takes besides the inbox, the handler's name and the
    handler: how soon a message given back may come again, where its identity comes from, and
    external-effect mode."""

    retry_after: float
    key: KeyFrom | None
    tenant: TenantFrom | None
    claiming: Claiming | None


def consumer_with(
    id_header: str,
    inbox: Inbox,
    handler: str,
    handle: Handle | ClaimHandle,
    **options: Unpack[Options],
) -> Consumer:
    """A Consumer whose key defaults to :func:`message_key` of ``id_header``."""
    return Consumer(
        inbox,
        handler,
        handle,
        options.get("key") or message_key(id_header),
        options.get("tenant") or TenantFrom.header(),
        options.get("retry_after", 1.0),
        claiming=options.get("claiming"),
    )

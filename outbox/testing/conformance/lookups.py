"""Checks of a provider's lookup (``Lookup``), which the reconciler trusts to decide.

A ``NotFound(complete=True)`` is proof that the effect does not exist: a person may then send
the operation again under a new key. So a lookup must find an effect that exists, and when it
could not look (a 5xx, a timeout, a refused connection) or the API no longer holds what it would
look by (the key forgotten after its retention), it raises or answers ``NotFound(complete=False)``.
"""

from __future__ import annotations

from datetime import UTC, datetime

from outbox.providers.base import Found, Lookup, NotFound, Provider, Succeeded, asks
from outbox.testing.conformance.calls import (
    GRACE,
    Called,
    describe,
    fresh_provider,
    new_key,
    send,
    timed,
)
from outbox.testing.conformance.harness import Harness, LookupFault, LookupHarness, Unsupported
from outbox.testing.conformance.results import Findings, check

_PROOF = (
    "outbox needs it to raise or answer NotFound(complete=False): a complete NotFound is proof "
    "of absence, and lets a person send the operation again, making a second effect"
)


def _lookup_harness(harness: Harness) -> LookupHarness:
    if not isinstance(harness, LookupHarness):
        raise Unsupported("the harness makes no lookups (it has no lookup_request/arm_lookup)")
    return harness


def _lookup_of(provider: Provider, action: str) -> Lookup:
    if not isinstance(provider, Lookup):
        raise Unsupported(f"{type(provider).__name__} implements no Lookup")
    if not asks(provider, action):  # an `http` provider whose action has no lookup
        raise Unsupported(f"{type(provider).__name__} has no lookup for {action!r}")
    return provider


async def _looked_up(
    harness: LookupHarness, findings: Findings, fault: LookupFault | None
) -> tuple[str, Called[Found | NotFound]]:
    """Send a fresh operation (it must succeed), arm ``fault``, look the operation up: the key
    and the lookup's call."""
    key = new_key(fault.name.lower() if fault else "lookup")
    first_sent_at = datetime.now(UTC)
    async with fresh_provider(harness, findings) as provider:
        request = harness.send_request(key, 1)
        lookup = _lookup_of(provider, request.action)
        sent = await send(provider, request, harness)
        if not isinstance(sent.answer, Succeeded):
            shown = sent.problem or describe(sent.answer)
            raise Unsupported(f"the send a lookup needs did not succeed ({shown})")
        if fault is not None and not harness.arm_lookup(fault):
            raise Unsupported(f"the harness cannot make {fault.name} ({fault.value})")
        wanted = harness.lookup_request(request, first_sent_at, datetime.now(UTC))
        try:
            called = await timed(lookup.lookup(wanted), harness.timeout + GRACE, "lookup")
        finally:
            harness.restore()
    return key, called


@check
async def lookup_finds_the_effect(harness: Harness, findings: Findings) -> None:
    """A lookup of an operation whose effect exists at the fake finds it."""
    key, called = await _looked_up(_lookup_harness(harness), findings, None)
    answer = called.answer
    if called.problem is not None:
        findings.fail(f"the lookup of an operation that succeeded: {called.problem}")
    elif not isinstance(answer, Found):
        findings.fail(
            f"the lookup of {key!r}, whose effect exists at the fake, answered "
            f"{describe(answer)}; outbox needs Found: reconciliation is what the lookup is for"
        )
    findings.judged()


async def _proves_nothing(harness: Harness, findings: Findings, fault: LookupFault) -> None:
    key, called = await _looked_up(_lookup_harness(harness), findings, fault)
    answer = called.answer
    if called.hung:
        findings.fail(f"when the fake was told to {fault.value}: {called.problem}")
    elif called.problem is not None:
        findings.note(f"the lookup {called.problem.removeprefix('lookup ')}, as it may")
    elif isinstance(answer, NotFound) and answer.complete:
        findings.fail(
            f"when the fake was told to {fault.value}, the lookup of {key!r} (whose effect "
            f"exists) answered {describe(answer)}; {_PROOF}"
        )
    elif answer is not None and not isinstance(answer, Found | NotFound):
        findings.fail(f"the lookup answered {describe(answer)}, not Found or NotFound")
    findings.judged()


@check
async def lookup_on_error_proves_nothing(harness: Harness, findings: Findings) -> None:
    """A 5xx to the lookup: it raises or answers an incomplete NotFound."""
    await _proves_nothing(harness, findings, LookupFault.ERROR)


@check
async def lookup_on_timeout_proves_nothing(harness: Harness, findings: Findings) -> None:
    """No answer to the lookup in time: it raises or answers an incomplete NotFound."""
    await _proves_nothing(harness, findings, LookupFault.TIMEOUT)


@check
async def lookup_on_refused_proves_nothing(harness: Harness, findings: Findings) -> None:
    """A refused connection: the lookup raises or answers an incomplete NotFound."""
    await _proves_nothing(harness, findings, LookupFault.REFUSED)


@check
async def lookup_after_forgotten_key_proves_nothing(harness: Harness, findings: Findings) -> None:
    """After the API forgot the key (its retention passed), a lookup by key must not claim a
    complete search: it finds the effect some other way, raises, or says it is incomplete."""
    await _proves_nothing(harness, findings, LookupFault.FORGOTTEN_KEY)

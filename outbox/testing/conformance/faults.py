"""Checks that every failure is classified as outbox's promise needs.

The rule behind them: a request that never left this host (a refused connection) is TRANSIENT;
one the API may have acted on is UNKNOWN, never TRANSIENT, since a TRANSIENT answer says "nothing
happened" and lets outbox retry outside the key window, where the API has forgotten the key and
acts a second time. A fault that struck before the fake acted may be either: the provider cannot
tell it from one after, and both keep the promise. Refused credentials pause the provider; a
refusal the API documents as final is PERMANENT; a 429 is TRANSIENT with its Retry-After.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from outbox.core.model import FailureClass
from outbox.providers.base import Failed, Succeeded
from outbox.testing.conformance.calls import Called, Wire, describe, fresh_provider, new_key, send
from outbox.testing.conformance.harness import RETRY_AFTER_SECONDS, Fault, Harness, Unsupported
from outbox.testing.conformance.results import Findings, check

TRANSIENT: Final = frozenset({FailureClass.TRANSIENT})
UNKNOWN: Final = frozenset({FailureClass.UNKNOWN})
EITHER: Final = frozenset({FailureClass.TRANSIENT, FailureClass.UNKNOWN})
PERMANENT: Final = frozenset({FailureClass.PERMANENT})
_MAY_HAVE_ACTED: Final = (
    "the API may have acted, and a TRANSIENT answer lets outbox retry outside the key window, "
    "where a forgotten key makes a second effect"
)


def arm_or_skip(harness: Harness, fault: Fault, key: str) -> None:
    if not harness.arm(fault, key):
        raise Unsupported(f"the harness cannot make {fault.name} ({fault.value})")


def judge_call(
    harness: Harness, findings: Findings, fault: Fault, key: str, called: Called[Succeeded | Failed]
) -> Failed | None:
    """The Failed a send under ``fault`` answered, or None after noting why there is none;
    also whether the fake made the fault as described (else the check proves nothing)."""
    effects = _optional_effects(harness, key)
    wanted = 1 if fault.acts else 0
    if effects is not None and effects != wanted:
        findings.fail(
            f"the harness's fake made {effects} effects under {fault.name}, which should make "
            f"{wanted} ({fault.value}): a harness bug, and the check proves nothing"
        )
    if called.problem is not None:
        findings.fail(f"when the fake was told to {fault.value}: {called.problem}")
        return None
    if not isinstance(called.answer, Failed):
        findings.fail(
            f"when the fake was told to {fault.value}, send answered {describe(called.answer)}; "
            "outbox needs a Failed (outbox owns retries, with the stored key)"
        )
        return None
    findings.judged()
    return called.answer


def _optional_effects(harness: Harness, key: str) -> int | None:
    try:
        return harness.effects(key)
    except Unsupported:
        return None


def needs(
    findings: Findings,
    fault: Fault,
    failed: Failed | None,
    allowed: frozenset[FailureClass],
    why: str,
) -> None:
    """``failed`` must be of a class in ``allowed``; a pause only for refused credentials."""
    if failed is None:
        return
    if failed.failure not in allowed:
        names = " or ".join(sorted(c.name for c in allowed))
        findings.fail(
            f"when the fake was told to {fault.value}, send answered {describe(failed)}; "
            f"outbox needs {names}: {why}"
        )
    if failed.pause and fault is not Fault.CREDENTIALS_REFUSED:
        findings.fail(
            f"under {fault.name} send answered pause=True, which says the credentials are "
            "refused: outbox would open the breaker (reason credentials) for every operation"
        )
    if fault.acts and not failed.spends_attempt:
        findings.fail(
            f"under {fault.name} send answered spends_attempt=False, which says the API did not "
            "act; it did"
        )


async def classified(harness: Harness, findings: Findings, fault: Fault) -> Failed | None:
    """Attempt 1 of a fresh operation with ``fault`` armed; the Failed it answered."""
    key = new_key(fault.name.lower())
    arm_or_skip(harness, fault, key)
    async with fresh_provider(harness, findings) as provider:
        wire = Wire(harness)
        try:
            called = await send(provider, harness.send_request(key, 1), harness)
        finally:
            harness.restore()
    failed = judge_call(harness, findings, fault, key, called)
    if failed is not None and failed.not_sent and wire.since():
        findings.fail(
            f"under {fault.name} send answered not_sent=True, but the request reached the fake: "
            "outbox would start no key window for a request the API saw"
        )
    return failed


@check
async def refused_connection_is_transient(harness: Harness, findings: Findings) -> None:
    """A refused connection sent nothing: TRANSIENT, so that no key window starts."""
    failed = await classified(harness, findings, Fault.REFUSED)
    why = "nothing was sent, and an UNKNOWN starts a key window that ends in reconciliation"
    needs(findings, Fault.REFUSED, failed, TRANSIENT, why)


@check
async def reset_before_acting_is_retried(harness: Harness, findings: Findings) -> None:
    """A reset after the request left: TRANSIENT or UNKNOWN (nothing acted here, but the
    provider cannot know that), never PERMANENT."""
    failed = await classified(harness, findings, Fault.RESET_BEFORE_ACTING)
    why = "a reset says nothing final; PERMANENT quarantines an operation a retry would do"
    needs(findings, Fault.RESET_BEFORE_ACTING, failed, EITHER, why)


@check
async def reset_after_acting_is_unknown(harness: Harness, findings: Findings) -> None:
    """A reset after the API acted: UNKNOWN."""
    failed = await classified(harness, findings, Fault.RESET_AFTER_ACTING)
    needs(findings, Fault.RESET_AFTER_ACTING, failed, UNKNOWN, _MAY_HAVE_ACTED)


@check
async def timeout_after_acting_is_unknown(harness: Harness, findings: Findings) -> None:
    """No answer within the provider's timeout after the API acted: UNKNOWN, and in time."""
    failed = await classified(harness, findings, Fault.TIMEOUT_AFTER_ACTING)
    needs(findings, Fault.TIMEOUT_AFTER_ACTING, failed, UNKNOWN, _MAY_HAVE_ACTED)


@check
async def error_after_acting_is_unknown(harness: Harness, findings: Findings) -> None:
    """A 5xx after the API acted: UNKNOWN."""
    failed = await classified(harness, findings, Fault.ERROR_AFTER_ACTING)
    needs(findings, Fault.ERROR_AFTER_ACTING, failed, UNKNOWN, _MAY_HAVE_ACTED)


@check
async def unavailable_before_acting_is_retried(harness: Harness, findings: Findings) -> None:
    """A 503 without acting: TRANSIENT or UNKNOWN (a gateway may answer 503 after the API
    acted), never PERMANENT."""
    failed = await classified(harness, findings, Fault.UNAVAILABLE_BEFORE_ACTING)
    why = "a 503 says to come back later; PERMANENT quarantines an operation a retry would do"
    needs(findings, Fault.UNAVAILABLE_BEFORE_ACTING, failed, EITHER, why)


@check
async def rate_limit_is_transient_with_retry_after(harness: Harness, findings: Findings) -> None:
    """A 429 with Retry-After: TRANSIENT, with ``retry_after`` at least what the API asked."""
    failed = await classified(harness, findings, Fault.RATE_LIMITED)
    why = "the API said it did not act and when to come back"
    needs(findings, Fault.RATE_LIMITED, failed, TRANSIENT, why)
    least = timedelta(seconds=RETRY_AFTER_SECONDS)
    if failed is not None and (failed.retry_after is None or failed.retry_after < least):
        findings.fail(
            f"for a 429 with Retry-After: {RETRY_AFTER_SECONDS} send answered retry_after="
            f"{failed.retry_after}; outbox needs at least {least}: it is the backoff's floor "
            "and empties the provider's rate bucket for that long"
        )


@check
async def key_in_use_is_retried(harness: Harness, findings: Findings) -> None:
    """A 409 (a request with this key still in progress): TRANSIENT or UNKNOWN, never
    PERMANENT, since the request in progress may yet succeed."""
    failed = await classified(harness, findings, Fault.KEY_IN_USE)
    why = "the earlier attempt with this key is still running; PERMANENT quarantines it"
    needs(findings, Fault.KEY_IN_USE, failed, EITHER, why)


@check
async def refused_credentials_pause(harness: Harness, findings: Findings) -> None:
    """A 401: ``pause=True``, so the breaker opens (reason credentials) and no operation spends
    an attempt or lands in quarantine while the credentials are wrong."""
    failed = await classified(harness, findings, Fault.CREDENTIALS_REFUSED)
    if failed is not None and not failed.pause:
        findings.fail(
            f"for a 401 send answered {describe(failed)}; outbox needs pause=True: every "
            "operation would fail the same way, so the provider pauses instead"
        )


@check
async def permanent_refusal_is_permanent(harness: Harness, findings: Findings) -> None:
    """A refusal the API documents as final: PERMANENT, so the operation is quarantined
    instead of retried until its attempts run out."""
    failed = await classified(harness, findings, Fault.PERMANENT_REFUSAL)
    why = "no attempt will ever succeed, and a person needs to see it"
    needs(findings, Fault.PERMANENT_REFUSAL, failed, PERMANENT, why)


@check
async def undecodable_answer_is_unknown(harness: Harness, findings: Findings) -> None:
    """An answer that cannot be decoded, after the API acted: UNKNOWN."""
    failed = await classified(harness, findings, Fault.UNDECODABLE_ANSWER)
    needs(findings, Fault.UNDECODABLE_ANSWER, failed, UNKNOWN, _MAY_HAVE_ACTED)

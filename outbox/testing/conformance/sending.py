"""Checks of what every send carries and survives: the stored key on every attempt, no
exception out of ``send`` for odd but valid requests, and ``check`` refusing only with
InvalidRequest."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any, Final

from outbox.core import payloads
from outbox.providers.base import Failed, InvalidRequest, Provider, SendRequest, Succeeded
from outbox.testing.conformance.calls import Wire, describe, fresh_provider, new_key, send
from outbox.testing.conformance.harness import Fault, Harness
from outbox.testing.conformance.results import Findings, check

# A key as outbox may make one: every visible ASCII character is allowed (a quote and a
# backslash need escaping in some headers), and ":r2" ends a second key generation's.
_ODD_KEY_TAIL: Final = '"q"\\b:r2'
# Faults that act and leave a retry something to replay, in the order they are tried.
_ACTED: Final = (Fault.RESET_AFTER_ACTING, Fault.TIMEOUT_AFTER_ACTING, Fault.ERROR_AFTER_ACTING)
# Big but under outbox's default max_payload_bytes (1 MiB).
_PADDING: Final = 900_000


@check
async def same_key_on_every_attempt(harness: Harness, findings: Findings) -> None:
    """Attempts 1 to 3 of one operation, then attempts after a fault that acted: the fake must
    receive the stored key, as it is, on every attempt, and apply exactly one effect."""
    harness.effects(new_key("probe"))  # Unsupported: nothing here can be judged
    key = new_key("same") + _ODD_KEY_TAIL
    async with fresh_provider(harness, findings) as provider:
        wire = Wire(harness)
        for attempt in (1, 2, 3):
            called = await send(provider, harness.send_request(key, attempt), harness)
            if called.problem is not None:
                findings.fail(f"attempt {attempt}: {called.problem}")
                return
            if not isinstance(called.answer, Succeeded):
                findings.fail(
                    f"attempt {attempt} of a request that succeeded answered "
                    f"{describe(called.answer)}; outbox needs the replay to succeed again"
                )
        _judge_keys(findings, harness, key, wire.since(), "three attempts")
    await _after_a_fault(harness, findings)


async def _after_a_fault(harness: Harness, findings: Findings) -> None:
    key = new_key("retry")
    fault = next((f for f in _ACTED if harness.arm(f, key)), None)
    if fault is None:
        findings.skip("the harness can make none of the faults that act: " + _names(_ACTED))
        return
    async with fresh_provider(harness, findings) as provider:
        wire = Wire(harness)
        try:
            first = await send(provider, harness.send_request(key, 1), harness)
        finally:
            harness.restore()
        for attempt in (2, 3):
            again = await send(provider, harness.send_request(key, attempt), harness)
            if again.problem is not None:
                findings.fail(f"attempt {attempt} after {fault.name}: {again.problem}")
        if first.problem is not None:
            findings.fail(f"attempt 1 under {fault.name}: {first.problem}")
        _judge_keys(findings, harness, key, wire.since(), f"attempts 1 to 3 around {fault.name}")


def _judge_keys(
    findings: Findings, harness: Harness, key: str, keys: list[str | None] | None, what: str
) -> None:
    if keys is not None and (len(keys) < 3 or any(k != key for k in keys)):
        findings.fail(
            f"for {what} carrying {key!r} the fake received the keys {keys!r}; outbox needs the "
            "stored key, exactly as it is, on every attempt (the key is what makes a retry safe)"
        )
    effects = harness.effects(key)
    if effects != 1:
        findings.fail(
            f"after {what} of one operation the fake holds {effects} effects under its key; "
            "outbox needs exactly one: every attempt carries that key, so the API applies it once"
        )
    findings.judged()


def _names(faults: tuple[Fault, ...]) -> str:
    return ", ".join(f.name for f in faults)


@check
async def send_never_raises(harness: Harness, findings: Findings) -> None:
    """Odd but valid requests (a payload near outbox's size limit, non-ASCII identities, an
    unknown action) each get a Succeeded or a Failed, never an exception: an exception is
    recorded as an unknown attempt (``provider_error``) and retried until the key window ends."""
    async with fresh_provider(harness, findings) as provider:
        for what, request in _odd_requests(harness):
            await _sends_a_result(provider, harness, findings, what, request)
        unknown = harness.unknown_action()
        if unknown is None:
            findings.skip("every action is valid to this provider (unknown_action() is None)")
            return
        request = dataclasses.replace(harness.send_request(new_key("unknown"), 1), action=unknown)
        called = await send(provider, request, harness)
        if called.problem is not None:
            findings.fail(f"for the unknown action {unknown!r}: {called.problem}")
        elif not isinstance(called.answer, Failed):
            findings.fail(
                f"for the unknown action {unknown!r} send answered {describe(called.answer)}; "
                "outbox needs a Failed (permanent: no attempt will ever do it)"
            )
        findings.judged()


async def _sends_a_result(
    provider: Provider, harness: Harness, findings: Findings, what: str, request: SendRequest
) -> None:
    called = await send(provider, request, harness)
    if called.problem is not None:
        findings.fail(f"for {what}: {called.problem}; outbox needs a Succeeded or a Failed")
    findings.judged()


def _odd_requests(harness: Harness) -> Iterator[tuple[str, SendRequest]]:
    def base(tag: str) -> SendRequest:
        return harness.send_request(new_key(tag), 1)

    big = base("big")
    padded = {**big.payload, "conformance_padding": "x" * _PADDING}
    text = None if big.payload_json is None else payloads.encode(padded)
    yield (
        "a payload of 900,000 characters",
        dataclasses.replace(big, payload=padded, payload_json=text),
    )
    yield "a non-ASCII tenant", dataclasses.replace(base("tenant"), tenant_id=" Zürich 客户 🙂")
    yield "a non-ASCII action", dataclasses.replace(base("action"), action="paiement.reçu.🙂")
    yield (
        "a non-ASCII operation key and correlation id",
        dataclasses.replace(base("ids"), operation_key="clé 🙂", correlation_id="corrélation 50%"),
    )


@check
async def check_raises_only_invalid_request(harness: Harness, findings: Findings) -> None:
    """``check(action, payload)`` accepts the valid request and, for odd actions and payloads,
    returns or raises InvalidRequest: outbox quarantines any other exception as its own bug
    (``internal_error``), not as the operation's."""
    valid = harness.send_request(new_key("check"), 1)
    async with fresh_provider(harness, findings) as provider:
        try:
            provider.check(valid.action, valid.payload)
        except Exception as exc:  # noqa: BLE001 (named in the verdict)
            findings.fail(
                f"check refused the harness's valid request with {type(exc).__name__}: {exc}"
            )
        for action in _actions(provider, harness, valid.action):
            for payload in _odd_payloads(valid.payload):
                _checks_cleanly(provider, findings, action, payload)
        findings.judged()


def _checks_cleanly(
    provider: Provider, findings: Findings, action: str, payload: Mapping[str, Any]
) -> None:
    try:
        provider.check(action, payload)
    except InvalidRequest:
        pass
    except Exception as exc:  # noqa: BLE001 (named in the verdict)
        shown = repr(dict(payload))[:120]
        findings.fail(
            f"check({action!r}, {shown}) raised {type(exc).__name__}; outbox needs "
            "InvalidRequest (or nothing)"
        )


def _actions(provider: Provider, harness: Harness, valid: str) -> list[str]:
    declared = getattr(provider, "actions", None)
    known = sorted(str(a) for a in declared) if declared else []
    unknown = harness.unknown_action()
    return [valid, *known, *([unknown] if unknown else []), "", "paiement.reçu.🙂", "x" * 300]


def _odd_payloads(valid: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    fields = list(valid) or ["id"]
    odd_values: list[Any] = [None, "", [], {}, 0, -1, 10**99, Decimal("1E-7"), True, "é" * 600]
    return [
        {},
        *({**valid, name: value} for name in fields for value in odd_values),
        {**valid, "metadata": {str(n): "v" for n in range(60)}},
        {**valid, "id": "x" * 10_000},
        {**valid, "stripe_account": "acct_1"},
        {**valid, "": "", "with space é": "\u2028"},
        {**valid, "nested": [[[[[{}]]]]]},
    ]

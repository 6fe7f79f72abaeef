"""How the checks call a provider: as the dispatcher does, under its timeout plus a grace, with
every exception caught and named, and every answer described in one line for the messages."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Generic, TypeVar

from outbox.providers.base import Failed, Found, NotFound, Provider, SendRequest, Succeeded
from outbox.testing.conformance.harness import Harness, Unsupported
from outbox.testing.conformance.results import Findings

# The dispatcher gives a call its provider's timeout plus this many seconds, then records it as
# unknown (docs/design.md, "Claim protocol"): a provider that needs more is broken.
GRACE = 5.0

T = TypeVar("T")


def new_key(tag: str) -> str:
    """A fresh idempotency key, shaped like outbox's own (``ob1_...``)."""
    return f"ob1_conformance_{tag}_{secrets.token_hex(6)}"


@asynccontextmanager
async def fresh_provider(harness: Harness, findings: Findings) -> AsyncIterator[Provider]:
    """A provider from the harness, closed afterwards; a close that raises or hangs is a
    problem (the daemon closes every provider at shutdown)."""
    provider = harness.provider()
    try:
        yield provider
    finally:
        try:
            await asyncio.wait_for(provider.aclose(), harness.timeout + GRACE)
        except Exception as exc:  # noqa: BLE001 (reported, not raised)
            findings.fail(f"aclose() raised {_name(exc)}; outbox needs it to close quietly")


@dataclass(frozen=True, slots=True)
class Called(Generic[T]):
    """A call's answer, or ``problem`` (it raised, hung, or answered the wrong type)."""

    answer: T | None
    problem: str | None
    seconds: float
    raised: BaseException | None = None
    hung: bool = False


async def timed(call: Awaitable[T], limit: float, what: str) -> Called[T]:
    """``call`` under ``limit`` seconds, its exception caught (``raised``; ``hung`` when the
    limit ran out, as opposed to the call raising a TimeoutError of its own)."""
    started = time.monotonic()
    deadline = asyncio.timeout(limit)
    try:
        async with deadline:
            answer = await call
    except Exception as exc:  # noqa: BLE001 (named in the verdict)
        spent = time.monotonic() - started
        if deadline.expired():
            return Called(None, f"{what} did not return within {limit:g} s", spent, exc, hung=True)
        return Called(None, f"{what} raised {_name(exc)}", spent, exc)
    return Called(answer, None, time.monotonic() - started)


async def send(
    provider: Provider, request: SendRequest, harness: Harness
) -> Called[Succeeded | Failed]:
    """``provider.send(request)`` as the dispatcher makes it; an answer other than Succeeded or
    Failed is a problem too."""
    called = await timed(provider.send(request), harness.timeout + GRACE, "send")
    if called.problem is None and not isinstance(called.answer, Succeeded | Failed):
        problem = f"send returned {type(called.answer).__name__}, not Succeeded or Failed"
        return Called(None, problem, called.seconds)
    return called


def describe(answer: object) -> str:
    """One line of what a provider answered, with the fields outbox acts on."""
    if isinstance(answer, Failed):
        flags = [
            f"error_class={answer.error_class!r}",
            *(f"{flag}=True" for flag in _FLAGS if getattr(answer, flag)),
            *([] if answer.spends_attempt else ["spends_attempt=False"]),
            *([] if answer.retry_after is None else [f"retry_after={answer.retry_after}"]),
        ]
        return f"Failed({answer.failure.name}, {', '.join(flags)})"
    if isinstance(answer, Succeeded):
        return f"Succeeded(reference={answer.reference!r})"
    if isinstance(answer, NotFound):
        return f"NotFound(complete={answer.complete}, sources={answer.sources!r})"
    if isinstance(answer, Found):
        return f"Found(reference={answer.reference!r}, verdict={answer.verdict.name})"
    return repr(answer)[:200]


_FLAGS = ("pause", "pause_action", "reconcile", "request_only", "not_sent")


def _name(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}({text[:160]!r})" if text else type(exc).__name__


def optional(read: Callable[[], T]) -> T | None:
    """What ``read`` gives, or None when the harness cannot tell (Unsupported)."""
    try:
        return read()
    except Unsupported:
        return None


class Wire:
    """The keys the fake received from a mark on (None when the harness cannot see them)."""

    def __init__(self, harness: Harness) -> None:
        self._harness = harness
        start = optional(harness.keys_received)
        self._start = None if start is None else len(start)

    def since(self) -> list[str | None] | None:
        if self._start is None:
            return None
        return list(self._harness.keys_received()[self._start :])

"""Checks that a provider reads an answer within bounds: a huge answer or a gzip bomb after the
API acted ends, within a couple of seconds, as a Failed UNKNOWN, and never sits in memory whole.

Memory is measured one of two ways, and the result says which. A provider with a ``tally``
(outbox's ``answers.Tally``: ``most_wire`` and ``most_decoded``, the largest answer's bytes as
received and as decoded) is judged by it: exact, and blind to everything else in the process.
Otherwise by ``tracemalloc``'s peak during the send; the fake shares the process, so only the
gzip bomb is judged that way (a bomb's wire is a thousandth of what it decodes to, so the peak
shows what the provider decoded), and the plain huge answer, whose bytes the fake itself holds,
is judged by time and class alone.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from outbox.providers.base import Provider
from outbox.testing.conformance.calls import fresh_provider, new_key, send
from outbox.testing.conformance.faults import UNKNOWN, arm_or_skip, judge_call, needs
from outbox.testing.conformance.harness import Fault, Harness
from outbox.testing.conformance.results import Findings, check

# "Within a couple of seconds": an answer past its cap is given up on, not read to its end.
ANSWER_SECONDS: Final = 2.0
# What reading past the cap may add: one decompression step (outbox reads 64 KiB at a time).
_STEP: Final = 64 * 1024
# What else a send may allocate under tracemalloc: the client's buffers, the fake's bomb.
_TRACED_OVERHEAD: Final = 32 << 20


@dataclass(slots=True)
class _Memory:
    """The most bytes of one answer the provider held, and how that was measured."""

    how: str = ""
    held: int | None = None
    bound: int = 0


@check
async def huge_answer_is_bounded(harness: Harness, findings: Findings) -> None:
    """An answer far over ``max_response_bytes`` after the API acted."""
    await _bounded(harness, findings, Fault.HUGE_ANSWER)


@check
async def gzip_bomb_is_bounded(harness: Harness, findings: Findings) -> None:
    """A gzip answer that decodes to a gibibyte after the API acted."""
    await _bounded(harness, findings, Fault.GZIP_BOMB)


async def _bounded(harness: Harness, findings: Findings, fault: Fault) -> None:
    key = new_key(fault.name.lower())
    arm_or_skip(harness, fault, key)
    memory = _Memory()
    async with fresh_provider(harness, findings) as provider:
        try:
            with _measured(provider, harness, fault, memory):
                called = await send(provider, harness.send_request(key, 1), harness)
        finally:
            harness.restore()
    failed = judge_call(harness, findings, fault, key, called)
    needs(findings, fault, failed, UNKNOWN, "the API acted and answered; only reading it failed")
    if called.seconds > ANSWER_SECONDS:
        findings.fail(
            f"the send under {fault.name} took {called.seconds:.1f} s; outbox needs the answer "
            f"given up on past its cap within {ANSWER_SECONDS:g} s, not read to its end"
        )
    _judge_memory(findings, fault, memory)


def _judge_memory(findings: Findings, fault: Fault, memory: _Memory) -> None:
    if memory.held is None:
        findings.note(f"memory not judged: {memory.how}")
        return
    if memory.held > memory.bound:
        findings.fail(
            f"under {fault.name} the provider held {memory.held} bytes of one answer (by "
            f"{memory.how}); outbox needs at most about max_response_bytes ({memory.bound}): "
            "a compression bomb once took the dispatcher to 12.6 GB"
        )
    else:
        findings.note(f"memory judged by {memory.how}: {memory.held} bytes at most")


@contextmanager
def _measured(
    provider: Provider, harness: Harness, fault: Fault, memory: _Memory
) -> Iterator[None]:
    tally = getattr(provider, "tally", None)
    if _most(tally, "most_decoded") is not None:
        memory.how, memory.bound = "the provider's tally", 2 * harness.max_response_bytes + _STEP
        yield
        memory.held = max(_most(tally, "most_wire") or 0, _most(tally, "most_decoded") or 0)
        return
    if fault is not Fault.GZIP_BOMB:
        memory.how = "the provider has no tally, and tracemalloc would count the fake's copy"
        yield
        return
    memory.how = "tracemalloc's peak during the send"
    memory.bound = 8 * harness.max_response_bytes + _TRACED_OVERHEAD
    started = not tracemalloc.is_tracing()
    if started:
        tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    try:
        yield
        memory.held = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started:
            tracemalloc.stop()


def _most(tally: object, field: str) -> int | None:
    """A count of the tally (outbox.providers.answers.Tally), or None when it has none."""
    value = getattr(tally, field, None)
    return value if isinstance(value, int) else None

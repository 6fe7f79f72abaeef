"""What a check found, and the report of a whole run.

A check passes, fails with a message saying what the provider did and what outbox needs instead,
or is skipped with the reason (the harness cannot make a fault, the provider has no lookup): a
skip is never counted as a pass.
"""

from __future__ import annotations

import asyncio
import enum
import functools
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from outbox.testing.conformance.harness import Harness, Unsupported


class Outcome(enum.StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True, slots=True)
class Result:
    """One check's verdict; ``message`` is the failure, the skip's reason, or notes on a pass
    (parts skipped, how memory was measured)."""

    check: str
    outcome: Outcome
    message: str = ""

    def __str__(self) -> str:
        return f"{self.outcome.upper()} {self.check}" + (
            f": {self.message}" if self.message else ""
        )


@dataclass(frozen=True, slots=True)
class Report:
    """Every check's result for one harness."""

    harness: str
    results: tuple[Result, ...]

    def of(self, outcome: Outcome) -> tuple[Result, ...]:
        return tuple(r for r in self.results if r.outcome is outcome)

    @property
    def failures(self) -> tuple[Result, ...]:
        return self.of(Outcome.FAILED)

    @property
    def ok(self) -> bool:
        return not self.failures

    def __str__(self) -> str:
        counts = ", ".join(f"{len(self.of(o))} {o}" for o in Outcome)
        lines = [f"conformance of {self.harness}: {counts}", *(f"  {r}" for r in self.results)]
        return "\n".join(lines)


@dataclass(slots=True)
class Findings:
    """What one check collects as it goes: problems (any fails it), notes, and parts skipped."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    parts: int = 0  # parts that ran to a verdict

    def fail(self, message: str) -> None:
        self.problems.append(message)

    def note(self, message: str) -> None:
        self.notes.append(message)

    def skip(self, reason: str) -> None:
        self.skipped.append(reason)

    def judged(self) -> None:
        self.parts += 1

    def result(self, check: str) -> Result:
        if self.problems:
            return Result(check, Outcome.FAILED, "; ".join(self.problems))
        if not self.parts:
            return Result(check, Outcome.SKIPPED, "; ".join(self.skipped) or "nothing to check")
        told = [*self.notes, *(f"part skipped: {reason}" for reason in self.skipped)]
        return Result(check, Outcome.PASSED, "; ".join(told))


Check = Callable[[Harness], Result]
Body = Callable[[Harness, Findings], Coroutine[Any, Any, None]]


def check(body: Body) -> Check:
    """A synchronous check from its async body: each call runs the body in an event loop of its
    own (``asyncio.run``), so a plain test can call it, and no provider outlives its loop.
    ``Unsupported`` from anywhere in the body skips what is left of it."""

    @functools.wraps(body)
    def run_check(harness: Harness) -> Result:
        _refuse_a_running_loop()
        findings = Findings()
        try:
            asyncio.run(body(harness, findings))
        except Unsupported as exc:
            findings.skip(str(exc) or type(exc).__name__)
        except Exception as exc:  # noqa: BLE001 (a broken harness is a verdict, not a crash)
            findings.fail(
                f"the check stopped on {type(exc).__name__}: {exc} (raised by the harness, or by "
                "the provider where outbox does not expect an exception)"
            )
        return findings.result(body.__name__)

    return run_check


def _refuse_a_running_loop() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise RuntimeError(
        "a conformance check runs an event loop of its own: call it from synchronous code "
        "(from async code: await asyncio.to_thread(check, harness))"
    )

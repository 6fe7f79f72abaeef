"""The whole suite: every check in order, a report, and an assertion listing every failure."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from outbox.testing.conformance.answers import gzip_bomb_is_bounded, huge_answer_is_bounded
from outbox.testing.conformance.faults import (
    error_after_acting_is_unknown,
    key_in_use_is_retried,
    permanent_refusal_is_permanent,
    rate_limit_is_transient_with_retry_after,
    refused_connection_is_transient,
    refused_credentials_pause,
    reset_after_acting_is_unknown,
    reset_before_acting_is_retried,
    timeout_after_acting_is_unknown,
    unavailable_before_acting_is_retried,
    undecodable_answer_is_unknown,
)
from outbox.testing.conformance.harness import Harness
from outbox.testing.conformance.lookups import (
    lookup_after_forgotten_key_proves_nothing,
    lookup_finds_the_effect,
    lookup_on_error_proves_nothing,
    lookup_on_refused_proves_nothing,
    lookup_on_timeout_proves_nothing,
)
from outbox.testing.conformance.results import Check, Report
from outbox.testing.conformance.sending import (
    check_raises_only_invalid_request,
    same_key_on_every_attempt,
    send_never_raises,
)

CHECKS: Final[tuple[Check, ...]] = (
    same_key_on_every_attempt,
    refused_connection_is_transient,
    reset_before_acting_is_retried,
    reset_after_acting_is_unknown,
    timeout_after_acting_is_unknown,
    error_after_acting_is_unknown,
    unavailable_before_acting_is_retried,
    rate_limit_is_transient_with_retry_after,
    key_in_use_is_retried,
    refused_credentials_pause,
    permanent_refusal_is_permanent,
    undecodable_answer_is_unknown,
    send_never_raises,
    huge_answer_is_bounded,
    gzip_bomb_is_bounded,
    lookup_finds_the_effect,
    lookup_on_error_proves_nothing,
    lookup_on_timeout_proves_nothing,
    lookup_on_refused_proves_nothing,
    lookup_after_forgotten_key_proves_nothing,
    check_raises_only_invalid_request,
)


def check_named(name: str) -> Check:
    """The check called ``name``; KeyError names the valid ones."""
    for candidate in CHECKS:
        if candidate.__name__ == name:
            return candidate
    raise KeyError(f"no check {name!r}; the checks are {', '.join(c.__name__ for c in CHECKS)}")


def run(harness: Harness, checks: Iterable[Check] = CHECKS) -> Report:
    """Every check against ``harness``, in order, each in an event loop of its own: call it from
    synchronous code (from async code: ``await asyncio.to_thread(run, harness)``)."""
    return Report(harness.name, tuple(c(harness) for c in checks))


def assert_conforms(harness: Harness, checks: Iterable[Check] = CHECKS) -> Report:
    """``run``, raising AssertionError that lists every failure; the report otherwise."""
    report = run(harness, checks)
    if report.failures:
        listed = "\n".join(f"- {r.check}: {r.message}" for r in report.failures)
        raise AssertionError(
            f"{harness.name} does not conform ({len(report.failures)} failed):\n{listed}"
        )
    return report

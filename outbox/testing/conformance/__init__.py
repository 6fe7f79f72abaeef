"""A conformance suite for provider plug-ins: does a provider keep the promise outbox makes on
its behalf (exactly one effect per operation, no blind resend)?

Run it against your provider and a fake of its API through a *harness*
(:class:`~outbox.testing.conformance.harness.Harness`; :class:`LookupHarness` adds lookups)::

    from outbox.testing.conformance import assert_conforms

    def test_my_provider_conforms() -> None:
        with my_harness() as harness:
            assert_conforms(harness)

or one test case per check with ``outbox.testing.conformance_pytest.conformance_tests``.
Each check is a plain function ``(Harness) -> Result`` that runs the provider's async methods in
an event loop of its own (``asyncio.run``): call it from synchronous code, no pytest-asyncio
needed. ``outbox.testing.harnesses`` holds harnesses for outbox's own providers and fakes.

pytest is not imported here (it is no dependency of outbox), nor anything of the dispatcher.
"""

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
from outbox.testing.conformance.harness import (
    GZIP_BOMB_BYTES,
    HUGE_ANSWER_FACTOR,
    RETRY_AFTER_SECONDS,
    Fault,
    Harness,
    LookupFault,
    LookupHarness,
    Unsupported,
)
from outbox.testing.conformance.lookups import (
    lookup_after_forgotten_key_proves_nothing,
    lookup_finds_the_effect,
    lookup_on_error_proves_nothing,
    lookup_on_refused_proves_nothing,
    lookup_on_timeout_proves_nothing,
)
from outbox.testing.conformance.results import Check, Outcome, Report, Result
from outbox.testing.conformance.sending import (
    check_raises_only_invalid_request,
    same_key_on_every_attempt,
    send_never_raises,
)
from outbox.testing.conformance.suite import CHECKS, assert_conforms, check_named, run

__all__ = [
    "CHECKS",
    "GZIP_BOMB_BYTES",
    "HUGE_ANSWER_FACTOR",
    "RETRY_AFTER_SECONDS",
    "Check",
    "Fault",
    "Harness",
    "LookupFault",
    "LookupHarness",
    "Outcome",
    "Report",
    "Result",
    "Unsupported",
    "assert_conforms",
    "check_named",
    "check_raises_only_invalid_request",
    "error_after_acting_is_unknown",
    "gzip_bomb_is_bounded",
    "huge_answer_is_bounded",
    "key_in_use_is_retried",
    "lookup_after_forgotten_key_proves_nothing",
    "lookup_finds_the_effect",
    "lookup_on_error_proves_nothing",
    "lookup_on_refused_proves_nothing",
    "lookup_on_timeout_proves_nothing",
    "permanent_refusal_is_permanent",
    "rate_limit_is_transient_with_retry_after",
    "refused_connection_is_transient",
    "refused_credentials_pause",
    "reset_after_acting_is_unknown",
    "reset_before_acting_is_retried",
    "run",
    "same_key_on_every_attempt",
    "send_never_raises",
    "timeout_after_acting_is_unknown",
    "unavailable_before_acting_is_retried",
    "undecodable_answer_is_unknown",
]

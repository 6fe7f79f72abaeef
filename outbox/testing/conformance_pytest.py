"""The conformance suite (``outbox.testing.conformance``) as pytest test cases, one per check.

In a plug-in's test module::

    from outbox.testing.conformance_pytest import conformance_tests
    from my_provider.testing import my_harness  # a context manager yielding a Harness

    test_conformance = conformance_tests(my_harness)

Each case gets a fresh harness (so a fault one check armed cannot reach another), runs one check
synchronously (no pytest-asyncio needed), fails with the check's message and skips with its
reason. ``expected_failures`` maps a check's name to why it fails for now: that case is
``xfail(strict=True)``, so it is visible, and turns red the day the provider is fixed.

This module imports pytest, a dev dependency: import it from tests only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import pytest

from outbox.testing.conformance import CHECKS, Check, Harness, Outcome, check_named

HarnessFactory = Callable[[], AbstractContextManager[Harness]]


def conformance_tests(
    harness: HarnessFactory,
    *,
    expected_failures: Mapping[str, str] | None = None,
    checks: Iterable[Check] = CHECKS,
) -> Callable[[Check], None]:
    """A test function parametrized over ``checks``, each id the check's name."""
    expected = dict(expected_failures or {})
    for name in expected:
        check_named(name)  # a misspelt name fails at collection, not silently
    cases = [_case(c, expected.get(c.__name__)) for c in checks]

    @pytest.mark.parametrize("check", cases)
    def test_conformance(check: Check) -> None:
        with harness() as made:
            result = check(made)
        if result.outcome is Outcome.SKIPPED:
            pytest.skip(result.message)
        if result.outcome is Outcome.FAILED:
            pytest.fail(f"{made.name}: {result.message}", pytrace=False)

    return test_conformance


def _case(check: Check, expected_failure: str | None) -> Any:
    marks = (
        () if expected_failure is None else pytest.mark.xfail(strict=True, reason=expected_failure)
    )
    return pytest.param(check, id=check.__name__, marks=marks)

"""The curated mutation check (tests/mutation) can fail: its catalogue matches the code, and its
runner tells a mutant the tests kill from one they let through."""

from __future__ import annotations

from tests.mutation.catalogue import MUTANTS, Edit, Mutant
from tests.mutation.run import check_catalogue, judge, tree_files

POLICY_TESTS = ("tests/unit/test_policy.py",)


def test_every_mutant_still_matches_the_code_once() -> None:
    assert check_catalogue(MUTANTS) == []
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def test_a_stale_catalogue_is_reported_not_passed() -> None:
    stale = Mutant(
        "stale", "nothing", (Edit("outbox/core/policy.py", "no such text", ""),), POLICY_TESTS
    )
    assert check_catalogue([stale]) == [
        "stale: outbox/core/policy.py has its text 0 times, not once"
    ]


def test_the_runner_tells_a_killed_mutant_from_a_survivor() -> None:
    files = tree_files()
    harmless = Mutant(
        "harmless",
        "nothing",
        (
            Edit(
                "outbox/core/policy.py", "# Reasons are stable words", "# Reasons are stable, words"
            ),
        ),
        POLICY_TESTS,
    )
    harmful = Mutant(
        "harmful",
        "permanent failures retried",
        (
            Edit(
                "outbox/core/policy.py",
                "    if failure is FailureClass.PERMANENT:\n",
                "    if False:\n",
            ),
        ),
        POLICY_TESTS,
    )
    survived = judge(harmless, files)
    assert (survived.outcome, survived.detail) == ("survived", "every test passed")
    killed = judge(harmful, files)
    assert killed.outcome == "killed"
    assert killed.detail.startswith("tests/unit/test_policy.py::")

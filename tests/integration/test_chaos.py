"""The chaos soak, bounded: 35 s of producers, provider faults, killed and frozen dispatchers
and one PostgreSQL crash, then every operation counted against every provider effect.

This one runs the workload of before issue 17 (NARROW: one kind of payload, no due times, no
ordering keys, nothing hostile), long enough for the key window to close on retried operations;
tests/integration/test_adversarial.py runs the whole workload. The same code runs for as long
as you like with `python bench/chaos.py --duration 600`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.chaos import NARROW, print_report, run_chaos

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_chaos_loses_nothing_and_duplicates_no_effect(tmp_path: Path) -> None:
    settings = replace(NARROW, duration=35.0, drain_timeout=60.0, chaos_every=3.0, seed=6)
    report = run_chaos(settings, tmp_path)
    print_report(report)

    assert report.violations == []
    assert (report.duplicates, report.lost, report.orphan_effects) == (0, 0, 0)
    assert report.rolled_back_with_effect == 0
    # The chaos happened: without these the invariants above prove nothing.
    assert report.mayhem.pg_restarts == 1
    assert report.mayhem.kills + report.mayhem.stops_killed + report.mayhem.stops_resumed >= 5
    assert report.faults_armed >= 50
    assert report.rolled_back > 0
    assert report.duplicate_enqueues > 0
    assert report.conflicts > 0
    # Every committed operation is accounted for: succeeded with its one effect, or set aside.
    assert sum(report.by_status.values()) == report.operations
    assert set(report.by_status) <= {"succeeded", "quarantined", "reconciling"}
    assert report.by_status["succeeded"] >= report.operations * 0.9
    assert report.effects_stripe + report.effects_hook >= report.by_status["succeeded"]

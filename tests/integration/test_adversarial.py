"""The adversarial workload of issue 17, bounded: a short chaos soak (tests/support/chaos.py)
with every kind of adversity at once, checked against every invariant.

Dozens of tenants (some with hostile names, 80 with only operations due hours ahead, sorting
first), operations due seconds and hours ahead, ordering keys, random payload shapes and exact
numbers, enqueues the door must refuse, poison rows planted behind its back, provider faults,
SIGKILLed and SIGSTOPped dispatchers and a PostgreSQL crash. Then: no dispatcher crashed, no
duplicate, nothing lost, every poison row quarantined unsent, no refused enqueue left a row,
every due operation first attempted within the bound, ordering keys kept, payloads carried
exactly.

On failure, the printed report names the seed and the command that replays the run's choices:
`python bench/chaos.py --seed 17 ...` (and `--duration 600` to look for longer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.chaos import HOSTILE, POISON, Settings, print_report, run_chaos

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_an_adversarial_workload_breaks_no_invariant(tmp_path: Path) -> None:
    settings = Settings(duration=20.0, chaos_every=2.0, drain_timeout=40.0, seed=17)
    report = run_chaos(settings, tmp_path)
    print_report(report)

    assert report.violations == []
    assert (report.duplicates, report.lost, report.orphan_effects, report.crashes) == (0, 0, 0, 0)
    # Each kind of adversity happened: without these the invariants above prove nothing.
    assert report.tenants >= 100
    assert report.scheduled_tenants == settings.scheduled_tenants
    assert report.scheduled_ahead > 2 * settings.scheduled_tenants
    assert report.soon >= 10
    assert report.ordered >= 50 and report.lines >= 4
    assert set(report.refused) == set(HOSTILE)
    assert set(report.poison) == set(POISON)
    assert report.poison_quarantined == sum(report.poison.values())
    assert report.exact_payloads >= 30
    assert report.payloads_checked >= report.by_status["succeeded"]
    assert report.faults_armed >= 30
    assert report.mayhem.pg_restarts == 1
    assert report.mayhem.kills + report.mayhem.stops_killed + report.mayhem.stops_resumed >= 4
    assert report.rolled_back > 0 and report.duplicate_enqueues > 0 and report.conflicts > 0
    assert max(report.waits) <= settings.due_bound

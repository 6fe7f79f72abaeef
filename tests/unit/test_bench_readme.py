"""bench/run_all runs what bench/README.md says it runs, in the order it says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_run_all_runs_every_benchmark_in_the_order_the_readme_states() -> None:
    listed = subprocess.run(
        ["bash", str(BENCH / "run_all"), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    text = " ".join(BENCH.joinpath("README.md").read_text().split())
    (stated,) = re.findall(r"in the order shown: ([a-z_, ]+)\.", text)
    assert listed == [f"bench/{name.strip()}.py" for name in stated.split(",")]
    # Every benchmark script is run: none is left out of the README's shell blocks.
    scripts = sorted(f"bench/{p.name}" for p in BENCH.glob("[a-z]*.py"))
    assert sorted(listed) == scripts

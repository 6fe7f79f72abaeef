"""The chaos soak: `python bench/chaos.py --duration 600` from the repository root.

Producers of an adversarial workload (dozens of tenants, due times, ordering keys, hostile
payloads, poison rows), provider faults, SIGKILLed and SIGSTOPped dispatchers and a PostgreSQL
crash, all at once; then every operation is counted against every provider effect and every
invariant checked. Prints a table and exits 1 if any invariant failed. The report names the seed
and the command that replays the run's choices (`--seed N` and the other knobs). The logic lives
in tests/support/chaos.py and its chaos_*.py parts, which tests/integration/test_chaos.py and
test_adversarial.py run too. See bench/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import fields
from pathlib import Path

# Run as a script, this file's directory is on sys.path, not the repository root that holds
# the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.chaos import Settings, print_report, run_chaos

# Where the bench's defaults differ from the bounded tests': a long run, and a long drain.
BENCH_DEFAULTS = {"duration": 600.0, "drain_timeout": 120.0}


def parse_args(argv: list[str]) -> tuple[Settings, Path | None]:
    """One option per Settings field (``--hostile-rate`` for hostile_rate), with its help."""
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for knob in fields(Settings):
        default = BENCH_DEFAULTS.get(knob.name, getattr(defaults, knob.name))
        parser.add_argument(
            f"--{knob.name.replace('_', '-')}",
            type=type(default),
            default=default,
            help=f"{knob.metadata['help']} (default {default})",
        )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where dispatcher logs go (default: a temporary directory, kept "
        "only when an invariant fails)",
    )
    args = parser.parse_args(argv)
    settings = Settings(**{knob.name: getattr(args, knob.name) for knob in fields(Settings)})
    return settings, args.workdir


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _stop_cleanly(signum: int, frame: object) -> None:
    # Unwinds through run_chaos's cleanup: dispatchers killed, the private cluster removed.
    raise SystemExit(128 + signum)


def main(argv: list[str]) -> int:
    # A shell's background job starts with SIGINT ignored, and SIGTERM would end Python
    # without cleanup: both unwind instead.
    signal.signal(signal.SIGINT, _stop_cleanly)
    signal.signal(signal.SIGTERM, _stop_cleanly)
    settings, workdir = parse_args(argv)
    keep = workdir is not None
    directory = workdir or Path(tempfile.mkdtemp(prefix="outbox-chaos-"))
    directory.mkdir(parents=True, exist_ok=True)
    progress(
        f"chaos for {settings.duration:.0f} s, seed {settings.seed}; dispatcher logs in {directory}"
    )
    report = run_chaos(settings, directory, progress)
    print_report(report)
    if report.ok and not keep:
        shutil.rmtree(directory, ignore_errors=True)
    elif not report.ok:
        print(f"dispatcher logs kept in {directory}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The chaos soak: `python bench/chaos.py --duration 600` from the repository root.

Producers, provider faults, SIGKILLed and SIGSTOPped dispatchers and a PostgreSQL crash, all at
once; then every operation is counted against every provider effect. Prints a table and exits 1
if any invariant failed. The logic lives in tests/support/chaos.py, which the bounded test in
tests/integration/test_chaos.py runs too. See bench/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's directory is on sys.path, not the repository root that holds
# the `tests` package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.chaos import Settings, print_report, run_chaos


def parse_args(argv: list[str]) -> tuple[Settings, Path | None]:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--duration",
        type=float,
        default=600.0,
        help="seconds of chaos before the drain (default 600)",
    )
    parser.add_argument("--dispatchers", type=int, default=defaults.dispatchers)
    parser.add_argument("--producers", type=int, default=defaults.producers)
    parser.add_argument(
        "--rate",
        type=float,
        default=defaults.rate,
        help="operations enqueued per second, all producers together",
    )
    parser.add_argument(
        "--fault-rate",
        type=float,
        default=defaults.fault_rate,
        help="provider faults armed per operation committed",
    )
    parser.add_argument(
        "--chaos-every",
        type=float,
        default=defaults.chaos_every,
        help="mean seconds between two dispatcher kills or stops",
    )
    parser.add_argument("--pg-restarts", type=int, default=defaults.pg_restarts)
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--key-retention", type=float, default=defaults.key_retention,
                        help="seconds the fakes remember an idempotency key (and the providers "
                             "are configured with)")  # fmt: skip
    parser.add_argument(
        "--retention-margin",
        type=float,
        default=defaults.retention_margin,
        help="seconds before that when retries stop",
    )
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where dispatcher logs go (default: a temporary directory, kept "
                             "only when an invariant fails)")  # fmt: skip
    args = parser.parse_args(argv)
    settings = Settings(
        duration=args.duration, dispatchers=args.dispatchers, producers=args.producers,
        rate=args.rate, fault_rate=args.fault_rate, chaos_every=args.chaos_every,
        pg_restarts=args.pg_restarts, drain_timeout=args.drain_timeout, seed=args.seed,
        key_retention=args.key_retention, retention_margin=args.retention_margin,
    )  # fmt: skip
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
    progress(f"chaos for {settings.duration:.0f} s; dispatcher logs in {directory}")
    report = run_chaos(settings, directory, progress)
    print_report(report)
    if report.ok and not keep:
        shutil.rmtree(directory, ignore_errors=True)
    elif not report.ok:
        print(f"dispatcher logs kept in {directory}", file=sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

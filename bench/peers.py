"""Peers in the same run: pgqueuer draining no-op jobs on the same server, against `outbox run`.

    python bench/peers.py                 # 100,000 jobs each: pgqueuer (psycopg, asyncpg), outbox
    python bench/peers.py --quick         # 10,000
    python bench/peers.py --count 50000 --outbox-config 64x100

pgqueuer (pinned: PGQUEUER_VERSION) is installed by this script into its own virtual environment,
bench/.venv-pgqueuer (gitignored), never into outbox's. Each measurement gets a fresh database.
pgqueuer runs as its own benchmark tool runs it (tools/benchmark.py, drain strategy): one process,
uvloop, 4 QueueManagers each on its own connection, batch 100, an async entrypoint that returns
at once, `mode=drain`. Its rate is counted on the client's clock from the first job started to the
last job run ("until exit", to the workers' return, is shown too). outbox's figure comes from
throughput.py's `outbox_drain` on the same count (first claim to last record, database clock),
its concurrency x batch configurable.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PGQUEUER_VERSION = "1.6.0"
PGQUEUER_WORKERS = 4
PGQUEUER_BATCH = 100
VENV = Path(__file__).resolve().parent / ".venv-pgqueuer"
DRIVERS = ("psycopg", "asyncpg")
DEFAULT_COUNT = 100_000
QUICK_COUNT = 10_000
# The target: outbox drains at least twice as fast as pgqueuer's fastest driver.
TARGET_RATIO = 2.0


# --- run inside pgqueuer's virtual environment (stdlib and pgqueuer only) -----------------------


async def _pgqueuer_drain(
    driver: str, dsn: str, count: int, workers: int, batch: int
) -> dict[str, Any]:
    pgqueuer = importlib.import_module("pgqueuer")
    queries_mod = importlib.import_module("pgqueuer.queries")
    types_mod = importlib.import_module("pgqueuer.types")

    async def connect() -> Any:
        if driver == "asyncpg":
            asyncpg = importlib.import_module("asyncpg")
            return pgqueuer.AsyncpgDriver(await asyncpg.connect(dsn=dsn))
        psycopg = importlib.import_module("psycopg")
        conn = await psycopg.AsyncConnection.connect(conninfo=dsn, autocommit=True)
        return pgqueuer.PsycopgDriver(conn)

    setup = queries_mod.Queries(await connect())
    for first in range(0, count, 50_000):
        n = min(50_000, count - first)
        await setup.enqueue(["noop"] * n, [None] * n, [0] * n)

    first_job: list[float] = []
    last_job = [0.0]

    managers = []
    for _ in range(workers):
        pgq = pgqueuer.PgQueuer(await connect())

        async def noop(job: Any) -> None:
            now = time.perf_counter()
            if not first_job:
                first_job.append(now)
            last_job[0] = now

        pgq.entrypoint("noop")(noop)
        managers.append(pgq)
    started = time.perf_counter()
    await asyncio.gather(
        *(m.run(batch_size=batch, mode=types_mod.QueueExecutionMode.drain) for m in managers)
    )
    done = time.perf_counter()
    left = sum(s.count for s in await setup.queue_size())
    begin = first_job[0] if first_job else started
    return {
        "driver": driver,
        "count": count,
        "left": left,
        "seconds": done - begin,
        "seconds_to_last_job": last_job[0] - begin,
        "version": str(pgqueuer.__version__),
    }


def _worker_main(argv: list[str]) -> int:
    driver, dsn, count, workers, batch = argv
    run = _pgqueuer_drain(driver, dsn, int(count), int(workers), int(batch))
    try:
        uvloop = importlib.import_module("uvloop")
        result = uvloop.run(run)
    except ImportError:
        result = asyncio.run(run)
    print(json.dumps(result))
    return 0


# --- the benchmark (outbox's virtual environment) -----------------------------------------------


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_pgqueuer() -> str:
    """pgqueuer PGQUEUER_VERSION in VENV, installed if missing; returns the installed versions."""
    python = venv_python()
    probe = "import importlib.metadata as m; print(m.version('pgqueuer'))"
    if python.exists():
        found = subprocess.run(  # noqa: S603
            [str(python), "-c", probe],
            capture_output=True,
            text=True,
            check=False,
        )
        if found.returncode == 0 and found.stdout.strip() == PGQUEUER_VERSION:
            return _versions(python)
    from _support import progress  # noqa: PLC0415 (not importable inside pgqueuer's venv)

    progress(f"installing pgqueuer {PGQUEUER_VERSION} into {VENV}")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)  # noqa: S603
    subprocess.run(  # noqa: S603 (fixed arguments)
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            f"pgqueuer=={PGQUEUER_VERSION}",
            "asyncpg",
            "psycopg",
        ],
        check=True,
    )
    return _versions(python)


def _versions(python: Path) -> str:
    probe = (
        "import importlib.metadata as m; "
        "print(', '.join(f'{p} {m.version(p)}' for p in ('pgqueuer', 'asyncpg', 'psycopg', "
        "'uvloop')))"
    )
    out = subprocess.run(  # noqa: S603
        [str(python), "-c", probe],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def pgqueuer_drain(
    driver: str, count: int, *, workers: int = PGQUEUER_WORKERS, batch: int = PGQUEUER_BATCH
) -> dict[str, Any]:
    """pgqueuer draining ``count`` no-op jobs in a fresh database; its result as a dict."""
    from _support import as_url, fresh_database  # noqa: PLC0415

    with fresh_database(migrate=False, prefix="pgq_") as conninfo:
        db_url = as_url(conninfo)
        env = {**os.environ, "PGDSN": db_url}
        installed = subprocess.run(  # noqa: S603
            [str(VENV / "bin" / "pgq"), "install"],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if installed.returncode != 0:
            raise RuntimeError(f"pgq install failed:\n{installed.stdout}{installed.stderr}")
        out = subprocess.run(  # noqa: S603 (this file, fixed arguments)
            [
                str(venv_python()),
                __file__,
                "--pgqueuer-worker",
                driver,
                db_url,
                str(count),
                str(workers),
                str(batch),
            ],
            capture_output=True,
            text=True,
            check=False,
            timeout=600 + count / 50,
        )
    if out.returncode != 0:
        raise RuntimeError(f"pgqueuer ({driver}) failed:\n{out.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    if result["left"] != 0:
        raise RuntimeError(f"pgqueuer ({driver}) left {result['left']} jobs queued")
    return result


def main(argv: list[str]) -> int:
    from _support import (  # noqa: PLC0415 (not importable inside pgqueuer's venv)
        fmt_rate,
        fmt_ratio,
        median,
        print_machine,
        print_table,
        progress,
    )
    from throughput import outbox_drain  # noqa: PLC0415

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--count", type=int, default=None, help=f"jobs per drain (default {DEFAULT_COUNT:,})"
    )
    parser.add_argument("--quick", action="store_true", help=f"--count {QUICK_COUNT:,}, one round")
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds of every queue, round-robin; medians count"
    )
    parser.add_argument(
        "--outbox-config",
        default="256x100",
        help="outbox run's concurrency x batch_size (default 256x100)",
    )
    parser.add_argument("--processes", type=int, default=1, help="`outbox run` processes")
    args = parser.parse_args(argv)
    count = args.count or (QUICK_COUNT if args.quick else DEFAULT_COUNT)
    rounds = 1 if args.quick else args.repeat
    concurrency, batch_size = (int(x) for x in args.outbox_config.lower().split("x"))

    machine = print_machine()
    versions = ensure_pgqueuer()
    outbox_name = f"outbox ({args.processes} process{'es' if args.processes > 1 else ''})"
    # name -> (configuration, [(drain seconds, until-exit seconds or None, jobs/s)])
    results: dict[str, tuple[str, list[tuple[float, float | None, float]]]] = {}
    # Round-robin, so that a burst of other work on a shared machine hits every queue alike.
    for round_number in range(rounds):
        for driver in DRIVERS:
            progress(
                f"pgqueuer {driver}: {count:,} jobs, {PGQUEUER_WORKERS} workers, "
                f"batch {PGQUEUER_BATCH}, round {round_number + 1} of {rounds}"
            )
            result = pgqueuer_drain(driver, count)
            # To the last job run, not to the workers' return: drain mode's exit can lag by
            # seconds (psycopg driver), which is no part of its throughput. This favours pgqueuer
            # slightly: its last status write is not counted, where outbox's is.
            seconds = float(result["seconds_to_last_job"])
            name = f"pgqueuer {result['version']} ({driver}, uvloop)"
            config = f"{PGQUEUER_WORKERS} workers x batch {PGQUEUER_BATCH}"
            results.setdefault(name, (config, []))[1].append(
                (seconds, float(result["seconds"]), count / seconds)
            )
        progress(
            f"outbox run: concurrency {concurrency}, batch {batch_size}, {count:,} "
            f"operations, round {round_number + 1} of {rounds}"
        )
        drain = outbox_drain(count, concurrency, batch_size, processes=args.processes)
        config = f"concurrency {concurrency} x batch {batch_size}"
        results.setdefault(outbox_name, (config, []))[1].append(
            (drain.seconds, None, drain.per_second)
        )

    rows: list[list[str]] = []
    rates: dict[str, float] = {}
    for name, (config, runs) in results.items():
        rate = median([r[2] for r in runs])
        rates[name] = rate
        exits = [r[1] for r in runs if r[1] is not None]
        rows.append(
            [
                name,
                config,
                f"{count:,}",
                f"{median([r[0] for r in runs]):.1f} s",
                f"{median(exits):.1f} s" if exits else "",
                fmt_rate(rate),
                " / ".join(fmt_rate(r[2]) for r in runs),
            ]
        )
    server = machine.postgres.split()[0]
    print_table(
        ["queue", "configuration", "jobs", "drain", "until exit", "jobs/s (median)", "runs"],
        rows,
        title=f"No-op jobs drained on PostgreSQL {server}",
    )
    ours = rates.pop(outbox_name)
    best = max(rates.values())
    ratio_rows = [[f"outbox / {name}", fmt_ratio(ours / rate)] for name, rate in rates.items()]
    ratio_rows.append(
        [
            f"target: outbox >= {TARGET_RATIO} x the fastest",
            "met" if ours >= TARGET_RATIO * best else "missed",
        ]
    )
    print_table(["ratio of medians", "value"], ratio_rows)
    print(f"peers' environment: {versions}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--pgqueuer-worker":
        sys.exit(_worker_main(sys.argv[2:]))
    sys.exit(main(sys.argv[1:]))

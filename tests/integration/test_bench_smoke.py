"""The benchmarks that drive outbox's own statements (not only `outbox run`) still run against
them: at tiny sizes, so that a changed statement cannot leave bench/ broken until the next full
run. No figure is checked here; bench/ measures, tests do not time."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.queues import require_service
from tests.support.tools import require_tool

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(pg_server: str, script: str, *args: str) -> str:
    env = {**os.environ, "OUTBOX_BENCH_DATABASE_URL": pg_server}
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


def test_growth_runs_its_claims_gauges_and_drains(pg_server: str) -> None:
    out = run_bench(
        pg_server,
        "growth.py",
        "--max-rows",
        "1000",
        "--pending",
        "200",
        "--claim-runs",
        "3",
        "--churn-ops",
        "0",
    )
    assert "### Growth: claim 100 of 200 pending, 3 runs" in out
    assert "| 1,000 finished" in out


def test_throughput_runs_the_raw_loop_the_protocol_floor_and_a_drain(pg_server: str) -> None:
    out = run_bench(
        pg_server,
        "throughput.py",
        "--count",
        "1000",
        "--repeat",
        "1",
        "--configs",
        "64x100",
        "--no-ordered",
    )
    assert "| outbox's claim + record |" in out
    assert "### outbox run, noop provider" in out


def test_lifecycle_builds_and_drains_every_variant(pg_server: str) -> None:
    """bench/lifecycle.py copies outbox.operations and its indexes: it must follow the schema."""
    out = run_bench(
        pg_server, "lifecycle.py", "--sizes", "0,300", "--pending", "300", "--claim-runs", "3"
    )
    cells = [[c.strip() for c in line.split("|")[1:3]] for line in out.splitlines()]
    variants = (
        "sql/0049",
        "sql/0049, no foreign key",
        "keys apart",
        "keys apart, success inline",
        "live table",
        "unfinished partition",
    )
    assert [c for c in cells if c[1:] == ["300"]] == [[v, "300"] for v in variants]


def test_lifecycle_enqueue_writes_every_shape(pg_server: str) -> None:
    """bench/lifecycle_enqueue.py builds on bench/lifecycle.py's copies; it raises unless every
    new key was inserted and the keys table holds one key per operation."""
    out = run_bench(pg_server, "lifecycle_enqueue.py", "--rows", "80", "--repeat", "1")
    shapes = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ")]
    for shape in ("plain INSERT", "sql/0049", "keys apart", "live table"):
        assert shapes.count(shape) == 2, shape  # at 1 and at 8 producers


@pytest.mark.parametrize("queue", ["nats", "amqp", "cloudtasks"])
def test_a_queue_bench_runs_its_three_phases(pg_server: str, queue: str) -> None:
    """bench/queue_<queue>.py at 200 messages, one run (the SQS one is left out: moto alone
    takes half a minute to start and fill). Each raises unless the broker holds every message
    and every operation succeeded."""
    if queue == "nats":
        require_service("NATS", 4222, "nats-server -js")
    if queue == "amqp":
        require_service("RabbitMQ", 5672, "rabbitmq-server -detached")
    out = run_bench(pg_server, f"queue_{queue}.py", "--count", "200", "--runs", "1")
    assert f"outbox run, {queue} provider" in out
    assert "| ratio outbox / bare loop |" in out


def test_the_payload_bench_enqueues_its_payloads_through_the_door_and_works_them(
    pg_server: str,
) -> None:
    """bench/payload_decode.py --quick: its payloads are still within the door's limits (each
    enqueue would raise), and the pipeline's turns it measures are still there."""
    out = run_bench(pg_server, "payload_decode.py", "--quick")
    assert "### One payload: CPU time, median of 3; peak memory allocated" in out
    assert "| verdict + read (Stripe), in turns" in out


def test_inbox_bench_serves_each_variant_and_prints_its_figures(pg_server: str) -> None:
    with socket.socket() as probe:  # a free port for the worker under uvicorn
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ("--seconds", "1", "--repeat", "1", "--clients", "4", "--port", str(port))
    out = run_bench(pg_server, "inbox.py", *args)
    for variant in ("with inbox", "without", "replays"):
        assert f"| {variant} " in out
    assert "with/without:" in out
    assert "p99 at 100/s" in out  # the paced phase ran and was read
    assert "CPU per request of the worker and PostgreSQL:" in out


def test_the_instruction_bench_counts_every_variant(pg_server: str) -> None:
    """bench/enqueue_instructions.py at a few calls: its private cluster migrates with today's
    schema, and every variant runs under callgrind without an error."""
    require_tool("valgrind")
    out = run_bench(pg_server, "enqueue_instructions.py", "--calls", "2,5")
    assert "### Enqueue in instructions (callgrind, per call: runs of 5 minus 2)" in out
    # Counts, not times: each variant's calls executed work (a statement that did nothing, or a
    # subtraction of the wrong runs, would count zero or less).
    counts = {
        row.split("|")[1].strip(): int(row.split("|")[2].replace(",", ""))
        for row in out.splitlines()
        if row.startswith("| outbox.enqueue") or row.startswith("| plain INSERT")
    }
    assert len(counts) == 4, out
    assert all(count > 0 for count in counts.values()), counts
    assert "the CHECK constraints of outbox.operations cost" in out


def test_the_contracts_bench_measures_each_checker_and_each_worst_case(pg_server: str) -> None:
    """bench/contracts.py --quick: each checker's time per check and each worst case's, as
    figures (a case that raised would stop the script: its schema must stay within the bounds
    it measures)."""
    out = run_bench(pg_server, "contracts.py", "--quick")
    checkers = [row for row in out.splitlines() if row.startswith(("| outbox", "| python-"))]
    assert len(checkers) == 3, out
    assert all(" us " in row for row in checkers), checkers
    worst = [row for row in out.splitlines() if row.endswith(" ms |")]
    assert len(worst) == 5, out

"""Growth (issue 7, part 5): claim time, drain throughput and the gauges' query time with 0, 1
million and 10 million finished rows in outbox.operations, and after a day of churn.

    python bench/growth.py [--max-rows 10000000] [--pending 20000] [--churn-ops 1000000]

One database, grown in steps. At each size:

* finished rows are bulk-loaded (INSERT ... SELECT generate_series): ``succeeded`` at their first
  attempt, kept on the row as `outbox run` keeps it (sql/0050: no row of outbox.attempt_log), a
  small payload and a small result; then VACUUM (ANALYZE), the
  state autovacuum leaves an insert-only table in;
* ``--pending`` pending rows are enqueued (noop provider);
* claim time: the claim `outbox run` makes here, CLAIM_ONE_GROUP (outbox/db/statements.py: the
  pending rows are of one provider and one tenant), executed directly, prepared, claiming 100
  of the pending rows; each run in a transaction rolled back, so every run sees the same rows;
  the median (and p90) of ``--claim-runs`` runs, client-side round trip; and the median of the
  fair CLAIM, which runs where several groups have rows, timed the same way;
* the gauges: GAUGES and NEARING_KEY_EXPIRY (the statements outbox.daemon.gauges runs), median of
  20;
* both on a connection with `outbox run`'s session settings (generic plans, no JIT);
* drain: one `outbox run` (noop provider, concurrency 64, batch 100) drains the pending rows;
  operations per second from the first claim to the last success, by the database's clock,
  the CPU time of its PostgreSQL backends per operation, which moves far less than the rate
  when other work shares the machine; and per operation, the WAL written (kB, and full-page
  images: a page's first change after a checkpoint logs the whole page) and the blocks of the
  outbox tables read from outside shared_buffers.

Then a simulated day of churn at the largest size, with autovacuum off on both tables: cycles of
``--churn-batch`` rows inserted pending, claimed (UPDATE to in_flight), recorded (UPDATE to
succeeded, one attempt row) and the same number of the oldest finished rows deleted (outbox
prune's PRUNE_BATCH statement), ``--churn-ops`` rows in all; measured as above. Then
autovacuum is switched back on (its server defaults), the benchmark waits until it has vacuumed
outbox.operations (``--autovacuum-wait``) and measures once more; on a server with autovacuum
off it runs the VACUUM autovacuum would, with autovacuum's default throttling. EXPLAIN (ANALYZE,
BUFFERS) of the claim and of GAUGES at the largest size and after the churn are printed.

Targets: claim time at the largest size at most 1.2 times that at 0 rows; drain throughput
loss at most 10 %. Disk: 10 million rows take about 10 GB with their attempts and indexes
(check ``df -h``; ``--max-rows`` scales down). Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, LiteralString

import psycopg
from _http_receiver import cpu_seconds
from _support import (
    as_outbox_run,
    bulk_enqueue,
    fmt_rate,
    fmt_ratio,
    fresh_database,
    outbox_runs,
    print_machine,
    print_table,
    progress,
    unfinished,
    wait_until,
)

from outbox.daemon.gauges import EXACT_COUNT_LIMIT
from outbox.db import statements
from outbox.db.store import claim_params

SIZES = (0, 1_000_000, 10_000_000)
LOAD_CHUNK = 1_000_000
CLAIM_LIMIT = 100
GAUGE_RUNS = 20
CLAIM_TARGET = 1.2
THROUGHPUT_LOSS_TARGET = 0.10
LEASE = timedelta(seconds=30)
KEY_WINDOW = timedelta(hours=23)  # key_retention 24 h less the default 1 h margin

# Finished operations as `outbox run` leaves them: succeeded with a provider reference at the
# first attempt, kept on the row (sql/0050), timestamps spread over the two days before the load.
LOAD_OPERATIONS: LiteralString = """
INSERT INTO outbox.operations (
    tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
    idempotency_key, status, attempts, available_at, first_sent_at, last_attempt_at,
    provider_ref, result, created_at, updated_at, status_changed_at, finished_at,
    success_worker, success_http_status, success_request_id)
SELECT 'bench', 'bench.done', k.key,
       sha256(convert_to('noop' || E'\\n' || 'bench' || E'\\n' || p.payload::text, 'UTF8')),
       'noop', 'bench', p.payload,
       outbox.derive_idempotency_key('bench', 'bench.done', k.key),
       'succeeded', 1, t.at, t.at, t.at, 'noop_' || i, jsonb_build_object('id', 'noop_' || i),
       t.at, t.at, t.at, t.at, 'bench-loader', 200, 'req_' || i
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT 'done-' || lpad(i::text, 10, '0') AS key) AS k,
     LATERAL (SELECT jsonb_build_object('n', i, 'amount', 1000, 'currency', 'usd',
                                        'customer', 'cus_bench') AS payload) AS p,
     LATERAL (SELECT now() - interval '2 days' + i * interval '10 ms' AS at) AS t
"""

MAX_ID: LiteralString = "SELECT coalesce(max(id), 0) FROM outbox.operations"

# One churn cycle, in the shapes of the dispatcher's statements: enqueue, claim, record.
CHURN_INSERT: LiteralString = """
INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint, provider,
                               action, payload, idempotency_key)
SELECT 'bench', 'bench.churn', k.key, sha256(convert_to(k.key, 'UTF8')), 'noop', 'bench',
       jsonb_build_object('n', i, 'amount', 1000, 'currency', 'usd'),
       outbox.derive_idempotency_key('bench', 'bench.churn', k.key)
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT 'churn-' || lpad(i::text, 10, '0') AS key) AS k
RETURNING id
"""
CHURN_CLAIM: LiteralString = """
UPDATE outbox.operations
SET status = 'in_flight', lease_owner = 'churn', lease_token = gen_random_uuid(),
    lease_expires_at = now() + interval '30 seconds', attempts = attempts + 1,
    last_attempt_at = now(), updated_at = now(), status_changed_at = now()
WHERE id = ANY (%(ids)s::bigint[]) AND status = 'pending'
"""
CHURN_RECORD: LiteralString = """
WITH recorded AS (
    UPDATE outbox.operations
    SET status = 'succeeded', lease_owner = NULL, lease_token = NULL, lease_expires_at = NULL,
        first_sent_at = last_attempt_at, provider_ref = 'noop_' || id,
        result = jsonb_build_object('id', 'noop_' || id), updated_at = now(),
        status_changed_at = now(), finished_at = now(), success_worker = 'churn',
        success_http_status = 200
    WHERE id = ANY (%(ids)s::bigint[]) AND status = 'in_flight'
    RETURNING id
)
SELECT count(*) FROM recorded
"""
VACUUM_STATS: LiteralString = """
SELECT coalesce(autovacuum_count, 0), n_dead_tup, n_live_tup
FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname = 'operations'
"""
OUTBOX_BACKENDS: LiteralString = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'outbox%%'
  AND pid <> pg_backend_pid()
"""
# Cluster-wide WAL and this database's blocks read from outside shared_buffers: counted around
# a drain (the benchmarks take a lock, so nothing else writes meanwhile), they show what a row
# costs the server beyond CPU.
IO_COUNTERS: LiteralString = """
SELECT w.wal_bytes, w.wal_fpi,
       (SELECT sum(heap_blks_read + coalesce(idx_blks_read, 0) + coalesce(toast_blks_read, 0))
        FROM pg_statio_user_tables WHERE schemaname = 'outbox')
FROM pg_stat_wal w
"""
SIZES_ON_DISK: LiteralString = """
SELECT pg_size_pretty(pg_total_relation_size('outbox.operations')),
       pg_size_pretty(pg_total_relation_size('outbox.attempt_log')),
       pg_size_pretty(pg_relation_size('outbox.operations_claim_group'))
"""


@dataclass(frozen=True)
class Io:
    wal_kb: float
    full_page_images: float
    blocks_read: float


def io_counters(db_url: str) -> tuple[int, int, int]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        # Counters are flushed by each backend now and then; this makes ours current.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(IO_COUNTERS).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2] or 0)


@dataclass(frozen=True)
class Measure:
    label: str
    finished: int
    claim_ms: float
    claim_p90_ms: float
    claim_first_ms: float
    fair_ms: float  # the fair claim (statements.CLAIM), median
    gauges_ms: float
    nearing_ms: float
    drain_per_s: float
    drain_pg_cpu_ms: float  # CPU of outbox run's backends per drained operation
    drain_io: Io  # per drained operation
    dead_tuples: int
    disk: str


def _claim_params() -> dict[str, Any]:
    return claim_params("bench-growth", CLAIM_LIMIT, LEASE)


def time_claims(db_url: str, runs: int, claim: LiteralString) -> tuple[float, float, float]:
    """Median, p90 and first time (ms) of ``runs`` claims by ``claim``, each rolled back."""
    times: list[float] = []
    with psycopg.connect(db_url) as conn:
        as_outbox_run(conn).commit()
        for _ in range(runs):
            started = time.perf_counter()
            rows = conn.execute(claim, _claim_params(), prepare=True).fetchall()
            times.append((time.perf_counter() - started) * 1000)
            conn.rollback()
            if len(rows) != CLAIM_LIMIT:
                raise RuntimeError(f"the claim returned {len(rows)} rows, not {CLAIM_LIMIT}")
    ordered = sorted(times)
    return statistics.median(times), ordered[int(0.9 * (len(ordered) - 1))], times[0]


def explain_claim(db_url: str) -> str:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS) " + statements.CLAIM_ONE_GROUP, _claim_params()
        ).fetchall()
        conn.rollback()
    return "\n".join(str(row[0]) for row in rows)


def explain_gauges(db_url: str) -> str:
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = (
            as_outbox_run(conn)
            .execute(
                "EXPLAIN (ANALYZE, BUFFERS) " + statements.GAUGES,
                {"exact_limit": EXACT_COUNT_LIMIT, "providers": []},
            )
            .fetchall()
        )
    return "\n".join(str(row[0]) for row in rows)


def time_gauges(db_url: str) -> tuple[float, float]:
    """Median times (ms) of the two gauge statements."""
    gauges: list[float] = []
    nearing: list[float] = []
    params = {"providers": ["noop"], "windows": [KEY_WINDOW]}
    with psycopg.connect(db_url, autocommit=True) as conn:
        as_outbox_run(conn)
        for _ in range(GAUGE_RUNS):
            started = time.perf_counter()
            conn.execute(
                statements.GAUGES, {"exact_limit": EXACT_COUNT_LIMIT, "providers": []}, prepare=True
            )
            gauges.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            conn.execute(statements.NEARING_KEY_EXPIRY, params, prepare=True).fetchall()
            nearing.append((time.perf_counter() - started) * 1000)
    return statistics.median(gauges), statistics.median(nearing)


def scalar(db_url: str, query: LiteralString, params: dict[str, Any] | None = None) -> Any:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def backend_cpu(db_url: str) -> float:
    """CPU seconds used so far by outbox run's PostgreSQL backends on this database (the server
    is on this host: /proc)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        pids = [row[0] for row in conn.execute(OUTBOX_BACKENDS)]
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(pid)
    return total


def drain(db_url: str, pending: int) -> tuple[float, float, Io]:
    """Drain the pending rows with one `outbox run`; ops/s by the database's clock, the CPU
    time of its PostgreSQL backends per operation (ms; less noisy than the rate on a shared
    machine, and where a growing table would cost more), and its WAL and reads per operation."""
    after = int(scalar(db_url, MAX_ID)) - pending  # the pending rows are the newest
    io_before = io_counters(db_url)
    with outbox_runs(db_url, concurrency=64, batch_size=CLAIM_LIMIT) as runs:
        with psycopg.connect(db_url, autocommit=True) as conn:
            wait_until(
                lambda: not any(unfinished(conn)),
                timeout=1800,
                what="the drain",
                interval=0.2,
                alive=runs,
            )
        # Its backends started with it and did nothing but this drain.
        pg_ms = backend_cpu(db_url) / pending * 1000
    # After outbox run has stopped: its backends flushed their counters as they exited.
    wal, fpi, reads = (b - a for a, b in zip(io_before, io_counters(db_url), strict=True))
    io = Io(wal / 1024 / pending, fpi / pending, reads / pending)
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*), extract(epoch FROM max(finished_at) - min(last_attempt_at)) "
            "FROM outbox.operations WHERE id > %s AND status = 'succeeded'",
            (after,),
        ).fetchone()
    assert row is not None
    done, seconds = int(row[0]), float(row[1] or 0)
    if done != pending:
        raise RuntimeError(f"{done} of {pending} pending rows succeeded")
    return (done / seconds if seconds > 0 else float("nan")), pg_ms, io


def measure(
    db_url: str,
    label: str,
    finished: int,
    args: argparse.Namespace,
    explain: list[tuple[str, str]] | None = None,
) -> Measure:
    progress(f"{label}: enqueueing {args.pending:,} pending rows")
    bulk_enqueue(db_url, args.pending, key_prefix=f"{label.split(maxsplit=1)[0]}-{time.time_ns()}-")
    progress(f"{label}: {args.claim_runs} claims")
    # One group (the noop provider, one tenant): what `outbox run` claims with here.
    claim, claim_p90, claim_first = time_claims(db_url, args.claim_runs, statements.CLAIM_ONE_GROUP)
    fair, _, _ = time_claims(db_url, args.claim_runs, statements.CLAIM)
    gauges, nearing = time_gauges(db_url)
    if explain is not None:
        explain.append((f"the claim: {label}", explain_claim(db_url)))
        explain.append((f"GAUGES: {label}", explain_gauges(db_url)))
    dead = int(scalar(db_url, VACUUM_STATS.replace("coalesce(autovacuum_count, 0), ", "")))
    progress(f"{label}: draining")
    per_s, pg_ms, io = drain(db_url, args.pending)
    with psycopg.connect(db_url, autocommit=True) as conn:
        sizes = conn.execute(SIZES_ON_DISK).fetchone()
    assert sizes is not None
    disk = f"{sizes[0]} + {sizes[1]} attempts; claim index {sizes[2]}"
    return Measure(
        label,
        finished,
        claim,
        claim_p90,
        claim_first,
        fair,
        gauges,
        nearing,
        per_s,
        pg_ms,
        io,
        dead,
        disk,
    )


def load_finished(db_url: str, have: int, want: int) -> None:
    """Bulk-load finished rows (numbered ``have`` .. ``want - 1``), each succeeded at its first
    attempt."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for first in range(have, want, LOAD_CHUNK):
            last = min(first + LOAD_CHUNK, want) - 1
            conn.execute(LOAD_OPERATIONS, {"first": first, "last": last})
            progress(f"loaded {last + 1:,} finished rows")
        progress("VACUUM (ANALYZE)")
        conn.execute("VACUUM (ANALYZE) outbox.operations")
        conn.execute("VACUUM (ANALYZE) outbox.attempt_log")


def set_autovacuum(db_url: str, *, enabled: bool) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        for table in ("outbox.operations", "outbox.attempt_log"):
            if enabled:
                conn.execute(f"ALTER TABLE {table} RESET (autovacuum_enabled)")
            else:
                conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")


def churn(db_url: str, total: int, batch: int) -> None:
    """``total`` rows through enqueue, claim and record, as many oldest rows deleted."""
    pruned_to = 0  # outbox prune walks the primary key from the last id it deleted
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for first in range(0, total, batch):
            last = min(first + batch, total) - 1
            ids = [row[0] for row in conn.execute(CHURN_INSERT, {"first": first, "last": last})]
            conn.execute(CHURN_CLAIM, {"ids": ids})
            conn.execute(CHURN_RECORD, {"ids": ids})
            params = {"after": pruned_to, "older_than": timedelta(0), "batch": len(ids)}
            pruned = [row[0] for row in conn.execute(statements.PRUNE_BATCH, params)]
            pruned_to = max(pruned, default=pruned_to)
            if (last + 1) % (10 * batch) == 0:
                progress(f"churned {last + 1:,} operations")


def vacuum_after_churn(db_url: str, timeout: float) -> str:
    """Autovacuum's normal behaviour after the churn; returns what happened, for the table.

    With the server's autovacuum on, wait for it to vacuum outbox.operations. With it off (as on
    a server tuned for a test suite), run what it would run: VACUUM (ANALYZE) with autovacuum's
    default throttling (cost delay 2 ms, cost limit 200); the churn's dead tuples are far past
    its default trigger (50 + 20 % of the table's rows).
    """
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SHOW autovacuum").fetchone()
        on = row is not None and row[0] == "on"
        if not on:
            progress("the server's autovacuum is off: VACUUM with autovacuum's throttling")
            started = time.monotonic()
            conn.execute("SET vacuum_cost_delay = '2ms'")
            conn.execute("SET vacuum_cost_limit = 200")
            conn.execute("VACUUM (ANALYZE) outbox.operations")
            conn.execute("VACUUM (ANALYZE) outbox.attempt_log")
            return f"VACUUM throttled as autovacuum ({time.monotonic() - started:.0f} s)"
    progress("waiting for autovacuum")
    before = int(scalar(db_url, VACUUM_STATS))
    try:
        waited = wait_until(
            lambda: int(scalar(db_url, VACUUM_STATS)) > before,
            timeout=timeout,
            what="autovacuum of outbox.operations",
            interval=2.0,
        )
    except TimeoutError:
        return f"autovacuum (not done in {timeout:.0f} s)"
    return f"autovacuum ({waited:.0f} s)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--max-rows", type=int, default=SIZES[-1])
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument("--claim-runs", type=int, default=200)
    parser.add_argument("--churn-ops", type=int, default=1_000_000)
    parser.add_argument("--churn-batch", type=int, default=10_000)
    parser.add_argument(
        "--autovacuum-wait",
        type=float,
        default=900.0,
        help="seconds to wait for autovacuum after the churn",
    )
    args = parser.parse_args(argv)
    sizes = sorted({s for s in SIZES if s <= args.max_rows} | {args.max_rows})

    print_machine()
    results: list[Measure] = []
    explains: list[tuple[str, str]] = []
    started = time.monotonic()
    with fresh_database(prefix="growth_") as db_url:
        loaded = 0
        for size in sizes:
            if size > loaded:
                load_finished(db_url, loaded, size)
                loaded = size
            largest = size == sizes[-1]
            results.append(
                measure(db_url, f"{size:,} finished", size, args, explains if largest else None)
            )
        if args.churn_ops > 0:
            set_autovacuum(db_url, enabled=False)
            progress(f"churn: {args.churn_ops:,} operations, autovacuum off")
            churn(db_url, args.churn_ops, args.churn_batch)
            results.append(measure(db_url, "churned, no vacuum", loaded, args, explains))
            set_autovacuum(db_url, enabled=True)
            note = vacuum_after_churn(db_url, args.autovacuum_wait)
            results.append(measure(db_url, f"churned, then {note}", loaded, args, explains))

    base = results[0]
    rows = [
        (
            m.label,
            f"{m.claim_ms:.3f}",
            f"{m.claim_p90_ms:.3f}",
            f"{m.claim_first_ms:.3f}",
            fmt_ratio(m.claim_ms / base.claim_ms),
            f"{m.fair_ms:.3f}",
            fmt_ratio(m.fair_ms / base.fair_ms),
            fmt_rate(m.drain_per_s),
            f"{(1 - m.drain_per_s / base.drain_per_s) * 100:+.1f} %".replace("+-", "-"),
            f"{m.drain_pg_cpu_ms:.3f}",
            f"{m.drain_io.wal_kb:.1f}",
            f"{m.drain_io.full_page_images:.2f}",
            f"{m.drain_io.blocks_read:.2f}",
            f"{m.gauges_ms:.2f}",
            f"{m.nearing_ms:.2f}",
            f"{m.dead_tuples:,}",
            m.disk,
        )
        for m in results
    ]
    print_table(
        [
            "finished rows",
            "claim ms (median)",
            "p90",
            "first",
            "x at 0",
            "fair claim ms",
            "fair x at 0",
            "drain ops/s",
            "loss vs 0",
            "PG CPU ms/op",
            "WAL kB/op",
            "full pages/op",
            "reads/op",
            "GAUGES ms",
            "NEARING_KEY_EXPIRY ms",
            "dead tuples",
            "size on disk",
        ],
        rows,
        title=f"Growth: claim {CLAIM_LIMIT} of {args.pending:,} pending, "
        f"{args.claim_runs} runs; drain with one outbox run (noop, 64 x 100)",
    )
    largest = next(m for m in results if m.finished == sizes[-1])
    claim_ratio = largest.claim_ms / base.claim_ms
    loss = 1 - largest.drain_per_s / base.drain_per_s
    print_table(
        ["target", "measured", "verdict"],
        [
            (
                f"claim at {sizes[-1]:,} ≤ {CLAIM_TARGET} x at 0",
                f"{claim_ratio:.2f} x",
                "met" if claim_ratio <= CLAIM_TARGET else "missed",
            ),
            (
                f"throughput loss at {sizes[-1]:,} ≤ {THROUGHPUT_LOSS_TARGET:.0%}",
                f"{loss:.1%}",
                "met" if loss <= THROUGHPUT_LOSS_TARGET else "missed",
            ),
        ],
    )
    for label, plan in explains:
        print(f"### EXPLAIN (ANALYZE, BUFFERS) of {label}\n\n```\n{plan}\n```\n")
    progress(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

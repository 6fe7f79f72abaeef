"""Issue 41's first measurement: candidate lifecycles in bare workers, measured before any was
built (C+S, the keys apart and a success inline, is outbox's since sql/0050 and sql/0051).

    python bench/lifecycle.py                       # 0, 1 and 5 million finished rows
    python bench/lifecycle.py --sizes 0,1000000     # quicker
    python bench/lifecycle.py --quick               # 0 and 100,000, a smoke run

Each variant is a copy of ``outbox.operations`` (and ``outbox.attempt_log``) in a schema of its
own, with the indexes the variant keeps, driven by plain SQL in the shape of the dispatcher's
claim and record (no provider, no Python per operation): what each design writes, measured
apart from everything else ``outbox run`` does. The variants (docs/drafts/lifecycle-research.md):

* ``sql/0049``: the lifecycle before issue 41 (earlier tables of bench/README.md call it
  ``today``): every index of today's table and the two unique ones sql/0051 moved out
  (``operations_identity``, ``operations_provider_key``); the claim and the record each UPDATE the
  row (never HOT: both change indexed columns), the record INSERTs an attempts row (foreign key
  checked);
* ``sql/0049, no foreign key``: the same without the attempts row's foreign key (and the KEY
  SHARE lock it takes on the operation's new version at every record);
* ``keys apart`` (design C): the same without the two unique indexes, whose uniqueness moved to
  a table written once at enqueue (sql/0051's ``operation_keys``, not written here);
* ``keys apart, success inline`` (C+S, outbox's lifecycle since sql/0051): also no attempts row
  for a success at its first attempt;
* ``live table`` (A+S): the row keeps only the indexes of what never changes (pkey, identity,
  provider key), and a narrow ``live`` row per unfinished operation carries the claim's and the
  lease's indexes; the claim updates ``live`` and HOT-updates the row, a success DELETEs the
  ``live`` row and HOT-updates the row, no attempts row.

At each size, finished rows are loaded (succeeded, one attempt row where the variant keeps one),
``--pending`` pending rows added, then: the claim of 100 (median of ``--claim-runs``, each rolled
back, prepared, generic plan), and, after a VACUUM and a CHECKPOINT, a drain of the pending rows
by ``--workers`` bare workers (claim 100, commit, record, commit): operations per second, WAL per
operation (full-page images included: each page's first change after the checkpoint) and the
share of the row's updates that were HOT. Not measured here: enqueue (issue 41 asks 0.8x of an
INSERT; design A writes a second row), the keys table's own INSERT, and anything in Python.
Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from _support import fmt_rate, fmt_ratio, fresh_database, print_machine, print_table, progress
from psycopg import sql

CLAIM_LIMIT = 100
# The unique indexes sql/0051 moved out of outbox.operations, as they were: the variants that
# keep them measure the lifecycle before it.
UNIQUE_KEYS: dict[str, str] = {
    "operations_identity": "CREATE UNIQUE INDEX operations_identity ON outbox.operations"
    " USING btree (tenant_id, operation_type, operation_key)",
    "operations_provider_key": "CREATE UNIQUE INDEX operations_provider_key ON outbox.operations"
    " USING btree (provider, idempotency_key) WHERE (NOT key_shared)",
}
LIVE_INDEXES = ("operations_pkey", *UNIQUE_KEYS)
# The benchmark vacuums when it means to: an autovacuum of the freshly loaded rows during a drain
# would add its WAL (the counter is the cluster's) and its CPU to the drain's.
NO_AUTOVACUUM = sql.SQL("autovacuum_enabled = false")


@dataclass(frozen=True)
class Variant:
    name: str
    schema: str
    indexes: Callable[[str], bool]  # which of today's operations indexes it keeps
    attempt_rows: bool  # an attempts row for a success at its first attempt
    live: bool  # a narrow live table carries the state indexes
    foreign_key: bool = True  # attempts.operation_id references operations (ON DELETE CASCADE)
    # operations partitioned by status: unfinished rows (pending, in flight) in one partition,
    # every other status in another; a success moves its row across, once
    partitioned: bool = False


VARIANTS = (
    Variant("sql/0049", "lc_today", lambda name: True, attempt_rows=True, live=False),
    Variant(
        "sql/0049, no foreign key",
        "lc_nofk",
        lambda name: True,
        attempt_rows=True,
        live=False,
        foreign_key=False,
    ),
    Variant(
        "keys apart", "lc_keys", lambda name: name not in UNIQUE_KEYS, attempt_rows=True, live=False
    ),
    Variant(
        "keys apart, success inline",
        "lc_keys_inline",
        lambda name: name not in UNIQUE_KEYS,
        attempt_rows=False,
        live=False,
    ),
    Variant(
        "live table", "lc_live", lambda name: name in LIVE_INDEXES, attempt_rows=False, live=True
    ),
    Variant(
        "unfinished partition",
        "lc_part",
        lambda name: name not in UNIQUE_KEYS,
        attempt_rows=False,
        live=False,
        foreign_key=False,  # a foreign key to a partitioned table needs the partition key too
        partitioned=True,
    ),
)

# Finished operations as `outbox run` leaves them (bench/growth.py's shape), numbered 1..n.
STAGE_FINISHED: LiteralString = """
CREATE UNLOGGED TABLE public.lc_finished AS
SELECT 'bench'::text AS tenant_id, 'bench.done'::text AS operation_type, k.key AS operation_key,
       sha256(convert_to('noop' || E'\\n' || 'bench' || E'\\n' || p.payload::text, 'UTF8'))
           AS fingerprint,
       'noop'::text AS provider, 'bench'::text AS action, p.payload,
       outbox.derive_idempotency_key('bench', 'bench.done', k.key) AS idempotency_key,
       'succeeded'::text AS status, 1 AS attempts, t.at AS available_at, t.at AS first_sent_at,
       t.at AS last_attempt_at, 'noop_' || i AS provider_ref,
       jsonb_build_object('id', 'noop_' || i) AS result, t.at AS created_at, t.at AS updated_at,
       t.at AS status_changed_at, t.at AS finished_at, i AS n
FROM generate_series(1, %(rows)s::bigint) AS i,
     LATERAL (SELECT 'done-' || lpad(i::text, 10, '0') AS key) AS k,
     LATERAL (SELECT jsonb_build_object('n', i, 'amount', 1000, 'currency', 'usd',
                                        'customer', 'cus_bench') AS payload) AS p,
     LATERAL (SELECT now() - interval '2 days' + i * interval '10 ms' AS at) AS t
"""
FINISHED_COLUMNS = (
    "tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,"
    " idempotency_key, status, attempts, available_at, first_sent_at, last_attempt_at,"
    " provider_ref, result, created_at, updated_at, status_changed_at, finished_at"
)
TODAYS_INDEXES: LiteralString = """
SELECT indexname, indexdef FROM pg_indexes
WHERE schemaname = 'outbox' AND tablename = 'operations'
"""


def build(conn: psycopg.Connection[Any], v: Variant, finished: int) -> None:
    """The variant's tables with ``finished`` rows loaded, then its indexes, then VACUUM."""
    s = sql.Identifier(v.schema)
    conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(s))
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
    if v.partitioned:
        create_partitioned(conn, s)
    else:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.operations (LIKE outbox.operations INCLUDING DEFAULTS"
                " INCLUDING CONSTRAINTS INCLUDING IDENTITY) WITH (fillfactor = 80, {})"
            ).format(s, NO_AUTOVACUUM)
        )
    conn.execute(
        sql.SQL(
            "CREATE TABLE {}.attempts (LIKE outbox.attempt_log INCLUDING DEFAULTS"
            " INCLUDING CONSTRAINTS) WITH ({})"
        ).format(s, NO_AUTOVACUUM)
    )
    if finished:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.operations ({}) SELECT {} FROM public.lc_finished WHERE n <= %s"
            ).format(s, sql.SQL(FINISHED_COLUMNS), sql.SQL(FINISHED_COLUMNS)),
            (finished,),
        )
        if v.attempt_rows:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.attempts (operation_id, attempt, idempotency_key, worker,"
                    " started_at, finished_at, outcome, sent, http_status, provider_request_id)"
                    " SELECT id, 1, idempotency_key, 'loader', last_attempt_at, finished_at,"
                    " 'succeeded', true, 200, 'req_' || id FROM {}.operations"
                ).format(s, s)
            )
    for name, definition in [*conn.execute(TODAYS_INDEXES).fetchall(), *UNIQUE_KEYS.items()]:
        if not v.indexes(name):
            continue
        # A unique index of a partitioned table must hold its partition key: each partition
        # gets its own (ids come from one sequence).
        for table in PARTITIONS if v.partitioned and "UNIQUE" in definition else ("operations",):
            conn.execute(
                definition.replace(" ON outbox.operations ", f" ON {v.schema}.{table} ").replace(
                    f"INDEX {name} ", f"INDEX {v.schema}_{table}_{name} "
                )
            )
    conn.execute(
        sql.SQL("ALTER TABLE {}.attempts ADD PRIMARY KEY (operation_id, attempt)").format(s)
    )
    if v.foreign_key:
        conn.execute(
            sql.SQL(
                "ALTER TABLE {}.attempts ADD FOREIGN KEY (operation_id)"
                " REFERENCES {}.operations (id) ON DELETE CASCADE"
            ).format(s, s)
        )
    if v.live:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.live (id bigint PRIMARY KEY, provider text NOT NULL,"
                " tenant_id text NOT NULL, available_at timestamptz NOT NULL,"
                " state text NOT NULL, lease_expires_at timestamptz)"
                " WITH (fillfactor = 80, autovacuum_enabled = false);"
                " CREATE INDEX ON {}.live (provider, tenant_id, available_at, id)"
                " WHERE state = 'ready';"
                " CREATE INDEX ON {}.live (lease_expires_at) WHERE state = 'in_flight'"
            ).format(s, s, s)
        )
    conn.execute(sql.SQL("VACUUM (ANALYZE) {}.operations").format(s))
    conn.execute(sql.SQL("VACUUM (ANALYZE) {}.attempts").format(s))


PARTITIONS = ("operations_unfinished", "operations_finished")


def create_partitioned(conn: psycopg.Connection[Any], s: sql.Identifier) -> None:
    """outbox.operations partitioned by status, its id drawn from a sequence of its own (PG 15
    has no identity column on a partitioned table)."""
    conn.execute(
        sql.SQL(
            "CREATE TABLE {s}.operations (LIKE outbox.operations INCLUDING DEFAULTS"
            " INCLUDING CONSTRAINTS) PARTITION BY LIST (status);"
            " CREATE SEQUENCE {s}.operations_id_seq;"
            " ALTER TABLE {s}.operations ALTER id SET DEFAULT nextval('{s}.operations_id_seq');"
            " CREATE TABLE {s}.operations_unfinished PARTITION OF {s}.operations"
            " FOR VALUES IN ('pending', 'in_flight') WITH (fillfactor = 80, {no_vacuum});"
            " CREATE TABLE {s}.operations_finished PARTITION OF {s}.operations DEFAULT"
            " WITH (fillfactor = 80, {no_vacuum})"
        ).format(s=s, no_vacuum=NO_AUTOVACUUM)
    )


def add_pending(conn: psycopg.Connection[Any], v: Variant, pending: int) -> int:
    """``pending`` due rows; returns how many pages hold them."""
    s = sql.Identifier(v.schema)
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.operations (tenant_id, operation_type, operation_key, fingerprint,"
            " provider, action, payload, idempotency_key, payload_bytes)"
            " SELECT 'bench', 'bench.op', 'op-' || i, sha256(convert_to('op-' || i, 'UTF8')),"
            " 'noop', 'bench', jsonb_build_object('n', i, 'amount', 1000),"
            " outbox.derive_idempotency_key('bench', 'bench.op', 'op-' || i), 30"
            " FROM generate_series(1, %s) AS i"
        ).format(s),
        (pending,),
    )
    if v.live:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.live (id, provider, tenant_id, available_at, state)"
                " SELECT id, provider, tenant_id, available_at, 'ready' FROM {}.operations"
                " WHERE status = 'pending'"
            ).format(s, s)
        )
        conn.execute(sql.SQL("ANALYZE {}.live").format(s))
    conn.execute(sql.SQL("ANALYZE {}.operations").format(s))
    # Where the free space map put them: packed into new pages, or one by one into the free
    # space the fillfactor left in the finished rows' pages. HOT and WAL per row follow it.
    row = conn.execute(
        sql.SQL(
            "SELECT count(DISTINCT (ctid::text::point)[0]) FROM {}.operations"
            " WHERE status = 'pending'"
        ).format(s)
    ).fetchone()
    assert row is not None
    return int(row[0])


def claim_statement(v: Variant) -> sql.Composed:
    """Claim up to 100 due rows of one provider and tenant, as CLAIM_ONE_GROUP does."""
    if v.live:
        return sql.SQL(
            """
            WITH c AS (
                UPDATE {s}.live l SET state = 'in_flight',
                       lease_expires_at = now() + interval '30 seconds'
                WHERE l.id IN (SELECT id FROM {s}.live
                               WHERE provider = 'noop' AND tenant_id = 'bench'
                                 AND state = 'ready' AND available_at <= now()
                               ORDER BY available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED)
                RETURNING l.id, l.lease_expires_at)
            UPDATE {s}.operations o
            SET status = 'in_flight', lease_owner = 'bare', lease_token = gen_random_uuid(),
                lease_expires_at = c.lease_expires_at, attempts = o.attempts + 1,
                last_attempt_at = now(), updated_at = now(), status_changed_at = now()
            FROM c WHERE o.id = c.id
            RETURNING o.id, o.payload, o.idempotency_key"""
        ).format(s=sql.Identifier(v.schema))
    return sql.SQL(
        """
        UPDATE {s}.operations o
        SET status = 'in_flight', lease_owner = 'bare', lease_token = gen_random_uuid(),
            lease_expires_at = now() + interval '30 seconds', attempts = o.attempts + 1,
            last_attempt_at = now(), updated_at = now(), status_changed_at = now()
        WHERE o.id IN (SELECT id FROM {s}.operations
                       WHERE provider = 'noop' AND tenant_id = 'bench' AND status = 'pending'
                         AND NOT ordering_blocked AND NOT scheduled AND available_at <= now()
                       ORDER BY available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED)
          {pruned}
        RETURNING o.id, o.payload, o.idempotency_key"""
    ).format(
        s=sql.Identifier(v.schema),
        # The update itself finds the rows in the unfinished partition only.
        pruned=sql.SQL("AND o.status = 'pending'" if v.partitioned else ""),
    )


def record_statement(v: Variant) -> sql.Composed:
    """A success at the first attempt for each claimed id (%(ids)s)."""
    succeeded = """
        UPDATE {s}.operations o
        SET status = 'succeeded', lease_owner = NULL, lease_token = NULL,
            lease_expires_at = NULL, first_sent_at = o.last_attempt_at,
            provider_ref = 'noop_' || o.id, result = jsonb_build_object('id', 'noop_' || o.id),
            updated_at = now(), status_changed_at = now(), finished_at = now()
        WHERE o.id {where} AND o.status = 'in_flight'
        RETURNING o.id, o.idempotency_key, o.last_attempt_at"""
    if v.live:
        text = "WITH gone AS (DELETE FROM {s}.live l WHERE l.id = ANY (%(ids)s) RETURNING l.id)"
        text += succeeded.format(s="{s}", where="IN (SELECT id FROM gone)")
    elif v.attempt_rows:
        text = "WITH recorded AS (" + succeeded.format(s="{s}", where="= ANY (%(ids)s)") + ")"
        text += """
        INSERT INTO {s}.attempts (operation_id, attempt, idempotency_key, worker, started_at,
                                  finished_at, outcome, sent, http_status)
        SELECT id, 1, idempotency_key, 'bare', last_attempt_at, now(), 'succeeded', true, 200
        FROM recorded"""
    else:
        text = succeeded.format(s="{s}", where="= ANY (%(ids)s)")
    return sql.SQL(text).format(s=sql.Identifier(v.schema))


def time_claims(db_url: str, v: Variant, runs: int) -> float:
    """Median time (ms) of the claim of 100, each run rolled back."""
    claim = claim_statement(v)
    times: list[float] = []
    with psycopg.connect(db_url) as conn:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        conn.commit()
        for _ in range(runs):
            started = time.perf_counter()
            rows = conn.execute(claim, prepare=True).fetchall()
            times.append((time.perf_counter() - started) * 1000)
            conn.rollback()
            if len(rows) != CLAIM_LIMIT:
                raise RuntimeError(f"{v.name}: the claim returned {len(rows)} rows")
    return statistics.median(times)


def in_threads(work: Callable[[int], None], count: int) -> float:
    """``work(0)`` to ``work(count - 1)`` at once, one thread each: the seconds until the last
    ends. The first failure is raised here, once every thread has ended."""
    failures: list[Exception] = []

    def guarded(n: int) -> None:
        try:
            work(n)
        except Exception as exc:  # noqa: BLE001 (reported by the main thread)
            failures.append(exc)

    threads = [threading.Thread(target=guarded, args=(n,)) for n in range(count)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]
    return time.perf_counter() - started


def drain(db_url: str, v: Variant, workers: int) -> tuple[float, int, int]:
    """Bare workers claim and record until nothing is left: seconds taken, operations done, and
    claims that failed and were retried. A partitioned variant's claim fails (40001) where its
    FOR UPDATE meets a row a concurrent record moved to the other partition: PostgreSQL does not
    follow a row across partitions, and SKIP LOCKED does not skip it."""
    claim, record = claim_statement(v), record_statement(v)
    done, retried = [0] * workers, [0] * workers

    def work(n: int) -> None:
        with psycopg.connect(db_url) as conn:
            while True:
                try:
                    ids = [row[0] for row in conn.execute(claim, prepare=True).fetchall()]
                except psycopg.errors.SerializationFailure:
                    conn.rollback()
                    retried[n] += 1
                    continue
                conn.commit()
                if not ids:
                    return
                conn.execute(record, {"ids": ids}, prepare=True)
                conn.commit()
                done[n] += len(ids)

    return in_threads(work, workers), sum(done), sum(retried)


@dataclass(frozen=True)
class Result:
    variant: str
    finished: int
    claim_ms: float
    drain_per_s: float
    wal_bytes_per_op: float
    hot_share: float
    pending_pages: int
    claims_retried: int


def counters(conn: psycopg.Connection[Any], v: Variant) -> tuple[int, int, int]:
    """WAL position (bytes), the row's updates and HOT updates so far."""
    time.sleep(1.2)  # the workers' backends flush their statistics as they exit
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint, sum(n_tup_upd)::bigint,"
        " sum(n_tup_hot_upd)::bigint FROM pg_stat_user_tables WHERE schemaname = %s"
        " AND relname LIKE 'operations%%'",  # a partitioned variant's partitions too
        (v.schema,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def measure(db_url: str, v: Variant, finished: int, args: argparse.Namespace) -> Result:
    s = sql.Identifier(v.schema)
    with psycopg.connect(db_url, autocommit=True) as conn:
        progress(f"{v.name}: {finished:,} finished rows")
        build(conn, v, finished)
        pages = add_pending(conn, v, args.pending)
        claim_ms = time_claims(db_url, v, args.claim_runs)
        # The drain starts from the same state in every variant: the rolled-back claims' row
        # versions vacuumed away, and every page's next change logging it whole.
        for table in ("operations", "live") if v.live else ("operations",):
            conn.execute(sql.SQL("VACUUM {}.{}").format(s, sql.Identifier(table)))
        conn.execute("CHECKPOINT")
        wal0, upd0, hot0 = counters(conn, v)
        seconds, ops, retried = drain(db_url, v, args.workers)
        wal1, upd1, hot1 = counters(conn, v)
        if ops != args.pending:
            raise RuntimeError(f"{v.name}: drained {ops} of {args.pending}")
        left = conn.execute(
            sql.SQL("SELECT count(*) FROM {}.operations WHERE status <> 'succeeded'").format(
                sql.Identifier(v.schema)
            )
        ).fetchone()
        if left != (0,):
            raise RuntimeError(f"{v.name}: {left} rows not succeeded after the drain")
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(v.schema)))
    # Each operation is updated twice by the drain (claim, record).
    return Result(
        v.name,
        finished,
        claim_ms,
        ops / seconds,
        (wal1 - wal0) / ops,
        (hot1 - hot0) / max(1, upd1 - upd0),
        pages,
        retried,
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="0,1000000,5000000")
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--claim-runs", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--only",
        default=",".join(v.schema for v in VARIANTS),
        help="the variants to run, by schema (lc_today, lc_keys_inline, lc_part, ...); the "
        "first is the one the others are compared with",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.pending, args.claim_runs = "0,100000", 5_000, 20
    by_schema = {v.schema: v for v in VARIANTS}
    chosen = [by_schema[name] for name in args.only.split(",")]
    sizes = sorted({int(s) for s in args.sizes.split(",")})
    print_machine()
    results: list[Result] = []
    started = time.monotonic()
    with fresh_database(prefix="lifecycle_") as db_url:
        with psycopg.connect(db_url, autocommit=True) as conn:
            progress(f"staging {sizes[-1]:,} finished rows")
            conn.execute(STAGE_FINISHED, {"rows": sizes[-1]})
        for size in sizes:
            for v in chosen:
                results.append(measure(db_url, v, size, args))
    first = {r.variant: r for r in results if r.finished == sizes[0]}
    base = {r.finished: r for r in results if r.variant == chosen[0].name}
    print_table(
        [
            "variant",
            "finished rows",
            "claim ms",
            f"x at {sizes[0]:,}",
            "drain ops/s",
            f"x {chosen[0].name}",
            "WAL B/op",
            "HOT share of updates",
            "pages of the pending rows",
            "claims retried (40001)",
        ],
        [
            (
                r.variant,
                f"{r.finished:,}",
                f"{r.claim_ms:.3f}",
                fmt_ratio(r.claim_ms / first[r.variant].claim_ms),
                fmt_rate(r.drain_per_s),
                fmt_ratio(r.drain_per_s / base[r.finished].drain_per_s),
                f"{r.wal_bytes_per_op:,.0f}",
                f"{r.hot_share:.0%}",
                f"{r.pending_pages:,}",
                f"{r.claims_retried:,}",
            )
            for r in results
        ],
        title=f"Lifecycles in bare workers: claim {CLAIM_LIMIT} of {args.pending:,} pending "
        f"({args.claim_runs} runs); drain by {args.workers} workers",
    )
    progress(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

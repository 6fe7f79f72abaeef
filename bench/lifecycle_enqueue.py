"""Issue 41: what each candidate lifecycle makes enqueue write, in bare producers, measured
before any was built (the part bench/lifecycle.py leaves out).

    python bench/lifecycle_enqueue.py              # 10,000 rows per run, 3 rounds
    python bench/lifecycle_enqueue.py --quick      # 2,000 rows, 1 round

Each producer commits one row per statement (autocommit, prepared), in the shape the design
would give ``outbox.enqueue``'s INSERT, beside a plain INSERT of the same row into a copy of
today's table with every index (issue 41's baseline: enqueue at >= 0.8x of it):

* ``sql/0049``: INSERT ... ON CONFLICT (identity) DO NOTHING into the table as it was before
  sql/0051 (earlier tables of bench/README.md call it ``today``);
* ``keys apart`` (designs C and C+S, outbox's enqueue since sql/0051): the row's identity and
  provider key first into a table of keys written once (both unique there, ON CONFLICT DO
  NOTHING, the operation's id drawn from the operations' sequence), then the row into operations
  without either unique index;
* ``live table`` (A+S): the row into operations keeping pkey, identity and provider key (ON
  CONFLICT as today), then a narrow ``live`` row carrying the claim's index.

Only the INSERTs: no function around them, no checks, no deferred triggers, which
``outbox.enqueue`` adds to every shape alike. Rows per second, median of the rounds, at 1 and
``--producers`` producers. Exits non-zero only on errors.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any, LiteralString

import psycopg
from _support import fmt_rate, fmt_ratio, fresh_database, print_machine, print_table, progress
from lifecycle import VARIANTS, build, in_threads
from psycopg import sql

# The row as enqueue writes it (bench/lifecycle.py's pending rows): its columns and values.
COLUMNS: LiteralString = (
    "tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,"
    " idempotency_key, payload_bytes"
)
VALUES: LiteralString = (
    "'bench', 'bench.enq', %(key)s, sha256(convert_to(%(key)s, 'UTF8')), 'noop', 'bench',"
    " jsonb_build_object('key', %(key)s::text, 'amount', 1000),"
    " outbox.derive_idempotency_key('bench', 'bench.enq', %(key)s), 30"
)
KEYS_TABLE = """
CREATE TABLE {s}.keys (
    tenant_id text NOT NULL, operation_type text NOT NULL, operation_key text NOT NULL,
    provider text NOT NULL, idempotency_key text NOT NULL, operation_id bigint NOT NULL,
    PRIMARY KEY (tenant_id, operation_type, operation_key),
    UNIQUE (provider, idempotency_key))
"""
# Each statement's {s} is the variant's schema, {cols} COLUMNS and {vals} VALUES.
SHAPES: dict[str, tuple[str, LiteralString]] = {
    # name: (schema of the variant, statement)
    "plain INSERT": ("lc_today", "INSERT INTO {s}.operations ({cols}) VALUES ({vals})"),
    "sql/0049": (
        "lc_today",
        "INSERT INTO {s}.operations ({cols}) VALUES ({vals})"
        " ON CONFLICT (tenant_id, operation_type, operation_key) DO NOTHING RETURNING id",
    ),
    "keys apart": (
        "lc_keys",
        "WITH k AS (INSERT INTO {s}.keys (tenant_id, operation_type, operation_key, provider,"
        " idempotency_key, operation_id)"
        " VALUES ('bench', 'bench.enq', %(key)s, 'noop',"
        " outbox.derive_idempotency_key('bench', 'bench.enq', %(key)s),"
        " nextval(pg_get_serial_sequence('{s}.operations', 'id')))"
        " ON CONFLICT DO NOTHING RETURNING operation_id)"
        " INSERT INTO {s}.operations (id, {cols}) OVERRIDING SYSTEM VALUE"
        " SELECT k.operation_id, {vals} FROM k RETURNING id",
    ),
    "live table": (
        "lc_live",
        "WITH o AS (INSERT INTO {s}.operations ({cols}) VALUES ({vals})"
        " ON CONFLICT (tenant_id, operation_type, operation_key) DO NOTHING"
        " RETURNING id, provider, tenant_id, available_at)"
        " INSERT INTO {s}.live (id, provider, tenant_id, available_at, state)"
        " SELECT id, provider, tenant_id, available_at, 'ready' FROM o RETURNING id",
    ),
}


def prepare(conn: psycopg.Connection[Any]) -> None:
    """Each variant's tables, empty, with their indexes (and the keys table for C)."""
    for v in VARIANTS:
        if v.schema in {schema for schema, _ in SHAPES.values()}:
            build(conn, v, 0)
    conn.execute(sql.SQL(KEYS_TABLE).format(s=sql.Identifier("lc_keys")))


def _inserted(shape: str, row: object) -> None:
    if row is None:
        raise RuntimeError(f"{shape}: a new key was taken as a duplicate")


def produce(db_url: str, shape: str, rows: int, producers: int, tag: str) -> float:
    """Rows per second of ``producers`` threads committing ``rows`` rows in all."""
    schema, text = SHAPES[shape]
    statement = sql.SQL(text).format(
        s=sql.Identifier(schema), cols=sql.SQL(COLUMNS), vals=sql.SQL(VALUES)
    )
    conns = [psycopg.connect(db_url, autocommit=True) for _ in range(producers)]

    def work(n: int) -> None:
        for i in range(rows // producers):
            cur = conns[n].execute(statement, {"key": f"{tag}-{n}-{i}"}, prepare=True)
            if shape != "plain INSERT":
                _inserted(shape, cur.fetchone())

    try:
        seconds = in_threads(work, producers)
    finally:
        for conn in conns:
            conn.close()
    return (rows // producers * producers) / seconds


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--producers", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.repeat = 2_000, 1
    print_machine()
    rates: dict[tuple[str, int], list[float]] = {}
    with fresh_database(prefix="lifecycle_enqueue_") as db_url:
        with psycopg.connect(db_url, autocommit=True) as conn:
            prepare(conn)
        for producers in sorted({1, args.producers}):
            for r in range(args.repeat):
                for shape in SHAPES:  # in turn, so that drift reaches every shape alike
                    progress(f"{producers} producers, round {r + 1}: {shape}")
                    rate = produce(db_url, shape, args.rows, producers, f"{shape}-{producers}-{r}")
                    rates.setdefault((shape, producers), []).append(rate)
        with psycopg.connect(db_url, autocommit=True) as conn:
            written = conn.execute("SELECT count(*) FROM lc_keys.operations").fetchone()
            keys = conn.execute("SELECT count(*) FROM lc_keys.keys").fetchone()
            if written != keys:
                raise RuntimeError(f"keys apart: {written} operations, {keys} keys")
    medians = {k: statistics.median(v) for k, v in rates.items()}
    rows = []
    for (shape, producers), rate in medians.items():
        base = medians[("plain INSERT", producers)]
        rows.append((shape, str(producers), fmt_rate(rate), fmt_ratio(rate / base)))
    print_table(
        ["shape", "producers", "rows/s (median)", "x plain INSERT"],
        rows,
        title=f"Enqueue's INSERTs in bare producers: {args.rows:,} rows a run, "
        f"{args.repeat} rounds, one row per statement",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

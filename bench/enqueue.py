"""Enqueue cost: producer transactions per second with `outbox.enqueue`, against a plain INSERT
of a row of the same shape into a table of the same shape with no trigger and no NOTIFY.

    python bench/enqueue.py                 # 1 and 8 producers, 10 s per measurement
    python bench/enqueue.py --quick         # 3 s per measurement
    python bench/enqueue.py --producers 1,4,8 --seconds 20

One operation per transaction, each producer a process with its own connection (two cores: no
shared GIL). Variants: the Python API (`outbox.enqueue` on a psycopg connection), the SQL function
called directly, a plain INSERT (fingerprint and idempotency key computed in Python, as a
hand-written outbox would) into `LIKE outbox.operations INCLUDING ALL` (same columns, defaults,
constraints and indexes; triggers are not copied), and that INSERT followed by a pg_notify, to
show what a notify per commit costs on its own. Whether enqueue notifies is read from the
migrated database, not assumed. See bench/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

import psycopg
from _support import fmt_rate, fmt_ratio, fresh_database, print_machine, print_table, progress

import outbox

DEFAULT_SECONDS = 10.0
QUICK_SECONDS = 3.0
DEFAULT_PRODUCERS = (1, 8)
# The target: enqueue at 8 producers keeps 0.8 of the plain INSERT's rate.
TARGET_RATIO = 0.8
TARGET_PRODUCERS = 8
PAYLOAD: dict[str, Any] = {"amount": 1000, "currency": "usd", "customer": "cus_123"}
PROVIDER = "stripe"
ACTION = "payment_intents.create"
TENANT = "acme"
OPERATION_TYPE = "invoice.charge"

PLAIN_TABLE = "public.plain_operations"
CREATE_PLAIN = f"CREATE TABLE {PLAIN_TABLE} (LIKE outbox.operations INCLUDING ALL)"
PLAIN_INSERT = (
    f"INSERT INTO {PLAIN_TABLE} ("  # noqa: S608 (a constant table name, no input)
    " tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,"
    " idempotency_key, correlation_id)"
    " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s) RETURNING id"
)
SQL_ENQUEUE = """
SELECT operation_id, outcome FROM outbox.enqueue(
    tenant_id => %s, operation_type => %s, operation_key => %s, provider => %s, action => %s,
    payload => %s::jsonb, correlation_id => %s)
"""
NOTIFY = "SELECT pg_notify('bench_plain', '')"

# Where a NOTIFY on enqueue could come from: functions of the outbox schema that call pg_notify
# or NOTIFY (a trigger's function among them), and which triggers on the operations table run one.
NOTIFY_SOURCES = """
SELECT 'function ' || p.oid::regprocedure::text
       || coalesce(' (trigger ' || string_agg(t.tgname, ', ') || ')', '')
FROM pg_proc p
JOIN pg_namespace n ON n.oid = p.pronamespace
LEFT JOIN pg_trigger t ON t.tgfoid = p.oid AND t.tgrelid = 'outbox.operations'::regclass
WHERE n.nspname = 'outbox'
  AND (p.prosrc ILIKE '%pg_notify%' OR p.prosrc ~* '\\mnotify\\s')
GROUP BY p.oid
ORDER BY 1
"""
ENQUEUE_CHANNEL = "outbox_enqueue"
NOTIFY_PROBES = 20

Variant = Callable[[psycopg.Connection[Any], str], None]


def _python_api(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        outbox.enqueue(conn, tenant_id=TENANT, operation_type=OPERATION_TYPE, operation_key=key,
                       provider=PROVIDER, action=ACTION, payload=PAYLOAD,
                       correlation_id=key)  # fmt: skip


def _sql_function(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(SQL_ENQUEUE, (TENANT, OPERATION_TYPE, key, PROVIDER, ACTION,
                                   json.dumps(PAYLOAD), key), prepare=True)  # fmt: skip


def _plain_params(key: str) -> tuple[Any, ...]:
    payload = json.dumps(PAYLOAD)
    fingerprint = hashlib.sha256(f"{PROVIDER}\n{ACTION}\n{payload}".encode()).digest()
    identity = json.dumps([TENANT, OPERATION_TYPE, key])
    idempotency_key = "ob1_" + hashlib.sha256(identity.encode()).hexdigest()
    return (TENANT, OPERATION_TYPE, key, fingerprint, PROVIDER, ACTION, payload,
            idempotency_key, key)  # fmt: skip


def _plain_insert(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(PLAIN_INSERT, _plain_params(key), prepare=True)


def _plain_insert_notify(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(PLAIN_INSERT, _plain_params(key), prepare=True)
        conn.execute(NOTIFY, prepare=True)


VARIANTS: dict[str, tuple[str, Variant]] = {
    "python": ("outbox.enqueue (Python API)", _python_api),
    "sql": ("outbox.enqueue(...) SQL function", _sql_function),
    "plain": ("plain INSERT, same shape, no trigger/notify", _plain_insert),
    "plain_notify": ("plain INSERT + pg_notify", _plain_insert_notify),
}


def _producer(job: tuple[str, str, str, float], start: Event,
              total: Synchronized[int]) -> None:  # fmt: skip
    db_url, variant, prefix, seconds = job
    fn = VARIANTS[variant][1]
    done = 0
    with psycopg.connect(db_url) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        start.wait()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            fn(conn, f"{prefix}-{done}")
            done += 1
    with total.get_lock():
        total.value += done


def measure(db_url: str, variant: str, producers: int, seconds: float) -> float:
    """Committed producer transactions per second, ``producers`` processes for ``seconds``."""
    ctx = multiprocessing.get_context("fork")
    start = ctx.Event()
    total: Synchronized[int] = ctx.Value("q", 0)
    tag = f"{variant}-{producers}-{os.getpid()}-{time.monotonic_ns()}"
    procs = [ctx.Process(target=_producer,
                         args=((db_url, variant, f"{tag}-{i}", seconds), start, total))
             for i in range(producers)]  # fmt: skip
    for p in procs:
        p.start()
    time.sleep(0.5)  # every producer connected
    began = time.monotonic()
    start.set()
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"a producer exited {p.exitcode}")
    elapsed = max(time.monotonic() - began, seconds)
    return int(total.value) / elapsed


def notify_sources(db_url: str) -> list[str]:
    """What in the migrated schema may NOTIFY when an operation is enqueued."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        return [str(row[0]) for row in conn.execute(NOTIFY_SOURCES).fetchall()]


def notifications_per_commit(db_url: str, commits: int = NOTIFY_PROBES) -> int:
    """How many of ``commits`` one-operation enqueue transactions a bare LISTEN on the enqueue
    channel hears, with no dispatcher running (each in its own transaction, spaced so that
    PostgreSQL cannot fold them)."""
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as producer:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        for i in range(commits):
            _python_api(producer, f"probe-{os.getpid()}-{i}")
            producer.commit()
            time.sleep(0.01)
        heard = 0
        for _ in listener.notifies(timeout=1.0):
            heard += 1
    return heard


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"per measurement (default {DEFAULT_SECONDS:.0f})")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"--seconds {QUICK_SECONDS:.0f}")
    parser.add_argument("--producers", default=",".join(map(str, DEFAULT_PRODUCERS)),
                        help="producer counts, comma-separated (default 1,8)")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"among {', '.join(VARIANTS)}")  # fmt: skip
    args = parser.parse_args(argv)
    seconds: float = args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS)
    counts = [int(x) for x in args.producers.split(",")]
    variants = [v for v in args.variants.split(",") if v]

    print_machine()
    rates: dict[tuple[str, int], float] = {}
    with fresh_database(prefix="enq_") as db_url:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(CREATE_PLAIN)
        sources = notify_sources(db_url)
        heard = notifications_per_commit(db_url)
        for producers in counts:
            for variant in variants:
                progress(f"{variant}: {producers} producer(s), {seconds:.0f} s")
                rates[variant, producers] = measure(db_url, variant, producers, seconds)
                with psycopg.connect(db_url, autocommit=True) as conn:
                    # Every variant starts from a table as small as the last one's was.
                    conn.execute("TRUNCATE outbox.operations CASCADE")
                    conn.execute(f"TRUNCATE {PLAIN_TABLE}")
                    conn.execute("VACUUM ANALYZE outbox.operations")
                    conn.execute(f"VACUUM ANALYZE {PLAIN_TABLE}")

    rows: list[list[str]] = []
    for variant in variants:
        row = [VARIANTS[variant][0]]
        for producers in counts:
            rate = rates[variant, producers]
            plain = rates.get(("plain", producers), float("nan"))
            row += [fmt_rate(rate), fmt_ratio(rate / plain)]
        rows.append(row)
    headers = ["producer transaction (1 operation)"]
    for producers in counts:
        headers += [f"{producers} producer{'s' if producers > 1 else ''}: tx/s", "x plain"]
    print_table(headers, rows, title=f"Enqueue cost, {seconds:.0f} s per figure")

    every = "yes" if heard == NOTIFY_PROBES else ("sometimes" if heard else "no")
    print(
        f"enqueue NOTIFYs on every commit: {every} ({heard} of {NOTIFY_PROBES} one-operation "
        f"commits heard on {ENQUEUE_CHANNEL} by a bare LISTEN, no dispatcher running)"
    )
    print("where it notifies: " + ("; ".join(sources) if sources else "nowhere in schema outbox"))
    for variant in ("python", "sql"):
        key = (variant, TARGET_PRODUCERS)
        baseline = rates.get(("plain", TARGET_PRODUCERS))
        if key in rates and baseline:
            ratio = rates[key] / baseline
            verdict = "met" if ratio >= TARGET_RATIO else "missed"
            print(f"target {TARGET_RATIO} x plain INSERT at {TARGET_PRODUCERS} producers, "
                  f"{VARIANTS[variant][0]}: {fmt_ratio(ratio)}, {verdict}")  # fmt: skip
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

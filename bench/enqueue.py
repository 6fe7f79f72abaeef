"""Enqueue cost: producer transactions per second with `outbox.enqueue`, against a plain INSERT
of a row of the same shape into a table of the same shape with no trigger and no NOTIFY.

    python bench/enqueue.py                 # 1 and 8 producers, 10 s per measurement
    python bench/enqueue.py --quick         # 3 s per measurement, one round
    python bench/enqueue.py --producers 1,4,8 --seconds 20

One operation per transaction, each producer a process with its own connection (two cores: no
shared GIL). Variants: the Python API (`outbox.enqueue` on a psycopg connection), the SQL function
called directly, a plain INSERT (fingerprint and idempotency key computed in Python, as a
hand-written outbox would) into `LIKE outbox.operations INCLUDING ALL` (same columns, defaults,
constraints and indexes, and its storage parameters copied; triggers are not), the same INSERT
into such a table that also has the identity and the provider key unique (the baseline's shape
before sql/0051 moved both rules out of outbox.operations), and the first INSERT
followed by a pg_notify, to show what a notify per commit costs on its own. Enqueue notifies
only the first time after a dispatcher went idle (sql/0012, 0029): the Python API is measured
again with one registered as waiting. Whether enqueue notifies is measured with a bare LISTEN,
not assumed.
Contracts (issue 42): the Python API with a 1 KB payload, once for a type under a 20-property
contract (checked before the row exists) and once for a type with none; the target is the first
at 0.8 of the second or better.
Each figure is the median of --repeat rounds, the variants taken round-robin. See bench/README.md.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

import psycopg
from _support import (
    fmt_rate,
    fmt_ratio,
    fresh_database,
    median,
    print_machine,
    print_table,
    progress,
)
from contracts import contract_20, payload_1kb
from psycopg import sql

import outbox
from outbox.contracts import parse_contract
from outbox.db import contracts as published

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
# The same, with the uniqueness an operation is held to (identity, provider key): the shape of
# this baseline before sql/0051 moved both rules out of outbox.operations, which issue 41's
# figures were taken against.
UNIQUE_TABLE = "public.plain_unique_operations"
CREATE_UNIQUE = (
    f"CREATE TABLE {UNIQUE_TABLE} (LIKE outbox.operations INCLUDING ALL);"
    f" ALTER TABLE {UNIQUE_TABLE} ADD UNIQUE (tenant_id, operation_type, operation_key),"
    " ADD UNIQUE (provider, idempotency_key)"
)
PLAIN_TABLES = (PLAIN_TABLE, UNIQUE_TABLE)


def _insert(table: str) -> str:
    return (
        f"INSERT INTO {table} ("  # noqa: S608 (a constant table name, no input)
        " tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,"
        " idempotency_key, correlation_id)"
        " VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s, %s) RETURNING id"
    )


PLAIN_INSERT = _insert(PLAIN_TABLE)
UNIQUE_INSERT = _insert(UNIQUE_TABLE)
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
  -- Comments removed first: "no NOTIFY here" is no notify.
  AND regexp_replace(p.prosrc, '--[^\n]*', '', 'g') ~* '(pg_notify\\s*\\(|\\mnotify\\s)'
GROUP BY p.oid
ORDER BY 1
"""
ENQUEUE_CHANNEL = "outbox_enqueue"
NOTIFY_PROBES = 20

Variant = Callable[[psycopg.Connection[Any], str], None]


def _python_api(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        outbox.enqueue(
            conn,
            tenant_id=TENANT,
            operation_type=OPERATION_TYPE,
            operation_key=key,
            provider=PROVIDER,
            action=ACTION,
            payload=PAYLOAD,
            correlation_id=key,
        )


# Contracts (issue 42): the Python API with a 1 KB payload, under a 20-property contract and
# under a type with none; the target is the first at 0.8 of the second or better.
CONTRACT_TYPE = "bench.contracted"
UNCHECKED_TYPE = "bench.unchecked"
PAYLOAD_1KB = payload_1kb()


def _python_1kb(conn: psycopg.Connection[Any], key: str, *, contracted: bool) -> None:
    with conn.transaction():
        outbox.enqueue(
            conn,
            tenant_id=TENANT,
            operation_type=CONTRACT_TYPE if contracted else UNCHECKED_TYPE,
            operation_key=key,
            provider=PROVIDER,
            action=ACTION,
            payload=PAYLOAD_1KB,
            correlation_id=key,
            contract_version=1 if contracted else None,
        )


def _publish_contract(db_url: str) -> None:
    contract = parse_contract(CONTRACT_TYPE, 1, json.dumps(contract_20()))
    with psycopg.connect(db_url) as conn:
        published.publish(conn, [contract], actor="bench", reason="bench/enqueue.py")


def _sql_function(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(
            SQL_ENQUEUE,
            (TENANT, OPERATION_TYPE, key, PROVIDER, ACTION, json.dumps(PAYLOAD), key),
            prepare=True,
        )


def _plain_params(key: str) -> tuple[Any, ...]:
    payload = json.dumps(PAYLOAD)
    fingerprint = hashlib.sha256(f"{PROVIDER}\n{ACTION}\n{payload}".encode()).digest()
    identity = json.dumps([TENANT, OPERATION_TYPE, key])
    idempotency_key = "ob1_" + hashlib.sha256(identity.encode()).hexdigest()
    return (
        TENANT,
        OPERATION_TYPE,
        key,
        fingerprint,
        PROVIDER,
        ACTION,
        payload,
        idempotency_key,
        key,
    )


def _insert_row(statement: str, conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(statement, _plain_params(key), prepare=True)


_plain_insert = functools.partial(_insert_row, PLAIN_INSERT)
_unique_insert = functools.partial(_insert_row, UNIQUE_INSERT)


def _plain_insert_notify(conn: psycopg.Connection[Any], key: str) -> None:
    with conn.transaction():
        conn.execute(PLAIN_INSERT, _plain_params(key), prepare=True)
        conn.execute(NOTIFY, prepare=True)


VARIANTS: dict[str, tuple[str, Variant]] = {
    "python": ("outbox.enqueue (Python API)", _python_api),
    "sql": ("outbox.enqueue(...) SQL function", _sql_function),
    "sql_no_key_index": ("the SQL function without the unique key index", _sql_function),
    "python_idle": ("outbox.enqueue (Python API), a dispatcher waiting idle", _python_api),
    "plain": ("plain INSERT, same shape, no trigger/notify", _plain_insert),
    "plain_unique": ("plain INSERT, same shape + identity and key unique", _unique_insert),
    "plain_notify": ("plain INSERT + pg_notify", _plain_insert_notify),
    "python_1kb": (
        "outbox.enqueue (Python API), 1 KB payload, no contract",
        functools.partial(_python_1kb, contracted=False),
    ),
    "python_1kb_contract": (
        "outbox.enqueue (Python API), 1 KB payload, 20-property contract",
        functools.partial(_python_1kb, contracted=True),
    ),
}
# Variants measured while a dispatcher is registered as waiting idle (outbox.waiting_dispatchers,
# sql/0012). A row is written there instead of running `outbox run`, which would compete for the
# two cores. Since sql/0029 the first commit takes the mark and notifies, and the rest of the
# idle period's commits do not: what a NOTIFY per idle period costs under synchronous
# replication is bench/sync_replication.py's to show.
IDLE_VARIANTS = frozenset({"python_idle"})
# Measured with the unique index of provider keys dropped (sql/0024; in outbox.operation_keys
# since sql/0051), to show what it costs each enqueue; it is made again (on empty tables) right
# after.
NO_KEY_INDEX_VARIANTS = frozenset({"sql_no_key_index"})
DROP_KEY_INDEX = (
    "ALTER TABLE outbox.operation_keys DROP CONSTRAINT IF EXISTS operation_keys_provider_key"
)
CREATE_KEY_INDEX = (
    "ALTER TABLE outbox.operation_keys "
    "ADD CONSTRAINT operation_keys_provider_key UNIQUE (provider, idempotency_key)"
)
IDLE_WORKER = "bench-enqueue-idle"
MARK_WAITING = (
    "INSERT INTO outbox.waiting_dispatchers (worker, seen_at) VALUES (%s, now()) "
    "ON CONFLICT (worker) DO UPDATE SET seen_at = now()"
)
UNMARK_WAITING = "DELETE FROM outbox.waiting_dispatchers WHERE worker = %s"


def _producer(job: tuple[str, str, str, float], start: Event, total: Synchronized[int]) -> None:
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
    procs = [
        ctx.Process(target=_producer, args=((db_url, variant, f"{tag}-{i}", seconds), start, total))
        for i in range(producers)
    ]
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


def _has_waiting_table(db_url: str) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass('outbox.waiting_dispatchers')").fetchone()
    return row is not None and row[0] is not None


CONTRACT_VARIANTS = frozenset({"python_1kb", "python_1kb_contract"})


def _has_contracts(db_url: str) -> bool:
    with psycopg.connect(db_url) as conn:
        found = conn.execute(
            "SELECT 1 FROM pg_attribute WHERE attrelid = 'outbox.operations'::regclass"
            " AND attname = 'contract_version'"
        ).fetchone()
    return found is not None


def _has_key_index(db_url: str) -> bool:
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass('outbox.operation_keys_provider_key')").fetchone()
    return row is not None and row[0] is not None


def _set_key_index(db_url: str, present: bool) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(CREATE_KEY_INDEX if present else DROP_KEY_INDEX)


def _set_waiting(db_url: str, waiting: bool) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(MARK_WAITING if waiting else UNMARK_WAITING, (IDLE_WORKER,))


def notifications_per_commit(
    db_url: str, commits: int = NOTIFY_PROBES, *, idle_dispatcher: bool = False
) -> int:
    """How many of ``commits`` one-operation enqueue transactions a bare LISTEN on the enqueue
    channel hears (each in its own transaction, spaced so that PostgreSQL cannot fold them):
    with no dispatcher, or with one registered as waiting idle."""
    if idle_dispatcher:
        _set_waiting(db_url, True)
    try:
        return _count_notifications(db_url, commits)
    finally:
        if idle_dispatcher:
            _set_waiting(db_url, False)


def _count_notifications(db_url: str, commits: int) -> int:
    with psycopg.connect(db_url, autocommit=True) as listener, psycopg.connect(db_url) as producer:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        # New keys every call: a duplicate inserts nothing, so it would notify nothing.
        tag = f"probe-{os.getpid()}-{time.monotonic_ns()}"
        for i in range(commits):
            _python_api(producer, f"{tag}-{i}")
            producer.commit()
            time.sleep(0.01)
        heard = 0
        for _ in listener.notifies(timeout=1.0):
            heard += 1
    return heard


def _reset_tables(db_url: str) -> None:
    """Every measurement starts from tables as small as the last one's were."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("TRUNCATE outbox.operations CASCADE")
        for table in PLAIN_TABLES:
            conn.execute(f"TRUNCATE {table}")
        conn.execute("VACUUM ANALYZE outbox.operations")
        for table in PLAIN_TABLES:
            conn.execute(f"VACUUM ANALYZE {table}")


@dataclass
class Findings:
    """What one run measured."""

    counts: list[int]
    variants: list[str]
    rounds: int
    seconds: float
    runs: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)
    heard: int = 0
    heard_idle: int | None = None  # None: this schema has no idle-dispatcher registry


def copy_storage(conn: psycopg.Connection[Any]) -> None:
    """LIKE copies no storage parameters: give the plain tables the operations table's own (its
    fill factor, sql/0018), so that they lay out their rows alike."""
    row = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'outbox.operations'::regclass"
    ).fetchone()
    for option in (row[0] if row else None) or []:
        name, _, value = option.partition("=")
        for table in PLAIN_TABLES:
            conn.execute(
                sql.SQL("ALTER TABLE {} SET ({} = {})").format(
                    sql.SQL(table), sql.Identifier(name), sql.Literal(value)
                )
            )


def prepare(findings: Findings, db_url: str) -> None:
    """The baseline tables and the contract; what this schema has decides the variants."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(CREATE_PLAIN)
        conn.execute(CREATE_UNIQUE)
        copy_storage(conn)
    if _has_contracts(db_url):
        _publish_contract(db_url)
    else:  # a schema from before sql/0053
        findings.variants = [v for v in findings.variants if v not in CONTRACT_VARIANTS]
    findings.sources = notify_sources(db_url)
    findings.heard = notifications_per_commit(db_url)
    if _has_waiting_table(db_url):
        findings.heard_idle = notifications_per_commit(db_url, idle_dispatcher=True)
    else:
        findings.variants = [v for v in findings.variants if v not in IDLE_VARIANTS]
    if not _has_key_index(db_url):  # a schema from before sql/0051
        findings.variants = [v for v in findings.variants if v not in NO_KEY_INDEX_VARIANTS]


def run(findings: Findings) -> None:
    """Measure every variant at every producer count, round-robin, in one fresh database."""
    with fresh_database(prefix="enq_") as db_url:
        prepare(findings, db_url)
        for producers in findings.counts:
            # Round-robin: a burst of other work on a shared machine hits every variant alike.
            for round_number in range(findings.rounds):
                for variant in findings.variants:
                    progress(
                        f"{variant}: {producers} producer(s), {findings.seconds:.0f} s, "
                        f"round {round_number + 1} of {findings.rounds}"
                    )
                    idle, unindexed = variant in IDLE_VARIANTS, variant in NO_KEY_INDEX_VARIANTS
                    if idle:
                        _set_waiting(db_url, True)
                    if unindexed:
                        _set_key_index(db_url, False)
                    try:
                        rate = measure(db_url, variant, producers, findings.seconds)
                    finally:
                        if idle:
                            _set_waiting(db_url, False)
                        if unindexed:
                            _set_key_index(db_url, True)
                    findings.runs.setdefault((variant, producers), []).append(rate)
                    _reset_tables(db_url)


def _verdict(heard: int) -> str:
    return "yes" if heard == NOTIFY_PROBES else ("sometimes" if heard else "no")


def report(findings: Findings) -> None:
    """The table, the NOTIFY findings and the target."""
    rates = {key: median(values) for key, values in findings.runs.items()}
    rows: list[list[str]] = []
    for variant in findings.variants:
        row = [VARIANTS[variant][0]]
        for producers in findings.counts:
            rate = rates[variant, producers]
            plain = rates.get(("plain", producers), float("nan"))
            row += [fmt_rate(rate), fmt_ratio(rate / plain)]
        rows.append(row)
    headers = ["producer transaction (1 operation)"]
    for producers in findings.counts:
        headers += [f"{producers} producer{'s' if producers > 1 else ''}: tx/s", "x plain"]
    title = f"Enqueue cost, {findings.seconds:.0f} s per figure, median of {findings.rounds}"
    print_table(headers, rows, title=title)

    line = (
        f"enqueue NOTIFYs on every commit: {_verdict(findings.heard)} with no dispatcher "
        f"waiting ({findings.heard} of {NOTIFY_PROBES} one-operation commits heard on "
        f"{ENQUEUE_CHANNEL})"
    )
    if findings.heard_idle is not None:
        line += (
            f"; {_verdict(findings.heard_idle)} with one waiting idle "
            f"({findings.heard_idle} of {NOTIFY_PROBES})"
        )
    print(line)
    where = "; ".join(findings.sources) if findings.sources else "nowhere in schema outbox"
    print(f"where it notifies: {where}")
    for producers in findings.counts:
        with_index, without = (
            rates.get(("sql", producers)),
            rates.get(("sql_no_key_index", producers)),
        )
        if with_index and without:
            print(
                f"the unique key index (sql/0024) at {producers} producer(s): the SQL function "
                f"runs at {fmt_ratio(with_index / without)} x its rate without it"
            )
    for producers in findings.counts:
        checked = rates.get(("python_1kb_contract", producers))
        unchecked = rates.get(("python_1kb", producers))
        if checked and unchecked:
            ratio = checked / unchecked
            met = "met" if ratio >= TARGET_RATIO else "missed"
            print(
                f"target {TARGET_RATIO} x enqueue without a contract, 1 KB payload, "
                f"{producers} producer(s): with a 20-property contract {fmt_ratio(ratio)}, {met}"
            )
    for base in ("plain", "plain_unique"):
        baseline = rates.get((base, TARGET_PRODUCERS))
        for variant in ("python", "sql"):
            key = (variant, TARGET_PRODUCERS)
            if key in rates and baseline:
                ratio = rates[key] / baseline
                met = "met" if ratio >= TARGET_RATIO else "missed"
                print(
                    f"target {TARGET_RATIO} x {VARIANTS[base][0]} at {TARGET_PRODUCERS} "
                    f"producers, {VARIANTS[variant][0]}: {fmt_ratio(ratio)}, {met}"
                )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        help=f"per measurement (default {DEFAULT_SECONDS:.0f})",
    )
    parser.add_argument(
        "--quick", action="store_true", help=f"--seconds {QUICK_SECONDS:.0f}, one round"
    )
    parser.add_argument(
        "--producers",
        default=",".join(map(str, DEFAULT_PRODUCERS)),
        help="producer counts, comma-separated (default 1,8)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"among {', '.join(VARIANTS)}"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds over the variants, round-robin; medians count"
    )
    args = parser.parse_args(argv)
    findings = Findings(
        counts=[int(x) for x in args.producers.split(",")],
        variants=[v for v in args.variants.split(",") if v],
        rounds=1 if args.quick else args.repeat,
        seconds=args.seconds or (QUICK_SECONDS if args.quick else DEFAULT_SECONDS),
    )
    print_machine()
    run(findings)
    report(findings)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))

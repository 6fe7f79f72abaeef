"""Enqueue cost in CPU instructions: the server's work for one `outbox.enqueue` call against a
plain INSERT of the same row, counted by valgrind (callgrind), so that a change of a few percent
shows through the noise of a shared two-core machine, where tx/s (bench/enqueue.py) cannot.

    python bench/enqueue_instructions.py              # 100 and 600 calls per variant
    python bench/enqueue_instructions.py --quick      # 50 and 250

A private cluster of the local PostgreSQL's binaries is made in a temporary directory (initdb,
fsync off), migrated, and stopped; each variant then runs in a single-user backend
(`postgres --single`) under callgrind: one prepared statement, executed N times with new keys,
each call its own transaction (the commit and the deferred triggers included; no fsync, no
network, no client). Two runs of different N are subtracted, so start-up and the prepare drop
out: the figure is instructions per call. Counts are repeatable for the same binaries and
inputs; the machine's load does not change them.

Variants (the plain tables are `LIKE outbox.operations INCLUDING ALL`, as in bench/enqueue.py):
the SQL function; the plain INSERT; the plain INSERT into a table that also has the uniqueness
an operation is held to (identity, provider key: the shape bench/enqueue.py's baseline had
before sql/0051 moved both rules to outbox.operation_keys); and the plain INSERT into a table
without the CHECK constraints, which PostgreSQL reads back from their stored text (and plans)
once per statement that writes the table. Needs valgrind; run as root, the backend runs as the
`postgres` user (runuser). See bench/README.md, "Enqueue in instructions".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
from _support import fmt_ratio, print_machine, print_table, progress
from enqueue import CREATE_PLAIN, CREATE_UNIQUE, PLAIN_TABLE, UNIQUE_TABLE

from outbox.db import migrations

PAYLOAD = """'{"amount": 1000, "currency": "usd", "customer": "cus_123"}'::jsonb"""
FINGERPRINT = r"'\x00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff'::bytea"
# bench/enqueue.py's two baselines, and the first without its CHECK constraints.
NO_CHECKS_TABLE = "public.plain_no_checks_operations"
PLAIN_TABLES = {
    PLAIN_TABLE: CREATE_PLAIN,
    UNIQUE_TABLE: CREATE_UNIQUE,
    NO_CHECKS_TABLE: (
        f"CREATE TABLE {NO_CHECKS_TABLE}"
        " (LIKE outbox.operations INCLUDING ALL EXCLUDING CONSTRAINTS)"
    ),
}
ENQUEUE = (
    "SELECT operation_id, outcome FROM outbox.enqueue(tenant_id => 'acme',"  # noqa: S608 (constants)
    " operation_type => 'invoice.charge', operation_key => $1, provider => 'stripe',"
    f" action => 'payment_intents.create', payload => {PAYLOAD}, correlation_id => $1)"
)


# As bench/enqueue.py's plain INSERT: fingerprint and a key of the derived key's length computed
# by the caller (here from the key, so that each row's is new).
def _plain_insert(table: str) -> str:
    return (
        f"INSERT INTO {table} (tenant_id, operation_type, operation_key, fingerprint,"  # noqa: S608 (constants)
        " provider, action, payload, idempotency_key, correlation_id) VALUES ('acme',"
        f" 'invoice.charge', $1, {FINGERPRINT}, 'stripe', 'payment_intents.create', {PAYLOAD},"
        " 'ob1_' || md5($1) || md5($1 || 'x'), $1) RETURNING id"
    )


VARIANTS = {
    "enqueue": ("outbox.enqueue(...) SQL function", ENQUEUE),
    "plain": ("plain INSERT, same shape", _plain_insert(PLAIN_TABLE)),
    "plain_unique": (
        "plain INSERT, same shape + identity and key unique",
        _plain_insert(UNIQUE_TABLE),
    ),
    "plain_no_checks": (
        "plain INSERT, same shape without its CHECK constraints",
        _plain_insert(NO_CHECKS_TABLE),
    ),
}
TRUNCATE = "TRUNCATE outbox.operations, outbox.attempt_log, " + ", ".join(PLAIN_TABLES)
RUN_AS = "postgres"  # when started as root: initdb and postgres refuse to run as root


@dataclass(frozen=True)
class Cluster:
    bindir: Path
    pgdata: Path
    socket_dir: Path


def _bindir() -> Path:
    """The binaries of the PostgreSQL whose client tools are on PATH (pg_config's, else the
    newest of Debian's /usr/lib/postgresql/<major>/bin)."""
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run(  # noqa: S603 (fixed arguments)
            [pg_config, "--bindir"], capture_output=True, text=True, check=True
        )
        bindir = Path(out.stdout.strip())
        if (bindir / "initdb").exists():
            return bindir
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: float(p.parts[-3]) if p.parts[-3].replace(".", "", 1).isdigit() else 0.0,
    )
    if not found:
        raise SystemExit("no PostgreSQL server binaries (initdb) found")
    return found[-1].parent


def _as_server_user(argv: list[str]) -> list[str]:
    if os.geteuid() != 0:
        return argv
    return ["runuser", "-u", RUN_AS, "--", *argv]


def _run(argv: list[str], stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(  # noqa: S603 (the cluster's binaries and valgrind, fixed arguments)
        _as_server_user(argv), input=stdin, capture_output=True, text=True, check=True
    )


@contextmanager
def private_cluster() -> Iterator[Cluster]:
    """initdb in a temporary directory (owned by the server's user when run as root)."""
    top = Path(tempfile.mkdtemp(prefix="outbox-instr-"))
    try:
        if os.geteuid() == 0:
            shutil.chown(top, user=RUN_AS)
        cluster = Cluster(_bindir(), top / "pgdata", top)
        initdb = str(cluster.bindir / "initdb")
        _run([initdb, "-D", str(cluster.pgdata), "-A", "trust", "-U", "postgres"])
        yield cluster
    finally:
        shutil.rmtree(top, ignore_errors=True)


def prepare_schema(cluster: Cluster) -> None:
    """Start the cluster on its socket only, migrate a database `bench`, make the plain tables,
    stop it."""
    pg_ctl = str(cluster.bindir / "pg_ctl")
    options = f"-c listen_addresses='' -k {cluster.socket_dir} -c fsync=off"
    # A log file: the server must not hold our captured stdout open.
    log = str(cluster.socket_dir / "server.log")
    _run([pg_ctl, "-D", str(cluster.pgdata), "-o", options, "-l", log, "-w", "start"])
    try:
        with psycopg.connect(
            host=str(cluster.socket_dir), user="postgres", dbname="postgres", autocommit=True
        ) as conn:
            conn.execute("CREATE DATABASE bench")
        with psycopg.connect(
            host=str(cluster.socket_dir), user="postgres", dbname="bench", autocommit=True
        ) as conn:
            migrations.migrate(conn)
            for ddl in PLAIN_TABLES.values():
                conn.execute(ddl)
    finally:
        _run([pg_ctl, "-D", str(cluster.pgdata), "-w", "stop"])


def _script(statement: str, calls: int, tag: str) -> str:
    lines = [TRUNCATE, f"PREPARE p(text) AS {statement}"]
    lines += [f"EXECUTE p('{tag}-{i}')" for i in range(calls)]
    return "\n".join(lines) + "\n"


def instructions(cluster: Cluster, statement: str, calls: int, tag: str) -> int:
    """Instructions callgrind counts for a single-user backend running ``calls`` executions."""
    out = cluster.socket_dir / f"callgrind.{tag}.out"
    backend = [
        str(cluster.bindir / "postgres"),
        "--single",
        "-D",
        str(cluster.pgdata),
        "-c",
        "fsync=off",
        "bench",
    ]
    result = _run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *backend],
        stdin=_script(statement, calls, tag),
    )
    if "ERROR:" in result.stdout or "ERROR:" in result.stderr:
        raise SystemExit(f"{tag}: the backend reported an error:\n{result.stderr[-2000:]}")
    match = re.search(r"^summary: (\d+)$", out.read_text(), re.MULTILINE)
    if match is None:
        raise SystemExit(f"{tag}: no summary in callgrind's output")
    return int(match.group(1))


def per_call(cluster: Cluster, variant: str, small: int, large: int) -> float:
    statement = VARIANTS[variant][1]
    progress(f"{variant}: {small} and {large} calls under callgrind")
    first = instructions(cluster, statement, small, f"{variant}-a")
    second = instructions(cluster, statement, large, f"{variant}-b")
    return (second - first) / (large - small)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="50 and 250 calls")
    parser.add_argument("--calls", default="100,600", help="the two call counts (default 100,600)")
    args = parser.parse_args()
    small, large = (50, 250) if args.quick else (int(n) for n in args.calls.split(","))
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (apt-get install valgrind)")
    print_machine()
    with private_cluster() as cluster:
        prepare_schema(cluster)
        progress(f"private cluster of {cluster.bindir}, migrated")
        counts = {v: per_call(cluster, v, small, large) for v in VARIANTS}
        bindir = cluster.bindir
    rows = [
        [
            label,
            f"{counts[v] / 1000:,.0f}",
            fmt_ratio(counts["plain"] / counts[v]),
            fmt_ratio(counts["plain_unique"] / counts[v]),
        ]
        for v, (label, _) in VARIANTS.items()
    ]
    print_table(
        [
            "one call, its own transaction",
            "thousand instructions",
            "plain / this",
            "plain_unique / this",
        ],
        rows,
        title=f"Enqueue in instructions (callgrind, per call: runs of {large} minus {small})",
    )
    print(f"counted in a private cluster of {bindir} (fsync off), not the server above")
    checks = counts["plain"] - counts["plain_no_checks"]
    print(
        f"the CHECK constraints of outbox.operations cost {checks / 1000:,.0f} thousand "
        f"instructions per statement that writes it ({checks / counts['plain']:.0%} of the "
        "plain INSERT)"
    )


if __name__ == "__main__":
    main()

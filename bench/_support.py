"""What every benchmark shares: a fresh database, fast bulk enqueue, `outbox run` subprocesses,
machine facts, medians and tables.

Import it from a script in bench/ as ``from _support import ...`` (a script's own directory is on
``sys.path``); importing it also puts the repository root on ``sys.path`` so ``outbox`` and
``tests.support`` resolve from a checkout. Only additions from here on: other scripts import it.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, LiteralString

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import psycopg  # noqa: E402 (after the path set-up above)
from psycopg import sql  # noqa: E402
from psycopg.conninfo import conninfo_to_dict, make_conninfo  # noqa: E402

from outbox.db import connect, migrations, statements  # noqa: E402
from tests.support.daemon import write_config as tests_write_config  # noqa: E402

# The server the benchmarks use unless $OUTBOX_BENCH_DATABASE_URL names another: the same local
# server the tests probe first.
DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/test"
BENCH_DB_PREFIX = "bench_"
# Rows per INSERT ... SELECT generate_series statement in bulk_enqueue: large enough that the
# per-statement cost vanishes, small enough that one statement's WAL and memory stay modest.
BULK_CHUNK = 50_000
# Server settings machine_info reports next to the version.
SERVER_SETTINGS = ("fsync", "synchronous_commit", "shared_buffers", "max_connections")
# The provider name bulk_enqueue writes by default; throughput configs name it with type "noop".
NOOP_PROVIDER = "noop"


def server_url() -> str:
    """The maintenance connection URL of the server benchmarks run on."""
    return os.environ.get("OUTBOX_BENCH_DATABASE_URL") or DEFAULT_SERVER_URL


def with_dbname(url: str, dbname: str) -> str:
    """``url`` pointing at another database of the same server."""
    return make_conninfo(url, dbname=dbname)


def as_url(dsn: str) -> str:
    """``dsn`` (a URL or libpq key=value string) as a postgresql:// URL, for clients such as
    asyncpg that take only URLs."""
    from urllib.parse import quote  # noqa: PLC0415

    params = conninfo_to_dict(dsn)
    user = quote(str(params.get("user") or ""), safe="")
    password = quote(str(params.get("password") or ""), safe="")
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = str(params.get("host") or "")
    port = f":{params['port']}" if params.get("port") else ""
    dbname = quote(str(params.get("dbname") or ""), safe="")
    return f"postgresql://{auth}{host}{port}/{dbname}"


def create_database(url: str | None = None, *, migrate: bool = True, prefix: str = "") -> str:
    """CREATE DATABASE bench_<random> (migrated unless ``migrate=False``); returns its URL."""
    base = url or server_url()
    name = f"{BENCH_DB_PREFIX}{prefix}{uuid.uuid4().hex[:12]}"
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    db_url = with_dbname(base, name)
    if migrate:
        with psycopg.connect(db_url, autocommit=True) as conn:
            migrations.migrate(conn)
    return db_url


def drop_database(db_url: str, url: str | None = None) -> None:
    """DROP DATABASE ... WITH (FORCE) of the database ``db_url`` names."""
    name = str(conninfo_to_dict(db_url)["dbname"])
    with psycopg.connect(url or server_url(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )


@contextmanager
def fresh_database(
    *, migrate: bool = True, prefix: str = "", url: str | None = None
) -> Iterator[str]:
    """A new database for one benchmark, dropped at the end whatever happens; yields its URL."""
    db_url = create_database(url, migrate=migrate, prefix=prefix)
    try:
        yield db_url
    finally:
        drop_database(db_url, url)


# What outbox.enqueue writes for one operation (sql/0004, sql/0011, sql/0019), as a set
# operation: the same fingerprint and derived idempotency key, the defaults for everything else.
_BULK_INSERT = """
INSERT INTO outbox.operations (
    tenant_id, operation_type, operation_key, fingerprint, provider, action, payload,
    idempotency_key, available_at, scheduled, payload_bytes, ordering_key, ordering_blocked)
SELECT t.tenant_id, t.operation_type, t.operation_key,
       sha256(convert_to(t.provider || E'\\n' || t.action || E'\\n' || t.payload::text
                         || coalesce(E'\\n' || t.ordering_key, ''), 'UTF8')),
       t.provider, t.action, t.payload,
       outbox.derive_idempotency_key(t.tenant_id, t.operation_type, t.operation_key),
       coalesce(%(available_at)s, now()),
       -- Not due yet: out of the claim index until staged (sql/0019).
       coalesce(%(available_at)s > now(), false), octet_length(t.payload::text),
       -- Ordered rows wait; the commit trigger (sql/0015) makes each key's first the head.
       t.ordering_key, t.ordering_key IS NOT NULL
FROM (
    SELECT %(tenant)s AS tenant_id, %(operation_type)s AS operation_type,
           %(key_prefix)s || i AS operation_key, %(provider)s AS provider,
           %(action)s AS action,
           jsonb_build_object('n', i) || %(payload)s::jsonb AS payload,
           CASE WHEN %(ordered_every)s::integer > 0 AND i %% %(ordered_every)s::integer = 0
                THEN 'key-' || (i / %(ordered_every)s::integer) %% %(ordering_keys)s::integer
           END AS ordering_key
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
) AS t
"""


def bulk_enqueue(
    db_url: str,
    count: int,
    *,
    provider: str = NOOP_PROVIDER,
    action: str = "bench",
    tenant: str = "bench",
    operation_type: str = "bench.op",
    key_prefix: str | None = None,
    payload: dict[str, Any] | None = None,
    available_at: Any = None,
    analyze: bool = True,
    ordered_every: int = 0,
    ordering_keys: int = 100,
) -> None:
    """Enqueue ``count`` pending operations fast, in chunks of one INSERT ... SELECT each.

    Rows are what ``outbox.enqueue`` would write (same fingerprint, same derived key), except
    that no NOTIFY is sent: start dispatchers after this returns. ``available_at`` None means
    now(); a datetime delays them. ``payload`` keys are merged into ``{"n": i}``. With
    ``ordered_every`` N, every Nth operation carries one of ``ordering_keys`` ordering keys.
    """
    import json  # noqa: PLC0415 (only this helper needs it)

    prefix = key_prefix if key_prefix is not None else f"op-{uuid.uuid4().hex[:8]}-"
    with psycopg.connect(db_url, autocommit=True) as conn:
        for first in range(0, count, BULK_CHUNK):
            last = min(first + BULK_CHUNK, count) - 1
            conn.execute(
                _BULK_INSERT,
                {
                    "tenant": tenant,
                    "operation_type": operation_type,
                    "key_prefix": prefix,
                    "provider": provider,
                    "action": action,
                    "payload": json.dumps(payload or {}),
                    "first": first,
                    "last": last,
                    "available_at": available_at,
                    "ordered_every": ordered_every,
                    "ordering_keys": ordering_keys,
                },
            )
        if analyze:
            conn.execute("ANALYZE outbox.operations")


def count_by_status(db_url: str) -> dict[str, int]:
    """How many operations are in each status."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT status, count(*) FROM outbox.operations GROUP BY status"
        ).fetchall()
    return {str(status): int(n) for status, n in rows}


@dataclass(frozen=True)
class DrainWindow:
    """The database's own clock for one drain: first claim to last success."""

    succeeded: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.succeeded / self.seconds if self.seconds > 0 else float("nan")


def drain_window(db_url: str) -> DrainWindow:
    """From the first attempt (claim) to the last finished row, by the rows' own timestamps.

    Uses the attempt rows' start when outbox.attempts has them, else the operations'
    ``last_attempt_at`` (each row is claimed once in a no-op drain, so both are its claim).
    """
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            """
            SELECT count(*),
                   extract(epoch FROM max(finished_at) - min(last_attempt_at))
            FROM outbox.operations WHERE status = 'succeeded'
            """
        ).fetchone()
    assert row is not None
    return DrainWindow(int(row[0]), float(row[1] or 0.0))


# --- `outbox run` subprocesses -------------------------------------------------------------


def write_config(
    path: Path, *, providers: dict[str, dict[str, Any]] | None = None, **dispatcher: Any
) -> Path:
    """The test suite's TOML writer; ``providers`` defaults to one ``noop`` provider."""
    tables = providers if providers is not None else {NOOP_PROVIDER: {"type": "noop"}}
    return tests_write_config(path, providers=tables, **dispatcher)


class OutboxRun:
    """One `outbox run` subprocess with its log in a file."""

    def __init__(
        self,
        db_url: str,
        config: Path,
        log_path: Path,
        *,
        metrics_addr: str = "127.0.0.1:0",
        env: dict[str, str] | None = None,
        python: str | None = None,
    ) -> None:
        """``metrics_addr`` defaults to an ephemeral loopback port: metrics on, as in production."""
        self.log_path = log_path
        self._log: IO[bytes] = log_path.open("ab")
        full_env = {**os.environ, "OUTBOX_DATABASE_URL": db_url, **(env or {})}
        full_env.setdefault("OUTBOX_LOG_LEVEL", "warning")
        self.proc = subprocess.Popen(  # noqa: S603 (our own CLI, fixed arguments)
            [
                python or sys.executable,
                "-m",
                "outbox",
                "run",
                "--config",
                str(config),
                "--metrics-addr",
                metrics_addr,
            ],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait for the drain; SIGKILL if it does not end in ``timeout`` seconds."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()
        return self.proc.returncode

    def log_text(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def metrics_url(self) -> str | None:
        """The HTTP listener's /metrics URL, from the process's log (needs log level info)."""
        found = re.findall(r'"metrics_addr": "([^"]+)"', self.log_text())
        return f"http://{found[0]}/metrics" if found else None

    def metrics(self) -> dict[str, float]:
        """The process's Prometheus samples summed over their labels, by sample name
        (``outbox_claim_duration_seconds_count``...); empty if the listener is unknown."""
        url = self.metrics_url()
        return scrape_metrics(url) if url else {}


def scrape_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """A Prometheus text endpoint's samples, summed over their labels, by sample name."""
    import urllib.request  # noqa: PLC0415

    with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (loopback)
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            samples[name] = samples.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return samples


@contextmanager
def outbox_runs(
    db_url: str,
    *,
    processes: int = 1,
    log_dir: Path | None = None,
    providers: dict[str, dict[str, Any]] | None = None,
    metrics_addr: str = "127.0.0.1:0",
    env: dict[str, str] | None = None,
    **dispatcher: Any,
) -> Iterator[list[OutboxRun]]:
    """Start ``processes`` `outbox run` subprocesses with one config; SIGTERM them at the end.

    ``dispatcher`` keys go into the [dispatcher] table (concurrency=..., batch_size=...).
    Logs go to ``log_dir`` (default: a temporary directory removed afterwards).
    """
    own_dir = log_dir is None
    directory = Path(tempfile.mkdtemp(prefix="outbox-bench-")) if own_dir else log_dir
    assert directory is not None
    config = write_config(directory / "outbox.toml", providers=providers, **dispatcher)
    runs = [
        OutboxRun(db_url, config, directory / f"outbox-{i}.log", metrics_addr=metrics_addr, env=env)
        for i in range(processes)
    ]
    try:
        yield runs
    finally:
        for run in runs:
            run.terminate()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)


def wait_until(
    predicate: Callable[[], bool],
    *,
    timeout: float,
    what: str,
    interval: float = 0.05,
    alive: Sequence[OutboxRun] = (),
) -> float:
    """Poll ``predicate`` until true; returns the seconds it took.

    Raises TimeoutError after ``timeout`` seconds, and RuntimeError as soon as one of ``alive``
    exited (with the tail of its log).
    """
    start = time.monotonic()
    while not predicate():
        for run in alive:
            if not run.alive():
                tail = run.log_text()[-2000:]
                raise RuntimeError(f"outbox run exited {run.proc.returncode}:\n{tail}")
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


# Whether any operation is still pending (claimable, waiting its turn, or scheduled), and
# whether any is in flight. Each subquery walks a partial index in its own order and stops at
# the first live row, so a poll costs a few index pages whatever the table holds. These waits
# used to count(*) the table: a read of the whole heap on every poll, a full core at 10 M rows,
# which bench/growth.py then measured as the table's own slowness.
UNFINISHED: LiteralString = """
SELECT EXISTS (SELECT 1 FROM outbox.operations
               WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled
               ORDER BY provider, tenant_id, available_at, id LIMIT 1)
       OR EXISTS (SELECT 1 FROM outbox.operations WHERE ordering_blocked
                  ORDER BY tenant_id, ordering_key, id LIMIT 1)
       OR EXISTS (SELECT 1 FROM outbox.operations WHERE scheduled
                  ORDER BY available_at, id LIMIT 1),
       EXISTS (SELECT 1 FROM outbox.operations WHERE status = 'in_flight'
               ORDER BY lease_expires_at LIMIT 1)
"""


def unfinished(conn: psycopg.Connection[Any]) -> tuple[bool, bool]:
    """(any operation pending, any in flight), from partial indexes only."""
    row = conn.execute(UNFINISHED).fetchone()
    assert row is not None
    return bool(row[0]), bool(row[1])


def wait_drained(
    db_url: str,
    expected: int,
    *,
    timeout: float,
    runs: Sequence[OutboxRun] = (),
    interval: float = 0.2,
) -> float:
    """Wait until ``expected`` operations are finished (no longer pending or in flight)."""
    with psycopg.connect(db_url, autocommit=True) as conn:

        def done() -> bool:
            if any(unfinished(conn)):
                return False
            # Once, at the end: every expected row is there, and finished.
            row = conn.execute("SELECT count(*) FROM outbox.operations").fetchone()
            return row is not None and int(row[0]) >= expected

        return wait_until(
            done,
            timeout=timeout,
            what=f"{expected} operations finished",
            interval=interval,
            alive=runs,
        )


# --- machine facts, statistics, tables --------------------------------------------------------


@dataclass
class Machine:
    """What a figure was measured on."""

    cpus: int
    cpu_model: str
    ram_gib: float
    kernel: str
    python: str
    postgres: str
    extra: dict[str, str] = field(default_factory=dict)

    def rows(self) -> list[tuple[str, str]]:
        base = [
            ("CPUs (nproc)", str(self.cpus)),
            ("CPU model", self.cpu_model),
            ("RAM", f"{self.ram_gib:.1f} GiB"),
            ("kernel", self.kernel),
            ("Python", self.python),
            ("PostgreSQL", self.postgres),
        ]
        return base + list(self.extra.items())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        pass
    return float("nan")


def machine_info(url: str | None = None) -> Machine:
    """nproc, CPU model, RAM, kernel, Python and the PostgreSQL server's version."""
    extra: dict[str, str] = {}
    try:
        with psycopg.connect(url or server_url(), autocommit=True) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            # The settings that decide a commit's cost, which dominates producer figures.
            for name in SERVER_SETTINGS:
                value = conn.execute("SELECT current_setting(%s, true)", (name,)).fetchone()
                extra[f"PostgreSQL {name}"] = str(value[0]) if value else "?"
        postgres = str(row[0]) if row else "?"
    except psycopg.Error as exc:
        postgres = f"unreachable ({type(exc).__name__})"
    load = os.getloadavg()
    # Other work on a shared machine shows here: figures taken under load are noisier.
    extra["load average (1, 5, 15 min)"] = ", ".join(f"{x:.2f}" for x in load)
    return Machine(
        cpus=os.cpu_count() or 0,
        cpu_model=_cpu_model(),
        ram_gib=_ram_gib(),
        kernel=platform.release(),
        python=platform.python_version(),
        postgres=postgres,
        extra=extra,
    )


def print_machine(machine: Machine | None = None, *, title: str = "machine") -> Machine:
    """Print the machine table; returns what it printed."""
    info = machine or machine_info()
    print_table(["", title], info.rows())
    return info


def median(values: Sequence[float]) -> float:
    """The median, NaN for no values."""
    return statistics.median(values) if values else float("nan")


def repeat(fn: Callable[[], float], times: int) -> tuple[float, list[float]]:
    """Run ``fn`` ``times`` times; returns the median of its results and all of them."""
    results = [fn() for _ in range(times)]
    return median(results), results


def fmt_rate(value: float) -> str:
    """A per-second figure for a table: 12,345."""
    return "n/a" if value != value else f"{value:,.0f}"  # noqa: PLR0124 (NaN check)


def fmt_ratio(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}"  # noqa: PLR0124 (NaN check)


def print_table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, title: str | None = None
) -> str:
    """A Markdown table (pipe-separated, aligned), printed and returned.

    Numbers are right-aligned; everything is turned into text with ``str``.
    """
    text_rows = [[str(cell) for cell in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text_rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def numeric(cell: str) -> bool:
        return _NUMBER.fullmatch(cell) is not None

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.rjust(widths[i]) if numeric(c) else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "| " + " | ".join(parts) + " |"

    out = []
    if title:
        out += [f"### {title}", ""]
    out.append(line(list(headers)))
    out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    out += [line(row) for row in text_rows]
    text = "\n".join(out)
    print(text, flush=True)
    print(flush=True)
    return text


_NUMBER = re.compile(r"-?[0-9][0-9,]*(\.[0-9]+)?( ?[%x]| s| ms)?")


def progress(message: str) -> None:
    """A timestamped line on stderr, so stdout keeps only the tables."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


__all__ = [
    "BULK_CHUNK",
    "DEFAULT_SERVER_URL",
    "NOOP_PROVIDER",
    "REPO",
    "DrainWindow",
    "Machine",
    "OutboxRun",
    "as_url",
    "bulk_enqueue",
    "count_by_status",
    "create_database",
    "drain_window",
    "drop_database",
    "fmt_rate",
    "fmt_ratio",
    "fresh_database",
    "machine_info",
    "median",
    "outbox_runs",
    "print_machine",
    "print_table",
    "progress",
    "repeat",
    "scrape_metrics",
    "server_url",
    "unfinished",
    "wait_drained",
    "wait_until",
    "with_dbname",
    "write_config",
]


def as_outbox_run(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """Give ``conn`` the session settings `outbox run` gives its own connections (generic plans,
    no JIT, its timeouts), so a statement timed here runs as it runs there."""
    for name, value in connect.SESSION_LIMITS.items():
        conn.execute(statements.SET_SESSION_LIMIT, (name, value))
    return conn

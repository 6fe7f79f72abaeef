"""The chaos soak: producers, faults, killed and frozen dispatchers and a PostgreSQL crash at
once, then a count of every operation against every provider effect.

``bench/chaos.py`` runs it for ``--duration`` seconds; tests/integration/test_chaos.py runs a
bounded version. Both call :func:`run_chaos` and read :class:`Report`.

What runs: a private PostgreSQL cluster (restarted once with ``-m immediate``), the fake Stripe
and the fake webhook receiver on loopback (in this process, so their ledgers of effects outlive
every dispatcher), producer threads that enqueue continuously (some transactions rolled back,
some duplicates, some conflicts) and arm a random provider fault for about one operation in
``fault_rate``, and ``dispatchers`` real ``outbox run`` processes, one of which is SIGKILLed or
SIGSTOPped (then resumed or killed) every ``chaos_every`` seconds and brought back. The fakes
forget idempotency keys after ``key_retention`` seconds (30 by default, and the providers are
configured so), so the run reaches the point where a blind resend would duplicate an effect.

What is checked (:func:`verify`), once producers stopped and dispatchers drained: every
operation a producer saw commit exists and is final; a succeeded one has exactly one effect,
the one its provider_ref names; a quarantined or reconciling one has its attempt history and at
most one effect; no rolled-back operation exists or has an effect; no effect belongs to no
operation; no operation has two effects; every duplicate enqueue returned the original id and
every conflicting one raised OperationConflict.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psycopg

import outbox
from outbox.model import EnqueueOutcome
from outbox.providers.fakes.stripe import FakeStripe
from outbox.providers.fakes.stripe import Fault as StripeFault
from outbox.providers.fakes.webhook import FakeWebhookReceiver
from outbox.providers.fakes.webhook import Fault as HookFault
from tests.support.cluster import PrivateCluster, private_cluster
from tests.support.daemon import OutboxProcess, write_config

TENANT: Final = "chaos"
STRIPE: Final = "stripe"
HOOK: Final = "hook"
STRIPE_KEY: Final = "sk_test_chaos"
FINAL: Final = frozenset({"succeeded", "quarantined", "reconciling", "cancelled"})
# How a producer's transaction ends, by weight: most commit; some roll back; some repeat an
# identity it committed (same payload: a duplicate; another payload: a conflict).
PRODUCER_MOVES: Final = {"commit": 70, "rollback": 12, "duplicate": 12, "conflict": 6}
# Provider faults by weight. "after" faults act and then fail to say so; their retries meet
# the providers' idempotency ledgers.
HOOK_FAULTS: Final = {
    "503_retry_after": 4, "429_retry_after": 4, "409_in_progress": 2, "500_before": 3,
    "reset_before": 3, "reset_after": 4, "slow_after": 2, "500_after_saved": 1, "422": 1,
}  # fmt: skip
STRIPE_FAULTS: Final = {
    "429_rate_limit": 4, "503": 3, "409_key_in_use": 2, "reset_before": 3, "500_before_saved": 1,
    "500_after_saved": 1, "slow_after": 2, "reset_after": 4, "402_card_declined": 1,
}  # fmt: skip
# A third of the operations may be tried this often instead of the dispatchers' 8 times: those
# that keep failing after their first send run into the key window (retention less margin) and
# must go to reconciliation rather than be sent once the provider may have forgotten the key.
PATIENT_ATTEMPTS: Final = 40
# The fakes delay a "slow" answer past the providers' timeout, so the call ends unknown.
PROVIDER_TIMEOUT: Final = 2.0
SLOW_ANSWER: Final = 3.0


@dataclass(frozen=True)
class Settings:
    """One soak's knobs; the defaults are the bounded test's."""

    duration: float = 40.0
    dispatchers: int = 3
    producers: int = 2
    rate: float = 40.0  # operations per second, all producers together
    fault_rate: float = 0.12  # faults armed per operation committed
    chaos_every: float = 4.0  # seconds between two dispatcher kills or stops
    pg_restarts: int = 1
    drain_timeout: float = 60.0
    seed: int = 1
    # How long the fakes remember an idempotency key, and what the providers are configured
    # with; retries stop `retention_margin` before. Short, so that the run reaches the point
    # where a blind resend would duplicate an effect, and outbox must reconcile instead. The
    # margin outlasts the longest SIGSTOP (4 s) plus a call's timeout (2 s) with room to spare:
    # a frozen process could otherwise send after its last check of the window.
    key_retention: float = 30.0
    retention_margin: float = 10.0


# --- what producers did --------------------------------------------------------------------


@dataclass
class Ledger:
    """What the producers know, shared by their threads under one lock."""

    committed: dict[str, int] = field(default_factory=dict)  # operation_key -> id
    rolled_back: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (id, idem key)
    uncertain: set[str] = field(default_factory=set)  # the COMMIT failed: outcome unknown
    duplicates: int = 0
    conflicts: int = 0
    violations: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class Intent:
    """One operation's enqueue arguments."""

    key: str
    provider: str
    action: str
    payload: dict[str, Any]
    max_attempts: int | None

    def enqueue(self, conn: psycopg.Connection[Any], payload: dict[str, Any] | None = None) -> Any:
        return outbox.enqueue(
            conn, tenant_id=TENANT, operation_type=f"chaos.{self.provider}",
            operation_key=self.key, provider=self.provider, action=self.action,
            payload=self.payload if payload is None else payload, max_attempts=self.max_attempts,
        )  # fmt: skip


def make_intent(key: str, rng: random.Random) -> Intent:
    patience = PATIENT_ATTEMPTS if rng.random() < 1 / 3 else None
    if rng.random() < 0.5:
        payload = {"amount": rng.randint(100, 99_999), "currency": "usd",
                   "customer": "cus_chaos", "metadata": {"chaos_key": key}}  # fmt: skip
        return Intent(key, STRIPE, "payment_intents.create", payload, patience)
    payload = {"invoice": key, "cents": rng.randint(1, 10_000)}
    return Intent(key, HOOK, "invoice.paid", payload, patience)


class Producer(threading.Thread):
    """Enqueues at its share of ``rate`` until stopped, riding out a database restart."""

    def __init__(self, index: int, url: str, settings: Settings, ledger: Ledger,
                 faults: FaultInjector, stop: threading.Event) -> None:  # fmt: skip
        super().__init__(name=f"chaos-producer-{index}", daemon=True)
        self._index, self._url, self._ledger = index, url, ledger
        self._faults, self._halt = faults, stop
        self._interval = settings.producers / settings.rate
        self._rng = random.Random(settings.seed * 1000 + index)
        self._mine: list[Intent] = []  # committed intents, for duplicates and conflicts
        self._seq = 0

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._halt.is_set():
            started = time.monotonic()
            try:
                conn = conn or psycopg.connect(self._url, connect_timeout=3)
                self._move(conn)
            except (psycopg.OperationalError, psycopg.InterfaceError):
                _discard(conn)
                conn = None
                self._halt.wait(0.5)  # the server is down or restarting
            except psycopg.Error as exc:  # not an outage: a finding
                _discard(conn)
                conn = None
                with self._ledger.lock:
                    self._ledger.violations.append(f"producer error {type(exc).__name__}: {exc}")
            self._halt.wait(max(0.0, self._interval - (time.monotonic() - started)))
        _discard(conn)

    def _move(self, conn: psycopg.Connection[Any]) -> None:
        moves, weights = zip(*PRODUCER_MOVES.items(), strict=True)
        move = self._rng.choices(moves, weights)[0]
        if move == "duplicate" and self._mine:
            self._duplicate(conn, self._rng.choice(self._mine))
        elif move == "conflict" and self._mine:
            self._conflict(conn, self._rng.choice(self._mine))
        else:
            self._new(conn, commit=move != "rollback")

    def _new(self, conn: psycopg.Connection[Any], *, commit: bool) -> None:
        intents = [make_intent(self._next_key(), self._rng) for _ in range(self._rng.randint(1, 3))]
        ids = [intent.enqueue(conn).operation_id for intent in intents]
        if not commit:
            keys = [_idempotency_key(conn, i) for i in ids]
            conn.rollback()
            with self._ledger.lock:
                for intent, op_id, key in zip(intents, ids, keys, strict=True):
                    self._ledger.rolled_back[intent.key] = (op_id, key)
            return
        try:
            conn.commit()
        except psycopg.OperationalError:
            with self._ledger.lock:
                self._ledger.uncertain.update(i.key for i in intents)
            raise
        with self._ledger.lock:
            for intent, op_id in zip(intents, ids, strict=True):
                self._ledger.committed[intent.key] = op_id
        self._mine += intents
        self._faults.arm_for(len(intents))

    def _duplicate(self, conn: psycopg.Connection[Any], intent: Intent) -> None:
        result = intent.enqueue(conn)
        conn.commit()
        with self._ledger.lock:
            expected = self._ledger.committed[intent.key]
            if result.outcome is EnqueueOutcome.DUPLICATE and result.operation_id == expected:
                self._ledger.duplicates += 1
            else:
                self._ledger.violations.append(
                    f"re-enqueue of {intent.key} gave {result.outcome} {result.operation_id}, "
                    f"not duplicate {expected}"
                )

    def _conflict(self, conn: psycopg.Connection[Any], intent: Intent) -> None:
        try:
            intent.enqueue(conn, {**intent.payload, "changed": True})
        except outbox.OperationConflict:
            conn.rollback()
            with self._ledger.lock:
                self._ledger.conflicts += 1
            return
        conn.rollback()
        with self._ledger.lock:
            self._ledger.violations.append(f"a changed payload for {intent.key} did not conflict")

    def _next_key(self) -> str:
        self._seq += 1
        return f"p{self._index}-{self._seq}"


def _idempotency_key(conn: psycopg.Connection[Any], op_id: int) -> str:
    row = conn.execute("SELECT idempotency_key FROM outbox.operations WHERE id = %s", (op_id,))
    found = row.fetchone()
    assert found is not None
    return str(found[0])


def _discard(conn: psycopg.Connection[Any] | None) -> None:
    if conn is not None:
        with suppress(psycopg.Error):
            conn.close()


# --- provider faults -----------------------------------------------------------------------


def _hook_fault(name: str) -> HookFault:
    makers: dict[str, Callable[[], HookFault]] = {
        "503_retry_after": lambda: HookFault.status(503, retry_after=1),
        "429_retry_after": lambda: HookFault.status(429, retry_after=1),
        "409_in_progress": lambda: HookFault.status(409),
        "500_before": HookFault.error_500_before_apply,
        "reset_before": HookFault.reset_before_apply,
        "reset_after": HookFault.reset_after_apply,
        "slow_after": lambda: HookFault.delay_after_apply(SLOW_ANSWER),
        "500_after_saved": HookFault.error_500_after_apply,
        "422": lambda: HookFault.status(422),
    }
    return makers[name]()


def _stripe_fault(name: str) -> StripeFault:
    status = StripeFault.status
    makers: dict[str, Callable[[], StripeFault]] = {
        "429_rate_limit": lambda: status(429, error_type="invalid_request_error",
                                         code_str="rate_limit", retry_after=1),
        "503": lambda: status(503, error_type="api_error"),
        "409_key_in_use": lambda: status(409, error_type="invalid_request_error",
                                         code_str="idempotency_key_in_use"),
        "reset_before": StripeFault.reset_before_apply,
        "500_before_saved": StripeFault.error_500_before_apply,
        "500_after_saved": StripeFault.error_500_after_apply,
        "slow_after": lambda: StripeFault.delay_after_apply(SLOW_ANSWER),
        "reset_after": StripeFault.reset_after_apply,
        "402_card_declined": lambda: status(402, error_type="card_error",
                                            code_str="card_declined"),
    }  # fmt: skip
    return makers[name]()


class FaultInjector:
    """Arms faults on the fakes in step with the operations committed, so a database outage
    (no commits) does not pile faults up for the moment it ends."""

    def __init__(self, stripe: FakeStripe, hook: FakeWebhookReceiver, rate: float,
                 seed: int) -> None:  # fmt: skip
        self._stripe, self._hook, self._rate = stripe, hook, rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.armed: Counter[str] = Counter()

    def arm_for(self, operations: int) -> None:
        with self._lock:
            for _ in range(operations):
                if self._rng.random() < self._rate:
                    self._arm_one()

    def _arm_one(self) -> None:
        if self._rng.random() < 0.5:
            name = _pick(self._rng, HOOK_FAULTS)
            self._hook.inject(_hook_fault(name))
            self.armed[f"hook {name}"] += 1
        else:
            name = _pick(self._rng, STRIPE_FAULTS)
            self._stripe.inject(_stripe_fault(name))
            self.armed[f"stripe {name}"] += 1


def _pick(rng: random.Random, weights: dict[str, int]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]


# --- dispatchers and the chaos monkey ------------------------------------------------------


class Dispatchers:
    """``count`` `outbox run` processes; a killed one is replaced at once."""

    def __init__(self, count: int, url: str, config: Path, log_dir: Path) -> None:
        self._url, self._config, self._log_dir = url, config, log_dir
        self._generation = Counter[int]()
        self.procs = [self._spawn(slot) for slot in range(count)]

    def _spawn(self, slot: int) -> OutboxProcess:
        self._generation[slot] += 1
        log = self._log_dir / f"dispatcher-{slot}-{self._generation[slot]}.log"
        return OutboxProcess(self._url, self._config, log, env={"STRIPE_API_KEY": STRIPE_KEY})

    def kill(self, slot: int) -> None:
        """SIGKILL (stopped or not), then a fresh process in its place."""
        self.procs[slot].signal(signal.SIGKILL)
        self.procs[slot].stop()
        self.procs[slot] = self._spawn(slot)

    def revive_all(self) -> None:
        """Resume stopped processes and replace dead ones (the drain needs every one)."""
        for slot, proc in enumerate(self.procs):
            if proc.proc.poll() is None:
                proc.signal(signal.SIGCONT)
            else:
                proc.stop()
                self.procs[slot] = self._spawn(slot)

    def terminate(self, timeout: float = 30.0) -> list[int | None]:
        """SIGTERM every process and collect exit codes (None: had to be killed)."""
        codes: list[int | None] = []
        for proc in self.procs:
            # A process revived just before the drain ended may still be starting up.
            proc.wait_started(timeout)
            proc.signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                codes.append(proc.wait(timeout))
            except TimeoutError:
                codes.append(None)
            proc.stop()
        return codes

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.stop()

    def logs(self) -> Iterator[Path]:
        return iter(sorted(self._log_dir.glob("dispatcher-*.log")))


@dataclass
class Mayhem:
    """What the monkey did."""

    kills: int = 0
    stops_resumed: int = 0
    stops_killed: int = 0
    pg_restarts: int = 0


def monkey(dispatchers: Dispatchers, cluster: PrivateCluster, settings: Settings,
           deadline: float, progress: Callable[[str], None]) -> Mayhem:  # fmt: skip
    """Every ``chaos_every`` seconds (jittered), kill or freeze one dispatcher; crash PostgreSQL
    ``pg_restarts`` times, spread over the run."""
    rng = random.Random(settings.seed + 7)
    mayhem = Mayhem()
    start = time.monotonic()
    span = deadline - start
    crash_at = [
        start + span * (i + 1) / (settings.pg_restarts + 1) for i in range(settings.pg_restarts)
    ]
    while True:
        pause = settings.chaos_every * rng.uniform(0.5, 1.5)
        if time.monotonic() + pause >= deadline:
            break
        time.sleep(pause)
        if crash_at and time.monotonic() >= crash_at[0]:
            crash_at.pop(0)
            cluster.restart(down_for=rng.uniform(1.0, 2.5))
            mayhem.pg_restarts += 1
            progress("PostgreSQL crashed (-m immediate) and restarted")
            continue
        _strike(dispatchers, rng, mayhem)
    return mayhem


def _strike(dispatchers: Dispatchers, rng: random.Random, mayhem: Mayhem) -> None:
    slot = rng.randrange(len(dispatchers.procs))
    proc = dispatchers.procs[slot]
    move = rng.choice(("kill", "stop_resume", "stop_kill"))
    if move == "kill":
        dispatchers.kill(slot)
        mayhem.kills += 1
        return
    proc.signal(signal.SIGSTOP)
    # Sometimes past the lease: another dispatcher rescues the rows while this one sleeps.
    time.sleep(rng.uniform(0.5, 4.0))
    if move == "stop_resume":
        proc.signal(signal.SIGCONT)
        mayhem.stops_resumed += 1
    else:
        dispatchers.kill(slot)
        mayhem.stops_killed += 1


# --- the run -------------------------------------------------------------------------------


@dataclass
class Report:
    """The soak's figures and every invariant that failed (``violations``)."""

    settings: Settings
    operations: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    by_reason: dict[str, int] = field(default_factory=dict)  # "status: reason" of set-aside ones
    effects_stripe: int = 0
    effects_hook: int = 0
    duplicates: int = 0
    lost: int = 0
    rolled_back: int = 0
    rolled_back_with_effect: int = 0
    orphan_effects: int = 0
    duplicate_enqueues: int = 0
    conflicts: int = 0
    uncertain_commits: int = 0
    attempts: int = 0
    succeeded_by_reconciler: int = 0
    faults_armed: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    mayhem: Mayhem = field(default_factory=Mayhem)
    drain_seconds: float = 0.0
    wall_seconds: float = 0.0
    exit_codes: list[int | None] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        """The figures as a Markdown table."""
        m = self.mayhem
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(self.by_status.items()))
        lines = [
            ("operations committed", f"{self.operations}"),
            ("by final status", statuses or "none"),
            ("why set aside", ", ".join(f"{r} {n}" for r, n in sorted(self.by_reason.items()))),
            ("provider effects", f"{self.effects_stripe + self.effects_hook} "
                                 f"(Stripe {self.effects_stripe}, webhook {self.effects_hook})"),
            ("duplicates (must be 0)", f"{self.duplicates}"),
            ("lost (must be 0)", f"{self.lost}"),
            ("effects without an operation (must be 0)", f"{self.orphan_effects}"),
            ("rolled back / with an effect (must be 0)",
             f"{self.rolled_back} / {self.rolled_back_with_effect}"),
            ("duplicate enqueues / conflicts refused",
             f"{self.duplicate_enqueues} / {self.conflicts}"),
            ("commits cut by the crash (resolved from the table)", f"{self.uncertain_commits}"),
            ("attempts", f"{self.attempts}"),
            ("succeeded by the reconciler's lookup", f"{self.succeeded_by_reconciler}"),
            ("provider faults armed", f"{self.faults_armed}"),
            ("dispatchers SIGKILLed / SIGSTOPped+resumed / SIGSTOPped+killed",
             f"{m.kills} / {m.stops_resumed} / {m.stops_killed}"),
            ("PostgreSQL crashes (-m immediate) and restarts", f"{m.pg_restarts}"),
            ("chaos / drain / wall time",
             f"{self.settings.duration:.0f} s / {self.drain_seconds:.1f} s / "
             f"{self.wall_seconds:.0f} s"),
            ("invariants", "all hold" if self.ok else f"{len(self.violations)} FAILED"),
        ]  # fmt: skip
        width = max(len(k) for k, _ in lines)
        out = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
        out += [f"| {k:<{width}} | {v} |" for k, v in lines]
        return "\n".join(out)


def run_chaos(settings: Settings, workdir: Path,
              progress: Callable[[str], None] = lambda _: None) -> Report:  # fmt: skip
    """Run the soak in ``workdir`` (dispatcher logs go there) and return its report."""
    wall = time.monotonic()
    ledger = Ledger()
    with ExitStack() as stack:
        cluster = stack.enter_context(private_cluster())
        retention = settings.key_retention
        stripe = stack.enter_context(FakeStripe(api_key=STRIPE_KEY, key_retention=retention))
        hook = stack.enter_context(FakeWebhookReceiver(key_retention=retention))
        faults = FaultInjector(stripe, hook, settings.fault_rate, settings.seed)
        config = _config(workdir / "outbox.toml", stripe, hook, settings)
        dispatchers = Dispatchers(settings.dispatchers, cluster.url, config, workdir)
        stack.callback(dispatchers.stop_all)
        mayhem, drain, codes = _storm(settings, cluster, dispatchers, ledger, faults, progress)
        report = verify(cluster.url, ledger, stripe, hook)
    report.settings, report.mayhem, report.exit_codes = settings, mayhem, codes
    report.drain_seconds, report.faults_armed = drain, sum(faults.armed.values())
    report.faults_by_kind = dict(sorted(faults.armed.items()))
    report.wall_seconds = time.monotonic() - wall
    if any(code != 0 for code in codes):
        report.violations.append(f"dispatchers exited with {codes} after SIGTERM, not all 0")
    return report


def _config(path: Path, stripe: FakeStripe, hook: FakeWebhookReceiver,
            settings: Settings) -> Path:  # fmt: skip
    common = {"timeout": f"{PROVIDER_TIMEOUT:g}s", "key_retention": f"{settings.key_retention:g}s"}
    return write_config(
        path,
        providers={
            STRIPE: {"type": "stripe", "api_key_env": "STRIPE_API_KEY", "api_base": stripe.url,
                     **common},
            HOOK: {"type": "webhook", "url": hook.url, **common},
        },
        # Short everything: rows of a killed dispatcher come back within seconds, retries come
        # due within a second, and the reconciler asks Stripe about saved 500s every 2 s.
        lease="2s", poll_interval="200ms", backoff_base="100ms", backoff_max="1s",
        shutdown_grace="5s", max_attempts=8, concurrency=32, batch_size=32,
        reconcile_interval="2s", retention_margin=f"{settings.retention_margin:g}s",
    )  # fmt: skip


def _storm(settings: Settings, cluster: PrivateCluster, dispatchers: Dispatchers,
           ledger: Ledger, faults: FaultInjector,
           progress: Callable[[str], None]) -> tuple[Mayhem, float, list[int | None]]:  # fmt: skip
    """Producers and the monkey for ``duration``, then the drain; returns what the monkey did,
    the drain's length and the dispatchers' exit codes."""
    stop = threading.Event()
    producers = [Producer(i, cluster.url, settings, ledger, faults, stop)
                 for i in range(settings.producers)]  # fmt: skip
    for p in producers:
        p.start()
    with _reporting(cluster.url, ledger, progress):
        mayhem = monkey(dispatchers, cluster, settings, time.monotonic() + settings.duration,
                        progress)  # fmt: skip
        stop.set()
        for p in producers:
            p.join(30)
        dispatchers.revive_all()
        progress("producers stopped; draining")
        started = time.monotonic()
        _wait_settled(cluster.url, settings.drain_timeout)
        drain = time.monotonic() - started
    return mayhem, drain, dispatchers.terminate()


@contextmanager
def _reporting(url: str, ledger: Ledger, progress: Callable[[str], None],
               every: float = 30.0) -> Iterator[None]:  # fmt: skip
    """A progress line every ``every`` seconds while the block runs."""
    done = threading.Event()

    def report() -> None:
        while not done.wait(every):
            with ledger.lock:
                committed = len(ledger.committed)
            progress(f"committed {committed}; by status {_statuses(url)}")

    thread = threading.Thread(target=report, name="chaos-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _statuses(url: str) -> dict[str, int] | None:
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            found = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1")
            return dict(found.fetchall())
    except psycopg.OperationalError:
        return None


def _wait_settled(url: str, timeout: float) -> None:
    """Until no operation is pending or in flight, or ``timeout``: verify() names the rest."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        counts = _statuses(url)
        if counts is not None and not set(counts) - FINAL:
            return
        time.sleep(0.5)


# --- the count -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: int
    key: str
    idempotency_key: str
    status: str
    reason: str | None
    provider: str
    provider_ref: str | None
    attempts: int
    attempt_rows: int
    succeeded_attempts: int


def _rows(url: str) -> list[Row]:
    with psycopg.connect(url) as conn:
        found = conn.execute("""
            SELECT o.id, o.operation_key, o.idempotency_key, o.status, o.status_reason,
                   o.provider, o.provider_ref, o.attempts, count(a.attempt),
                   count(a.attempt) FILTER (WHERE a.outcome = 'succeeded')
            FROM outbox.operations o LEFT JOIN outbox.attempts a ON a.operation_id = o.id
            GROUP BY o.id ORDER BY o.id
        """).fetchall()  # fmt: skip
    return [Row(*r) for r in found]


@dataclass(frozen=True)
class Carried:
    """What an effect carried: the idempotency key, the operation id, and its reference."""

    key: str
    operation_id: str
    ref: str


Matched = tuple[dict[int, list[str]], list[Carried], int, int]


def _effects(stripe: FakeStripe, hook: FakeWebhookReceiver, ops: dict[str, Row]) -> Matched:
    """Effects by operation id (their references), effects matching no operation, and the
    Stripe and webhook totals. An effect is matched by the idempotency key it carried, and must
    carry its operation's id too."""
    by_op: dict[int, list[str]] = {}
    orphans: list[Carried] = []
    objects = stripe.objects()
    effects = hook.effects
    carried = [Carried(str(o["metadata"].get("outbox_idempotency_key")),
                       str(o["metadata"].get("outbox_operation_id")), str(o["id"]))
               for o in objects]  # fmt: skip
    carried += [Carried(e.key, e.headers.get("outbox-operation-id", ""), e.effect_id)
                for e in effects]  # fmt: skip
    for effect in carried:
        row = ops.get(effect.key)
        if row is None or str(row.id) != effect.operation_id:
            orphans.append(effect)
            continue
        by_op.setdefault(row.id, []).append(effect.ref)
    return by_op, orphans, len(objects), len(effects)


def verify(url: str, ledger: Ledger, stripe: FakeStripe, hook: FakeWebhookReceiver) -> Report:
    """Count every operation against every effect; see the module's docstring."""
    report = Report(Settings())
    rows = _rows(url)
    ops = {r.idempotency_key: r for r in rows}
    by_key = {r.key: r for r in rows}
    by_op, orphans, report.effects_stripe, report.effects_hook = _effects(stripe, hook, ops)
    with ledger.lock:
        report.violations += ledger.violations
        committed, rolled_back = dict(ledger.committed), dict(ledger.rolled_back)
        uncertain = set(ledger.uncertain)
        report.duplicate_enqueues, report.conflicts = ledger.duplicates, ledger.conflicts
    report.operations, report.attempts = len(rows), sum(r.attempts for r in rows)
    report.by_status = dict(Counter(r.status for r in rows))
    report.by_reason = dict(Counter(f"{r.status} {r.reason}" for r in rows
                                    if r.status in ("quarantined", "reconciling")))  # fmt: skip
    report.uncertain_commits = len(uncertain)
    _check_producers(report, committed, rolled_back, uncertain, by_key, orphans)
    for row in rows:
        _check_row(report, row, by_op.get(row.id, []))
    return report


def _check_producers(report: Report, committed: dict[str, int],
                     rolled_back: dict[str, tuple[int, str]], uncertain: set[str],
                     by_key: dict[str, Row], orphans: list[Carried]) -> None:  # fmt: skip
    """The table against what producers saw: commits kept, rollbacks gone without effect."""
    for key, op_id in committed.items():
        row = by_key.get(key)
        if row is None or row.id != op_id:
            report.lost += 1
            report.violations.append(f"committed {key} (id {op_id}) is not in the table")
    known = set(committed) | uncertain
    for key in set(by_key) - known:
        report.violations.append(f"{key} is in the table but no producer committed it")
    report.rolled_back = len(rolled_back)
    rolled_keys = {key for _, key in rolled_back.values()}
    rolled_ids = {str(op_id) for op_id, _ in rolled_back.values()}
    for key in rolled_back:
        if key in by_key:
            report.violations.append(f"rolled-back {key} is in the table")
    report.orphan_effects = len(orphans)
    for o in orphans:
        if o.key in rolled_keys or o.operation_id in rolled_ids:
            report.rolled_back_with_effect += 1
        report.violations.append(
            f"effect {o.ref} (key {o.key}, operation {o.operation_id}) belongs to no operation"
        )


def _check_row(report: Report, row: Row, refs: list[str]) -> None:
    """One operation's invariants."""
    name = f"operation {row.id} ({row.key}, {row.status})"
    report.duplicates += max(0, len(refs) - 1)
    if len(refs) > 1:
        report.violations.append(f"{name} has {len(refs)} effects: {refs}")
    if row.status not in FINAL:
        report.lost += 1
        report.violations.append(f"{name} is not final after the drain")
        return
    if row.attempts != row.attempt_rows:
        report.violations.append(f"{name}: attempts {row.attempts} but {row.attempt_rows} rows")
    if row.status == "succeeded":
        if refs != [row.provider_ref]:
            report.violations.append(f"{name}: provider_ref {row.provider_ref}, effects {refs}")
        if row.succeeded_attempts == 0:
            report.succeeded_by_reconciler += 1
        elif row.succeeded_attempts > 1:
            report.violations.append(f"{name} succeeded {row.succeeded_attempts} times")
    elif row.attempt_rows == 0:
        report.violations.append(f"{name} has no attempt history")


def print_report(report: Report, out: Any = sys.stdout, limit: int = 50) -> None:
    print(report.table(), file=out)
    kinds = ", ".join(f"{kind} {n}" for kind, n in report.faults_by_kind.items())
    print(f"\nfaults armed: {kinds}", file=out)
    for violation in report.violations[:limit]:
        print(f"VIOLATION: {violation}", file=out)
    if len(report.violations) > limit:
        print(f"... and {len(report.violations) - limit} more", file=out)

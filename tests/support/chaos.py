"""The chaos soak: producers, faults, killed and frozen dispatchers and a PostgreSQL crash at
once, under an adversarial workload; then every operation counted against every provider effect
and every invariant checked.

``bench/chaos.py`` runs it for ``--duration`` seconds. tests/integration/test_chaos.py runs a
bounded soak of the workload of before issue 17 (:data:`NARROW`), and
tests/integration/test_adversarial.py a short one of the whole workload. All call
:func:`run_chaos` and read :class:`Report`.

What runs: a private PostgreSQL cluster (restarted once with ``-m immediate``), the fake Stripe
and the fake webhook receiver on loopback (in this process, so their ledgers of effects outlive
every dispatcher), producer threads that enqueue continuously (some transactions rolled back,
some duplicates, some conflicts) and arm a random provider fault for about one operation in
``fault_rate``, and ``dispatchers`` real ``outbox run`` processes, one of which is SIGKILLed or
SIGSTOPped (then resumed or killed) every ``chaos_every`` seconds and brought back. The fakes
forget idempotency keys after ``key_retention`` seconds (30 by default, and the providers are
configured so), so the run reaches the point where a blind resend would duplicate an effect.

Its parts: tests/support/chaos_settings.py (the knobs and the constants they share),
chaos_workload.py (what producers enqueue, try or plant), chaos_producers.py (the producer
threads and their ledger), chaos_mayhem.py (provider faults, the dispatchers and the monkey),
chaos_audit.py (the count and the invariants), chaos_report.py (the figures and their print);
this module runs them together.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Final

import psycopg

from outbox.testing.stripe import FakeStripe
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.chaos_audit import verify
from tests.support.chaos_mayhem import Dispatchers, FaultInjector, Mayhem, monkey
from tests.support.chaos_producers import Ledger, Producer, schedule_far_ahead
from tests.support.chaos_report import Report, print_report
from tests.support.chaos_settings import (
    BATCH_SIZE,
    HOOK,
    LATER,
    LEASE,
    NARROW,
    PAYLOAD_LIMIT,
    POLL_INTERVAL,
    PROVIDER_TIMEOUT,
    RECONCILE_INTERVAL,
    STRIPE,
    STRIPE_KEY,
    Settings,
)
from tests.support.chaos_workload import HOSTILE, POISON, tenant_names
from tests.support.cluster import PrivateCluster, private_cluster
from tests.support.daemon import write_config

# What the tests and bench/chaos.py import from here.
__all__ = ["HOSTILE", "NARROW", "POISON", "Report", "Settings", "print_report", "run_chaos"]

# A reconciling operation the reconciler can settle does so at its first lookup, within one
# RECONCILE_INTERVAL, and lets the next of its ordering key go: the drain ends once nothing has
# changed for this long.
DRAIN_QUIET: Final = RECONCILE_INTERVAL + 1.0


def run_chaos(
    settings: Settings, workdir: Path, progress: Callable[[str], None] = lambda _: None
) -> Report:
    """Run the soak in ``workdir`` (dispatcher logs go there) and return its report."""
    wall = time.monotonic()
    ledger = Ledger()
    tenants, early = tenant_names(settings)
    with ExitStack() as stack:
        cluster = stack.enter_context(private_cluster())
        with psycopg.connect(cluster.url) as owner:
            owner.execute("UPDATE outbox.limits SET max_payload_bytes = %s", (PAYLOAD_LIMIT,))
        schedule_far_ahead(cluster.url, settings, early, ledger)
        retention = settings.key_retention
        stripe = stack.enter_context(FakeStripe(api_key=STRIPE_KEY, key_retention=retention))
        hook = stack.enter_context(FakeWebhookReceiver(key_retention=retention))
        faults = FaultInjector(stripe, hook, settings.fault_rate, settings.seed)
        config = _config(workdir / "outbox.toml", stripe, hook, settings)
        dispatchers = Dispatchers(settings.dispatchers, cluster.url, config, workdir)
        stack.callback(dispatchers.stop_all)
        # Operations wait for no dispatcher's start: the bound on their first attempt holds from
        # the first enqueue.
        dispatchers.wait_started()
        mayhem, drain, codes = _storm(
            settings, cluster, dispatchers, tenants, ledger, faults, progress
        )
        report = verify(cluster.url, ledger, stripe, hook, settings)
    report.mayhem, report.exit_codes = mayhem, codes
    report.drain_seconds, report.faults_armed = drain, sum(faults.armed.values())
    report.faults_by_kind = dict(sorted(faults.armed.items()))
    report.wall_seconds = time.monotonic() - wall
    report.crashes = len(dispatchers.crashes)
    report.violations += [f"dispatcher {crash}" for crash in dispatchers.crashes]
    if any(code != 0 for code in codes):
        report.violations.append(f"dispatchers exited with {codes} after SIGTERM, not all 0")
    return report


def _config(path: Path, stripe: FakeStripe, hook: FakeWebhookReceiver, settings: Settings) -> Path:
    common = {"timeout": f"{PROVIDER_TIMEOUT:g}s", "key_retention": f"{settings.key_retention:g}s"}
    return write_config(
        path,
        providers={
            STRIPE: {
                "type": "stripe",
                "api_key_env": "STRIPE_API_KEY",
                "api_base": stripe.url,
                **common,
            },
            HOOK: {"type": "webhook", "url": hook.url, **common},
        },
        lease=f"{LEASE:g}s",
        poll_interval=f"{POLL_INTERVAL * 1000:g}ms",
        backoff_base="100ms",
        backoff_max="1s",
        shutdown_grace="5s",
        max_attempts=8,
        concurrency=32,
        batch_size=BATCH_SIZE,
        reconcile_interval=f"{RECONCILE_INTERVAL:g}s",
        retention_margin=f"{settings.retention_margin:g}s",
    )


def _storm(
    settings: Settings,
    cluster: PrivateCluster,
    dispatchers: Dispatchers,
    tenants: list[str],
    ledger: Ledger,
    faults: FaultInjector,
    progress: Callable[[str], None],
) -> tuple[Mayhem, float, list[int | None]]:
    """Producers and the monkey for ``duration``, then the drain; returns what the monkey did,
    the drain's length and the dispatchers' exit codes."""
    stop = threading.Event()
    producers = [
        Producer(i, cluster.url, settings, tenants, ledger, faults, stop)
        for i in range(settings.producers)
    ]
    for p in producers:
        p.start()
    with _reporting(cluster.url, ledger, progress):
        mayhem = monkey(
            dispatchers, cluster, settings, time.monotonic() + settings.duration, progress
        )
        stop.set()
        for p in producers:
            p.join(30)
        dispatchers.revive_all()
        progress("producers stopped; draining")
        started = time.monotonic()
        _wait_settled(cluster.url, settings.drain_timeout, dispatchers.reap)
        drain = time.monotonic() - started
        dispatchers.reap()
    return mayhem, drain, dispatchers.terminate()


@contextmanager
def _reporting(
    url: str, ledger: Ledger, progress: Callable[[str], None], every: float = 30.0
) -> Iterator[None]:
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


# Operations the drain waits for: in flight, or pending and free to go. Those due hours ahead and
# those behind a set-aside operation of their ordering key (mode block) wait for longer than
# any drain; verify() checks them.
_UNSETTLED: Final = """
SELECT count(*) FROM outbox.operations o
WHERE o.status = 'in_flight'
   OR (o.status = 'pending' AND o.available_at < now() + %(later)s::interval
       AND NOT EXISTS (SELECT 1 FROM outbox.operations h
                       WHERE h.tenant_id = o.tenant_id AND h.ordering_key = o.ordering_key
                         AND h.id < o.id AND h.status IN ('quarantined', 'reconciling')))
"""


def _settlement(url: str) -> tuple[int, dict[str, int]] | None:
    """How many operations may still move, and the count by status; None while down."""
    try:
        with psycopg.connect(url, connect_timeout=3) as conn:
            row = conn.execute(_UNSETTLED, {"later": timedelta(hours=LATER[0] / 2)}).fetchone()
            found = conn.execute("SELECT status, count(*) FROM outbox.operations GROUP BY 1")
            return (0 if row is None else int(row[0])), dict(found.fetchall())
    except psycopg.OperationalError:
        return None


def _wait_settled(url: str, timeout: float, watch: Callable[[], None]) -> None:
    """Until nothing may move and nothing has for DRAIN_QUIET, or ``timeout``: verify() names
    the rest. ``watch`` runs between looks."""
    deadline = time.monotonic() + timeout
    calm: tuple[float, dict[str, int]] | None = None
    while time.monotonic() < deadline:
        watch()
        state = _settlement(url)
        if state is None or state[0]:
            calm = None
        elif calm is None or calm[1] != state[1]:
            calm = (time.monotonic(), state[1])
        elif time.monotonic() - calm[0] >= DRAIN_QUIET:
            return
        time.sleep(0.5)

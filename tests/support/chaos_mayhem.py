"""The chaos soak's mayhem: the provider faults armed on the fakes (:class:`FaultInjector`), the
``outbox run`` processes (:class:`Dispatchers`) and the monkey that SIGKILLs and SIGSTOPs them
and crashes PostgreSQL (:func:`monkey`)."""

from __future__ import annotations

import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.chaos_settings import (
    LONGEST_STOP,
    PG_DOWN,
    SLOW_ANSWER,
    STRIPE_KEY,
    Settings,
    pick,
    random_source,
)
from tests.support.cluster import PrivateCluster
from tests.support.daemon import OutboxProcess

# Provider faults by weight. "after" faults act and then fail to say so; their retries meet
# the providers' idempotency ledgers.
HOOK_FAULTS: Final = {
    "503_retry_after": 4,
    "429_retry_after": 4,
    "409_in_progress": 2,
    "500_before": 3,
    "reset_before": 3,
    "reset_after": 4,
    "slow_after": 2,
    "500_after_saved": 1,
    "422": 1,
}
STRIPE_FAULTS: Final = {
    "429_rate_limit": 4,
    "503": 3,
    "409_key_in_use": 2,
    "reset_before": 3,
    "500_before_saved": 1,
    "500_after_saved": 1,
    "slow_after": 2,
    "reset_after": 4,
    "402_card_declined": 1,
}


# --- provider faults -----------------------------------------------------------------------


def _hook_fault(name: str) -> WebhookFault:
    makers: dict[str, Callable[[], WebhookFault]] = {
        "503_retry_after": lambda: WebhookFault.status(503, retry_after=1),
        "429_retry_after": lambda: WebhookFault.status(429, retry_after=1),
        "409_in_progress": lambda: WebhookFault.status(409),
        "500_before": WebhookFault.error_500_before_apply,
        "reset_before": WebhookFault.reset_before_apply,
        "reset_after": WebhookFault.reset_after_apply,
        "slow_after": lambda: WebhookFault.delay_after_apply(SLOW_ANSWER),
        "500_after_saved": WebhookFault.error_500_after_apply,
        "422": lambda: WebhookFault.status(422),
    }
    return makers[name]()


def _stripe_fault(name: str) -> StripeFault:
    status = StripeFault.status
    makers: dict[str, Callable[[], StripeFault]] = {
        "429_rate_limit": lambda: status(
            429, error_type="invalid_request_error", code_str="rate_limit", retry_after=1
        ),
        "503": lambda: status(503, error_type="api_error"),
        "409_key_in_use": lambda: status(
            409, error_type="invalid_request_error", code_str="idempotency_key_in_use"
        ),
        "reset_before": StripeFault.reset_before_apply,
        "500_before_saved": StripeFault.error_500_before_apply,
        "500_after_saved": StripeFault.error_500_after_apply,
        "slow_after": lambda: StripeFault.delay_after_apply(SLOW_ANSWER),
        "reset_after": StripeFault.reset_after_apply,
        "402_card_declined": lambda: status(402, error_type="card_error", code_str="card_declined"),
    }
    return makers[name]()


class FaultInjector:
    """Arms faults on the fakes in step with the operations committed, so a database outage
    (no commits) does not pile faults up for the moment it ends."""

    def __init__(
        self, stripe: FakeStripe, hook: FakeWebhookReceiver, rate: float, seed: int
    ) -> None:
        self._stripe, self._hook, self._rate = stripe, hook, rate
        self._rng = random_source(seed, "faults")
        self._lock = threading.Lock()
        self.armed: Counter[str] = Counter()

    def arm_for(self, operations: int) -> None:
        with self._lock:
            for _ in range(operations):
                if self._rng.random() < self._rate:
                    self._arm_one()

    def _arm_one(self) -> None:
        if self._rng.random() < 0.5:
            name = pick(self._rng, HOOK_FAULTS)
            self._hook.inject(_hook_fault(name))
            self.armed[f"hook {name}"] += 1
        else:
            name = pick(self._rng, STRIPE_FAULTS)
            self._stripe.inject(_stripe_fault(name))
            self.armed[f"stripe {name}"] += 1


# --- dispatchers and the chaos monkey ------------------------------------------------------


class Dispatchers:
    """``count`` `outbox run` processes; a killed one is replaced at once. One that exits by
    itself is a crash: :meth:`reap` notes it in ``crashes`` and replaces it."""

    def __init__(self, count: int, url: str, config: Path, log_dir: Path) -> None:
        self._url, self._config, self._log_dir = url, config, log_dir
        self._generation = Counter[int]()
        self.procs = [self._spawn(slot) for slot in range(count)]
        self.crashes: list[str] = []

    def _spawn(self, slot: int) -> OutboxProcess:
        self._generation[slot] += 1
        log = self._log_dir / f"dispatcher-{slot}-{self._generation[slot]}.log"
        return OutboxProcess(self._url, self._config, log, env={"STRIPE_API_KEY": STRIPE_KEY})

    def kill(self, slot: int) -> None:
        """SIGKILL (stopped or not), then a fresh process in its place."""
        self.procs[slot].signal(signal.SIGKILL)
        self.procs[slot].stop()
        self.procs[slot] = self._spawn(slot)

    def reap(self) -> None:
        """Note and replace every process that exited although nobody killed it."""
        for slot, proc in enumerate(self.procs):
            code = proc.proc.poll()
            if code is None:
                continue
            last = proc.log_text().strip().splitlines()[-3:]
            self.crashes.append(
                f"{proc.log_path.name} exited by itself with code {code}: " + " | ".join(last)
            )
            proc.stop()
            self.procs[slot] = self._spawn(slot)

    def revive_all(self) -> None:
        """Resume stopped processes and replace crashed ones (the drain needs every one)."""
        self.reap()
        for proc in self.procs:
            proc.signal(signal.SIGCONT)

    def wait_started(self, timeout: float = 30.0) -> None:
        for proc in self.procs:
            proc.wait_started(timeout)

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


def _watch(dispatchers: Dispatchers, seconds: float) -> None:
    """Sleep ``seconds``, looking for crashed dispatchers meanwhile."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(left, 0.25))
        dispatchers.reap()


@dataclass
class Mayhem:
    """What the monkey did."""

    kills: int = 0
    stops_resumed: int = 0
    stops_killed: int = 0
    pg_restarts: int = 0


def monkey(
    dispatchers: Dispatchers,
    cluster: PrivateCluster,
    settings: Settings,
    deadline: float,
    progress: Callable[[str], None],
) -> Mayhem:
    """Every ``chaos_every`` seconds (jittered), kill or freeze one dispatcher; crash PostgreSQL
    ``pg_restarts`` times, spread over the run."""
    rng = random_source(settings.seed, "monkey")
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
        _watch(dispatchers, pause)
        if crash_at and time.monotonic() >= crash_at[0]:
            crash_at.pop(0)
            cluster.restart(down_for=rng.uniform(*PG_DOWN))
            mayhem.pg_restarts += 1
            progress("PostgreSQL crashed (-m immediate) and restarted")
            continue
        _strike(dispatchers, rng, mayhem)
    _watch(dispatchers, max(0.0, deadline - time.monotonic()))
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
    _watch(dispatchers, rng.uniform(0.5, LONGEST_STOP))
    if move == "stop_resume":
        proc.signal(signal.SIGCONT)
        mayhem.stops_resumed += 1
    else:
        dispatchers.kill(slot)
        mayhem.stops_killed += 1

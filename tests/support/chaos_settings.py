"""The chaos soak's knobs (:class:`Settings`, and :data:`NARROW`), the constants its parts share
(tests/support/chaos.py and its chaos_* modules), and the seeded random sources every choice of
a run is drawn from."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Final, TypeVar

from outbox.dispatch.claims import CLAIM_RETRY_MAX
from outbox.dispatch.maintenance import ORDERING_REPAIR_INTERVAL

STRIPE: Final = "stripe"
HOOK: Final = "hook"
STRIPE_KEY: Final = "sk_test_chaos"
# The fakes delay a "slow" answer past the providers' timeout, so the call ends unknown.
PROVIDER_TIMEOUT: Final = 2.0
SLOW_ANSWER: Final = 3.0

# The dispatchers' settings (_config in tests/support/chaos.py). Short everything: rows of a
# killed dispatcher come back within seconds, retries come due within a second, and the
# reconciler asks Stripe about saved 500s every RECONCILE_INTERVAL.
LEASE: Final = 2.0
POLL_INTERVAL: Final = 0.2
BATCH_SIZE: Final = 32
RECONCILE_INTERVAL: Final = 2.0
# The monkey's longest SIGSTOP (they last from half a second to this, often past the lease:
# another dispatcher rescues the rows while the frozen one sleeps), and how long PostgreSQL
# stays down after its crash.
LONGEST_STOP: Final = 4.0
PG_DOWN: Final = (1.0, 2.5)
# Crash recovery of the small cluster, until it accepts connections again: well under a second
# when measured (tests/support/cluster.py waits for it), counted at a second.
PG_RECOVERY: Final = 1.0
# CI runs the soak beside the rest of the suite (pytest -n auto): three dispatchers, PostgreSQL,
# the fakes and the producers share two cores with other tests' processes.
LOADED_MACHINE: Final = 3.0
# The longest a due operation may wait for its first attempt, in seconds from when it became due
# (its enqueue's commit, its available_at, or the settling of the operation before it under its
# ordering key). The waits one operation can meet, added up as if all struck it at once:
# - a poll interval for the stager to stage it once due, and another for a claim to find it
#   (NOTIFY is sooner, but a planted row, a staged one or a busy dispatcher wait for the poll);
# - ORDERING_REPAIR_INTERVAL: when a producer of its key was committing as the operation before
#   it settled, a dispatcher's repair, not the settler, promotes it;
# - LONGEST_STOP: a SIGSTOPped dispatcher keeps the row locks of a claim or a staging it had
#   open until it is resumed or killed (SKIP LOCKED makes the others pass the rows by);
# - the PostgreSQL crash: down for up to PG_DOWN[1], then PG_RECOVERY, then the claim loop's
#   retry, which doubles while claims fail, up to CLAIM_RETRY_MAX;
# - LOADED_MACHINE.
# Not the lease: an attempt is stamped (attempts.started_at) when its claim commits, and one
# rescued from a killed or frozen claimer keeps that stamp (statements.RESCUE): the lease delays
# the outcome of an attempt, never its start.
DUE_BOUND: Final = (
    2 * POLL_INTERVAL
    + ORDERING_REPAIR_INTERVAL
    + LONGEST_STOP
    + PG_DOWN[1]
    + PG_RECOVERY
    + CLAIM_RETRY_MAX
    + LOADED_MACHINE
)
# When "soon" operations are due after their enqueue (seconds), and "later" ones (hours). The
# drain leaves alone what is due more than half of LATER's least ahead: a run of up to an hour
# never sees a "later" operation come due.
SOON: Final = (1.0, 5.0)
LATER: Final = (2.0, 24.0)
# outbox.limits.max_payload_bytes in the run, lowered from 1 MiB (the least allowed is 4 KiB) so
# that a poison row stored past it and a refused payload past it cost 80 KB, not megabytes.
PAYLOAD_LIMIT: Final = 65536

_T = TypeVar("_T")


def _knob(default: _T, what: str) -> _T:
    """A Settings field and its help text, from which bench/chaos.py makes its options."""
    return field(default=default, metadata={"help": what})


@dataclass(frozen=True)
class Settings:
    """One soak's knobs. The defaults exercise the whole workload; :data:`NARROW` is the workload
    of before issue 17 (one kind of payload, no due times, no ordering keys, nothing hostile)."""

    duration: float = _knob(40.0, "seconds of chaos before the drain")
    dispatchers: int = _knob(3, "outbox run processes")
    producers: int = _knob(2, "producer threads")
    rate: float = _knob(40.0, "producer transactions a second, all producers together")
    fault_rate: float = _knob(0.12, "provider faults armed per operation committed")
    chaos_every: float = _knob(4.0, "mean seconds between two dispatcher kills or stops")
    pg_restarts: int = _knob(1, "PostgreSQL crashes (-m immediate), spread over the run")
    drain_timeout: float = _knob(60.0, "seconds the drain may take at most")
    seed: int = _knob(1, "the seed of every random choice of the run (the report prints it)")
    # How long the fakes remember an idempotency key, and what the providers are configured
    # with; retries stop `retention_margin` before. Short, so that the run reaches the point
    # where a blind resend would duplicate an effect, and outbox must reconcile instead. The
    # margin outlasts the longest SIGSTOP (4 s) plus a call's timeout (2 s) with room to spare:
    # a frozen process could otherwise send after its last check of the window.
    key_retention: float = _knob(
        30.0,
        "seconds the fakes remember an idempotency key (and the providers are configured with)",
    )
    retention_margin: float = _knob(10.0, "seconds before that when retries stop")
    tenants: int = _knob(40, "tenants with due work")
    scheduled_tenants: int = _knob(
        80,
        "tenants with only operations due hours ahead, sorting before the others (more "
        f"than one claim visits: {2 * BATCH_SIZE} groups)",
    )
    soon_rate: float = _knob(0.1, "share of the operations due 1 to 5 s after their enqueue")
    later_rate: float = _knob(0.04, "share due 2 to 24 hours ahead (never attempted)")
    ordered_rate: float = _knob(0.25, "share under an ordering key")
    lines: int = _knob(4, "ordering keys a producer enqueues under at a time")
    exact_rate: float = _knob(0.2, "share of payloads with numbers a float cannot hold")
    hostile_rate: float = _knob(0.05, "share of transactions trying what the door must refuse")
    poison_rate: float = _knob(0.02, "share of transactions planting a poison row behind enqueue")
    due_bound: float = _knob(
        DUE_BOUND, "seconds within which a due operation must be first attempted (see DUE_BOUND)"
    )

    def command(self) -> str:
        """The bench command that runs these settings again."""
        knobs = " ".join(
            f"--{f.name.replace('_', '-')} {getattr(self, f.name)}" for f in fields(self)
        )
        return f"python bench/chaos.py {knobs}"


NARROW: Final = Settings(
    tenants=1,
    scheduled_tenants=0,
    soon_rate=0.0,
    later_rate=0.0,
    ordered_rate=0.0,
    exact_rate=0.0,
    hostile_rate=0.0,
    poison_rate=0.0,
)


def random_source(seed: int, purpose: str) -> random.Random:
    """The random source of one part of the run, derived from the run's seed."""
    return random.Random(f"{seed}/{purpose}")


def pick(rng: random.Random, weights: Mapping[str, float]) -> str:
    return rng.choices(list(weights), list(weights.values()))[0]

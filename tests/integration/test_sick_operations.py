"""A sick provider is not sick operations (issue 37), through a real `outbox run`.

A receiver fails a chosen share of operations every time (by payload, by tenant, by ordering
key) and takes the rest, while healthy operations keep coming. Below 100 %: every healthy
operation is delivered once, within HEALTHY_WITHIN seconds of its enqueue, the breaker does
not open (at 10 % and less), and every failing one spends its whole budget and leaves the line
for a person (an ordering key's later operations wait behind it, unsent). At 100 %, and with
the provider down, the breaker opens and the operations wait pending: only the calls in flight
as it opened and its probes are spent.

Seeded: OUTBOX_TEST_SEED replays a run; the seed is in every assertion message.
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import psycopg
import pytest

import outbox
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.daemon import wait_until
from tests.support.dispatch import rows
from tests.support.queues import outbox_run

TENANTS: Final = 20
KEYS: Final = 40  # ordering keys, in "ordering" mode: five operations each
COUNT: Final = 200
BUDGET: Final = 3  # max_attempts
CONCURRENCY: Final = 8
# Every healthy operation is delivered within this many seconds of its enqueue: the breaker
# never holds them up.
HEALTHY_WITHIN: Final = 15.0
# How long a run at 100 % (or against a provider that is down) is watched.
WATCH: Final = 4.0
OPEN_FOR: Final = "1s"
STREAM_GAP: Final = 0.025  # seconds between two streamed healthy operations (40 a second)


@dataclass
class Workload:
    seed: int
    mode: str
    share: float
    keys: dict[int, str]  # operation id -> stored idempotency key
    failing: set[int]
    ordering: dict[int, str | None]
    tenant: dict[int, str]


def seeded() -> int:
    return int(os.environ.get("OUTBOX_TEST_SEED", random.randrange(1 << 30)))


def enqueue(url: str, mode: str, share: float, seed: int) -> Workload:
    rng = random.Random(seed)
    plan = []
    for n in range(COUNT):
        ordering = f"k{n % KEYS}" if mode == "ordering" else None
        plan.append((f"t{rng.randrange(TENANTS):02}", f"op-{n}", ordering))
    rng.shuffle(plan)
    ids: list[int] = []
    with psycopg.connect(url) as conn:
        for tenant, key, ordering in plan:
            made = outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="order.placed",
                operation_key=key,
                provider="hook",
                action="order.placed",
                payload={"key": key, "tenant": tenant},
                ordering_key=ordering,
                max_attempts=BUDGET,
            )
            ids.append(made.operation_id)
    found = rows(url, "SELECT id, idempotency_key, tenant_id, ordering_key FROM outbox.operations")
    keys = {int(i): str(k) for i, k, _, _ in found}
    tenant_of = {int(i): str(t) for i, _, t, _ in found}
    ordering_of = {int(i): o for i, _, _, o in found}
    failing = pick_failing(rng, mode, share, ids, tenant_of, ordering_of)
    return Workload(seed, mode, share, keys, failing, ordering_of, tenant_of)


def pick_failing(
    rng: random.Random,
    mode: str,
    share: float,
    ids: list[int],
    tenant_of: dict[int, str],
    ordering_of: dict[int, str | None],
) -> set[int]:
    if mode in ("payload", "down"):
        return set(rng.sample(ids, max(1, round(share * len(ids)))))
    group_of = tenant_of if mode == "tenant" else ordering_of
    groups = sorted({str(g) for g in group_of.values()})
    sick = set(rng.sample(groups, max(1, round(share * len(groups)))))
    return {i for i in ids if group_of[i] in sick}


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def receiver() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as r:
        yield r


def run(url: str, tmp_path: Path, target: str) -> Any:
    provider = {"type": "webhook", "url": target, "breaker_open_for": OPEN_FOR, "timeout": "2s"}
    return outbox_run(
        url,
        tmp_path,
        {"hook": provider},
        concurrency=CONCURRENCY,
        batch_size=CONCURRENCY,
    )


def table(url: str) -> dict[int, tuple[str, int, bool]]:
    found = rows(url, "SELECT id, status, attempts, ordering_blocked FROM outbox.operations")
    return {int(i): (str(s), int(a), bool(b)) for i, s, a, b in found}


class Stream:
    """Healthy operations enqueued through the whole run, every STREAM_GAP seconds, from tenants
    and ordering keys that do not fail: the neighbours that keep succeeding while the failing
    ones spend their budgets (as in production, where traffic does not stop)."""

    def __init__(self, url: str, w: Workload) -> None:
        self._url, self._w = url, w
        sick_tenants = {w.tenant[op] for op in w.failing} if w.mode == "tenant" else set()
        self._tenants = [f"t{n:02}" for n in range(TENANTS) if f"t{n:02}" not in sick_tenants]
        self._stop = threading.Event()
        self.count = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        rng = random.Random(self._w.seed + 1)
        with psycopg.connect(self._url, autocommit=True) as conn:
            while not self._stop.wait(STREAM_GAP):
                outbox.enqueue(
                    conn,
                    tenant_id=rng.choice(self._tenants),
                    operation_type="order.placed",
                    operation_key=f"stream-{self.count}",
                    provider="hook",
                    action="order.placed",
                    payload={"stream": self.count},
                    max_attempts=BUDGET,
                )
                self.count += 1


@pytest.mark.parametrize(
    ("mode", "share"),
    [
        ("payload", 0.01),
        ("payload", 0.10),
        ("payload", 0.50),
        ("tenant", 0.10),
        ("tenant", 0.50),
        ("ordering", 0.10),
        ("ordering", 0.50),
    ],
)
def test_failing_operations_spend_their_own_budget_and_the_healthy_ones_go(
    db_url: str, tmp_path: Path, receiver: FakeWebhookReceiver, mode: str, share: float
) -> None:
    w = enqueue(db_url, mode, share, seeded())
    for op in w.failing:
        receiver.inject(WebhookFault.status(500), key=w.keys[op], times=1000)
    heads = first_of_each_key(w) if mode == "ordering" else set(w.keys)
    failing_heads = w.failing & heads
    blocked_behind = w.failing - heads  # later operations of a failing ordering key
    healthy = set(w.keys) - w.failing
    said = f"seed {w.seed}, {mode} {share:.0%}: {len(w.failing)} failing"

    def settled() -> bool:
        now = table(db_url)
        # Their 500s may have acted: in doubt, they go to reconciliation (departure 20).
        return all(now[op][0] == "reconciling" for op in failing_heads)

    with run(db_url, tmp_path, receiver.url) as process:
        with Stream(db_url, w) as stream:
            wait_until(settled, timeout=30, what=f"the failing ones settled ({said})")
        wait_until(
            lambda: statuses_of(db_url, "stream-%") == {"succeeded": stream.count},
            timeout=10,
            what=f"the stream delivered ({said})",
        )
        log = process.log_text()
    now = table(db_url)
    slowest = slowest_delivery(db_url)
    print(f"\n{said}: {stream.count} streamed; slowest delivery {slowest:.1f} s")  # noqa: T201
    assert slowest <= HEALTHY_WITHIN, said
    for op in healthy:
        assert now[op][0] == "succeeded", (said, op, now[op])
        assert receiver.effect_count(w.keys[op]) == 1, said
    # Each failing one used its whole budget, one request per attempt, and left the line.
    for op in failing_heads:
        assert now[op][1] == BUDGET, (said, op, now[op])
        assert len(receiver.received_for(w.keys[op])) == BUDGET, said
    for op in blocked_behind:  # never sent: their key's head is set aside (mode block)
        assert now[op] == ("pending", 0, True), (said, op, now[op])
    assert receiver.effect_count() == len(healthy) + stream.count, said
    # At 50 % a burst of failing payloads may open it for a moment (a call in flight that
    # succeeds closes it again): the bound above is what holds the healthy ones to account.
    assert "provider breaker opened" not in log or share >= 0.5, (said, log[-3000:])


def statuses_of(url: str, keys_like: str) -> dict[str, int]:
    found = rows(
        url,
        "SELECT status, count(*) FROM outbox.operations WHERE operation_key LIKE %s GROUP BY 1",
        (keys_like,),
    )
    return {str(s): int(n) for s, n in found}


def slowest_delivery(url: str) -> float:
    """The longest any succeeded operation took from its enqueue to its success (seconds)."""
    ((took,),) = rows(
        url,
        "SELECT coalesce(max(extract(epoch FROM finished_at - created_at)), 0)::float8 "
        "FROM outbox.operations WHERE status = 'succeeded'",
    )
    return float(took)


def first_of_each_key(w: Workload) -> set[int]:
    """The head of each ordering key: its first operation (a key is a tenant's own)."""
    firsts: dict[tuple[str, str], int] = {}
    for op in sorted(w.keys):
        key = w.ordering[op]
        if key is not None:
            firsts.setdefault((w.tenant[op], key), op)
    return set(firsts.values())


@pytest.mark.parametrize("mode", ["payload", "down"])
def test_a_provider_failing_everything_opens_the_breaker_and_spends_almost_nothing(
    db_url: str, tmp_path: Path, receiver: FakeWebhookReceiver, mode: str
) -> None:
    w = enqueue(db_url, "payload", 1.0, seeded())
    target = receiver.url if mode == "payload" else f"http://127.0.0.1:{closed_port()}/hook"
    for op in w.failing:
        receiver.inject(WebhookFault.status(500), key=w.keys[op], times=1000)
    said = f"seed {w.seed}, {mode}"
    with run(db_url, tmp_path, target) as process:
        wait_until(lambda: bool(process.events("provider breaker opened")), timeout=20, what=said)
        time.sleep(WATCH)
        opened = process.events("provider breaker opened")
        probes = len(process.events("provider breaker half-open"))
    now = table(db_url)
    spent = sum(attempts for _, attempts, _ in now.values())
    assert {status for status, _, _ in now.values()} == {"pending"}, said
    # The window's failures, the calls in flight as it opened, and one per probe.
    assert spent <= 5 + CONCURRENCY + probes, (said, spent, probes)
    # Probes doubled their period: the provider failed fresh operations every time.
    assert probes <= 3, (said, probes)
    assert opened[0]["reason"] == "failures", said
    assert max(attempts for _, attempts, _ in now.values()) <= 2, said
    if mode == "payload":
        assert receiver.effect_count() == 0
        assert len(receiver.received) == spent, said

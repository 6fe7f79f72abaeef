"""A slow provider holds up no check but its own (issue 38).

An `http` lookup's requests were bounded by httpx's timeouts, which bound each read, not the
answer: a server sending a header line a second held one check 121 s against `timeout = "3s"`.
And the reconciler checked one row at a time across every provider, so that one provider slow
to answer held up every other's checks. Now each request of a lookup is bounded whole by its
provider's timeout, each check by the reconciler's deadline, and each provider's checks run
apart from the others'.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderSettings
from outbox.oncall.reconciler import CheckResult, Reconciler
from outbox.providers.base import (
    Found,
    LookupRequest,
    NotFound,
    SendRequest,
    SendResult,
    Succeeded,
)
from outbox.providers.http.lookup import LookupFailed
from outbox.providers.http.provider import HttpProvider
from outbox.providers.registry import build_providers
from tests.support.dispatch import enqueue_many, rows
from tests.support.lookups import lookup_request


class Trickler:
    """A server that answers every request with a status line, then one header line every
    ``gap`` seconds, for ever: every read gets something, the answer never ends."""

    def __init__(self, gap: float = 0.2) -> None:
        self.gap = gap
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                n = 0
                while not self.stop.wait(self.gap):
                    conn.sendall(f"X-Slow-{n}: 1\r\n".encode())
                    n += 1
            except OSError:
                return


@pytest.fixture
def trickler() -> Iterator[Trickler]:
    server = Trickler()
    yield server
    server.stop.set()
    server.sock.close()


def http_provider(base_url: str, timeout: float) -> HttpProvider:
    options = {
        "base_url": base_url,
        "actions": {
            "post_effect": {
                "path": "/v1/effects",
                "lookup": {"path": "/v1/effects?key={key}", "state": "/status", "done": ["ok"]},
            }
        },
    }
    ps = ProviderSettings("svc", "http", timeout=timedelta(seconds=timeout), options=options)
    built = build_providers({"svc": ps}, {})["svc"]
    assert isinstance(built, HttpProvider)
    return built


async def test_a_lookup_request_ends_at_its_providers_timeout_whatever_trickles_in(
    trickler: Trickler,
) -> None:
    p = http_provider(trickler.url, timeout=1.0)
    now = datetime.now(UTC)
    request = lookup_request("post_effect", 1, "k", now - timedelta(hours=1), now)
    started = time.monotonic()
    try:
        with pytest.raises(LookupFailed, match="within the provider's timeout"):
            # The outer bound only keeps a failure from hanging the test.
            await asyncio.wait_for(p.lookup(request), 20)
    finally:
        await p.aclose()
    assert time.monotonic() - started < 3


class ScriptedLookup:
    """A provider whose lookups take ``delay`` seconds (None: for ever) and then find."""

    def __init__(self, name: str, delay: float | None) -> None:
        self.name = name
        self.key_retention = timedelta(hours=24)
        self.delay = delay
        self.asked: list[int] = []

    def check(self, action: str, payload: Mapping[str, Any]) -> None: ...

    async def send(self, request: SendRequest) -> SendResult:
        return Succeeded("never")

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        self.asked.append(request.operation_id)
        if self.delay is None:
            await asyncio.Event().wait()
        else:
            await asyncio.sleep(self.delay)
        return Found(f"ref-{request.operation_id}")

    async def aclose(self) -> None: ...


def reconciling(db_url: str, provider: str, count: int) -> list[int]:
    """``count`` reconciling operations of ``provider``, later than any made before."""
    ids = enqueue_many(db_url, count, provider=provider, prefix=f"{provider}-{time.time_ns()}")
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'reconciling', status_reason = "
            "'key_window_passed', attempts = 1, first_sent_at = now(), last_attempt_at = now(), "
            "status_changed_at = clock_timestamp() WHERE id = ANY(%s)",
            (ids,),
        )
    return ids


async def test_a_check_past_its_deadline_ends_as_an_error_due_again_in_minutes(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    stuck = ScriptedLookup("stuck", delay=None)
    (op,) = reconciling(db_url, "stuck", 1)
    checker = Reconciler(pool, {"stuck": stuck}, check_deadline=timedelta(seconds=0.5))
    results: list[CheckResult] = []
    started = time.monotonic()
    assert await asyncio.wait_for(checker.run_once(on_result=results.append), 20) == 1
    assert time.monotonic() - started < 5
    assert [(r.operation_id, r.finding, r.error) for r in results] == [(op, "error", "deadline")]
    ((due_in,),) = rows(
        db_url,
        "SELECT extract(epoch FROM checked_at + interval '1 hour' - now()) "
        "FROM outbox.operations WHERE id = %s",
        (op,),
    )
    assert 200 < due_in <= 300  # tried again in 5 minutes, as any failed lookup
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("reconciling",)]


async def test_a_slow_providers_checks_hold_up_no_other_providers(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """The slow provider's operations are the older: one row at a time across providers, the
    fast provider's waited behind all of them."""
    slow, fast = ScriptedLookup("slow", delay=1.0), ScriptedLookup("fast", delay=0.0)
    slow_ops = reconciling(db_url, "slow", 3)
    fast_ops = reconciling(db_url, "fast", 3)
    checker = Reconciler(pool, {"slow": slow, "fast": fast})
    arrived: dict[int, float] = {}
    started = time.monotonic()

    def note(result: CheckResult) -> None:
        arrived[result.operation_id] = time.monotonic() - started

    assert await asyncio.wait_for(checker.run_once(on_result=note), 30) == 6
    assert max(arrived[op] for op in fast_ops) < 0.8, arrived
    assert min(arrived[op] for op in slow_ops) >= 0.9
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("succeeded", 6)
    ]


async def test_each_provider_reconciles_in_a_loop_of_its_own(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """`outbox run`'s reconciler: while one provider's round is stuck in a lookup (within its
    deadline), the other's rounds go on, and settle operations that arrive meanwhile."""
    stuck, fast = ScriptedLookup("stuck", delay=None), ScriptedLookup("fast", delay=0.0)
    reconciling(db_url, "stuck", 1)
    first = reconciling(db_url, "fast", 2)
    checker = Reconciler(pool, {"stuck": stuck, "fast": fast}, check_deadline=timedelta(hours=1))
    loop = asyncio.create_task(checker.run_forever(timedelta(seconds=0.1)))
    try:
        await until(lambda: set(first) <= set(fast.asked))
        later = reconciling(db_url, "fast", 1)
        # Asked is not yet recorded: wait for the finding's record, which the check below reads.
        await until(lambda: settled(db_url, "fast") == len(first) + len(later))
        assert stuck.asked  # still in its first lookup
    finally:
        loop.cancel()
        await asyncio.gather(loop, return_exceptions=True)
    assert rows(
        db_url, "SELECT provider, status, count(*) FROM outbox.operations GROUP BY 1, 2 ORDER BY 1"
    ) == [("fast", "succeeded", 3), ("stuck", "reconciling", 1)]


def settled(url: str, provider: str) -> int:
    ((count,),) = rows(
        url,
        "SELECT count(*) FROM outbox.operations WHERE provider = %s AND status = 'succeeded'",
        (provider,),
    )
    return int(count)


async def until(condition: Any) -> None:
    """Wait until ``condition()`` holds; fails after 10 s."""
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not within 10 s")

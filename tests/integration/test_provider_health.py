"""Each provider's breaker seen and acted on beyond its process (issue 37; sql/0031): `outbox
providers list` shows what every dispatcher wrote, `reset` and `probe` reach every dispatcher and
are audited, and a dispatcher that restarts keeps a breaker open instead of sending a burst to a
provider that is down. Requests are counted at a real receiver, rows in the database."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox.config import BREAKER_OPEN_MAX, ProviderLimits
from outbox.dispatcher import Dispatcher
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import dispatcher, enqueue_many, rows, statuses
from tests.support.queues import FAST_RUN

LONG = timedelta(minutes=10)  # an open period no test waits out


async def run_while(d: Dispatcher, done: Callable[[], bool], within: float) -> None:
    """Run ``d`` (with its background loops) until ``done()``, a cheap check."""
    runner = asyncio.create_task(d.run())
    started = time.monotonic()
    try:
        while not done():
            if time.monotonic() - started > within or runner.done():
                raise AssertionError(f"not done within {within}s")
            await asyncio.sleep(0.02)
    finally:
        d.request_stop()
        await runner


def health(url: str) -> list[tuple[Any, ...]]:
    return rows(
        url,
        "SELECT provider, worker, state, reason, failing_alone, next_probe_at > now() "
        "FROM outbox.provider_health ORDER BY worker",
    )


async def open_breaker(
    url: str, pool: AsyncConnectionPool[Any], hook: Provider, receiver: FakeWebhookReceiver
) -> Dispatcher:
    """A dispatcher whose breaker of "hook" opened on 503s, for LONG; 20 operations wait."""
    enqueue_many(url, 20)
    receiver.inject(WebhookFault.status(503), times=3)
    limits = {"hook": ProviderLimits(breaker_failures=3, breaker_open_for=LONG)}
    d = dispatcher(pool, {"hook": hook}, concurrency=1, limits=limits, worker="w1")
    for _ in range(3):
        await d.run_once()
    return d


async def test_a_reset_reaches_the_running_dispatcher_and_is_audited(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    d = await open_breaker(db_url, pool, hook, receiver)
    seen: dict[str, Any] = {}

    def listed_open() -> bool:
        if health(db_url) and "listed" not in seen:
            seen["listed"] = outbox_cli(cli_env, "providers", "list", "--json")
            reset = outbox_cli(cli_env, "providers", "reset", "hook", "--reason", "back up")
            assert reset.returncode == 0, reset.stderr
        return statuses(db_url).get("succeeded", 0) == 20

    await run_while(d, listed_open, within=20)
    listed = seen["listed"]
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)
    assert (row["provider"], row["worker"], row["state"], row["reason"]) == (
        "hook",
        "w1",
        "open",
        "failures",
    )
    assert row["failure_rate"] == 1.0 and row["calls"] == 3
    assert [r.status for r in receiver.received] == [503] * 3 + [201] * 20
    ((actor, action, reason, details),) = rows(
        db_url, "SELECT actor, action, reason, details FROM outbox.audit"
    )
    assert (action, reason, details["provider"]) == ("provider_reset", "back up", "hook")
    assert actor
    # What the dispatcher wrote last: closed again.
    assert [h[2] for h in health(db_url)] == ["closed"]


async def test_a_probe_on_request_goes_now_and_its_success_closes_the_breaker(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    d = await open_breaker(db_url, pool, hook, receiver)
    asked: list[Any] = []

    def probed() -> bool:
        if health(db_url) and not asked:  # the dispatcher is running: ask it
            asked.append(outbox_cli(cli_env, "providers", "probe", "hook", "--reason", "back?"))
            assert asked[0].returncode == 0, asked[0].stderr
        return statuses(db_url).get("succeeded", 0) == 20

    await run_while(d, probed, within=20)
    assert len(receiver.received) == 23  # the three failures, the probe, the other nineteen
    ((action,),) = rows(db_url, "SELECT action FROM outbox.audit")
    assert action == "provider_probe"


def test_provider_actions_refuse_bad_input_and_change_nothing(cli_env: dict[str, str]) -> None:
    for args in (
        ("reset", "Not A Name", "--reason", "x"),
        ("probe", "hook", "--reason", "  "),
        ("reset", "hook", "--reason", "x", "--actor", "a" * 300),
    ):
        done = outbox_cli(cli_env, "providers", *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
    assert rows(cli_env["OUTBOX_DATABASE_URL"], "SELECT count(*) FROM outbox.audit") == [(0,)]
    listed = outbox_cli(cli_env, "providers", "list")
    assert listed.returncode == 0 and "no dispatcher" in listed.stdout


async def test_a_breaker_another_process_left_open_stays_open_and_a_reset_since_wins(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    enqueue_many(db_url, 5)
    with psycopg.connect(db_url) as conn:  # a process that died with its breaker open
        conn.execute(
            "INSERT INTO outbox.provider_health (provider, worker, state, reason, "
            "next_probe_at, open_for) VALUES ('hook', 'dead', 'open', 'failures', "
            "now() + interval '1 minute', interval '2 minutes')"
        )
    d = dispatcher(pool, {"hook": hook}, worker="w2")
    started = time.monotonic()
    await run_while(d, lambda: time.monotonic() - started > 1.0, within=10)
    assert receiver.received == []  # not one call: it is down, as far as anyone knows
    assert statuses(db_url) == {"pending": 5}
    assert ("hook", "w2", "open", "failures", 0, True) in health(db_url)

    reset = outbox_cli(cli_env, "providers", "reset", "hook", "--reason", "fixed")
    assert reset.returncode == 0, reset.stderr
    d = dispatcher(pool, {"hook": hook}, worker="w3")
    await run_while(d, lambda: statuses(db_url) == {"succeeded": 5}, within=10)


async def test_a_row_written_to_keep_a_provider_shut_holds_it_no_longer_than_its_own_breaker(
    db_url: str, pool: AsyncConnectionPool[Any], hook: Provider
) -> None:
    """Any dispatcher login may write outbox.provider_health: a row that says "probe in a
    thousand years" (or never) must not shut the provider for every replica that starts."""
    for worker, never in (("far", False), ("never", True)):
        with psycopg.connect(db_url) as conn:
            conn.execute("DELETE FROM outbox.provider_health")
            conn.execute(
                "INSERT INTO outbox.provider_health (provider, worker, state, reason, "
                "next_probe_at, open_for) VALUES ('hook', %s, 'open', 'failures', "
                "CASE WHEN %s THEN 'infinity' ELSE now() + interval '1000 years' END, "
                "interval '1000 years')",
                (worker, never),
            )
        d = dispatcher(pool, {"hook": hook}, worker="w")
        await d.health.restore()
        probe_in = d.limits.breaker("hook").next_probe_in()
        assert probe_in is not None and probe_in <= BREAKER_OPEN_MAX.total_seconds(), worker


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_crash_loop_does_not_send_a_burst_at_a_provider_that_is_down(
    db_url: str, tmp_path: Path
) -> None:
    """`outbox run` against a receiver that refuses connections, killed and started again: the
    second process starts with the breaker open and spends no attempt before its probe."""
    enqueue_many(db_url, 50)
    url = f"http://127.0.0.1:{closed_port()}/hook"
    providers = {"hook": {"type": "webhook", "url": url, "breaker_open_for": "1m"}}
    concurrency = 4  # calls in flight when the breaker opens are spent: at most this many
    config = write_config(
        tmp_path / "outbox.toml",
        providers=providers,
        **{**FAST_RUN, "concurrency": concurrency, "batch_size": concurrency},
    )

    def spent() -> int:
        ((total,),) = rows(db_url, "SELECT coalesce(sum(attempts), 0) FROM outbox.operations")
        return int(total)

    first = OutboxProcess(db_url, config, tmp_path / "first.log")
    try:
        wait_until(
            lambda: any(h[2] == "open" for h in health(db_url)), timeout=30, what="it opened"
        )
    finally:
        first.signal(signal.SIGKILL)
        first.wait()
    before = spent()
    assert 5 <= before <= 5 + concurrency  # the window's failures and the calls in flight
    second = OutboxProcess(db_url, config, tmp_path / "second.log")
    try:
        assert second.wait_started()
        wait_until(lambda: len(health(db_url)) == 2, timeout=30, what="the second's health row")
        time.sleep(1.0)
        assert spent() == before, second.log_text()[-3000:]
        assert second.events("provider breaker open at start")
    finally:
        second.stop()
    assert statuses(db_url) == {"pending": 50}

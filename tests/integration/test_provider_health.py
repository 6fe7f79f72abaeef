"""Each provider's breaker seen and acted on beyond its process (issue 37; sql/0031): `outbox
providers list` shows what every dispatcher wrote, `reset` and `probe` reach every dispatcher and
are audited, and a dispatcher that restarts keeps a breaker open instead of sending a burst to a
provider that is down. Requests are counted at a real receiver, rows in the database."""

from __future__ import annotations

import json
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import BREAKER_OPEN_MAX, ProviderLimits
from outbox.db.store import Store
from outbox.dispatch import health as health_module
from outbox.dispatch.breaker import ALONE_FOR, Breaker, State, Verdict
from outbox.dispatch.dispatcher import Dispatcher
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.dispatch import dispatcher, enqueue_many, rows, run_until, statuses
from tests.support.queues import FAST_RUN

LONG = timedelta(minutes=10)  # an open period no test waits out


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

    await run_until(d, listed_open, within=20)
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

    await run_until(d, probed, within=20)
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
    await run_until(d, lambda: time.monotonic() - started > 1.0, within=10)
    assert receiver.received == []  # not one call: it is down, as far as anyone knows
    assert statuses(db_url) == {"pending": 5}
    assert ("hook", "w2", "open", "failures", 0, True) in health(db_url)

    reset = outbox_cli(cli_env, "providers", "reset", "hook", "--reason", "fixed")
    assert reset.returncode == 0, reset.stderr
    d = dispatcher(pool, {"hook": hook}, worker="w3")
    await run_until(d, lambda: statuses(db_url) == {"succeeded": 5}, within=10)


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


def strict_json(text: str) -> Any:
    """JSON as the standard has it: NaN and Infinity are not JSON, and jq refuses them."""

    def refuse(word: str) -> Any:
        raise AssertionError(f"not JSON: {word}")

    return json.loads(text, parse_constant=refuse)


def test_odd_rows_are_listed_with_unknowns_and_rows_dated_ahead_as_suspect(
    db_url: str, cli_env: dict[str, str]
) -> None:
    """Any dispatcher login may write outbox.provider_health: times no timestamp type of Python
    holds, a rate that is no share, a row dated years ahead. `list` and `list --json` still
    answer, show what they cannot trust as unknown, and the JSON stays JSON."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO outbox.provider_health (provider, worker, state, reason, failure_rate, "
            "calls, failing_alone, opened_at, next_probe_at, open_for, updated_at) VALUES "
            "('hook', 'inf', 'open', 'failures', 'NaN', 3, 0, '-infinity', 'infinity', "
            " '1 hour', now()), "
            "('hook', 'huge', 'open', 'failures', 'Infinity', 3, 0, now(), "
            " now() + interval '5000 years', '100000000 years', now()), "
            "('hook', 'ahead', 'open', 'credentials', 1, 3, 0, now(), now() + interval '1 hour', "
            " '1 hour', now() + interval '10 years')"
        )
    listed = outbox_cli(cli_env, "providers", "list")
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[1]: line for line in listed.stdout.splitlines()[1:]}
    assert set(lines) == {"inf", "huge", "ahead"}
    for worker in ("inf", "huge"):
        # rate, calls, alone, next probe, seen
        assert lines[worker].split()[4:] == ["unknown", "of", "3", "0", "unknown", "live"]
    assert lines["ahead"].endswith("suspect"), lines["ahead"]

    as_json = outbox_cli(cli_env, "providers", "list", "--json")
    assert as_json.returncode == 0, as_json.stderr
    found = {r["worker"]: r for r in strict_json(as_json.stdout)}
    for worker in ("inf", "huge"):
        r = found[worker]
        assert (r["failure_rate"], r["next_probe_at"], r["probe_in"]) == (None, None, None)
        assert not r["suspect"]
    assert found["inf"]["opened_at"] is None and found["inf"]["open_for"] == 3600.0
    assert found["huge"]["open_for"] is None
    ahead = found["ahead"]
    assert ahead["suspect"] and not ahead["stale"] and ahead["updated_at"] is not None


def test_the_next_probe_is_counted_from_now_not_from_the_last_write(
    db_url: str, cli_env: dict[str, str]
) -> None:
    """A breaker that has not changed is written every 30 s only: its row's time is no clock."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO outbox.provider_health (provider, worker, state, reason, failure_rate, "
            "calls, failing_alone, opened_at, next_probe_at, open_for, updated_at) VALUES "
            "('hook', 'w1', 'open', 'failures', 1, 20, 0, now() - interval '25 s', "
            " now() + interval '45 s', '70 s', now() - interval '25 s'), "
            "('hook', 'w2', 'open', 'failures', 1, 20, 0, now() - interval '25 s', "
            " now() - interval '5 s', '20 s', now() - interval '25 s')"
        )
    listed = outbox_cli(cli_env, "providers", "list")
    assert listed.returncode == 0, listed.stderr
    lines = {line.split()[1]: line for line in listed.stdout.splitlines()[1:]}
    assert " in 4" in lines["w1"], lines["w1"]  # 40-some seconds, not 1m10s
    assert " in 0ms " in lines["w2"], lines["w2"]  # overdue: now, not "in 20s"
    found = {
        r["worker"]: r
        for r in strict_json(outbox_cli(cli_env, "providers", "list", "--json").stdout)
    }
    assert 30 < found["w1"]["probe_in"] <= 45 and found["w2"]["probe_in"] == 0


async def test_a_row_dated_ahead_is_not_restored_and_a_reset_wins_over_rows_opened_before_it(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    store = Store(pool)

    def write(sql: str) -> None:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("DELETE FROM outbox.provider_health")
            conn.execute(sql)

    insert = (
        "INSERT INTO outbox.provider_health (provider, worker, state, reason, opened_at, "
        "next_probe_at, open_for, updated_at) VALUES "
    )
    # Dated ten years ahead, it would win over every reset for ten years; it is not taken at all
    # (not even to hide the newest real row, here an open one).
    write(
        insert + "('hook', 'evil', 'closed', NULL, NULL, NULL, NULL, now() + interval '10 years'),"
        " ('hook', 'w1', 'open', 'failures', now(), now() + interval '1 minute', '1 minute', "
        "  now())"
    )
    assert [b.provider for b in await store.restore_health(["hook"])] == ["hook"]
    write(
        insert + "('hook', 'evil', 'open', 'credentials', now(), 'infinity', '1 hour', "
        "now() + interval '10 years')"
    )
    assert await store.restore_health(["hook"]) == []

    # A row written after a reset by a process that kept a breaker it had opened before the
    # reset: the reset wins. One opened after the reset is a new outage: it is taken.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("SELECT outbox.request_provider_action('hook', 'reset', 'oncall', 'fixed')")
    write(
        insert + "('hook', 'w1', 'open', 'failures', now() - interval '1 minute', "
        "now() + interval '1 minute', '1 minute', now())"
    )
    assert await store.restore_health(["hook"]) == []
    write(
        insert + "('hook', 'w1', 'open', 'failures', now(), now() + interval '1 minute', "
        "'1 minute', now())"
    )
    assert [b.provider for b in await store.restore_health(["hook"])] == ["hook"]


def health_workers(url: str) -> list[str]:
    return [w for (w,) in rows(url, "SELECT worker FROM outbox.provider_health ORDER BY worker")]


async def test_rows_not_written_for_a_day_or_dated_a_day_ahead_go_every_few_minutes(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    hook: Provider,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Not at every write: 50 replicas writing every 2 s would scan the table 25 times a second."""

    def old(worker: str, when: str) -> None:
        with psycopg.connect(db_url) as conn:
            conn.execute(
                "INSERT INTO outbox.provider_health (provider, worker, state, updated_at) "
                "VALUES ('hook', %s, 'closed', now() + %s::interval)",
                (worker, when),
            )

    old("gone", "-2 days")
    old("ahead", "2 days")
    old("recent", "-1 hour")
    d = dispatcher(pool, {"hook": hook}, worker="w")
    await d.health.round()
    assert health_workers(db_url) == ["recent", "w"]

    old("gone", "-2 days")
    d.limits.breaker("hook").record(1, Verdict.FAILING)  # a change: written this round
    before = rows(db_url, "SELECT failure_rate FROM outbox.provider_health WHERE worker = 'w'")
    await d.health.round()
    after = rows(db_url, "SELECT failure_rate FROM outbox.provider_health WHERE worker = 'w'")
    assert (before, after) == ([(0.0,)], [(1.0,)])
    assert health_workers(db_url) == ["gone", "recent", "w"]

    monkeypatch.setattr(health_module, "PRUNE_EVERY", 0.0)
    await d.health.round()
    assert health_workers(db_url) == ["recent", "w"]


async def test_a_restore_the_database_refused_at_start_is_tried_again_until_it_is_done(
    db_url: str, pool: AsyncConnectionPool[Any], hook: Provider
) -> None:
    """`outbox run` started while the database was away: once it is back, the breaker another
    process left open is open here too, unless a breaker of this process has moved since."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "INSERT INTO outbox.provider_health (provider, worker, state, reason, opened_at, "
            "next_probe_at, open_for) VALUES ('hook', 'dead', 'open', 'credentials', now(), "
            "now() + interval '1 minute', interval '2 minutes')"
        )

    def away(away: bool) -> None:
        names = ("provider_health", "provider_health_away")
        with psycopg.connect(db_url) as conn:
            conn.execute(f"ALTER TABLE outbox.{names[not away]} RENAME TO {names[away]}")

    fresh = dispatcher(pool, {"hook": hook}, worker="fresh")
    moved = dispatcher(pool, {"hook": hook}, worker="moved")
    away(True)
    for d in (fresh, moved):
        await d.health.restore()
        await d.health.round()
        assert d.limits.breaker("hook").state is State.CLOSED
    away(False)
    # This one has sent a call since (and it succeeded): its own word is newer than the row.
    moved.limits.breaker("hook").record(1, Verdict.HEALTHY)
    for _ in range(2):
        for d in (fresh, moved):
            await d.health.round()
    assert fresh.limits.breaker("hook").state is State.OPEN
    assert fresh.limits.breaker("hook").reason == "credentials"
    assert moved.limits.breaker("hook").state is State.CLOSED


def test_the_failing_alone_gauge_counts_the_operations_failing_alone_now() -> None:
    """It follows them when they succeed at last, and when their hour is over."""

    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    b = Breaker("alone-gauge", 5, timedelta(seconds=30), clock)

    def gauge() -> float | None:
        return REGISTRY.get_sample_value(
            "outbox_provider_failing_alone", {"provider": "alone-gauge"}
        )

    for op in range(3):  # each fails, another succeeds, it fails again: alone
        b.record(op, Verdict.FAILING)
        b.record(100 + op, Verdict.HEALTHY)
        b.record(op, Verdict.FAILING)
    assert (b.snapshot().failing_alone, gauge()) == (3, 3)
    b.record(0, Verdict.HEALTHY)
    assert gauge() == 2
    b.record(1, Verdict.HEALTHY)
    assert (b.snapshot().failing_alone, gauge()) == (1, 1)
    clock.now += ALONE_FOR - 1
    assert (b.snapshot().failing_alone, gauge()) == (1, 1)
    clock.now += 1  # op 2's hour is over (it was quarantined and will never succeed)
    assert (b.snapshot().failing_alone, gauge()) == (0, 0)

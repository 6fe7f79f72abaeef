"""Seen and acted on (issue 37): `outbox status` shows, per provider, the pending operations
whose last attempt failed, by error ("50 pending with http_500"), and `outbox pending list`
lists them, filtered by provider and error, a page at a time. Operations not tried yet are
counted by status, not listed here."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.cli import status
from outbox.config.settings import ProviderLimits
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.dispatch import dispatcher, enqueue_many, key_of, rows

NO_BREAKER = ProviderLimits(breaker_failures=1_000_000)


async def failing(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> tuple[list[int], list[int], list[int]]:
    """50 operations of "hook" answered 500, 10 answered 408, 5 that succeeded, and 30 of a
    provider no dispatcher has, never tried."""
    five_hundreds = enqueue_many(db_url, 50, prefix="a")
    four_o_eights = enqueue_many(db_url, 10, prefix="b")
    fine = enqueue_many(db_url, 5, prefix="c")
    untried = enqueue_many(db_url, 30, prefix="d", provider="other")
    for op in five_hundreds:
        receiver.inject(WebhookFault.status(500), key=key_of(db_url, op))
    for op in four_o_eights:
        receiver.inject(WebhookFault.status(408), key=key_of(db_url, op))
    d = dispatcher(
        pool, {"hook": hook}, limits={"hook": NO_BREAKER}, batch_size=200, concurrency=200
    )
    await d.run_once()  # "other"'s are handed back untried: no dispatcher has it
    assert rows(
        db_url,
        "SELECT provider, status, last_error_class, count(*) FROM outbox.operations "
        "GROUP BY 1, 2, 3 ORDER BY 1, 2, 3",
    ) == [
        ("hook", "pending", "transient", 10),
        ("hook", "pending", "unknown", 50),
        ("hook", "succeeded", None, 5),
        ("other", "pending", None, 30),
    ]
    assert fine
    return five_hundreds, four_o_eights, untried


async def test_status_counts_the_failing_pending_by_provider_and_error_and_list_pages_them(
    db_url: str,
    cli_env: dict[str, str],
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
) -> None:
    five_hundreds, four_o_eights, _ = await failing(db_url, pool, receiver, hook)

    shown = outbox_cli(cli_env, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["failing_by_provider"] == [
        {
            "provider": "hook",
            "pending": 60,
            "pending_is_lower_bound": False,
            "by_error": [
                {"error": "http_500", "pending": 50},
                {"error": "http_408", "pending": 10},
            ],
        }
    ]
    text = outbox_cli(cli_env, "status")
    assert "pending after a failed attempt" in text.stdout
    assert "http_500 50, http_408 10" in text.stdout, text.stdout

    # Every one of the 500s once, a page of 20 at a time; none of the others.
    seen: list[int] = []
    after: list[str] = []
    while True:
        page = outbox_cli(
            cli_env, "pending", "list", "--provider", "hook", "--error", "http_500",
            "--limit", "20", "--json", *after,
        )  # fmt: skip
        assert page.returncode == 0, page.stderr
        listed = json.loads(page.stdout)
        assert {r["error"] for r in listed} <= {"http_500"}
        seen += [r["id"] for r in listed]
        if "the next page is" not in page.stderr:
            break
        after = ["--after", page.stderr.split("`--after ")[1].split("`")[0]]
    assert sorted(seen) == sorted(five_hundreds) and len(seen) == len(set(seen))

    transient = outbox_cli(cli_env, "pending", "list", "--error", "http_408", "--json")
    assert sorted(r["id"] for r in json.loads(transient.stdout)) == sorted(four_o_eights)
    table = outbox_cli(cli_env, "pending", "list", "--provider", "hook", "--error", "http_408")
    assert table.returncode == 0 and "http_408" in table.stdout
    assert len(table.stdout.strip().splitlines()) == 1 + 10  # the header and ten rows
    untried = outbox_cli(cli_env, "pending", "list", "--provider", "other")
    assert untried.returncode == 0
    assert "no pending operation with a failed attempt matches" in untried.stdout
    everything = outbox_cli(cli_env, "pending", "list", "--json", "--limit", "1000")
    assert len(json.loads(everything.stdout)) == 60


def test_the_count_of_a_provider_stops_at_its_limit(
    db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bounded: of each provider only the oldest FAILING_LIMIT are read, and the count says so."""
    ops = enqueue_many(db_url, 8)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET attempts = 1, last_error_class = 'unknown', "
            "last_attempt_at = now(), first_sent_at = now()"
        )
        for i, op in enumerate(ops):
            conn.execute(
                "INSERT INTO outbox.attempt_log (operation_id, attempt, idempotency_key, worker, "
                "started_at, outcome, sent, error_class) SELECT id, 1, idempotency_key, 'w', "
                "now(), 'unknown', true, %s FROM outbox.operations WHERE id = %s",
                ("timeout" if i % 4 else "http_503", op),
            )
    monkeypatch.setattr(status, "FAILING_LIMIT", 5)
    with psycopg.connect(db_url) as conn:
        (hook,) = status._failing_by_provider(conn)
    assert (hook["pending"], hook["pending_is_lower_bound"]) == (5, True)
    assert status._failing_count(hook) == "5+"
    assert status._errors(hook) == "timeout 3, http_503 2 (of the oldest 5)"

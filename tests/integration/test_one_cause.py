"""One cause lands in one status (issue 37). Operations whose attempts time out are in doubt:
whether the attempt budget or the key window runs out first, they end `reconciling`, never
`quarantined`, whose replay would send them again on a person's word alone. Only operations that
nothing may have reached (transient answers) are quarantined as attempts_exhausted."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderLimits
from outbox.observability import metrics
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import dispatcher, enqueue_many, make_due, rows, webhook

# The breaker stays closed: every round sends every due operation.
NO_BREAKER = ProviderLimits(breaker_failures=1_000_000)


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A URL whose server takes connections and the requests on them and never answers: every
    attempt times out after the request left (unknown: the provider may have acted)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)  # the kernel completes handshakes and buffers the requests
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook"


def routed(provider: str, reason: str) -> float:
    value = metrics.RECONCILIATION_ROUTED.labels(provider, reason)._value.get()
    return float(value)


def quarantined(provider: str, reason: str) -> float:
    return float(metrics.QUARANTINED.labels(provider, reason)._value.get())


@pytest.mark.parametrize("seed", [37, 2026])
async def test_operations_that_time_out_all_end_reconciling_whichever_ran_out_first(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    blackhole: str,
    receiver: FakeWebhookReceiver,
    seed: int,
) -> None:
    rng = random.Random(seed)
    # The timeout bounds the connect too, and a connect that times out sent nothing (transient,
    # rightly quarantined): 0.3 s was shorter than the event loop's turn through 60 sends at once
    # on a loaded 2-core CI machine (at least 11 of 50 first connects timed out there), so a second.
    timeouts = webhook("slow", blackhole, timeout=1.0, key_retention=7200)
    refusing = webhook("busy", receiver.url, key_retention=7200)
    receiver.inject(WebhookFault.status(408), times=10_000)  # transient: it did not act
    # Each operation's budget, and after which attempt its key window closes (time moves in the
    # data): before its budget ends for some, after it for the others.
    plan = {}
    with psycopg.connect(db_url) as conn:
        for i in range(50):
            budget, window_after = rng.randint(1, 4), rng.randint(1, 5)
            found = conn.execute(
                "SELECT operation_id FROM outbox.enqueue('acme', 'charge', %s, 'slow', 'paid', "
                "'{}'::jsonb, max_attempts => %s)",
                (f"t-{i}", budget),
            ).fetchone()
            assert found is not None
            plan[found[0]] = (budget, window_after)
    busy = enqueue_many(db_url, 10, provider="busy", max_attempts=3)
    before = {r: routed("slow", r) for r in ("key_window_passed", "indeterminate_provider_error")}
    before_quarantined = quarantined("busy", "attempts_exhausted")
    d = dispatcher(
        pool,
        {"slow": timeouts, "busy": refusing},
        limits={"slow": NO_BREAKER, "busy": NO_BREAKER},
        batch_size=200,
        concurrency=200,
    )
    try:
        for round_ in range(1, 8):
            await d.run_once()
            closing = [op for op, (_, after) in plan.items() if after == round_]
            with psycopg.connect(db_url) as conn:  # their key window closed since
                conn.execute(
                    "UPDATE outbox.operations SET first_sent_at = now() - interval '2 hours' "
                    "WHERE id = ANY(%s) AND status = 'pending'",
                    (closing,),
                )
            make_due(db_url)
    finally:
        await timeouts.aclose()
        await refusing.aclose()

    got = {
        op: (status, reason, attempts)
        for op, status, reason, attempts in rows(
            db_url,
            "SELECT id, status, status_reason, attempts FROM outbox.operations "
            "WHERE provider = 'slow'",
        )
    }
    expected = {
        op: (
            "reconciling",
            "key_window_passed" if after < budget else "indeterminate_provider_error",
            min(after, budget),
        )
        for op, (budget, after) in plan.items()
    }
    assert got == expected
    reasons = [reason for _, reason, _ in got.values()]
    assert {"key_window_passed", "indeterminate_provider_error"} <= set(reasons)
    # Every attempt may have reached the provider, and none went to quarantine.
    assert rows(
        db_url,
        "SELECT count(*) FILTER (WHERE NOT a.sent), count(DISTINCT a.error_class) "
        "FROM outbox.attempts a JOIN outbox.operations o ON o.id = a.operation_id "
        "WHERE o.provider = 'slow'",
    ) == [(0, 1)]
    for reason, was in before.items():
        assert routed("slow", reason) - was == reasons.count(reason), reason
    # Nothing reached the provider of the others: quarantined, as before.
    assert rows(
        db_url,
        "SELECT status, status_reason, attempts, first_sent_at IS NULL, count(*) "
        "FROM outbox.operations WHERE id = ANY(%s) GROUP BY 1, 2, 3, 4",
        (busy,),
    ) == [("quarantined", "attempts_exhausted", 3, True, 10)]
    assert quarantined("busy", "attempts_exhausted") - before_quarantined == 10


async def test_a_lease_that_expires_on_the_last_attempt_goes_to_reconciliation(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    """The rescuer agrees with the dispatcher: the attempt of a dead worker may have reached the
    provider, so an operation it leaves without budget is reconciling, not quarantined."""
    last, more = enqueue_many(db_url, 2)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET max_attempts = 1 WHERE id = %s", (last,))
        conn.execute(  # claimed by a worker that died: its lease ran out
            "UPDATE outbox.operations SET status = 'in_flight', lease_owner = 'dead', "
            "lease_token = gen_random_uuid(), lease_expires_at = now() - interval '1 second', "
            "attempts = attempts + 1, last_attempt_at = now() - interval '1 minute'"
        )
    was = routed("hook", "indeterminate_provider_error")
    was_quarantined = quarantined("hook", "attempts_exhausted")
    hook = webhook("hook", receiver.url)
    try:
        assert await dispatcher(pool, {"hook": hook}).rescue_once() == 2
    finally:
        await hook.aclose()
    assert rows(
        db_url,
        "SELECT id, status, status_reason, first_sent_at IS NOT NULL FROM outbox.operations "
        "ORDER BY id",
    ) == [
        (last, "reconciling", "indeterminate_provider_error", True),
        (more, "pending", None, True),
    ]
    assert rows(db_url, "SELECT operation_id, error_class FROM outbox.attempts ORDER BY 1") == [
        (last, "lease_expired"),
        (more, "lease_expired"),
    ]
    assert routed("hook", "indeterminate_provider_error") - was == 1
    assert quarantined("hook", "attempts_exhausted") == was_quarantined

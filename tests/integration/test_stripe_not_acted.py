"""Answers that say Stripe did not act do not spend the attempt budget (issue 19, case 4).

A long rate-limit episode (429) or a key still in use by a running request (409) used to
quarantine operations that never reached Stripe, as attempts_exhausted. They are retried, their
attempts recorded but not counted toward max_attempts, with a backoff that still grows, until
policy.UNSPENT_FOR after their enqueue: a limit that never lifts still ends in quarantine.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderLimits
from outbox.providers.base import Provider
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.dispatch import dispatcher, enqueue_charges, make_due, rows, stripe_provider

MAX_ATTEMPTS = 3
NOT_ACTED = {
    "rate_limited": lambda: StripeFault.status(
        429, error_type="invalid_request_error", code_str="rate_limit"
    ),
    "lock_timeout": lambda: StripeFault.status(
        429, error_type="invalid_request_error", code_str="lock_timeout", should_retry=False
    ),
    "key_in_use": lambda: StripeFault.status(
        409, error_type="idempotency_error", code_str="idempotency_key_in_use"
    ),
}


@pytest.fixture
async def stripe(fake: FakeStripe) -> AsyncIterator[Provider]:
    p = stripe_provider("stripe", fake.url)
    yield p
    await p.aclose()


async def _run(pool: AsyncConnectionPool[Any], stripe: Provider, url: str, rounds: int) -> None:
    d = dispatcher(pool, {"stripe": stripe}, max_attempts=MAX_ATTEMPTS)
    for _ in range(rounds):
        make_due(url)
        await d.run_once()


@pytest.mark.parametrize("seed", range(3))
async def test_a_long_episode_of_answers_that_did_not_act_never_quarantines(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider, seed: int
) -> None:
    """Seeded: more 429s and 409s, in a random mix, than max_attempts allows; then Stripe
    answers. One PaymentIntent, every attempt in the history, none counted."""
    rng = random.Random(seed)
    refusals = rng.randint(MAX_ATTEMPTS + 1, 3 * MAX_ATTEMPTS)
    for _ in range(refusals):
        fake.inject(NOT_ACTED[rng.choice(sorted(NOT_ACTED))]())
    enqueue_charges(db_url, 1)
    await _run(pool, stripe, db_url, refusals + 1)
    assert rows(db_url, "SELECT status, attempts, attempt_base FROM outbox.operations") == [
        ("succeeded", refusals + 1, refusals)
    ]
    assert rows(db_url, "SELECT count(*) FILTER (WHERE sent), count(*) FROM outbox.attempts") == [
        (1, refusals + 1)
    ]
    assert fake.object_count("payment_intents") == 1


async def test_answers_that_did_not_act_spend_the_budget_once_the_ceiling_passed(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """Enqueued more than UNSPENT_FOR ago: a 429 counts, and the operation is quarantined
    after max_attempts, never sent through."""
    for _ in range(MAX_ATTEMPTS + 2):
        fake.inject(NOT_ACTED["rate_limited"]())
    enqueue_charges(db_url, 1)
    with psycopg.connect(db_url) as conn:
        conn.execute("UPDATE outbox.operations SET created_at = now() - interval '25 hours'")
    await _run(pool, stripe, db_url, MAX_ATTEMPTS + 2)
    assert rows(
        db_url, "SELECT status, status_reason, attempts, attempt_base FROM outbox.operations"
    ) == [("quarantined", "attempts_exhausted", MAX_ATTEMPTS, 0)]
    assert fake.object_count() == 0


async def test_an_unknown_answer_still_spends_its_attempt(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """Only answers that prove Stripe did not act are free: a 503 may have acted, so out of
    attempts the operation is in doubt, and reconciled (docs/design.md, "Attempts")."""
    for _ in range(MAX_ATTEMPTS):
        fake.inject(StripeFault.status(503, error_type="api_error"))
    enqueue_charges(db_url, 1)
    await _run(pool, stripe, db_url, MAX_ATTEMPTS)
    assert rows(
        db_url, "SELECT status, status_reason, attempts, attempt_base FROM outbox.operations"
    ) == [("reconciling", "indeterminate_provider_error", MAX_ATTEMPTS, 0)]


async def test_a_403_on_one_action_pauses_that_action_and_not_the_provider(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe, stripe: Provider
) -> None:
    """A restricted key without the payouts permission: payments go on, payouts wait with
    their attempts unspent and are not sent again until the pause runs out; once the permission
    is granted, one probe, then the rest. A 401 still pauses the whole provider (test_stripe)."""
    fake.restrict_key("payouts")
    enqueue_charges(db_url, 3, prefix="pay")
    enqueue_charges(db_url, 3, prefix="po", action="payouts.create")
    limits = {"stripe": ProviderLimits(breaker_open_for=timedelta(seconds=0.5))}
    d = dispatcher(pool, {"stripe": stripe}, max_attempts=MAX_ATTEMPTS, limits=limits)
    assert await d.run_once() == 6
    by_action = "SELECT action, status, count(*), sum(attempts) FROM outbox.operations "
    by_action += "GROUP BY 1, 2 ORDER BY 1"
    assert rows(db_url, by_action) == [
        ("payment_intents.create", "succeeded", 3, 3),
        ("payouts.create", "pending", 3, 0),
    ]
    forbidden = sum(r.status == 403 for r in fake.received)
    assert forbidden == 3  # the three in flight together; none since
    assert (
        REGISTRY.get_sample_value(
            "outbox_action_paused", {"provider": "stripe", "action": "payouts.create"}
        )
        == 1
    )
    assert REGISTRY.get_sample_value("outbox_provider_paused", {"provider": "stripe"}) == 0
    for _ in range(3):  # due again, within the pause: handed back unsent
        make_due(db_url)
        await d.run_once()
    assert sum(r.status == 403 for r in fake.received) == forbidden
    enqueue_charges(db_url, 1, prefix="later")  # the provider's other actions go on
    make_due(db_url)
    await d.run_once()
    assert fake.object_count("payment_intents") == 4
    fake.restrict_key()  # the permission granted
    for _ in range(20):
        await asyncio.sleep(0.3)
        make_due(db_url)
        await d.run_once()
        if fake.object_count("payouts") == 3:
            break
    assert rows(db_url, by_action) == [
        ("payment_intents.create", "succeeded", 4, 4),
        ("payouts.create", "succeeded", 3, 3),
    ]
    assert sum(r.status == 403 for r in fake.received) == forbidden
    assert (
        REGISTRY.get_sample_value(
            "outbox_action_paused", {"provider": "stripe", "action": "payouts.create"}
        )
        == 0
    )

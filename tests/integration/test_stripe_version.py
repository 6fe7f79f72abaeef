"""The Stripe API version is pinned, and an operation keeps its first send's (issue 19, case 5).

A payload means what the API version says it means. The version came from the SDK, which has
no upper bound: an upgrade could change the meaning of operations already queued, and quarantine
them in bulk. Every request now names the configured version (a documented default); an
operation stores the version of its first send, and every retry and lookup uses it.
"""

from __future__ import annotations

import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from packaging.requirements import Requirement
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ConfigError
from outbox.oncall.reconciler import Reconciler
from outbox.providers.base import Lookup
from outbox.providers.stripe.provider import DEFAULT_STRIPE_VERSION
from outbox.testing.stripe import FakeStripe, StripeFault
from tests.support.dispatch import dispatcher, enqueue_charges, make_due, rows, stripe_provider
from tests.support.lookups import lookup_request

OLD = "2024-06-20"


async def test_every_request_names_the_pinned_version(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    stripe = stripe_provider("stripe", fake.url)
    try:
        enqueue_charges(db_url, 2)
        assert await dispatcher(pool, {"stripe": stripe}).run_once() == 2
        assert isinstance(stripe, Lookup)
        now = datetime.now(UTC)
        await stripe.lookup(lookup_request("payment_intents.create", 1, "nothing", now, now))
    finally:
        await stripe.aclose()
    assert {(r.method, r.version) for r in fake.received} == {
        ("POST", DEFAULT_STRIPE_VERSION),
        ("GET", DEFAULT_STRIPE_VERSION),
    }
    assert rows(db_url, "SELECT DISTINCT api_version FROM outbox.operations") == [
        (DEFAULT_STRIPE_VERSION,)
    ]


async def test_an_operation_keeps_its_first_sends_version_across_a_config_change(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    """Sent under OLD with the answer lost; the config moves to the default. Its retry, and
    the lookup of it, still speak OLD; a new operation speaks the new version."""
    old = stripe_provider("stripe", fake.url, stripe_version=OLD)
    fake.inject(StripeFault.reset_after_apply())
    enqueue_charges(db_url, 1, prefix="early")
    try:
        assert await dispatcher(pool, {"stripe": old}).run_once() == 1
    finally:
        await old.aclose()
    new = stripe_provider("stripe", fake.url)
    try:
        enqueue_charges(db_url, 1, prefix="late")
        make_due(db_url)
        assert await dispatcher(pool, {"stripe": new}).run_once() == 2
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE outbox.operations SET status = 'reconciling' "
                "WHERE operation_key = 'early-0'"
            )
        before = len(fake.received)
        reconciler = Reconciler(pool, {"stripe": new})
        (check,) = await reconciler.candidates()
        assert check["api_version"] == OLD
        result = await reconciler.check(check, dry_run=True)
    finally:
        await new.aclose()
    assert result.finding == "found"
    sent = [
        (r.idempotency_key is not None, r.params["metadata"]["outbox_operation_id"], r.version)
        for r in fake.received[:before]
    ]
    # the retry and the new operation are sent concurrently: in either order
    assert sorted(sent) == [(True, "1", OLD), (True, "1", OLD), (True, "2", DEFAULT_STRIPE_VERSION)]
    assert {r.version for r in fake.received[before:]} == {OLD}
    assert rows(db_url, "SELECT operation_key, api_version FROM outbox.operations ORDER BY id") == [
        ("early-0", OLD),
        ("late-0", DEFAULT_STRIPE_VERSION),
    ]
    assert fake.object_count() == 2


@pytest.mark.parametrize("version", ["latest", "", "2024-6-20", 20240620, "2024-06-20.Acacia"])
def test_a_version_that_is_not_stripes_is_refused_at_start(
    fake: FakeStripe, version: object
) -> None:
    with pytest.raises(ConfigError, match="stripe_version must be a Stripe API version"):
        stripe_provider("stripe", fake.url, stripe_version=version)


def test_the_sdk_is_bounded_below_its_next_major() -> None:
    """A new major of stripe-python may change what its calls send; it is taken on purpose."""
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (spec,) = [
        Requirement(r)
        for r in project["project"]["dependencies"]
        if Requirement(r).name == "stripe"
    ]
    assert "16.1.0" in spec.specifier and "17.0.0" not in spec.specifier

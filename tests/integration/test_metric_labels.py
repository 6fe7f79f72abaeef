"""Cardinality the producer controls is bounded (issue 17, case 5).

A row's action, and its provider when no provider of that name is configured, are the
producer's choice. Before outbox.observability.metric_labels, 3,000 distinct actions made 60,075
series and a 12.5 MB /metrics.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.observability.metric_labels import MAX_OTHER_ACTIONS, OTHER, UNCONFIGURED, Labels
from outbox.providers.noop import NoopProvider
from tests.support.dispatch import dispatcher, statuses

# A provider name no other test uses: the metrics registry is one per process.
NAME = "labels-noop"


def label_sets(metric: str) -> list[dict[str, str]]:
    return [
        dict(sample.labels)
        for family in REGISTRY.collect()
        if family.name == metric
        for sample in family.samples
        if sample.name == f"{metric}_total"
    ]


async def test_3000_made_up_actions_and_300_made_up_providers_add_a_bounded_number_of_series(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't', operation_type => 'x', "
            "operation_key => 'a' || g, provider => %s, action => 'made.up.' || g, "
            "payload => '{}') FROM generate_series(1, 3000) g",
            (NAME,),
        )
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 't', operation_type => 'x', "
            "operation_key => 'p' || g, provider => 'nobody-' || g, action => 'a', "
            "payload => '{}') FROM generate_series(1, 300) g"
        )
        # Past the grace a rolling deploy gets to bring a provider: quarantined at once.
        conn.execute("UPDATE outbox.operations SET created_at = now() - interval '1 hour'")
    d = dispatcher(
        pool, {NAME: NoopProvider(NAME, timedelta(hours=24))}, batch_size=1000, concurrency=1000
    )
    while await d.run_once():
        pass
    assert statuses(db_url) == {"succeeded": 3000, "quarantined": 300}
    mine = [s for s in label_sets("outbox_dispatch") if s["provider"] == NAME]
    actions = {s["action"] for s in mine}
    assert len(actions) == MAX_OTHER_ACTIONS + 1 and OTHER in actions
    assert sum(1 for s in mine if s["action"] == OTHER) == 1  # one outcome: succeeded
    providers = {s["provider"] for s in label_sets("outbox_dispatch")}
    assert not {p for p in providers if p.startswith("nobody-")}
    assert UNCONFIGURED in providers


def test_declared_actions_keep_their_names_past_the_bound() -> None:
    labels = Labels({"stripe": {"refunds.create"}, "hook": None}, max_other=2)
    assert [labels.action("hook", a) for a in ("a", "b", "c", "a")] == ["a", "b", OTHER, "a"]
    assert [labels.action("stripe", a) for a in ("x", "y", "z")] == ["x", "y", OTHER]
    assert labels.action("stripe", "refunds.create") == "refunds.create"
    assert labels.action("nobody", "a") == OTHER
    assert (labels.provider("hook"), labels.provider("nobody")) == ("hook", UNCONFIGURED)

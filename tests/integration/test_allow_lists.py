"""Optional per-tenant allow-lists of providers and actions (issue 20, case 4).

With one shared Stripe key, a producer of any tenant could enqueue payouts.create with its own
parameters. outbox.enqueue_allowances, empty by default (everything allowed, as before), says
what each tenant or tenant pattern may enqueue once an operator fills it.
"""

from __future__ import annotations

import random
from typing import Any

import psycopg
import pytest

import outbox
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_roles import APP, as_role, roles_db, sqlstate_of
from tests.support.dispatch import dispatcher, rows

__all__ = ["roles_db"]  # the fixture, shared with test_roles

RULES = [
    ("acme", "stripe", "payment_intents.create"),
    ("acme", "stripe", "refunds.create"),
    ("eu-%", "hook", "*"),
]


def enqueue(conn: psycopg.Connection[Any], tenant: str, provider: str, action: str) -> Any:
    return outbox.enqueue(
        conn,
        tenant_id=tenant,
        operation_type="t",
        operation_key=f"{tenant}-{provider}-{action}-{random.random()}",
        provider=provider,
        action=action,
        payload={},
    )


def allow(db_url: str, rules: list[tuple[str, str, str]]) -> None:
    with psycopg.connect(db_url) as conn:
        conn.cursor().executemany(
            "INSERT INTO outbox.enqueue_allowances (tenant_pattern, "
            "provider, action) VALUES (%s, %s, %s)",
            rules,
        )


def test_an_empty_list_allows_everything(db_url: str) -> None:
    with psycopg.connect(db_url) as conn:
        assert enqueue(conn, "anyone", "stripe", "payouts.create").outcome == "accepted"


@pytest.mark.parametrize(
    ("tenant", "provider", "action", "refused"),
    [
        ("acme", "stripe", "payment_intents.create", None),
        ("acme", "stripe", "refunds.create", None),
        ("acme", "stripe", "payouts.create", "action"),
        ("acme", "hook", "invoice.paid", "provider"),
        ("eu-1", "hook", "anything.at.all", None),
        ("eu-1", "stripe", "payment_intents.create", "provider"),
        ("acme-evil", "stripe", "payment_intents.create", "provider"),  # a pattern, not a prefix
        ("other", "stripe", "transfers.create", "provider"),
    ],
)
def test_once_filled_the_list_refuses_what_no_rule_allows(
    db_url: str, tenant: str, provider: str, action: str, refused: str | None
) -> None:
    allow(db_url, RULES)
    with psycopg.connect(db_url) as conn:
        if refused is None:
            assert enqueue(conn, tenant, provider, action).outcome == "accepted"
            conn.commit()
        else:
            with pytest.raises(outbox.InvalidOperation) as exc:
                enqueue(conn, tenant, provider, action)
            assert exc.value.field == refused
    assert rows(db_url, "SELECT count(*) FROM outbox.operations") == [(int(refused is None),)]


def test_a_producer_can_neither_read_nor_change_the_list(roles_db: str) -> None:
    app = as_role(roles_db, APP)
    for query in (
        "SELECT * FROM outbox.enqueue_allowances",
        "INSERT INTO outbox.enqueue_allowances VALUES ('%', 'stripe', '*')",
        "DELETE FROM outbox.enqueue_allowances",
    ):
        assert sqlstate_of(app, query) == "42501", query


async def test_the_webhook_receiver_is_told_the_tenant(
    db_url: str, pool: Any, receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    with psycopg.connect(db_url) as conn:
        enqueue(conn, "tenant-ü-1", "hook", "invoice.paid")
    assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    (effect,) = receiver.effects
    assert effect.headers["outbox-tenant-id"] == "tenant-%C3%BC-1"  # ASCII, as UTF-8 percent-coded

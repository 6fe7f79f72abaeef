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
from outbox.db import migrations
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.integration.test_migrations import run_migrate
from tests.integration.test_roles import APP, as_role, roles_db, sqlstate_of
from tests.support.dispatch import dispatcher, rows

__all__ = ["roles_db"]  # the fixture, shared with test_roles

RULES = [
    ("acme", "stripe", "payment_intents.create"),
    ("acme", "stripe", "refunds.create"),
    ("eu-*", "hook", "*"),
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


@pytest.mark.parametrize(
    ("pattern", "admitted", "refused"),
    [
        # _ and % were LIKE's wildcards (issue 38): a rule for acme_eu admitted acme-eu.
        ("acme_eu", ["acme_eu"], ["acme-eu", "acmeXeu", "acme_eu2", "ACME_EU"]),
        ("50%", ["50%"], ["500", "50", "50%x"]),
        ("a\\b", ["a\\b"], ["ab", "a\\\\b"]),
        ("eu-*", ["eu-", "eu-1", "eu-x_y%"], ["eu", "xeu-1", "EU-1"]),
        ("*-eu", ["acme-eu", "-eu"], ["acme-eu-2"]),
        ("*", ["anyone", "a_b", "50%"], []),
    ],
)
def test_a_pattern_is_the_tenant_id_itself_where_only_a_star_is_a_wildcard(
    db_url: str, pattern: str, admitted: list[str], refused: list[str]
) -> None:
    allow(db_url, [(pattern, "stripe", "*")])
    with psycopg.connect(db_url) as conn:
        for tenant in admitted:
            assert enqueue(conn, tenant, "stripe", "payouts.create").outcome == "accepted", tenant
        for tenant in refused:
            conn.execute("SAVEPOINT s")
            with pytest.raises(outbox.InvalidOperation) as exc:
                enqueue(conn, tenant, "stripe", "payouts.create")
            assert exc.value.field == "provider", tenant
            conn.execute("ROLLBACK TO SAVEPOINT s")


def test_rules_written_for_like_keep_their_meaning_but_underscores(empty_db_url: str) -> None:
    """0035 rewrites the rules 0026 matched with LIKE: % becomes *, an escaped character itself;
    _ matches only itself from now on. Two rules that become one are kept once."""
    with psycopg.connect(empty_db_url, autocommit=True) as conn:
        migrations.migrate(conn, target=34)
        conn.cursor().executemany(
            "INSERT INTO outbox.enqueue_allowances (tenant_pattern, provider, action) "
            "VALUES (%s, %s, %s)",
            [
                ("eu-%", "hook", "*"),
                ("%", "noop", "*"),
                ("acme_eu", "stripe", "*"),
                ("acme\\_eu", "stripe", "*"),  # the same tenant, escaped as LIKE wants
                ("50\\%", "stripe", "refunds.create"),
                ("a\\\\b", "stripe", "*"),
                ("plain", "stripe", "refunds.create"),
            ],
        )
        done = run_migrate(empty_db_url)
        assert done.returncode == 0, done.stderr
        # Each rule whose text or meaning changed is named to the person migrating.
        assert "warning: enqueue_allowances: the tenant pattern 'acme_eu' (LIKE)" in done.stderr
        assert "'eu-%' (LIKE) is now 'eu-*'" in done.stderr
        assert "'plain'" not in done.stderr
        kept = conn.execute(
            "SELECT tenant_pattern, provider, action FROM outbox.enqueue_allowances ORDER BY 1, 2"
        ).fetchall()
    assert kept == [
        ("*", "noop", "*"),
        ("50%", "stripe", "refunds.create"),
        ("a\\b", "stripe", "*"),
        ("acme_eu", "stripe", "*"),
        ("eu-*", "hook", "*"),
        ("plain", "stripe", "refunds.create"),
    ]

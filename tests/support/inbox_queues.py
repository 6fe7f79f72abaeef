"""What the inbox's queue tests share (tests/integration/test_inbox_{jetstream,rabbitmq,sqs}.py):
a pool on the test's database with an ``invoices`` table, the handler that writes one invoice
(and refuses a non-positive amount after writing, so a refusal must undo it), a handler that
fails a given number of times first, and the messages of the copies-and-conflicts workload."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Delivery, Refuse

INSERT: Final = "INSERT INTO invoices (tenant_id, account_id, amount) VALUES (%s, %s, %s)"
BODY: Final = {"account_id": "a", "amount": 100}
# The workload every queue test publishes, as (body, attributes): three copies each of ten
# messages from outbox, a fourth of message 3 with another amount (a conflict), two copies of a
# message the handler refuses, and one with no tenant. It settles as ten invoices, one recorded
# refusal, and the messages that can never succeed (final()). Which body of message 3 wins its
# identity is a race: two consumers take batches at once, each message in a task of its own, so
# the copy of 7 may run before every copy of 100 (it did under load in CI).
COPIES: Final = [
    *[(BODY, {"Outbox-Operation-Id": str(op), "Outbox-Tenant-Id": "acme"})
      for op in range(10) for _ in range(3)],
    ({**BODY, "amount": 7}, {"Outbox-Operation-Id": "3", "Outbox-Tenant-Id": "acme"}),
    ({**BODY, "amount": -1}, {"Outbox-Operation-Id": "50", "Outbox-Tenant-Id": "acme"}),
    ({**BODY, "amount": -1}, {"Outbox-Operation-Id": "50", "Outbox-Tenant-Id": "acme"}),
    (BODY, {"Outbox-Operation-Id": "60"}),
]  # fmt: skip
REFUSED: Final = 3  # both refusals and the tenantless one


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "CREATE TABLE invoices (id serial, tenant_id text, account_id text, amount bigint)"
        )
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


async def create_invoice(d: Delivery, body: bytes) -> None:
    invoice = json.loads(body)
    assert d.conn is not None
    await d.conn.execute(INSERT, (d.identity.tenant_id, invoice["account_id"], invoice["amount"]))
    if invoice["amount"] <= 0:  # refused after a write: the refusal must undo it
        raise Refuse("amount must be positive")
    await asyncio.sleep(0.05)  # in its transaction a while: copies arrive meanwhile


def failing(times: int) -> tuple[Callable[[Delivery, bytes], Awaitable[None]], dict[str, int]]:
    """A handler that writes its invoice, then raises the first ``times`` times; and the count
    of failures left."""
    left = {"left": times}

    async def handle(d: Delivery, body: bytes) -> None:
        await create_invoice(d, body)
        if left["left"] > 0:
            left["left"] -= 1
            raise RuntimeError("the handler's bug")

    return handle, left


def _one(db_url: str, query: str) -> int:
    with psycopg.connect(db_url) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


def _lost(db_url: str) -> int:
    """How many copies of message 3 lost its identity to the other body: one (the copy of 7)
    when a copy of 100 won, the three of 100 when the copy of 7 did."""
    return 3 if _one(db_url, "SELECT count(*) FROM invoices WHERE amount = 7") else 1


def final(db_url: str) -> int:
    """How many messages of COPIES can never succeed: message 3's losing copies, both refusals
    and the tenantless one. Known once message 3's winner committed its invoice."""
    return REFUSED + _lost(db_url)


def assert_copies_settled(db_url: str) -> None:
    """What COPIES must leave in the database, whichever body of message 3 won."""
    lost = _lost(db_url)
    assert _one(db_url, "SELECT count(*) FROM invoices") == 10
    assert _one(db_url, "SELECT count(*) FROM invoices WHERE amount = 100") == (
        10 if lost == 1 else 9
    )
    assert _one(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_status = 422") == 1
    assert _one(db_url, "SELECT sum(seen) FROM outbox.inbox_conflicts") == lost

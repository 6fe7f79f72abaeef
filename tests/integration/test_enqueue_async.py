"""The asyncio twins behave as the sync API does."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

import outbox
from outbox import EnqueueOutcome, InvalidOperation, OperationConflict, Status
from tests.support.producers import charge, count


async def test_accepted_then_duplicate_then_conflict(
    aconn: psycopg.AsyncConnection[Any], db_url: str
) -> None:
    first = await outbox.enqueue_async(aconn, **charge())
    again = await outbox.enqueue_async(aconn, **charge())
    await aconn.commit()
    assert (first.outcome, again.outcome) == (EnqueueOutcome.ACCEPTED, EnqueueOutcome.DUPLICATE)
    assert first.operation_id == again.operation_id

    with pytest.raises(OperationConflict):
        await outbox.enqueue_async(aconn, **charge(payload={"amount": 1}))
    await aconn.rollback()
    assert count(db_url) == 1


async def test_get_operation_async(aconn: psycopg.AsyncConnection[Any]) -> None:
    result = await outbox.enqueue_async(aconn, **charge())
    op = await outbox.get_operation_async(aconn, "acme", "invoice.charge", "invoice-42-charge")
    assert op is not None and op.operation_id == result.operation_id
    assert op.status is Status.PENDING
    assert await outbox.get_operation_async(aconn, "acme", "invoice.charge", "other") is None


async def test_invalid_input_names_the_field(
    aconn: psycopg.AsyncConnection[Any], db_url: str
) -> None:
    with pytest.raises(InvalidOperation) as caught:
        await outbox.enqueue_async(aconn, **charge(operation_type=""))
    assert caught.value.field == "operation_type"
    await aconn.rollback()
    assert count(db_url) == 0


async def test_concurrent_async_producers_converge_on_one_row(db_url: str) -> None:
    async def produce() -> outbox.EnqueueResult:
        async with await psycopg.AsyncConnection.connect(db_url) as conn:
            result = await outbox.enqueue_async(conn, **charge())
            await conn.commit()
            return result

    results = await asyncio.gather(*(produce() for _ in range(8)))
    assert sorted(r.outcome.value for r in results) == ["accepted"] + ["duplicate"] * 7
    assert len({r.operation_id for r in results}) == 1
    assert count(db_url) == 1

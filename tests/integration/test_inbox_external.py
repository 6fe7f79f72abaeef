"""External-effect mode (issue 40): a handler that calls a downstream provider before it can
answer. The downstream is FakeWebhookReceiver, a real HTTP server that honours Idempotency-Key;
each test counts the effects it applied and the inbox's records."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox.inbox import Decision, Identity, Inbox, Outcome, gauges
from outbox.inbox.external import LeaseLost
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.cli import outbox_cli
from tests.support.invoice_worker import count

BODY = json.dumps({"account_id": "a", "amount": 100}).encode()
IDENTITY = Identity("acme", "charge", "key:order-1")
LEASE = timedelta(seconds=1)


@pytest.fixture
async def pool(db_url: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(db_url, min_size=1, max_size=8, open=False) as opened:
        yield opened


@pytest.fixture
def downstream() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as receiver:
        yield receiver


async def redeliver(inbox: Inbox, url: str) -> Decision:
    """As a sender would: deliver again while the downstream says it is still busy (409)."""
    for _ in range(40):
        try:
            return await charge(inbox, url)
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code != 409:
                raise
        await asyncio.sleep(0.1)
    raise AssertionError("the downstream stayed busy")


async def charge(inbox: Inbox, url: str, patience: float = 5.0, max_claims: int = 8) -> Decision:
    """One delivery of the order: claim, charge downstream under the claim's key, record."""
    async with inbox.claim(
        IDENTITY, BODY, is_json=True, lease=LEASE, max_claims=max_claims
    ) as claim:
        if claim.decision not in (Decision.NEW, Decision.RECLAIMED):
            return claim.decision
        async with httpx.AsyncClient(timeout=patience) as client:
            answer = await client.post(
                url,
                content=BODY,
                headers={
                    "Idempotency-Key": claim.downstream_key("charge"),
                    "Content-Type": "application/json",
                },
            )
        answer.raise_for_status()
        async with claim.finish():
            await claim.complete(Outcome(201, (), answer.content))
        return claim.decision


async def test_an_ambiguous_timeout_retried_under_the_same_key_is_one_effect(
    db_url: str, pool: AsyncConnectionPool[Any], downstream: FakeWebhookReceiver
) -> None:
    """The downstream applies the charge, then answers too late: the handler gives up, the lease
    ends, the redelivery reclaims and sends the same key, and the downstream replays."""
    inbox = Inbox(pool)
    downstream.inject(WebhookFault.delay_after_apply(1.5), times=1)
    with pytest.raises(httpx.TimeoutException):
        await charge(inbox, downstream.url, patience=0.3)
    assert downstream.effect_count() == 1
    assert await redeliver(inbox, downstream.url) == Decision.RECLAIMED
    assert await charge(inbox, downstream.url) == Decision.REPLAYED
    assert downstream.effect_count() == 1
    keys = {str(r.key) for r in downstream.received}
    assert len(keys) == 1 and keys.pop().startswith("ib1_"), keys
    # Handed back cleanly each time (the timeout, the downstream's 409s): no lease ran out.
    assert count(db_url, "SELECT claims FROM outbox.inbox WHERE state = 'completed'") == 1


async def test_claims_at_once_run_the_handler_once(
    db_url: str, pool: AsyncConnectionPool[Any], downstream: FakeWebhookReceiver
) -> None:
    inbox = Inbox(pool)
    decisions = await asyncio.gather(*(charge(inbox, downstream.url) for _ in range(20)))
    ran = [d for d in decisions if d in (Decision.NEW, Decision.RECLAIMED)]
    assert ran == [Decision.NEW], decisions
    assert set(decisions) <= {Decision.NEW, Decision.IN_PROGRESS, Decision.REPLAYED}
    assert downstream.effect_count() == 1
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'") == 1


def raw_claim(db_url: str, lease: str = "1 s") -> tuple[str, int, Any]:
    """A claim as a worker that dies right after it leaves it: (decision, id, token)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT decision, inbox_id, token FROM outbox.inbox_claim('acme', 'charge',"
            " 'key:order-1', %s, NULL, %s, 3, '1 day')",
            (BODY.decode(), lease),
        ).fetchone()
    assert row is not None
    return str(row[0]), int(row[1]), row[2]


async def test_a_dead_workers_claim_is_reclaimed_after_its_lease_and_its_late_write_refused(
    db_url: str, pool: AsyncConnectionPool[Any], downstream: FakeWebhookReceiver
) -> None:
    decision, inbox_id, stale = raw_claim(db_url)
    assert decision == "new"
    inbox = Inbox(pool)
    assert await charge(inbox, downstream.url) == Decision.IN_PROGRESS  # its lease still runs
    await asyncio.sleep(1.1)
    assert await charge(inbox, downstream.url) == Decision.RECLAIMED
    with psycopg.connect(db_url) as conn:  # the stale worker wakes and tries to record
        conn.execute("SELECT outbox.bind_tenant('acme')")
        late = conn.execute(
            "SELECT outbox.inbox_complete(%s, %s, 200, '[]', 'late')", (inbox_id, stale)
        ).fetchone()
    assert late == (False,)
    assert downstream.effect_count() == 1
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE response_body = 'late'") == 0


async def test_a_claim_taken_too_often_is_abandoned_until_released(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    downstream: FakeWebhookReceiver,
    cli_env: dict[str, str],
) -> None:
    for _ in range(3):  # three workers die after their claim
        decision, inbox_id, _ = raw_claim(db_url)
        assert decision in ("new", "reclaimed")
        await asyncio.sleep(1.05)
    inbox = Inbox(pool)
    assert await charge(inbox, downstream.url, max_claims=3) == Decision.ABANDONED
    assert await charge(inbox, downstream.url, max_claims=3) == Decision.ABANDONED
    assert downstream.effect_count() == 0
    known: set[str] = set()
    await gauges.refresh(pool, known)
    assert REGISTRY.get_sample_value("outbox_inbox_abandoned", {"handler": "charge"}) == 1
    shown = outbox_cli(cli_env, "inbox", "show", str(inbox_id))
    assert "state: abandoned" in shown.stdout and "claims: 3" in shown.stdout, shown.stdout
    released = outbox_cli(cli_env, "inbox", "release", str(inbox_id), "--reason", "looked")
    assert released.returncode == 0, released.stderr
    await gauges.refresh(pool, known)
    assert REGISTRY.get_sample_value("outbox_inbox_abandoned", {"handler": "charge"}) == 0
    assert await charge(inbox, downstream.url, max_claims=3) == Decision.RECLAIMED
    assert downstream.effect_count() == 1
    assert count(db_url, "SELECT count(*) FROM outbox.audit WHERE action = 'inbox_release'") == 1


async def test_a_lost_lease_refuses_the_final_transaction(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """A handler stalled past its lease (its heartbeat could not run) is reclaimed by another
    delivery; its own completion is refused and its final writes rolled back."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (note text)")
    inbox = Inbox(pool)

    async def stalled() -> None:
        async with inbox.claim(IDENTITY, BODY, is_json=True, lease=LEASE, max_claims=8) as c:
            with psycopg.connect(db_url, autocommit=True) as other:  # another delivery
                await asyncio.sleep(0)
                other.execute("UPDATE outbox.inbox SET lease_expires_at = now()")
                row = other.execute(
                    "SELECT decision FROM outbox.inbox_claim('acme', 'charge', 'key:order-1',"
                    " %s, NULL, '1 min', 3, '1 day')",
                    (BODY.decode(),),
                ).fetchone()
                assert row == ("reclaimed",)
            async with c.finish() as conn:
                await conn.execute("INSERT INTO ledger VALUES ('stale')")
                await c.complete(Outcome(201, (), b"stale"))

    with pytest.raises(LeaseLost):
        await stalled()
    assert count(db_url, "SELECT count(*) FROM ledger") == 0
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'") == 0


def test_a_claim_handed_back_is_not_taken_back_by_a_late_renewal(db_url: str) -> None:
    """inbox_fail hands a claim back at once; a renewal under its token that comes after (a
    heartbeat still running, any caller) renews nothing, and the next delivery reclaims it at
    once instead of hearing "in progress" for a lease that nobody holds (sql/0047)."""
    claim = (
        "SELECT decision, inbox_id, token FROM outbox.inbox_claim('acme', 'charge', 'key:k',"
        " '{}', NULL, '1 min', 5, '1 day')"
    )
    with psycopg.connect(db_url, autocommit=True) as conn:
        first = conn.execute(claim).fetchone()
        assert first is not None and first[0] == "new"
        renew = "SELECT outbox.inbox_renew(%s, %s, '1 min')"
        assert conn.execute(renew, first[1:]).fetchone() == (True,)
        fail = "SELECT outbox.inbox_fail(%s, %s, 'timeout')"
        assert conn.execute(fail, first[1:]).fetchone() == (True,)
        assert conn.execute(renew, first[1:]).fetchone() == (False,)
        lease = "SELECT lease_expires_at FROM outbox.inbox WHERE id = %s"
        assert conn.execute(lease, (first[1],)).fetchone() == (None,)
        again = conn.execute(claim).fetchone()
    assert again is not None and (again[0], again[1]) == ("reclaimed", first[1])
    assert again[2] != first[2]  # a new token fences the first claim's late writes

"""outbox.enqueue from Python: one row per identity, in the caller's transaction, nothing else."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from psycopg import pq

import outbox
from outbox import EnqueueOutcome, InvalidOperation, OperationConflict, Status
from outbox.core import payloads
from outbox.db.statements import ENQUEUE_CHANNEL, MARK_WAITING
from tests.support.producers import charge, count


def test_first_enqueue_is_accepted_and_the_same_again_is_a_duplicate(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    first = outbox.enqueue(conn, **charge())
    again = outbox.enqueue(conn, **charge())
    conn.commit()
    assert first.outcome is EnqueueOutcome.ACCEPTED and first.accepted
    assert again.outcome is EnqueueOutcome.DUPLICATE and not again.accepted
    assert again.operation_id == first.operation_id
    assert count(db_url) == 1


def test_enqueue_never_commits_or_rolls_back_on_its_own(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    outbox.enqueue(conn, **charge())
    assert conn.info.transaction_status is pq.TransactionStatus.INTRANS
    assert count(db_url) == 0  # invisible to others until the caller commits
    conn.commit()
    assert count(db_url) == 1


def test_32_concurrent_enqueues_of_one_identity_make_one_row(db_url: str) -> None:
    barrier = threading.Barrier(32)
    results: list[outbox.EnqueueResult] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def producer() -> None:
        try:
            with psycopg.connect(db_url) as conn:
                conn.execute("SELECT 1")  # open the transaction before the race starts
                barrier.wait(timeout=30)
                result = outbox.enqueue(conn, **charge())
                conn.commit()
            with lock:
                results.append(result)
        except BaseException as exc:  # noqa: BLE001 (reported by the assertion below)
            errors.append(exc)

    threads = [threading.Thread(target=producer) for _ in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    outcomes = sorted(r.outcome.value for r in results)
    assert outcomes == ["accepted"] + ["duplicate"] * 31
    assert len({r.operation_id for r in results}) == 1
    assert count(db_url) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"payload": {"amount": 2000, "currency": "usd", "customer": "cus_123"}},
        {"action": "refunds.create"},
        {"provider": "billing"},
    ],
    ids=["payload", "action", "provider"],
)
def test_same_identity_other_content_is_a_conflict_and_changes_nothing(
    conn: psycopg.Connection[Any], db_url: str, change: dict[str, Any]
) -> None:
    outbox.enqueue(conn, **charge())
    conn.commit()
    before = conn.execute("SELECT * FROM outbox.operations").fetchall()
    with pytest.raises(OperationConflict, match="invoice-42-charge") as caught:
        outbox.enqueue(conn, **charge(**change))
    assert isinstance(caught.value.__cause__, psycopg.Error)
    assert caught.value.__cause__.sqlstate == "OB001"
    assert caught.value.operation_key == "invoice-42-charge"
    conn.rollback()
    assert conn.execute("SELECT * FROM outbox.operations").fetchall() == before
    assert count(db_url) == 1


def test_payload_key_order_and_spacing_do_not_make_a_conflict(
    conn: psycopg.Connection[Any],
) -> None:
    first = outbox.enqueue(conn, **charge(payload={"a": 1, "b": [1, 2]}))
    # jsonb's text form is canonical: the fingerprint sees the same payload.
    conn.execute(
        "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'invoice.charge', "
        "operation_key => 'invoice-42-charge', provider => 'stripe', "
        "action => 'payment_intents.create', payload => '{ \"b\" : [1,2],  \"a\":1 }')"
    )
    again = outbox.enqueue(conn, **charge(payload={"b": [1, 2], "a": 1}))
    assert again.operation_id == first.operation_id
    assert again.outcome is EnqueueOutcome.DUPLICATE


def test_a_rolled_back_producer_transaction_leaves_nothing(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    outbox.enqueue(conn, **charge())
    outbox.enqueue(conn, **charge(operation_key="invoice-43-charge"))
    conn.rollback()
    assert count(db_url, "outbox.operations") == 0
    assert count(db_url, "outbox.attempts") == 0


def test_business_write_and_enqueue_commit_together_and_wake_listeners_only_then(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    conn.execute("CREATE TABLE invoices (id int PRIMARY KEY, state text NOT NULL)")
    conn.commit()
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        listener.execute(MARK_WAITING, {"worker": "idle-dispatcher"})  # as an idle one does

        conn.execute("INSERT INTO invoices VALUES (42, 'charging')")
        outbox.enqueue(conn, **charge())
        before_commit = list(listener.notifies(timeout=0.5, stop_after=1))
        assert before_commit == []
        assert count(db_url, "invoices") == 0 and count(db_url) == 0

        conn.commit()
        after_commit = list(listener.notifies(timeout=10, stop_after=1))
        assert [n.channel for n in after_commit] == [ENQUEUE_CHANNEL]
    assert count(db_url, "invoices") == 1 and count(db_url) == 1


def test_no_notification_while_no_dispatcher_waits_and_one_per_commit_while_one_does(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {ENQUEUE_CHANNEL}")
        for n in range(3):  # every dispatcher busy: producers' commits take no notify lock
            outbox.enqueue(conn, **charge(operation_key=f"busy-{n}"))
            conn.commit()
        assert list(listener.notifies(timeout=0.5)) == []
        listener.execute(MARK_WAITING, {"worker": "idle-dispatcher"})
        for n in range(3):  # three operations, one transaction: one notification
            outbox.enqueue(conn, **charge(operation_key=f"idle-{n}"))
        conn.commit()
        assert len(list(listener.notifies(timeout=1))) == 1
        listener.execute(
            "UPDATE outbox.waiting_dispatchers SET seen_at = now() - interval '1 hour'"
        )
        outbox.enqueue(conn, **charge(operation_key="stale"))
        conn.commit()  # a mark left by a dispatcher that died waiting is ignored
        assert list(listener.notifies(timeout=0.5)) == []
    assert count(db_url) == 7


def test_get_operation_reads_the_persisted_state(conn: psycopg.Connection[Any]) -> None:
    result = outbox.enqueue(conn, **charge(correlation_id="req-193", max_attempts=3))
    op = outbox.get_operation(conn, "acme", "invoice.charge", "invoice-42-charge")
    assert op is not None
    assert op.operation_id == result.operation_id
    assert op.status is Status.PENDING
    assert (op.attempts, op.provider_ref, op.result, op.last_error) == (0, None, None, None)
    assert (op.provider, op.action, op.correlation_id) == (
        "stripe",
        "payment_intents.create",
        "req-193",
    )
    assert outbox.get_operation(conn, "acme", "invoice.charge", "no-such-key") is None


def test_get_operation_shows_provider_ref_and_result_once_recorded(
    conn: psycopg.Connection[Any],
) -> None:
    result = outbox.enqueue(conn, **charge())
    conn.execute(
        "UPDATE outbox.operations SET status = 'succeeded', provider_ref = 'pi_1', "
        'result = \'{"id": "pi_1"}\', attempts = 1 WHERE id = %s',
        (result.operation_id,),
    )
    op = outbox.get_operation(conn, "acme", "invoice.charge", "invoice-42-charge")
    assert op is not None
    assert (op.status, op.provider_ref, op.result, op.attempts) == (
        Status.SUCCEEDED,
        "pi_1",
        {"id": "pi_1"},
        1,
    )


def test_the_derived_idempotency_key_is_stable_and_header_safe(
    conn: psycopg.Connection[Any],
) -> None:
    outbox.enqueue(conn, **charge())
    op = outbox.get_operation(conn, "acme", "invoice.charge", "invoice-42-charge")
    assert op is not None
    assert re.fullmatch(r"[!-~]{1,255}", op.idempotency_key)
    # A pure function of the identity: the same identity always gets the same key.
    row = conn.execute(
        "SELECT outbox.derive_idempotency_key('acme', 'invoice.charge', 'invoice-42-charge'),"
        "       outbox.derive_idempotency_key('acme', 'invoice.charge', 'invoice-43-charge')"
    ).fetchone()
    assert row is not None and row[0] == op.idempotency_key and row[1] != op.idempotency_key


def test_an_application_key_is_kept_as_given(conn: psycopg.Connection[Any]) -> None:
    outbox.enqueue(conn, **charge(idempotency_key="client-key-884"))
    row = conn.execute("SELECT idempotency_key FROM outbox.operations").fetchone()
    assert row == ("client-key-884",)


def test_available_at_schedules_the_first_attempt(conn: psycopg.Connection[Any]) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    outbox.enqueue(conn, **charge(available_at=later))
    row = conn.execute("SELECT available_at FROM outbox.operations").fetchone()
    assert row == (later,)


def test_an_unknown_status_is_refused_by_the_table_and_the_enum(
    conn: psycopg.Connection[Any],
) -> None:
    outbox.enqueue(conn, **charge())
    with pytest.raises(psycopg.errors.CheckViolation, match="operations_status_valid"):
        conn.execute("UPDATE outbox.operations SET status = 'done'")
    conn.rollback()
    with pytest.raises(ValueError, match="unknown status 'done'; valid statuses: pending"):
        Status.parse("done")


def test_a_decimal_amount_is_stored_exactly_from_python(conn: psycopg.Connection[Any]) -> None:
    """json.dumps writes a Decimal only by way of a float (or not at all): the producer API
    writes it exactly, so an amount keeps every digit from the application to the provider."""
    amount = Decimal("19.999999999999999999")
    payload = {
        "amount": amount,
        "lines": [{"net": Decimal("0.1")}],
        7: "an integer key, as json.dumps writes it",
    }
    outbox.enqueue(conn, **charge(payload=payload))
    ((text,),) = conn.execute("SELECT payload::text FROM outbox.operations").fetchall()
    assert payloads.decode(text) == {
        "7": "an integer key, as json.dumps writes it",
        "amount": amount,
        "lines": [{"net": Decimal("0.1")}],
    }
    with pytest.raises(InvalidOperation, match="not a JSON number"):
        outbox.enqueue(conn, **charge(operation_key="nan", payload={"x": Decimal("NaN")}))

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from outbox.core.model import EnqueueOutcome, EnqueueResult, FailureClass, Operation, Status
from outbox.oncall.text_tables import render_table


def test_status_parse_accepts_every_status_and_lists_them_on_error() -> None:
    assert [Status.parse(s.value) for s in Status] == list(Status)
    with pytest.raises(
        ValueError, match="unknown status 'sent'; valid statuses: pending, in_flight"
    ):
        Status.parse("sent")


def test_only_succeeded_and_cancelled_are_final() -> None:
    assert {s for s in Status if s.is_final} == {Status.SUCCEEDED, Status.CANCELLED}


def test_enqueue_result_accepted() -> None:
    assert EnqueueResult(1, EnqueueOutcome.ACCEPTED).accepted
    assert not EnqueueResult(1, EnqueueOutcome.DUPLICATE).accepted


def test_operation_from_row_types_its_enums() -> None:
    now = datetime.now(UTC)
    row = {
        "operation_id": 1,
        "tenant_id": "t",
        "operation_type": "ty",
        "operation_key": "k",
        "provider": "stripe",
        "action": "x",
        "status": "quarantined",
        "status_reason": "bad",
        "attempts": 2,
        "provider_ref": None,
        "result": None,
        "last_error": "boom",
        "last_error_class": "permanent",
        "idempotency_key": "ob1_x",
        "correlation_id": None,
        "created_at": now,
        "updated_at": now,
        "available_at": now,
        "finished_at": None,
    }
    op = Operation.from_row(**row)
    assert op.status is Status.QUARANTINED
    assert op.last_error_class is FailureClass.PERMANENT
    with pytest.raises(ValueError, match="unknown status"):
        Operation.from_row(**{**row, "status": "gone"})
    # An operation that never failed has no error class.
    never_failed = Operation.from_row(**{**row, "last_error": None, "last_error_class": None})
    assert never_failed.last_error_class is None


def test_render_table_aligns_numbers_right() -> None:
    assert render_table(["status", "count"], [("pending", 3), ("in_flight", 120)]) == (
        "STATUS     COUNT\npending        3\nin_flight    120"
    )

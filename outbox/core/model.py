"""The vocabulary of outbox as types: statuses, outcomes and the records the producer API returns.

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any


class Status(enum.StrEnum):
    """Where an operation is in its lifecycle. Mirrored by the CHECK constraint
    ``operations_status_valid``; a test keeps the two equal."""

    PENDING = "pending"
    IN_FLIGHT = "in_flight"
    SUCCEEDED = "succeeded"
    QUARANTINED = "quarantined"
    RECONCILING = "reconciling"
    CANCELLED = "cancelled"

    @classmethod
    def parse(cls, value: str) -> Status:
        """The status named ``value``, or a ValueError that lists the valid names."""
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown status {value!r}; valid statuses: {valid}") from None

    @property
    def is_final(self) -> bool:
        """True for statuses that no automatic process moves the operation out of."""
        return self in (Status.SUCCEEDED, Status.CANCELLED)


class FailureClass(enum.StrEnum):
    """What a failed attempt leads to (docs/design.md, "Failure classes")."""

    TRANSIENT = "transient"  # the provider did not act: retry
    PERMANENT = "permanent"  # another attempt will not help: quarantine
    UNKNOWN = "unknown"  # the provider may have acted: retry only within the key window


class EnqueueOutcome(enum.StrEnum):
    """What ``enqueue`` did."""

    ACCEPTED = "accepted"  # a new operation was recorded
    DUPLICATE = "duplicate"  # the same identity and fingerprint existed; nothing was written


@dataclass(frozen=True, slots=True)
class EnqueueResult:
    """The operation an enqueue recorded or found."""

    operation_id: int
    outcome: EnqueueOutcome

    @property
    def accepted(self) -> bool:
        """True when this call recorded a new operation."""
        return self.outcome is EnqueueOutcome.ACCEPTED


@dataclass(frozen=True, slots=True)
class Operation:
    """An operation's persisted state, as the read API returns it."""

    operation_id: int
    tenant_id: str
    operation_type: str
    operation_key: str
    provider: str
    action: str
    status: Status
    status_reason: str | None
    attempts: int
    provider_ref: str | None
    result: dict[str, Any] | None
    last_error: str | None
    last_error_class: FailureClass | None
    idempotency_key: str
    correlation_id: str | None
    created_at: datetime
    updated_at: datetime
    available_at: datetime
    finished_at: datetime | None
    # The version of its type's contract it was enqueued under (sql/0053); None without one.
    contract_version: int | None = None

    @classmethod
    def from_row(cls, **row: Any) -> Operation:
        """Build from a row of ``outbox.get_operation``, whose enums arrive as plain strings."""
        error_class = row.pop("last_error_class")
        return cls(
            status=Status.parse(row.pop("status")),
            last_error_class=None if error_class is None else FailureClass(error_class),
            **row,
        )

"""Exceptions of the public API, and the SQLSTATEs the SQL functions raise for them."""

from __future__ import annotations

from typing import Final

# Class OB is ours; PostgreSQL defines no class that starts with O. Documented in sql/0004.
SQLSTATE_OPERATION_CONFLICT: Final = "OB001"
SQLSTATE_INVALID_OPERATION: Final = "OB002"
SQLSTATE_AUDIT_APPEND_ONLY: Final = "OB003"
# OB004 is the operator functions' refusal (outbox.operators).
SQLSTATE_OPERATION_IMMUTABLE: Final = "OB005"  # identity, payload or key changed after enqueue


class OutboxError(Exception):
    """Base class of every error outbox raises on purpose."""


class OperationConflict(OutboxError):
    """The identity is already taken by an operation with another provider, action or payload;
    or (``field`` "idempotency_key") the key already names another operation of the provider,
    of any tenant (sql/0024).

    Nothing was written. As with any SQL error, the caller's transaction is aborted and must be
    rolled back.
    """

    def __init__(
        self, message: str, *, tenant_id: str, operation_type: str, operation_key: str,
        field: str | None = None,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.tenant_id = tenant_id
        self.operation_type = operation_type
        self.operation_key = operation_key
        self.field = field


class InvalidOperation(OutboxError, ValueError):
    """An enqueue argument is malformed; ``field`` names it. Nothing was written."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

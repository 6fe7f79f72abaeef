"""Exceptions of the public API, and every SQLSTATE outbox's SQL raises on purpose.

Each constant's comment names what raises it: the SQL function or trigger function, and the
migration (sql/) that defines it last.
"""

from __future__ import annotations

from typing import Final

# Class OB is ours; PostgreSQL defines no class that starts with O. Documented in sql/0004.
# outbox.enqueue (sql/0028): the identity or the idempotency key is taken (OperationConflict).
SQLSTATE_OPERATION_CONFLICT: Final = "OB001"
# enqueue, check_text (0028), require_allowance (0026), set_ordering_mode (0025): a bad argument.
SQLSTATE_INVALID_OPERATION: Final = "OB002"
# Triggers on outbox.audit: audit_is_append_only (sql/0003), audit_is_kept (sql/0009).
SQLSTATE_AUDIT_APPEND_ONLY: Final = "OB003"
# Operator functions: lock_for_action (sql/0005), require_reason (0025), record_finding (0023)...
SQLSTATE_OPERATOR_REFUSED: Final = "OB004"
# Trigger on outbox.operations, operations_keep_immutable (sql/0015): what it asks changed.
SQLSTATE_OPERATION_IMMUTABLE: Final = "OB005"
# Deferred trigger on outbox.inbox, inbox_outcome_before_commit (sql/0042): a COMMIT whose inbox
# record has no outcome.
SQLSTATE_INBOX_NO_OUTCOME: Final = "OB006"
# outbox.inbox_begin and inbox_claim (sql/0046): the body does not match the fingerprint its
# sender sent. The inbox answers it as a malformed delivery (400; a queue drops it).
SQLSTATE_INBOX_BODY_ALTERED: Final = "OB007"
# outbox.publish_contract (sql/0052): the version is published with other content.
SQLSTATE_CONTRACT_CHANGED: Final = "OB008"
# outbox.enqueue (sql/0053): a type with contracts without a version, a version not published
# or retired. The Python API raises it too for a payload its contract refuses (ContractViolation).
SQLSTATE_CONTRACT_VIOLATION: Final = "OB009"
# no_data_found, from outbox.lock_for_action (sql/0005): an operator function names no operation.
SQLSTATE_NO_DATA_FOUND: Final = "P0002"
# insufficient_privilege, from outbox.require_tenant (sql/0011): unbound, or another tenant.
SQLSTATE_INSUFFICIENT_PRIVILEGE: Final = "42501"


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
        self,
        message: str,
        *,
        tenant_id: str,
        operation_type: str,
        operation_key: str,
        field: str | None = None,
    ) -> None:
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


class ContractViolation(InvalidOperation):
    """The operation breaks its type's contract (issue 42): its payload (``path`` a JSON
    pointer into it and ``rule`` the keyword it breaks, never the value), or its
    ``contract_version`` (none named for a type that has contracts, not published, retired).
    Nothing was written."""

    def __init__(
        self, field: str, message: str, *, path: str | None = None, rule: str | None = None
    ) -> None:
        super().__init__(field, message)
        self.path = path
        self.rule = rule

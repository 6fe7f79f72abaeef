"""outbox: a transactional-outbox dispatcher for PostgreSQL.

The producer API, for applications that record operations inside their own transactions::

    with conn.transaction():
        conn.execute("INSERT INTO invoices ...")
        outbox.enqueue(conn, tenant_id="acme", operation_type="invoice.charge",
                       operation_key="invoice-42-charge", provider="stripe",
                       action="payment_intents.create", payload={"amount": 1000, ...})

With tenant isolation on, bind the transaction to its tenant first: ``outbox.bind_tenant(conn,
"acme")``.
"""

from importlib.metadata import version as _version

from outbox.core.model import EnqueueOutcome, EnqueueResult, FailureClass, Operation, Status
from outbox.errors import ContractViolation, InvalidOperation, OperationConflict, OutboxError
from outbox.producer import (
    bind_tenant,
    bind_tenant_async,
    enqueue,
    enqueue_async,
    get_operation,
    get_operation_async,
)

__version__ = _version("outbox")

__all__ = [
    "ContractViolation",
    "EnqueueOutcome",
    "EnqueueResult",
    "FailureClass",
    "InvalidOperation",
    "Operation",
    "OperationConflict",
    "OutboxError",
    "Status",
    "__version__",
    "bind_tenant",
    "bind_tenant_async",
    "enqueue",
    "enqueue_async",
    "get_operation",
    "get_operation_async",
]

"""Shared arguments and counting helpers for producer tests."""

from __future__ import annotations

from typing import Any

import psycopg


def charge(**overrides: Any) -> dict[str, Any]:
    """The keyword arguments of a typical enqueue, with ``overrides`` applied."""
    args: dict[str, Any] = {
        "tenant_id": "acme",
        "operation_type": "invoice.charge",
        "operation_key": "invoice-42-charge",
        "provider": "stripe",
        "action": "payment_intents.create",
        "payload": {"amount": 1000, "currency": "usd", "customer": "cus_123"},
    }
    args.update(overrides)
    return args


def count(url: str, table: str = "outbox.operations") -> int:
    """Rows in ``table``, read on a connection of its own (so: committed rows only)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()  # noqa: S608 (fixed names)
    assert row is not None
    return int(row[0])


def nested_payload(depth: int) -> str:
    """JSON text of a payload whose objects and arrays nest ``depth`` levels deep, the payload
    being level 1 (built as text: Python's json could not even write 1,000 levels)."""
    return '{"a": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def plant(
    conn: psycopg.Connection[Any],
    *,
    tenant: str,
    key: str,
    payload: str,
    provider: str = "hook",
    action: str = "invoice.paid",
    operation_type: str = "poison",
) -> int:
    """A row written behind enqueue's back, whatever its payload (JSON text), as a superuser
    may write one and as rows from before enqueue's checks were written; returns its id."""
    row = conn.execute(
        "INSERT INTO outbox.operations (tenant_id, operation_type, operation_key, fingerprint, "
        "provider, action, payload, idempotency_key) "
        "VALUES (%s, %s, %s, sha256(%s::bytea), %s, %s, %s::jsonb, %s) RETURNING id",
        (
            tenant,
            operation_type,
            key,
            key.encode(),
            provider,
            action,
            payload,
            f"ob1_poison_{tenant}_{key}",
        ),
    ).fetchone()
    assert row is not None
    return int(row[0])

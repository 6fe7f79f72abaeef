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

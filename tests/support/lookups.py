"""LookupRequests for tests that ask a provider directly, as the reconciler would (sql/0023)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from outbox.providers.base import LookupRequest


def lookup_request(
    action: str,
    operation_id: int,
    key: str,
    first_sent_at: datetime,
    last_attempt_at: datetime,
    *,
    keys: Iterable[str] = (),
    payload: Mapping[str, Any] | None = None,
    search_until: datetime | None = None,
    now: datetime | None = None,
) -> LookupRequest:
    """The request for ``key`` (and ``keys``), searched up to the last attempt by default."""
    return LookupRequest(
        action=action,
        operation_id=operation_id,
        idempotency_key=key,
        keys=frozenset({key, *keys}),
        first_sent_at=first_sent_at,
        last_attempt_at=last_attempt_at,
        search_until=search_until or last_attempt_at,
        checked_now=now or datetime.now(UTC),
        payload=payload or {},
    )

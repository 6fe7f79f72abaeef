"""What on-call engineers do to operations automation could not finish: list them, look at
one, and resolve, retry, replay or cancel it. Every action is a SQL function that changes the
status and writes who, when and why to the append-only audit, in one transaction."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row

from outbox.core.durations import format_duration
from outbox.core.model import Status
from outbox.core.safe_text import printable
from outbox.db import statements
from outbox.errors import SQLSTATE_NO_DATA_FOUND, SQLSTATE_OPERATOR_REFUSED, OutboxError

# One bulk action takes at most this many: a bigger backlog is worked through in several runs of
# the same command (each run takes the oldest), so no run holds an unbounded list.
MAX_BULK: Final = 100_000


class ActionRefused(OutboxError):
    """The action does not apply to the operation as it is, or the operation does not exist."""


@dataclass(frozen=True)
class Identity:
    tenant_id: str
    operation_type: str
    operation_key: str


Row = dict[str, Any]


_OPTION_OF: Final = {"reason": "status-reason"}  # as the command line spells them


@dataclass(frozen=True)
class Filters:
    """Which operations of a status a list or a bulk action takes; None means any."""

    provider: str | None = None
    reason: str | None = None  # status_reason: permanent_failure, attempts_exhausted, ...
    error: str | None = None  # the last attempt's error class: unknown_provider, http_422, ...
    tenant: str | None = None
    since: timedelta | datetime | None = None  # entered the status within, or at or after

    def given(self) -> bool:
        return any(v is not None for v in vars(self).values())

    def describe(self) -> str:
        """``provider=stripe, since=2h``, as the options were given."""
        shown = {
            _OPTION_OF.get(k, k): format_duration(v) if isinstance(v, timedelta) else v
            for k, v in vars(self).items()
            if v is not None
        }
        return ", ".join(f"{k}={printable(str(v))}" for k, v in shown.items()) or "all"

    def params(self) -> Row:
        since = self.since
        return {
            "provider": self.provider,
            "reason": self.reason,
            "error": self.error,
            "tenant": self.tenant,
            "since_ago": since if isinstance(since, timedelta) else None,
            "since_at": since if isinstance(since, datetime) else None,
        }


@dataclass(frozen=True)
class Cursor:
    """Where a page of ``list`` ended: the last row's place in the order, (entered, id)."""

    at: datetime
    id: int

    def __str__(self) -> str:
        return f"{self.at.isoformat()}/{self.id}"

    @classmethod
    def parse(cls, text: str) -> Cursor:
        at, _, id_ = text.rpartition("/")
        try:
            cursor = cls(datetime.fromisoformat(at), int(id_))
        except ValueError:
            raise ValueError(f"{printable(text)!r} is not a cursor that `list` printed") from None
        if cursor.at.tzinfo is None or not 0 <= cursor.id < 2**63:  # an id is a bigint
            raise ValueError(f"{printable(text)!r} is not a cursor that `list` printed")
        return cursor


def list_attention(
    conn: psycopg.Connection[Any],
    status: Status,
    filters: Filters = Filters(),
    *,
    after: Cursor | None = None,
    limit: int = 100,
) -> list[Row]:
    """Operations in ``status`` (reconciling or quarantined), oldest first, from ``after``."""
    params = {
        "status": status.value,
        **filters.params(),
        "limit": limit,
        "after_at": after.at if after else None,
        "after_id": after.id if after else None,
    }
    return _all(conn, statements.LIST_ATTENTION, params)


def list_pending_failed(
    conn: psycopg.Connection[Any],
    filters: Filters = Filters(),
    *,
    after: Cursor | None = None,
    limit: int = 100,
) -> list[Row]:
    """Pending operations whose last attempt failed, oldest in the status first, from
    ``after``; ``error`` is the last attempt's error class."""
    params = {
        "status": Status.PENDING.value,
        **filters.params(),
        "limit": limit,
        "after_at": after.at if after else None,
        "after_id": after.id if after else None,
    }
    return _all(conn, statements.LIST_PENDING_FAILED, params)


def pending_failed_by_provider(
    conn: psycopg.Connection[Any], *, count_limit: int, provider_limit: int
) -> list[Row]:
    """Per provider (at most ``provider_limit``), its pending operations whose last attempt
    failed, by that attempt's error class: (provider, error, pending) rows, most first, of at
    most ``count_limit`` (the oldest) per provider."""
    params = {"count_limit": count_limit, "provider_limit": provider_limit}
    return _all(conn, statements.PENDING_FAILED_BY_PROVIDER, params)


def select_ids(
    conn: psycopg.Connection[Any], status: Status, filters: Filters, limit: int = MAX_BULK
) -> list[int]:
    """The ids a bulk action takes, oldest first."""
    params = {
        "status": status.value,
        **filters.params(),
        "limit": limit,
        "after_at": None,
        "after_id": None,
    }
    with conn.cursor() as cur:
        return [row[0] for row in cur.execute(statements.SELECT_ATTENTION_IDS, params)]


def reconciling_providers(
    conn: psycopg.Connection[Any], operation_id: int | None, ids: list[int] | None
) -> set[str]:
    """The providers of the reconciling operations a check takes: ``operation_id``, those of
    ``ids``, or (with neither) every one."""
    params = {"id": operation_id, "ids": ids}
    with conn.cursor() as cur:
        return {row[0] for row in cur.execute(statements.RECONCILING_PROVIDERS, params)}


def list_ids(conn: psycopg.Connection[Any], ids: list[int]) -> list[Row]:
    """These operations as `list` shows them, oldest in their status first."""
    return _all(conn, statements.LIST_IDS, {"ids": ids})


def statuses_of(conn: psycopg.Connection[Any], ids: list[int]) -> dict[int, Status]:
    """The status of each of these operations that exists."""
    with conn.cursor() as cur:
        found = cur.execute(statements.STATUS_OF_IDS, {"ids": ids}).fetchall()
    return {int(i): Status.parse(s) for i, s in found}


def retryable_ids(conn: psycopg.Connection[Any], ids: list[int]) -> set[int]:
    """Those of these reconciling operations `retry` takes without --force: a check (or a
    person, `resolve --no-effect`) found no effect, 30 s or more after the last attempt."""
    with conn.cursor() as cur:
        return {int(r[0]) for r in cur.execute(statements.RETRYABLE_IDS, {"ids": ids})}


def settled_ids(conn: psycopg.Connection[Any], ids: list[int]) -> set[int]:
    """Those of these reconciling operations whose last attempt was 30 s ago or more: a person's
    "no effect" is taken of those only (sql/0034)."""
    with conn.cursor() as cur:
        return {int(r[0]) for r in cur.execute(statements.SETTLED_IDS, {"ids": ids})}


def find_id(conn: psycopg.Connection[Any], identity: Identity) -> int:
    rows = _all(conn, statements.FIND_BY_IDENTITY, vars(identity))
    if not rows:
        raise ActionRefused(
            f"no operation {identity.tenant_id}/{identity.operation_type}/{identity.operation_key}"
        )
    return int(rows[0]["id"])


def show(conn: psycopg.Connection[Any], operation_id: int, *, with_payload: bool = False) -> Row:
    """The operation with its attempt history and audit trail."""
    rows = _all(conn, statements.SHOW_OPERATION, {"id": operation_id, "with_payload": with_payload})
    if not rows:
        raise ActionRefused(f"no operation with id {operation_id}")
    operation = rows[0]
    operation["attempt_history"] = _all(conn, statements.ATTEMPT_HISTORY, {"id": operation_id})
    operation["audit"] = _all(conn, statements.AUDIT_HISTORY, {"id": operation_id})
    return operation


def resolve(
    conn: psycopg.Connection[Any], operation_id: int, *, provider_ref: str, reason: str, actor: str
) -> Status:
    """Mark succeeded with the provider's reference of the effect."""
    return _act(
        conn,
        statements.RESOLVE,
        {"id": operation_id, "provider_ref": provider_ref, "reason": reason, "actor": actor},
    )


def record_no_effect(
    conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str
) -> Status:
    """A person found no effect at the provider: a not_found finding of theirs, audited, after
    which `retry` needs no force (sql/0032). The operation stays reconciling."""
    return _act(
        conn, statements.RECORD_NO_EFFECT, {"id": operation_id, "reason": reason, "actor": actor}
    )


def cancel(conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str) -> Status:
    """Reconciling or quarantined to cancelled."""
    return _act(conn, statements.CANCEL, {"id": operation_id, "reason": reason, "actor": actor})


def request_cancel(
    conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str
) -> Status:
    """Any unfinished operation to cancelled, or RECONCILING where an earlier attempt may have
    reached the provider; IN_FLIGHT when it is settled only once the attempt under way ends
    (sql/0019, request_cancel)."""
    params = {"id": operation_id, "reason": reason, "actor": actor}
    return _act(conn, statements.REQUEST_CANCEL, params)


def replay(conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str) -> Status:
    """Quarantined back to pending, same key; the key-window rule still applies."""
    return _act(conn, statements.REPLAY, {"id": operation_id, "reason": reason, "actor": actor})


def request_reconciliation(
    conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str
) -> Status:
    """Quarantined to reconciling (reason operator_request): the reconciler checks it first."""
    params = {"id": operation_id, "reason": reason, "actor": actor}
    return _act(conn, statements.REQUEST_RECONCILIATION, params)


def retry(
    conn: psycopg.Connection[Any],
    operation_id: int,
    *,
    reason: str,
    actor: str,
    force: bool = False,
) -> Status:
    """Reconciling back to pending under a new key generation."""
    params = {"id": operation_id, "reason": reason, "actor": actor, "force": force}
    return _act(conn, statements.RETRY, params)


def retry_with_no_effect(
    conn: psycopg.Connection[Any], operation_id: int, *, reason: str, actor: str
) -> Status:
    """A person found no effect at the provider: their finding recorded (``record_no_effect``),
    then the operation retried under a new key without force, in one transaction."""
    with conn.transaction():
        record_no_effect(conn, operation_id, reason=reason, actor=actor)
        return retry(conn, operation_id, reason=reason, actor=actor)


def _act(conn: psycopg.Connection[Any], query: LiteralString, params: Row) -> Status:
    try:
        with conn.transaction():
            row = conn.execute(query, params).fetchone()
    except psycopg.Error as exc:
        if exc.sqlstate in (SQLSTATE_OPERATOR_REFUSED, SQLSTATE_NO_DATA_FOUND):
            raise ActionRefused(exc.diag.message_primary or str(exc)) from None
        raise
    assert row is not None  # noqa: S101 (the functions always return the new status)
    return Status.parse(row[0])


def _all(conn: psycopg.Connection[Any], query: LiteralString, params: Row) -> list[Row]:
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query, params).fetchall()

"""The dispatcher's check of a payload against its contract before the first send (issue 42;
docs/design.md "Contracts").

The Python API checks a payload before its row exists; a row from the SQL function, or written
by hand past it, reaches the claim unchecked (PostgreSQL has no JSON Schema validator). A row
that names a contract version is checked here before anything of it is sent, with the checker
the producer uses (outbox.contracts.checks), on the payload as stored: a violation is
quarantined unsent as ``contract_violation``, naming the path and the rule, never the value.
A row already sent is not checked again: whatever it carried may have reached the provider, and
its key window, not a contract, decides what happens to it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import psycopg

from outbox.contracts import Checker, InvalidContract, checker_for, label
from outbox.core import payloads
from outbox.core.model import Status
from outbox.core.policy import REASON_CONTRACT_VIOLATION
from outbox.db.store import Claimed, Store
from outbox.dispatch.flight import Aside, log
from outbox.providers.base import permanent

# A row whose contract could not be read (the database did not answer) goes back this long.
LOOKUP_RETRY: Final = timedelta(seconds=30)
# Contracts kept per process, refusals included; past it the cache starts again.
MAX_KEPT: Final = 1024


class Contracts:
    """The contracts this dispatcher has checked rows against, by (type, version): a published
    version never changes (sql/0052), so one look-up per process is enough."""

    def __init__(self, store: Store) -> None:
        self._store = store
        # A checker, or the refusal every row of a contract past the bounds gets (it never
        # changes, so neither does the refusal).
        self._kept: dict[tuple[str, int], Checker | Aside] = {}
        self._loading: dict[tuple[str, int], asyncio.Future[Checker | Aside]] = {}

    def needs_check(self, row: Claimed) -> bool:
        return row.contract_version is not None and row.first_sent_at is None

    async def checker(self, row: Claimed) -> Checker | Aside:
        """The row's contract's checker, or where the row goes instead of being checked."""
        assert row.contract_version is not None  # noqa: S101 (needs_check said so)
        key = (row.operation_type, row.contract_version)
        kept = self._kept.get(key)
        if kept is not None:
            return kept
        loading = self._loading.get(key)
        if loading is None:  # one look-up for all the rows of a claim that name it
            loading = self._loading[key] = asyncio.ensure_future(self._load(*key))
            loading.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(loading)

    async def _load(self, operation_type: str, version: int) -> Checker | Aside:
        named = label(operation_type, version)
        try:
            found = await self._store.get_contract(operation_type, version)
        except psycopg.Error as exc:
            # Nothing known about the payload: back unsent, its attempt unspent (not kept).
            log.warning(
                "reading a contract failed; its rows go back unsent",
                contract=named,
                error=type(exc).__name__,
            )
            return Aside(Status.PENDING, None, delay=LOOKUP_RETRY)
        if found is None:
            # A row written by hand past enqueue's check. Not kept: the version may be published
            # later, and the next row that names it must then be checked, not refused.
            return _refused(f"no contract {named} is published")
        canonical, digest = found
        try:
            checker = checker_for(named, digest, canonical)
        except InvalidContract as exc:
            return self._keep(operation_type, version, _refused(f"contract {exc}"))
        return self._keep(operation_type, version, checker)

    def _keep(self, operation_type: str, version: int, kept: Checker | Aside) -> Checker | Aside:
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[operation_type, version] = kept
        return kept


def verdict(checker: Checker, payload: Mapping[str, Any]) -> Aside | None:
    """Where a payload that breaks its contract goes (quarantine, unsent), or None. ``payload``
    is the row's, as outbox.core.payloads carried it from the stored text: the producer checks
    the same value (outbox.producer._check_contract)."""
    value = payload.value() if isinstance(payload, payloads.Decoded) else dict(payload)
    found = checker.violation(value)
    if found is None:
        return None
    return _refused(f"the payload breaks contract {checker.label} {found}")


def _refused(message: str) -> Aside:
    return Aside(
        Status.QUARANTINED,
        REASON_CONTRACT_VIOLATION,
        permanent("contract_violation", message),
    )

"""The inbox's check of a delivery's body against the contract its sender names (issue 42;
docs/design.md, "Contracts").

outbox sends ``Outbox-Contract: <type>/v<N>`` with every delivery of an operation enqueued
under a contract. Before the decision (and so before any handler runs, and before anything is
recorded), the body is checked against that version as published in the receiver's own
database, with the checker the producer and the dispatcher use, on the body decoded as they
decode it. A body that breaks it is a conflict of input: ``ContractBreach``, answered 422 over
HTTP and dropped (terminated, dead-lettered) on a queue, never retried, naming the contract, the
path and the rule, never a value. A version the receiver's database has not published (the
receiving service's deploy pushes its contracts after the sender's) is ``ContractUnknown``:
tried again later, never taken unchecked and never dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any, Final

from psycopg_pool import AsyncConnectionPool, ConnectionPool

from outbox.contracts import Checker, InvalidContract, checker_for, label
from outbox.core import payloads
from outbox.inbox import statements

# Compiled contracts kept per inbox; past it the cache starts again.
MAX_KEPT: Final = 1024
# A body past this many bytes is checked on a thread: a check within the bounds may take some
# 0.1 s on the largest body (bench/README.md, "Contracts"), which the event loop that serves
# the worker's other requests must not wait for.
THREAD_BYTES: Final = 64 * 1024


class ContractBreach(ValueError):
    """The body breaks the contract its sender names (or cannot be read as a payload at all):
    a conflict of input, never retried. ``path`` and ``rule`` as outbox.contracts.Violation."""

    def __init__(self, contract: str, message: str, path: str = "", rule: str = "type") -> None:
        super().__init__(message)
        self.contract = contract
        self.path = path
        self.rule = rule


class ContractUnknown(RuntimeError):
    """The receiver's database cannot check the contract the delivery names (not published
    there, or published past outbox's bounds): try again later; nothing was decided."""


Required = Mapping[str, str | Iterable[str]]


class Contracts:
    """The contracts one inbox has checked deliveries against, by type and version: a
    published version never changes (sql/0052), so one look-up per process is enough.
    ``required`` maps a handler to the operation type (or types: a renamed type's old and new
    names) its deliveries must name: one that names none, or another, is a breach, so that a
    sender cannot pass a body unchecked by leaving the header out."""

    def __init__(self, required: Required | None = None) -> None:
        self._kept: dict[tuple[str, int], Checker] = {}
        self._required = {
            handler: frozenset([types] if isinstance(types, str) else types)
            for handler, types in (required or {}).items()
        }

    async def check(
        self,
        pool: AsyncConnectionPool[Any],
        handler: str,
        contract: tuple[str, int] | None,
        body: bytes,
        is_json: bool,
    ) -> None:
        """Raise ContractBreach if the body breaks ``contract`` (the type and version a
        delivery names, Identity.contract) or the handler requires another, ContractUnknown if
        the database cannot check it; nothing when it names none and none is required. A
        look-up the database fails raises its error."""
        self._require(handler, contract)
        if contract is None:
            return
        checker = self._kept.get(contract)
        if checker is None:
            async with pool.connection() as conn:
                cur = await conn.execute(statements.GET_CONTRACT, contract)
                checker = self._keep(contract, await cur.fetchone())
        if len(body) > THREAD_BYTES:
            await asyncio.to_thread(check_body, checker, body, is_json)
        else:
            check_body(checker, body, is_json)

    def check_sync(
        self,
        pool: ConnectionPool[Any],
        handler: str,
        contract: tuple[str, int] | None,
        body: bytes,
        is_json: bool,
    ) -> None:
        """``check`` on a thread's pool (SyncInbox)."""
        self._require(handler, contract)
        if contract is None:
            return
        checker = self._kept.get(contract)
        if checker is None:
            with pool.connection() as conn:
                row = conn.execute(statements.GET_CONTRACT, contract).fetchone()
            checker = self._keep(contract, row)
        check_body(checker, body, is_json)

    def _require(self, handler: str, contract: tuple[str, int] | None) -> None:
        required = self._required.get(handler)
        if required is None or (contract is not None and contract[0] in required):
            return
        takes = " or ".join(sorted(required))
        named = "" if contract is None else label(*contract)
        message = f"handler {handler} takes deliveries under contract {takes}; this one names "
        raise ContractBreach(named, message + (named or "none"), "", "contract")

    def _keep(self, contract: tuple[str, int], row: Any) -> Checker:
        named = label(*contract)
        if row is None:  # not kept: the receiver's push may come any moment
            raise ContractUnknown(f"contract {named} is not published in this database")
        canonical, digest = row
        try:
            checker = checker_for(named, digest, canonical)
        except InvalidContract as exc:
            raise ContractUnknown(f"contract {exc}") from None
        if len(self._kept) >= MAX_KEPT:
            self._kept.clear()
        self._kept[contract] = checker
        return checker


def check_body(checker: Checker, body: bytes, is_json: bool) -> None:
    """Raise ContractBreach unless ``body`` (the delivery's bytes) keeps ``checker``'s contract:
    decoded as the producer and the dispatcher decode a payload (outbox.core.payloads)."""
    named = checker.label
    if not is_json:
        raise ContractBreach(named, f"contract {named}: the body is not JSON")
    try:
        value = payloads.decode(body.decode("utf-8"))
    except (UnicodeDecodeError, payloads.InvalidPayload) as exc:
        # The reason names the kind, depth or position; never the content.
        reason = "the body is not UTF-8" if isinstance(exc, UnicodeDecodeError) else str(exc)
        raise ContractBreach(named, f"contract {named}: {reason}") from None
    found = checker.violation(value)
    if found is not None:
        message = f"the body breaks contract {named} {found}"
        raise ContractBreach(named, message, found.path, found.rule)

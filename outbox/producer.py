"""The producer API: record an operation in the caller's transaction, and read it back.

Every function runs on the caller's psycopg connection and never commits or rolls back: the
operation becomes visible to the dispatcher when, and only if, the caller's transaction commits.
Validation lives in the SQL function ``outbox.enqueue`` so that Python and every other language
get the same rules; this module checks only what cannot reach SQL intact (NUL characters, values
that are not JSON).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from typing import Any, ClassVar, Final, NoReturn, Protocol

import psycopg
import structlog
from psycopg.pq import TransactionStatus
from psycopg.rows import kwargs_row, tuple_row

from outbox.contracts import Checker, InvalidContract, checker_for, label
from outbox.core import payloads
from outbox.core.model import EnqueueOutcome, EnqueueResult, Operation
from outbox.db import statements
from outbox.errors import (
    SQLSTATE_CONTRACT_VIOLATION,
    SQLSTATE_INVALID_OPERATION,
    SQLSTATE_OPERATION_CONFLICT,
    ContractViolation,
    InvalidOperation,
    OperationConflict,
)
from outbox.observability import tracing

Params = dict[str, Any]


class Contracted(Protocol):
    """A payload class written by `outbox contracts codegen`: its contract's type and version,
    and the payload it stands for."""

    CONTRACT: ClassVar[tuple[str, int]]

    def to_payload(self) -> dict[str, Any]: ...


def bind_tenant(conn: psycopg.Connection[Any], tenant_id: str) -> None:
    """Bind the caller's current transaction to ``tenant_id``, until it commits or rolls back.

    With tenant isolation on (``outbox migrate --with-roles --tenant-rls``), :func:`enqueue` and
    :func:`get_operation` act only for the bound tenant and refuse any other with SQLSTATE 42501
    (``psycopg.errors.InsufficientPrivilege``); without it, binding changes nothing. Call it
    where your application knows which tenant a request belongs to, inside the transaction of
    the request. Raises ``psycopg.ProgrammingError`` on an autocommit connection outside
    ``conn.transaction()``, where the binding would end with this very statement.
    """
    _check_binding(tenant_id, conn.autocommit, conn.info.transaction_status)
    conn.execute(statements.BIND_TENANT, (tenant_id,))


async def bind_tenant_async(conn: psycopg.AsyncConnection[Any], tenant_id: str) -> None:
    """The asyncio twin of :func:`bind_tenant`."""
    _check_binding(tenant_id, conn.autocommit, conn.info.transaction_status)
    await conn.execute(statements.BIND_TENANT, (tenant_id,))


def _check_binding(tenant_id: object, autocommit: bool, status: TransactionStatus) -> None:
    if not isinstance(tenant_id, str):
        raise InvalidOperation(
            "tenant_id", f"tenant_id must be a string, not {type(tenant_id).__name__}"
        )
    if "\x00" in tenant_id:
        raise InvalidOperation("tenant_id", "tenant_id must not contain NUL characters")
    if not tenant_id.isascii() and not _encodable(tenant_id):
        raise InvalidOperation("tenant_id", "tenant_id must be UTF-8 text")
    if autocommit and status == TransactionStatus.IDLE:
        raise psycopg.ProgrammingError(
            "bind_tenant needs an open transaction (use `with conn.transaction():`): on an "
            "autocommit connection the binding would end with its own statement"
        )


def enqueue(
    conn: psycopg.Connection[Any],
    *,
    tenant_id: str,
    operation_type: str,
    operation_key: str,
    provider: str,
    action: str,
    payload: Mapping[str, Any] | Contracted,
    correlation_id: str | None = None,
    idempotency_key: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    traceparent: str | None = None,
    ordering_key: str | None = None,
    contract_version: int | None = None,
) -> EnqueueResult:
    """Record an operation inside the caller's open transaction.

    Returns ``accepted`` for a new operation, ``duplicate`` (with the existing id) when the same
    identity was recorded with the same provider, action and payload. Raises
    :class:`OperationConflict` when the identity exists with other content and
    :class:`InvalidOperation` for malformed arguments; either way nothing is written.
    ``available_at`` delays the first attempt; ``idempotency_key`` replaces the derived key when
    the application already has one from its own client. Operations of one tenant with the same
    ``ordering_key`` reach the provider one at a time, in enqueue order.
    """
    params = _enqueue_params(locals())
    try:
        with conn.cursor(row_factory=tuple_row) as cur:
            if params["contract_version"] is not None:
                where = _database(conn.info)
                checker = _CHECKERS.get(
                    (where, params["operation_type"], params["contract_version"])
                )
                if checker is None:
                    cur.execute(statements.GET_CONTRACT, _contract_of(params))
                    checker = _checker(where, params, cur.fetchone())
                _check_contract(checker, params)
            cur.execute(_statement(params), params)
            row = cur.fetchone()
    except psycopg.Error as exc:
        _raise_translated(exc, params)
    return _enqueue_result(row)


async def enqueue_async(
    conn: psycopg.AsyncConnection[Any],
    *,
    tenant_id: str,
    operation_type: str,
    operation_key: str,
    provider: str,
    action: str,
    payload: Mapping[str, Any] | Contracted,
    correlation_id: str | None = None,
    idempotency_key: str | None = None,
    available_at: datetime | None = None,
    max_attempts: int | None = None,
    traceparent: str | None = None,
    ordering_key: str | None = None,
    contract_version: int | None = None,
) -> EnqueueResult:
    """The asyncio twin of :func:`enqueue`, on a psycopg ``AsyncConnection``."""
    params = _enqueue_params(locals())
    try:
        async with conn.cursor(row_factory=tuple_row) as cur:
            if params["contract_version"] is not None:
                where = _database(conn.info)
                checker = _CHECKERS.get(
                    (where, params["operation_type"], params["contract_version"])
                )
                if checker is None:
                    await cur.execute(statements.GET_CONTRACT, _contract_of(params))
                    checker = _checker(where, params, await cur.fetchone())
                _check_contract(checker, params)
            await cur.execute(_statement(params), params)
            row = await cur.fetchone()
    except psycopg.Error as exc:
        _raise_translated(exc, params)
    return _enqueue_result(row)


def get_operation(
    conn: psycopg.Connection[Any], tenant_id: str, operation_type: str, operation_key: str
) -> Operation | None:
    """The persisted state of the operation with this identity, or None if there is none.

    Reads within the caller's transaction, so it sees the caller's own uncommitted enqueue.
    """
    params = {
        "tenant_id": tenant_id,
        "operation_type": operation_type,
        "operation_key": operation_key,
    }
    with conn.cursor(row_factory=kwargs_row(Operation.from_row)) as cur:
        cur.execute(statements.GET_OPERATION, params)
        return cur.fetchone()


async def get_operation_async(
    conn: psycopg.AsyncConnection[Any], tenant_id: str, operation_type: str, operation_key: str
) -> Operation | None:
    """The asyncio twin of :func:`get_operation`."""
    params = {
        "tenant_id": tenant_id,
        "operation_type": operation_type,
        "operation_key": operation_key,
    }
    async with conn.cursor(row_factory=kwargs_row(Operation.from_row)) as cur:
        await cur.execute(statements.GET_OPERATION, params)
        return await cur.fetchone()


_TEXT_FIELDS = (
    "tenant_id",
    "operation_type",
    "operation_key",
    "provider",
    "action",
    "correlation_id",
    "idempotency_key",
    "traceparent",
    "ordering_key",
)


def _enqueue_params(arguments: Mapping[str, Any]) -> Params:
    """The bound parameters of ENQUEUE, after the checks SQL cannot make itself."""
    params = {name: value for name, value in arguments.items() if name != "conn"}
    _from_generated(params)
    version = params["contract_version"]
    if version is not None and (
        not isinstance(version, int) or isinstance(version, bool) or not 1 <= version < 2**31
    ):
        raise InvalidOperation(
            "contract_version", "contract_version must be a whole number from 1 (an integer)"
        )
    if params["traceparent"] is None:
        params["traceparent"] = tracing.current_traceparent()
    for field in _TEXT_FIELDS:
        value = params[field]
        if value is not None and not isinstance(value, str):
            raise InvalidOperation(field, f"{field} must be a string, not {type(value).__name__}")
        if value is not None and "\x00" in value:
            raise InvalidOperation(field, f"{field} must not contain NUL characters")
        if value is not None and not value.isascii() and not _encodable(value):
            # A lone surrogate (undecodable bytes on a command line): no UTF-8 text has it.
            raise InvalidOperation(field, f"{field} must be UTF-8 text")
    params["payload"] = _payload_json(params["payload"])
    return params


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _payload_json(payload: object) -> str:
    """The payload as JSON text, or InvalidOperation saying why it cannot be one."""
    if not isinstance(payload, Mapping):
        raise InvalidOperation(
            "payload", f"payload must be a JSON object (a mapping), not {type(payload).__name__}"
        )
    try:
        try:
            text = _PAYLOAD_ENCODER.encode(payload)
        except TypeError:
            # A decimal.Decimal somewhere, most likely: an amount to be kept exact, which the C
            # encoder could write only by way of a float. The slower exact encoder writes it.
            text = payloads.encode(payload)
            _check_decimals(payload)
            if not text.isascii() and not _encodable(text):
                raise InvalidOperation("payload", _LONE_SURROGATE) from None
    except RecursionError:
        # enqueue refuses more than 64 levels anyway (sql/0019): say so, not a traceback.
        raise InvalidOperation("payload", "payload nests too deep to be written") from None
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidOperation):
            raise
        raise InvalidOperation("payload", f"payload is not valid JSON: {exc}") from None
    if "\\u0000" in text and _ESCAPED_NUL.search(text):  # the regex only where it may match
        raise InvalidOperation("payload", "payload must not contain NUL characters")
    if "\\ud" in text and any(m.group(1) for m in _SURROGATE_ESCAPES.finditer(text)):
        raise InvalidOperation("payload", _LONE_SURROGATE)
    return text


def _check_decimals(payload: Mapping[str, Any]) -> None:
    """InvalidOperation for a Decimal PostgreSQL would refuse as a raw driver error: its jsonb
    cannot hold more than 16,383 digits after the point, and enqueue refuses 1e100 and more
    (outbox.core.payloads.MAX_NUMBER_DIGITS), but only once the cast has let it through. Iterative,
    as the payload has been written already (its depth is no risk to the stack here)."""
    stack: list[Any] = [payload]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, Decimal):
            exponent = item.as_tuple().exponent
            if isinstance(exponent, int) and exponent < -_MAX_FRACTION_DIGITS:
                raise InvalidOperation(
                    "payload",
                    f"payload holds a number with more than {_MAX_FRACTION_DIGITS} digits after "
                    "the decimal point, which PostgreSQL cannot store",
                )
            if item and item.adjusted() >= payloads.MAX_NUMBER_DIGITS:
                raise InvalidOperation(
                    "payload",
                    f"payload holds a number of 1e{payloads.MAX_NUMBER_DIGITS} or more in "
                    f"magnitude; at most {payloads.MAX_NUMBER_DIGITS} digits before the decimal "
                    "point are allowed",
                )


# One encoder for every call: json.dumps builds a new one whenever an argument is not its
# default. allow_nan=False: NaN and Infinity are not JSON, and PostgreSQL would refuse them.
_PAYLOAD_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))
# PostgreSQL text and jsonb cannot hold U+0000, in keys or in values. The encoder writes it as
# \u0000 (ensure_ascii); an even run of backslashes before it is escaped backslashes, not the
# escape. Searching the text the encoder wrote anyway costs less than walking the payload.
_ESCAPED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
# A lone surrogate (U+D800 to U+DFFF without its pair: a str from undecodable bytes) is no
# UTF-8 text. The encoder writes it as \udXXX, which PostgreSQL's jsonb refuses with an error
# whose context quotes the payload into the server's log: refused here instead. Each escape is
# read whole from its backslash (an escaped backslash, a pair, or a lone one: group 1), so an
# escaped backslash before "ud800" is not taken for an escape.
_SURROGATE_ESCAPES = re.compile(
    r"\\(?:\\|ud[89ab][0-9a-f]{2}\\ud[c-f][0-9a-f]{2}|(ud[89a-f][0-9a-f]{2}))"
)
_LONE_SURROGATE = (
    "payload holds a lone surrogate (U+D800 to U+DFFF without its pair), which is not UTF-8 text"
)
# The most digits after the decimal point a PostgreSQL numeric (and so a jsonb number) holds.
_MAX_FRACTION_DIGITS = 16383


def _enqueue_result(row: tuple[Any, ...] | None) -> EnqueueResult:
    if row is None:  # the SQL function always returns one row
        raise RuntimeError("outbox.enqueue returned no row")
    return EnqueueResult(operation_id=row[0], outcome=EnqueueOutcome(row[1]))


def _raise_translated(exc: psycopg.Error, params: Params) -> NoReturn:
    """Re-raise a database error as the public exception it stands for."""
    message = exc.diag.message_primary or str(exc)
    if exc.sqlstate == SQLSTATE_OPERATION_CONFLICT:
        raise OperationConflict(
            message,
            tenant_id=params["tenant_id"],
            operation_type=params["operation_type"],
            operation_key=params["operation_key"],
            field=exc.diag.column_name,
        ) from exc
    if exc.sqlstate == SQLSTATE_CONTRACT_VIOLATION:
        raise ContractViolation(exc.diag.column_name or "contract_version", message) from exc
    if exc.sqlstate == SQLSTATE_INVALID_OPERATION:
        raise InvalidOperation(exc.diag.column_name or "unknown", message) from exc
    raise exc


# Compiled contracts this process has checked payloads against, by database, type and version:
# a published version never changes (sql/0052), so one look-up per process is enough. Bounded:
# a process that met more is emptied and starts again.
log = structlog.get_logger("outbox.producer")
_CHECKERS: dict[tuple[tuple[str, str, str], str, int], Checker] = {}
MAX_CHECKERS: Final = 1024


def _statement(params: Params) -> str:
    """Without a contract's version, the statement every schema since 0051 takes."""
    if params["contract_version"] is None:
        return statements.ENQUEUE
    return statements.ENQUEUE_UNDER_CONTRACT


def _from_generated(params: Params) -> None:
    """A payload of a generated class (``Contracted``) names its type and version itself."""
    payload = params["payload"]
    contract = getattr(type(payload), "CONTRACT", None)
    if contract is None or not callable(getattr(payload, "to_payload", None)):
        return
    kind, version = contract
    if params["operation_type"] != kind:
        raise InvalidOperation(
            "operation_type",
            f"the payload is a {kind}/v{version} but operation_type is "
            f"{params['operation_type']!r}",
        )
    if params["contract_version"] not in (None, version):
        raise InvalidOperation(
            "contract_version",
            f"the payload is a {kind}/v{version} but contract_version is "
            f"{params['contract_version']}",
        )
    params["contract_version"] = version
    params["payload"] = payload.to_payload()


def _database(info: Any) -> tuple[str, str, str]:
    return (str(info.host), str(info.port), str(info.dbname))


def _contract_of(params: Params) -> tuple[str, int]:
    return params["operation_type"], params["contract_version"]


def _checker(
    where: tuple[str, str, str], params: Params, row: tuple[Any, ...] | None
) -> Checker | None:
    """The contract's compiled checker, kept; None when it is not published (enqueue says so)."""
    if row is None:
        return None
    canonical, digest, state = row
    kind, version = _contract_of(params)
    if state == "deprecated":  # once per process and version: the checker is kept
        log.warning(
            "enqueue under a deprecated contract version: move to a newer one before it is "
            "retired (then refused)",
            contract=label(kind, version),
        )
    try:
        checker = checker_for(label(kind, version), digest, canonical)
    except InvalidContract as exc:
        # Published past the bounds (by the SQL function: `outbox contracts push` bounds what
        # it publishes): no payload can be checked against it within the budget.
        raise ContractViolation("contract_version", f"contract {exc}") from None
    if len(_CHECKERS) >= MAX_CHECKERS:
        _CHECKERS.clear()
    _CHECKERS[where, kind, version] = checker
    return checker


def _check_contract(checker: Checker | None, params: Params) -> None:
    """Raise ContractViolation if the payload breaks its contract; checked as stored (the JSON
    text enqueue writes, numbers exact), as the dispatcher and the inbox will check it."""
    if checker is None:
        return  # not published: outbox.enqueue refuses the version itself (OB009)
    found = checker.violation(payloads.decode(params["payload"]))
    if found is not None:
        raise ContractViolation(
            "payload",
            f"the payload breaks contract {checker.label} {found}",
            path=found.path,
            rule=found.rule,
        )

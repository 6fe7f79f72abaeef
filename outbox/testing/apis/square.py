"""Square's Payments API ``POST /v2/payments``, with ``idempotency_key`` in the body.

What Square documents (developer.squareup.com/docs/build-basics/common-api-patterns/idempotency,
the CreatePayment reference, "Retrieve payments", the Sandbox test values): the key is the
required body field ``idempotency_key``, 1 to 45 characters; "the same CreatePayment request
with the same idempotency key" returns the first successful response and takes no second
payment; the same key with a changed request gets an error (``IDEMPOTENCY_KEY_REUSED``). A
payment is ``{"payment": {...}}`` with ``status`` COMPLETED (``autocomplete``, the default),
APPROVED (``autocomplete`` false) or FAILED; errors are ``{"errors": [{"category", "code",
"detail", "field"}]}``. ``GET /v2/payments/{payment_id}`` reads one (404 ``NOT_FOUND``);
``GET /v2/payments`` (ListPayments) filters by time, location, total, card, but not by
``reference_id`` nor by idempotency key: no endpoint finds a payment by either, so a lost
answer is found only by listing and matching ``reference_id`` client-side (eventually
consistent), or by retrying with the same key while Square keeps it.

What this fake assumes where Square is silent: Square publishes no retention for these keys (a
Square engineer said as much on its forum in 2026), so 24 hours is this fake's default; a
request while the first with its key is processed gets 409 ``CONFLICT``; a declined card is
400 with the ``errors`` and the FAILED ``payment``, saved and replayed like a success; a 500
after the payment is transient and the key keeps the real answer; ``GET /v2/payments`` answers
the newest first, at most ``limit`` (100), without cursors. As in the Sandbox, ``source_id``
"cnon:card-nonce-declined" is declined.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any, ClassVar

from outbox.testing.http_api import (
    DAY,
    ApiProfile,
    ApiRequest,
    Applied,
    Context,
    ErrorAfterApply,
    FakeHttpApi,
    KeySpec,
    Route,
)
from outbox.testing.loopback import Headers, Reply

__all__ = ["SQUARE", "FakeSquare", "SquareProfile"]

PAYMENTS = "payments"
DECLINED_NONCE = "cnon:card-nonce-declined"
_MAX_LIMIT = 100
_CATEGORIES = {401: "AUTHENTICATION_ERROR", 429: "RATE_LIMIT_ERROR"}
_CODES = {
    400: "BAD_REQUEST",
    401: "UNAUTHORIZED",
    403: "FORBIDDEN",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    409: "CONFLICT",
    429: "RATE_LIMITED",
    503: "SERVICE_UNAVAILABLE",
}


def _errors(status: int, code: str, detail: str, **extra: Any) -> Reply:
    category = _CATEGORIES.get(status, "API_ERROR" if status >= 500 else "INVALID_REQUEST_ERROR")
    error = {"category": category, "code": code, "detail": detail, **extra}
    return Reply(status, {"errors": [error]})


def _missing(field: str) -> Reply:
    return _errors(400, "MISSING_REQUIRED_PARAMETER", f"Field must be set: {field}", field=field)


def _body_problem(body: Any) -> Reply | None:
    if not isinstance(body, dict) or not isinstance(body.get("source_id"), str):
        return _missing("source_id")
    money = body.get("amount_money")
    if not isinstance(money, dict):
        return _missing("amount_money")
    amount = money.get("amount")
    if not isinstance(amount, int) or isinstance(amount, bool):
        return _errors(400, "INVALID_VALUE", "Invalid amount", field="amount_money.amount")
    if not isinstance(money.get("currency"), str):
        return _missing("amount_money.currency")
    return None


def _status(body: dict[str, Any], armed: str | None) -> str:
    if armed is not None:
        return armed.upper()
    if body["source_id"] == DECLINED_NONCE:
        return "FAILED"
    return "APPROVED" if body.get("autocomplete") is False else "COMPLETED"


_CARD_STATUS = {"COMPLETED": "CAPTURED", "APPROVED": "AUTHORIZED", "FAILED": "FAILED"}


def _payment(ctx: Context, body: dict[str, Any], status: str) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    payment: dict[str, Any] = {
        "id": ctx.store.new_id("sqpay", 17),
        "created_at": now,
        "updated_at": now,
        "amount_money": copy.deepcopy(body["amount_money"]),
        "total_money": copy.deepcopy(body["amount_money"]),
        "status": status,
        "source_type": "CARD",
        "card_details": {"status": _CARD_STATUS[status]},
        "location_id": body.get("location_id", "LFAKE"),
    }
    for name in ("reference_id", "note", "customer_id", "order_id"):
        if name in body:
            payment[name] = body[name]
    return ctx.store.put(PAYMENTS, payment)


def create_payment(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v2/payments: 200 ``{"payment": {...}}``, COMPLETED or APPROVED; a decline is 400
    with ``errors`` (GENERIC_DECLINE) and the FAILED ``payment``."""
    problem = _body_problem(request.body)
    if problem is not None:
        return problem
    payment = _payment(ctx, request.body, _status(request.body, ctx.take_outcome()))
    if payment["status"] != "FAILED":
        return Applied(Reply(200, {"payment": copy.deepcopy(payment)}), payment["id"])
    declined = _errors(400, "GENERIC_DECLINE", "Authorization error: 'GENERIC_DECLINE'")
    declined.body["errors"][0]["category"] = "PAYMENT_METHOD_ERROR"
    declined.body["payment"] = copy.deepcopy(payment)
    return Applied(declined, payment["id"])


def get_payment(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v2/payments/{payment_id}: 200 ``{"payment": {...}}``, or 404 NOT_FOUND."""
    payment_id = request.params["payment_id"]
    payment = ctx.store.get(PAYMENTS, payment_id)
    if payment is None:
        return _errors(404, "NOT_FOUND", f"Could not find payment with id: {payment_id}")
    return Reply(200, {"payment": copy.deepcopy(payment)})


def list_payments(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v2/payments: ``{"payments": [...]}``, newest first (``sort_order`` ASC: oldest)."""
    try:
        limit = int(request.query.get("limit", _MAX_LIMIT))
    except ValueError:
        return _errors(400, "INVALID_VALUE", "Invalid limit", field="limit")
    if not 1 <= limit <= _MAX_LIMIT:
        limit = _MAX_LIMIT  # as Square does: an out-of-range limit gets the default
    payments = ctx.store.all(PAYMENTS)
    if request.query.get("sort_order", "DESC") != "ASC":
        payments.reverse()
    return Reply(200, {"payments": copy.deepcopy(payments[:limit])})


class SquareProfile(ApiProfile):
    """Square's idempotency: see the module's docstring."""

    name: ClassVar[str] = "square"
    key: ClassVar[KeySpec] = KeySpec("idempotency_key", 45, in_body=True)
    retention: ClassVar[float] = DAY
    outcomes: ClassVar[frozenset[str]] = frozenset({"completed", "approved", "failed"})
    replay_headers: ClassVar[Headers] = ()
    error_after_apply: ClassVar[ErrorAfterApply] = ErrorAfterApply.TRANSIENT

    def routes(self) -> tuple[Route, ...]:
        return (
            Route("POST", "/v2/payments", "payments", create_payment, effect=True),
            Route("GET", "/v2/payments", "list_payments", list_payments),
            Route("GET", "/v2/payments/{payment_id}", "get_payment", get_payment),
        )

    def error(self, status: int, message: str) -> Reply:
        code = _CODES.get(status, "INTERNAL_SERVER_ERROR" if status >= 500 else "BAD_REQUEST")
        return _errors(status, code, message)

    def missing_key(self, request: ApiRequest) -> Reply | None:
        body = request.body if isinstance(request.body, dict) else {}
        if body.get("idempotency_key") == "":
            detail = "Field must not be blank"
            return _errors(400, "VALUE_TOO_SHORT", detail, field="idempotency_key")
        return _missing("idempotency_key")

    def bad_key(self, key: str, problem: str) -> Reply:
        detail = f"Field must not be greater than {self.key.max_length} length"
        return _errors(400, "VALUE_TOO_LONG", detail, field="idempotency_key")

    def in_progress(self, request: ApiRequest) -> Reply:
        return _errors(409, "CONFLICT", "A request with this idempotency key is in progress")

    def mismatch(self, request: ApiRequest) -> Reply:
        detail = "The idempotency key can only be retried with the same request data."
        return _errors(400, "IDEMPOTENCY_KEY_REUSED", detail, field="idempotency_key")

    def bad_json(self) -> Reply:
        return _errors(400, "INVALID_REQUEST_ERROR", "Invalid JSON body")


SQUARE = SquareProfile()


class FakeSquare(FakeHttpApi):
    """Square's Payments API on loopback; see ``outbox.testing.apis.square``.

    Outcomes for ``set_outcome``: "completed", "approved", "failed".
    """

    def __init__(self, *, key_retention: float | None = None) -> None:
        super().__init__(SQUARE, key_retention=key_retention)

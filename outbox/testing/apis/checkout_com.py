"""Checkout.com's ``POST /payments``, with ``Cko-Idempotency-Key``, and its lookups.

What Checkout.com documents (checkout.com/docs/payments/manage-payments/idempotency, its
support article on 409s, and "Get a list of payments"): the header is ``Cko-Idempotency-Key``;
keys expire after 24 hours (sandbox and production alike, in the current page); "subsequent
requests with the same key will return the same HTTP status code and response body as the
original request", which is cached only "if the request returns a 2xx response code": after a
4xx or 5xx "no idempotent result is saved and the payment is reattempted"; concurrent requests
with one key get 409 "Conflict with another request being processed" (429 before). A payment
answers 201 (``approved`` true, ``status`` "Authorized"; or ``approved`` false, ``status``
"Declined", still 201) or 202 ``status`` "Pending". ``GET /payments?reference=`` (a beta)
lists the payments with that reference, newest first, as ``{"limit", "skip", "total_count",
"data"}``; the reference is required. ``GET /payments/{id}`` reads one.

What this fake assumes where Checkout.com is silent: no limit on the key's length or
characters is published, so keys up to 255 characters of any kind are accepted and longer
ones get 422 ``idempotency_key_invalid``; the body of a repeat is not compared (the saved
answer is returned); the 409's body; a missing reference is 422 ``reference_required``; an
unknown payment id is 404 with an empty JSON object; a request with ``3ds.enabled`` true is 202
Pending. As in the sandbox, an amount ending in 05 is declined (``response_code`` 20005).
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

__all__ = ["CHECKOUT_COM", "CheckoutComProfile", "FakeCheckoutCom"]

PAYMENTS = "payments"
_ID_WIDTH = 26
_MAX_LIMIT = 100
_RESULTS = {
    "authorized": (201, "Authorized", True, "10000", "Approved"),
    "declined": (201, "Declined", False, "20005", "Declined - Do not honour"),
    "pending": (202, "Pending", False, None, None),
}


def _cko_error(status: int, kind: str, *codes: str) -> Reply:
    body: dict[str, Any] = {"request_id": "req_fake", "error_type": kind}
    if codes:
        body["error_codes"] = list(codes)
    return Reply(status, body)


def _body_problem(body: Any) -> Reply | None:
    if not isinstance(body, dict):
        return _cko_error(422, "request_invalid", "payment_source_required")
    if not isinstance(body.get("currency"), str):
        return _cko_error(422, "request_invalid", "currency_required")
    amount = body.get("amount", 0)
    if not isinstance(amount, int) or isinstance(amount, bool) or amount < 0:
        return _cko_error(422, "request_invalid", "amount_invalid")
    return None


def _outcome(body: dict[str, Any], armed: str | None) -> str:
    if armed is not None:
        return armed
    three_ds = body.get("3ds")
    if isinstance(three_ds, dict) and three_ds.get("enabled") is True:
        return "pending"
    return "declined" if body.get("amount", 0) % 100 == 5 else "authorized"


def _payment(ctx: Context, body: dict[str, Any], outcome: str) -> dict[str, Any]:
    status, state, approved, code, summary = _RESULTS[outcome]
    payment: dict[str, Any] = {
        "id": ctx.store.new_id("pay_", _ID_WIDTH),
        "action_id": ctx.store.new_id("act_", _ID_WIDTH),
        "amount": body.get("amount", 0),
        "currency": body["currency"],
        "approved": approved,
        "status": state,
        "processed_on": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "_links": {},
    }
    if code is not None:
        payment.update(response_code=code, response_summary=summary)
    if "reference" in body:
        payment["reference"] = body["reference"]
    payment["http_status"] = status  # kept for the answer; removed from what is shown
    return ctx.store.put(PAYMENTS, payment)


def _shown(payment: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in payment.items() if k != "http_status"}


def request_payment(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /payments: 201 Authorized or Declined, or 202 Pending."""
    problem = _body_problem(request.body)
    if problem is not None:
        return problem
    payment = _payment(ctx, request.body, _outcome(request.body, ctx.take_outcome()))
    return Applied(Reply(payment["http_status"], _shown(payment)), payment["id"])


def get_payment(ctx: Context, request: ApiRequest) -> Reply:
    """GET /payments/{id}: 200 with the payment, or 404."""
    payment = ctx.store.get(PAYMENTS, request.params["id"])
    return Reply(404, {}) if payment is None else Reply(200, _shown(payment))


def _count(query: dict[str, str], name: str, default: int) -> int | None:
    try:
        value = int(query.get(name, default))
    except ValueError:
        return None
    return value if value >= 0 else None


def list_payments(ctx: Context, request: ApiRequest) -> Reply:
    """GET /payments?reference=&limit=&skip=: the payments with that reference, newest first."""
    reference = request.query.get("reference")
    if not reference:
        return _cko_error(422, "request_invalid", "reference_required")
    limit, skip = _count(request.query, "limit", 10), _count(request.query, "skip", 0)
    if limit is None or skip is None or not 1 <= limit <= _MAX_LIMIT:
        return _cko_error(422, "request_invalid", "paging_invalid")
    found = [p for p in reversed(ctx.store.all(PAYMENTS)) if p.get("reference") == reference]
    page = [_shown(p) for p in found[skip : skip + limit]]
    body = {"limit": limit, "skip": skip, "total_count": len(found), "data": page}
    return Reply(200, body)


class CheckoutComProfile(ApiProfile):
    """Checkout.com's idempotency: see the module's docstring."""

    name: ClassVar[str] = "checkout_com"
    key: ClassVar[KeySpec] = KeySpec("Cko-Idempotency-Key", 255)
    retention: ClassVar[float] = DAY
    outcomes: ClassVar[frozenset[str]] = frozenset(_RESULTS)
    compare_body: ClassVar[bool] = False
    replay_headers: ClassVar[Headers] = ()
    error_after_apply: ClassVar[ErrorAfterApply] = ErrorAfterApply.FORGOTTEN

    def routes(self) -> tuple[Route, ...]:
        return (
            Route("POST", "/payments", "payments", request_payment, effect=True),
            Route("GET", "/payments", "list_payments", list_payments),
            Route("GET", "/payments/{id}", "get_payment", get_payment),
        )

    def error(self, status: int, message: str) -> Reply:
        kinds = {401: "unauthorized", 404: "not_found", 409: "conflict", 429: "too_many_requests"}
        return _cko_error(
            status, kinds.get(status, "request_invalid" if status < 500 else "internal_error")
        )

    def missing_key(self, request: ApiRequest) -> Reply | None:
        return None  # the header is optional: each request without it is a new payment

    def bad_key(self, key: str, problem: str) -> Reply:
        return _cko_error(422, "request_invalid", "idempotency_key_invalid")

    def in_progress(self, request: ApiRequest) -> Reply:
        return _cko_error(409, "conflict", "request_in_progress")

    def server_error(self) -> Reply:
        return _cko_error(500, "internal_error")


CHECKOUT_COM = CheckoutComProfile()


class FakeCheckoutCom(FakeHttpApi):
    """Checkout.com's payments on loopback; see ``outbox.testing.apis.checkout_com``.

    Outcomes for ``set_outcome``: "authorized", "declined", "pending".
    """

    def __init__(self, *, key_retention: float | None = None) -> None:
        super().__init__(CHECKOUT_COM, key_retention=key_retention)

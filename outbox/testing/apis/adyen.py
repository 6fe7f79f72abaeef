"""Adyen's Checkout API ``POST /v71/payments``, with ``Idempotency-Key``.

What Adyen documents (docs.adyen.com/development-resources/api-idempotency): the header is
``Idempotency-Key``, at most 64 characters; keys are kept "for a minimum period of 31 days
after first submission" (older versions of the page said 7 days), per company account; a
request repeating a processed key gets "the response to the first attempt" and the answer
carries the ``Idempotency-Key`` header back; a request whose key's first request is still
being processed gets 422 or 409 with error code 704 "request already processed or in progress"
and the header ``transient-error: true`` (retry later with the same key). Without the header
each request is a new payment. A refusal is a 200 with ``resultCode`` "Refused" and a
``refusalReason``. The Checkout API has no endpoint to read a payment back: outcomes arrive by
webhook, so a lost answer is recovered only by retrying with the same key while it is kept.

What this fake assumes where Adyen is silent: the body of a repeat is not compared (the first
answer is returned); a key longer than 64 characters is 422 ``errorType`` "validation"; a 500
after the payment is transient (``transient-error: true``) and the key keeps the real answer;
the in-progress answer uses 409; validation errors use Adyen's shape with this fake's codes.
For tests, a ``paymentMethod.holderName`` that names a refusal reason (as Adyen's test
environment does) refuses with that reason.
"""

from __future__ import annotations

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

__all__ = ["ADYEN", "AdyenProfile", "FakeAdyen"]

PAYMENTS = "payments"
TRANSIENT: Headers = (("transient-error", "true"),)
# Refusal reasons and their codes (Adyen's "Refusal reasons" table, a few of them).
REFUSALS = {
    "Refused": "2",
    "Acquirer Error": "4",
    "Blocked Card": "5",
    "Expired Card": "6",
    "Not enough balance": "12",
    "CVC Declined": "24",
}
_REQUIRED = ("merchantAccount", "reference", "amount", "paymentMethod")


def _adyen_error(status: int, code: str, message: str, kind: str, headers: Headers = ()) -> Reply:
    body = {"status": status, "errorCode": code, "message": message, "errorType": kind}
    return Reply(status, body, headers)


def _body_problem(body: Any) -> Reply | None:
    if not isinstance(body, dict):
        return _adyen_error(
            422, "702", "Empty input which would have resulted in a null result.", "validation"
        )
    for name in _REQUIRED:
        if name not in body:
            message = f"Required field '{name}' is not provided."
            return _adyen_error(422, "100", message, "validation")
    amount = body["amount"]
    if not isinstance(amount, dict) or not isinstance(amount.get("value"), int):
        return _adyen_error(422, "137", "Invalid amount specified", "validation")
    if not isinstance(amount.get("currency"), str):
        return _adyen_error(422, "138", "Invalid currency specified", "validation")
    return None


def _refusal(body: dict[str, Any], outcome: str | None) -> str | None:
    """The refusal reason, or None when the payment is authorised."""
    if outcome == "refused":
        return "Refused"
    if outcome == "authorised":
        return None
    method = body["paymentMethod"]
    holder = method.get("holderName") if isinstance(method, dict) else None
    return holder if holder in REFUSALS else None


def make_payment(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v71/payments: 200 ``{"pspReference", "resultCode": "Authorised"}`` or
    ``"Refused"`` with ``refusalReason`` and ``refusalReasonCode``."""
    problem = _body_problem(request.body)
    if problem is not None:
        return problem
    body = request.body
    reason = _refusal(body, ctx.take_outcome())
    payment: dict[str, Any] = {
        "id": ctx.store.new_id("PSP", 13),
        "additionalData": {},
        "amount": body["amount"],
        "merchantReference": body["reference"],
        "resultCode": "Authorised" if reason is None else "Refused",
    }
    payment["pspReference"] = payment["id"]
    if reason is not None:
        payment.update(refusalReason=reason, refusalReasonCode=REFUSALS[reason])
    ctx.store.put(PAYMENTS, payment)
    answer = {k: v for k, v in payment.items() if k != "id"}
    return Applied(Reply(200, answer), payment["id"])


class AdyenProfile(ApiProfile):
    """Adyen's idempotency: see the module's docstring."""

    name: ClassVar[str] = "adyen"
    key: ClassVar[KeySpec] = KeySpec("Idempotency-Key", 64)
    retention: ClassVar[float] = 31 * DAY
    outcomes: ClassVar[frozenset[str]] = frozenset({"authorised", "refused"})
    compare_body: ClassVar[bool] = False
    replay_headers: ClassVar[Headers] = ()
    echo_key: ClassVar[bool] = True
    error_after_apply: ClassVar[ErrorAfterApply] = ErrorAfterApply.TRANSIENT

    def routes(self) -> tuple[Route, ...]:
        return (Route("POST", "/v71/payments", "payments", make_payment, effect=True),)

    def error(self, status: int, message: str) -> Reply:
        kind = "internal" if status >= 500 else "validation"
        headers = TRANSIENT if status >= 500 or status == 429 else ()
        return _adyen_error(status, str(status), message, kind, headers)

    def missing_key(self, request: ApiRequest) -> Reply | None:
        return None  # the header is optional: each request without it is a new payment

    def bad_key(self, key: str, problem: str) -> Reply:
        message = "Idempotency-Key must be at most 64 characters"
        return _adyen_error(422, "702", message, "validation")

    def in_progress(self, request: ApiRequest) -> Reply:
        message = "request already processed or in progress"
        return _adyen_error(409, "704", message, "validation", TRANSIENT)

    def server_error(self) -> Reply:
        return _adyen_error(500, "000", "An unknown error occurred", "internal", TRANSIENT)


ADYEN = AdyenProfile()


class FakeAdyen(FakeHttpApi):
    """Adyen's ``POST /v71/payments`` on loopback; see ``outbox.testing.apis.adyen``.

    Outcomes for ``set_outcome``: "authorised", "refused" (refusalReason "Refused").
    """

    def __init__(self, *, key_retention: float | None = None) -> None:
        super().__init__(ADYEN, key_retention=key_retention)

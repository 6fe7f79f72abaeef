"""PayPal Orders v2 and Payments v2 (authorization capture), with ``PayPal-Request-Id``.

What PayPal documents (developer.paypal.com/api/rest/reference/idempotency, the Orders v2 and
Payments v2 references): the header is ``PayPal-Request-Id``, a bare value of 1 to 108
characters of any kind on Orders v2; Orders v2 keeps keys 6 hours (72 on request), Payments v2
capture 45 days. A request repeating a kept key "returns the latest status of the previous
request": 200 OK with the resource as it is now (the first answer was 201). Without the header
PayPal "duplicates the request", except on a create order that carries a ``payment_source``,
where the header is mandatory. Two simultaneous requests with one key: "PayPal processes the
first request and might fail the second": 409 ``PREVIOUS_REQUEST_IN_PROGRESS``.

What this fake assumes where PayPal is silent: a key reused with another body replays the
first request's resource (the body is not compared); a key is scoped to its operation (create,
order capture, authorization capture); a too-long key is 400 ``INVALID_REQUEST`` with issue
``INVALID_STRING_LENGTH``; a declined capture is 422 ``INSTRUMENT_DECLINED`` and applies
nothing; capturing a VOIDED order is 422 ``ORDER_CANNOT_BE_CAPTURED``.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any, ClassVar

from outbox.testing.http_api import (
    DAY,
    HOUR,
    ApiProfile,
    ApiRequest,
    Applied,
    Context,
    ErrorAfterApply,
    FakeHttpApi,
    KeySpec,
    Route,
    Store,
)
from outbox.testing.loopback import Reply

__all__ = ["PAYPAL", "FakePayPal", "PayPalProfile"]

ORDERS = "orders"
AUTHORIZATIONS = "authorizations"
CAPTURES = "captures"
_INTENTS = ("CAPTURE", "AUTHORIZE")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _error(status: int, name: str, issue: str, description: str, **extra: str) -> Reply:
    detail = {"issue": issue, "description": description, **extra}
    return Reply(status, {"name": name, "message": description, "details": [detail], "links": []})


def _unprocessable(issue: str, description: str) -> Reply:
    return _error(422, "UNPROCESSABLE_ENTITY", issue, description)


def _not_found() -> Reply:
    return _error(
        404,
        "RESOURCE_NOT_FOUND",
        "INVALID_RESOURCE_ID",
        "Specified resource ID does not exist. Please check the resource ID and try again.",
    )


def _invalid(issue: str, field: str, description: str) -> Reply:
    return _error(400, "INVALID_REQUEST", issue, description, field=field, location="body")


def _wants_representation(request: ApiRequest) -> bool:
    return "return=representation" in request.headers.get("prefer", "")


def _order_view(order: dict[str, Any], request: ApiRequest, status: int) -> Reply:
    """An order as PayPal answers it: minimal unless ``Prefer: return=representation``."""
    if _wants_representation(request):
        return Reply(status, copy.deepcopy(order))
    return Reply(status, {"id": order["id"], "status": order["status"], "links": []})


# --- orders ---------------------------------------------------------------------------------


def new_order(store: Store, body: dict[str, Any], status: str = "CREATED") -> dict[str, Any]:
    """Store an order made from a create-order body (already validated)."""
    units = [
        {**copy.deepcopy(unit), "reference_id": unit.get("reference_id", "default")}
        for unit in body["purchase_units"]
    ]
    order = {
        "id": store.new_id("ORD", 14),
        "intent": body["intent"],
        "status": status,
        "purchase_units": units,
        "create_time": _now(),
        "links": [],
    }
    return store.put(ORDERS, order)


def _order_body_problem(body: Any) -> Reply | None:
    if not isinstance(body, dict):
        return _invalid("MISSING_REQUIRED_PARAMETER", "/intent", "A required field is missing.")
    if body.get("intent") not in _INTENTS:
        return _invalid("INVALID_PARAMETER_VALUE", "/intent", "The value of a field is invalid.")
    units = body.get("purchase_units")
    if not isinstance(units, list) or not units:
        field = "/purchase_units"
        return _invalid("MISSING_REQUIRED_PARAMETER", field, "A required field is missing.")
    for index, unit in enumerate(units):
        amount = unit.get("amount") if isinstance(unit, dict) else None
        if not isinstance(amount, dict) or not {"currency_code", "value"} <= amount.keys():
            field = f"/purchase_units/{index}/amount"
            return _invalid("MISSING_REQUIRED_PARAMETER", field, "A required field is missing.")
    return None


def create_order(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v2/checkout/orders: 201 with the order, status CREATED (a buyer must approve)."""
    problem = _order_body_problem(request.body)
    if problem is not None:
        return problem
    order = new_order(ctx.store, request.body)
    return Applied(_order_view(order, request, 201), order["id"])


def show_order(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v2/checkout/orders/{id}: 200 with the whole order, or 404."""
    order = ctx.store.get(ORDERS, request.params["id"])
    return _not_found() if order is None else Reply(200, copy.deepcopy(order))


def current_order(store: Store, order_id: str, request: ApiRequest) -> Reply:
    """A replay's answer on Orders v2: 200 with the order as it is now."""
    order = store.get(ORDERS, order_id)
    return _not_found() if order is None else _order_view(order, request, 200)


def current_captured_order(store: Store, order_id: str, request: ApiRequest) -> Reply:
    """A capture replay's answer: 200 with the whole order as it is now, captures included."""
    order = store.get(ORDERS, order_id)
    return _not_found() if order is None else Reply(200, copy.deepcopy(order))


_NOT_CAPTURABLE = {
    "CREATED": ("ORDER_NOT_APPROVED", "Payer has not yet approved the Order for payment."),
    "COMPLETED": (
        "ORDER_ALREADY_CAPTURED",
        "Order already captured. If 'intent=CAPTURE' only one capture per order is allowed.",
    ),
    "VOIDED": ("ORDER_CANNOT_BE_CAPTURED", "The order was voided and cannot be captured."),
}


def _capture_problem(order: dict[str, Any]) -> Reply | None:
    if order["intent"] != "CAPTURE":
        return _unprocessable(
            "ACTION_DOES_NOT_MATCH_INTENT", "Order was created with an intent to 'AUTHORIZE'."
        )
    refusal = _NOT_CAPTURABLE.get(order["status"])
    return None if refusal is None else _unprocessable(*refusal)


def _capture_units(store: Store, order: dict[str, Any], status: str) -> None:
    for unit in order["purchase_units"]:
        capture = {
            "id": store.new_id("CAP", 14),
            "status": status,
            "amount": copy.deepcopy(unit["amount"]),
            "final_capture": True,
            "create_time": _now(),
        }
        for name in ("custom_id", "invoice_id"):
            if name in unit:
                capture[name] = unit[name]
        store.put(CAPTURES, {**capture, "order_id": order["id"]})
        unit["payments"] = {"captures": [capture]}


def capture_order(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v2/checkout/orders/{id}/capture: 201 with the order COMPLETED and its captures
    under ``purchase_units[].payments.captures``; 422 when the order cannot be captured."""
    order = ctx.store.get(ORDERS, request.params["id"])
    if order is None:
        return _not_found()
    problem = _capture_problem(order)
    if problem is not None:
        return problem
    outcome = ctx.take_outcome()
    if outcome == "declined":
        return _unprocessable("INSTRUMENT_DECLINED", "The instrument presented was declined.")
    _capture_units(ctx.store, order, "PENDING" if outcome == "pending" else "COMPLETED")
    order["status"] = "COMPLETED"
    return Applied(Reply(201, copy.deepcopy(order)), order["id"])


# --- authorizations (Payments v2) -----------------------------------------------------------


def capture_authorization(ctx: Context, request: ApiRequest) -> Reply | Applied:
    """POST /v2/payments/authorizations/{id}/capture: 201 with the capture; 422
    ``AUTHORIZATION_ALREADY_CAPTURED`` once a final capture was made."""
    authorization = ctx.store.get(AUTHORIZATIONS, request.params["id"])
    if authorization is None:
        return _not_found()
    if authorization["status"] == "CAPTURED":
        return _unprocessable(
            "AUTHORIZATION_ALREADY_CAPTURED", "Authorization has already been captured."
        )
    body = request.body if isinstance(request.body, dict) else {}
    if ctx.take_outcome() == "declined":
        return _unprocessable("INSTRUMENT_DECLINED", "The instrument presented was declined.")
    capture = {
        "id": ctx.store.new_id("CAP", 14),
        "status": "COMPLETED",
        "amount": copy.deepcopy(body.get("amount", authorization["amount"])),
        "final_capture": body.get("final_capture", True),
        "create_time": _now(),
        "links": [],
    }
    if "invoice_id" in body:
        capture["invoice_id"] = body["invoice_id"]
    ctx.store.put(CAPTURES, {**capture, "authorization_id": authorization["id"]})
    if capture["final_capture"]:
        authorization["status"] = "CAPTURED"
    return Applied(Reply(201, capture), capture["id"])


def current_capture(store: Store, capture_id: str, request: ApiRequest) -> Reply:
    """A replay's answer on Payments v2: 200 with the capture as it is now."""
    capture = store.get(CAPTURES, capture_id)
    if capture is None:
        return _not_found()
    shown = {k: v for k, v in capture.items() if k not in ("order_id", "authorization_id")}
    return Reply(200, copy.deepcopy(shown))


def show_capture(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v2/payments/captures/{id}."""
    return current_capture(ctx.store, request.params["id"], request)


def show_authorization(ctx: Context, request: ApiRequest) -> Reply:
    """GET /v2/payments/authorizations/{id}."""
    authorization = ctx.store.get(AUTHORIZATIONS, request.params["id"])
    return _not_found() if authorization is None else Reply(200, copy.deepcopy(authorization))


# --- the profile ----------------------------------------------------------------------------

_ERROR_NAMES = {
    400: "INVALID_REQUEST",
    401: "AUTHENTICATION_FAILURE",
    403: "NOT_AUTHORIZED",
    404: "RESOURCE_NOT_FOUND",
    405: "METHOD_NOT_SUPPORTED",
    409: "RESOURCE_CONFLICT",
    415: "UNSUPPORTED_MEDIA_TYPE",
    422: "UNPROCESSABLE_ENTITY",
    429: "RATE_LIMIT_REACHED",
}


class PayPalProfile(ApiProfile):
    """PayPal's idempotency: see the module's docstring."""

    name: ClassVar[str] = "paypal"
    key: ClassVar[KeySpec] = KeySpec("PayPal-Request-Id", 108)
    retention: ClassVar[float] = 6 * HOUR
    outcomes: ClassVar[frozenset[str]] = frozenset({"declined", "pending"})
    compare_body: ClassVar[bool] = False
    # Replays answer the resource's current state (each route's ``current``).
    error_after_apply: ClassVar[ErrorAfterApply] = ErrorAfterApply.TRANSIENT

    def routes(self) -> tuple[Route, ...]:
        orders = "/v2/checkout/orders"
        return (
            Route("POST", orders, "create_order", create_order, effect=True, current=current_order),
            Route("GET", orders + "/{id}", "show_order", show_order),
            Route(
                "POST",
                orders + "/{id}/capture",
                "capture_order",
                capture_order,
                effect=True,
                current=current_captured_order,
            ),
            Route(
                "POST",
                "/v2/payments/authorizations/{id}/capture",
                "capture_authorization",
                capture_authorization,
                effect=True,
                retention=45 * DAY,
                max_key_length=10000,
                current=current_capture,
            ),
            Route(
                "GET", "/v2/payments/authorizations/{id}", "show_authorization", show_authorization
            ),
            Route("GET", "/v2/payments/captures/{id}", "show_capture", show_capture),
        )

    def error(self, status: int, message: str) -> Reply:
        name = _ERROR_NAMES.get(status, "INTERNAL_SERVER_ERROR")
        return Reply(status, {"name": name, "message": message, "details": [], "links": []})

    def missing_key(self, request: ApiRequest) -> Reply | None:
        body = request.body if isinstance(request.body, dict) else {}
        if request.path == "/v2/checkout/orders" and "payment_source" in body:
            return _error(
                400,
                "INVALID_REQUEST",
                "PAYPAL_REQUEST_ID_REQUIRED",
                "A PayPal-Request-Id is required if you are trying to process payment for an "
                "Order.",
                field="PayPal-Request-Id",
                location="header",
            )
        return None

    def bad_key(self, key: str, problem: str) -> Reply:
        return _error(
            400,
            "INVALID_REQUEST",
            "INVALID_STRING_LENGTH",
            "The value of a field is either too short or too long.",
            field="PayPal-Request-Id",
            location="header",
        )

    def in_progress(self, request: ApiRequest) -> Reply:
        return _error(
            409,
            "RESOURCE_CONFLICT",
            "PREVIOUS_REQUEST_IN_PROGRESS",
            "A previous request on this resource is currently in progress. Please wait for "
            "sometime and try again. It is best to space out the initial and the subsequent "
            "request(s) to avoid receiving this error.",
        )


PAYPAL = PayPalProfile()


class FakePayPal(FakeHttpApi):
    """PayPal Orders v2 and Payments v2 on loopback; see ``outbox.testing.apis.paypal``.

    Outcomes for ``set_outcome``: "declined" (a capture answers 422 INSTRUMENT_DECLINED and
    applies nothing), "pending" (the capture is made with status PENDING).
    """

    def __init__(self, *, key_retention: float | None = None) -> None:
        super().__init__(PAYPAL, key_retention=key_retention)

    def create_approved_order(
        self,
        value: str = "10.00",
        currency: str = "USD",
        *,
        intent: str = "CAPTURE",
        **unit: Any,
    ) -> str:
        """An order as if created and then approved by a buyer; its id. ``unit`` adds fields
        to its one purchase unit (``reference_id``, ``custom_id``, ``invoice_id``...)."""
        amount = {"currency_code": currency, "value": value}
        body = {"intent": intent, "purchase_units": [{**unit, "amount": amount}]}
        order = self.edit(lambda store: new_order(store, body, "APPROVED"))
        return str(order["id"])

    def set_order_status(self, order_id: str, status: str) -> None:
        """Move an order to ``status`` (CREATED, APPROVED, COMPLETED, VOIDED)."""

        def change(store: Store) -> None:
            order = store.get(ORDERS, order_id)
            if order is None:
                raise KeyError(order_id)
            order["status"] = status

        self.edit(change)

    def create_authorization(self, value: str = "10.00", currency: str = "USD") -> str:
        """An authorized payment (status CREATED) ready to capture; its id."""

        def make(store: Store) -> str:
            amount = {"currency_code": currency, "value": value}
            authorization = {"id": store.new_id("AUTH", 13), "status": "CREATED", "amount": amount}
            return str(store.put(AUTHORIZATIONS, authorization)["id"])

        return self.edit(make)

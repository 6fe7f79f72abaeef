"""The fake Stripe's state changes: what POST /v1/<resource>/<id>/<verb> (and DELETE of a
subscription) does to an object, as Stripe documents it.

Each change either moves the object to its next state, answering the object, or answers 400
``invalid_request_error`` with code ``<object>_unexpected_state`` and leaves it as it was.
The ledger saves either answer under the request's key, as Stripe does once an endpoint began
executing; a decline of a confirmation is a 402 with the PaymentIntent in it, saved too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

# (resource, verb) -> the states it may start from. DELETE of a subscription is verb "cancel";
# POST of the object itself is verb "update".
_FROM: Final[dict[tuple[str, str], frozenset[str]]] = {
    ("payment_intents", "confirm"): frozenset({"requires_confirmation", "requires_payment_method"}),
    ("payment_intents", "capture"): frozenset({"requires_capture"}),
    ("payment_intents", "cancel"): frozenset(
        {
            "requires_payment_method",
            "requires_confirmation",
            "requires_capture",
            "requires_action",
            "processing",
        }
    ),
    ("refunds", "cancel"): frozenset({"pending", "requires_action"}),
    ("invoices", "finalize"): frozenset({"draft"}),
    ("invoices", "pay"): frozenset({"open", "uncollectible"}),
    ("invoices", "void"): frozenset({"open", "uncollectible"}),
    ("subscriptions", "update"): frozenset(
        {"active", "trialing", "past_due", "unpaid", "incomplete", "paused"}
    ),
    ("subscriptions", "cancel"): frozenset(
        {"active", "trialing", "past_due", "unpaid", "incomplete", "paused"}
    ),
}

Confirm = Callable[[dict[str, Any]], dict[str, Any]]


def changes(resource: str, verb: str) -> bool:
    """Whether the fake knows this change."""
    return (resource, verb) in _FROM


def change(
    resource: str, verb: str, obj: dict[str, Any], params: dict[str, Any], confirm: Confirm
) -> tuple[int, dict[str, Any]]:
    """Apply the change to ``obj`` in place; the status and body of the answer."""
    status = obj.get("status")
    if status not in _FROM[(resource, verb)]:
        message = f"You cannot {verb} this {obj['object']} because it has a status of {status}."
        error = {
            "type": "invalid_request_error",
            "code": f"{obj['object']}_unexpected_state",
            "message": message,
        }
        return 400, {"error": error}
    _APPLY[(resource, verb)](obj, params, confirm)
    return 200, obj


def _confirm(obj: dict[str, Any], params: dict[str, Any], confirm: Confirm) -> None:
    method = params.get("payment_method") or obj.get("payment_method")
    asked = {**obj, **params, "payment_method": method, "confirm": "true"}
    obj.update(confirm(asked), payment_method=method)


def _capture(obj: dict[str, Any], params: dict[str, Any], _: Confirm) -> None:
    obj.update(status="succeeded", amount_received=obj.get("amount"))


def _cancel_intent(obj: dict[str, Any], params: dict[str, Any], _: Confirm) -> None:
    obj.update(status="canceled", cancellation_reason=params.get("cancellation_reason"))


def _status(status: str) -> Callable[[dict[str, Any], dict[str, Any], Confirm], None]:
    def apply(obj: dict[str, Any], params: dict[str, Any], _: Confirm) -> None:
        obj["status"] = status

    return apply


def _update(obj: dict[str, Any], params: dict[str, Any], _: Confirm) -> None:
    metadata = params.get("metadata")
    if isinstance(metadata, dict):
        obj["metadata"] = {**obj.get("metadata", {}), **metadata}
    obj.update({k: v for k, v in params.items() if k not in ("metadata", "items")})


_APPLY: Final[dict[tuple[str, str], Callable[[dict[str, Any], dict[str, Any], Confirm], None]]] = {
    ("payment_intents", "confirm"): _confirm,
    ("payment_intents", "capture"): _capture,
    ("payment_intents", "cancel"): _cancel_intent,
    ("refunds", "cancel"): _status("canceled"),
    ("invoices", "finalize"): _status("open"),
    ("invoices", "pay"): _status("paid"),
    ("invoices", "void"): _status("void"),
    ("subscriptions", "update"): _update,
    ("subscriptions", "cancel"): _status("canceled"),
}

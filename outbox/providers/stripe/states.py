"""What the state of a Stripe object means for the operation that created it (issue 19).

The reconciler finds an operation's object by its metadata; finding it is not finding the
effect. A PaymentIntent whose confirmation the issuer declined exists too (Stripe saved the 402
under the key), and marking its operation succeeded would tell the application that an unpaid
charge was paid. Each rule says what the send path would have recorded had it read Stripe's
answer: a 2xx is DONE, a decline REFUSED; a state that only later events decide is UNDECIDED.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

from outbox.providers.base import Verdict

Rule = Callable[[Mapping[str, Any]], Verdict]


def _payment_intent(obj: Mapping[str, Any]) -> Verdict:
    status = obj.get("status")
    if status in ("succeeded", "processing", "requires_capture"):
        return Verdict.DONE
    if status == "canceled":
        return Verdict.REFUSED
    if status == "requires_payment_method" and obj.get("last_payment_error"):
        return Verdict.REFUSED  # a confirmation was declined: no payment happened
    if status in ("requires_payment_method", "requires_confirmation"):
        # Never confirmed: the create asked for no confirmation (one that was asked for either
        # moved the state on or left last_payment_error), and the object is the whole effect.
        return Verdict.DONE
    return Verdict.UNDECIDED  # requires_action (the customer must authenticate), or new words


def _refund(obj: Mapping[str, Any]) -> Verdict:
    status = obj.get("status")
    if status in ("failed", "canceled"):
        return Verdict.REFUSED
    if status in ("succeeded", "pending"):
        return Verdict.DONE
    return Verdict.UNDECIDED  # requires_action


def _payout(obj: Mapping[str, Any]) -> Verdict:
    status = obj.get("status")
    if status in ("failed", "canceled"):
        return Verdict.REFUSED
    if status in ("paid", "pending", "in_transit"):
        return Verdict.DONE
    return Verdict.UNDECIDED


def _subscription(obj: Mapping[str, Any]) -> Verdict:
    status = obj.get("status")
    if status == "incomplete_expired":
        return Verdict.REFUSED  # its first payment failed and it expired
    if status == "incomplete":
        return Verdict.UNDECIDED  # its first payment is still due
    return Verdict.DONE  # active, trialing, past_due, unpaid, canceled, paused: it was made


def _exists(_: Mapping[str, Any]) -> Verdict:
    """Customers, transfers and invoices: the object is the effect, whatever became of it."""
    return Verdict.DONE


def _setup_intent(obj: Mapping[str, Any]) -> Verdict:
    status = obj.get("status")
    if status == "canceled" or (
        status == "requires_payment_method" and obj.get("last_setup_error")
    ):
        return Verdict.REFUSED
    if status in ("succeeded", "processing", "requires_payment_method", "requires_confirmation"):
        return Verdict.DONE
    return Verdict.UNDECIDED  # requires_action


RULES: Final[Mapping[str, Rule]] = {
    "payment_intents.create": _payment_intent,
    "refunds.create": _refund,
    "payouts.create": _payout,
    "subscriptions.create": _subscription,
    "customers.create": _exists,
    "transfers.create": _exists,
    "invoices.create": _exists,
    "setup_intents.create": _setup_intent,
    # A Checkout Session is the effect, whatever the customer did with it since.
    "checkout.sessions.create": _exists,
}

# The parts of an error Stripe left on the object that an operator acts on.
_DETAIL_KEYS: Final = ("type", "code", "decline_code", "advice_code", "message", "charge")


def verdict(action: str, obj: Mapping[str, Any]) -> tuple[Verdict, str | None, dict[str, str]]:
    """The verdict on ``obj``, its status word, and the details of the failure it records."""
    if obj.get("deleted") is True:
        # Found by the event of its creation: a deleted customer was made (sending again would
        # make the one someone removed); a deleted draft invoice never reached its customer.
        decided = Verdict.DONE if action == "customers.create" else Verdict.UNDECIDED
        return decided, "deleted", {}
    rule = RULES.get(action)
    decided = rule(obj) if rule is not None else Verdict.UNDECIDED
    status = obj.get("status")
    state = status if isinstance(status, str) else None
    error = obj.get("last_payment_error") or obj.get("failure_reason") or {}
    if isinstance(error, str):
        error = {"code": error}
    details = {}
    if decided is not Verdict.DONE and isinstance(error, Mapping):
        details = {k: str(error[k]) for k in _DETAIL_KEYS if error.get(k) is not None}
    if decided is Verdict.REFUSED and state == "canceled":
        reason = obj.get("cancellation_reason")
        details.setdefault("code", f"canceled: {reason}" if reason else "canceled")
    return decided, state, details


# A state change is decided by its target's state now (retrieved, never listed): DONE, REFUSED,
# UNDECIDED, or None when the state says the change did not happen (it may be sent again).
ChangeRule = Callable[[Mapping[str, Any]], Verdict | None]


def _states(
    done: tuple[str, ...], refused: tuple[str, ...] = (), not_yet: tuple[str, ...] = ()
) -> ChangeRule:
    def rule(obj: Mapping[str, Any]) -> Verdict | None:
        status = obj.get("status")
        if status in done:
            return Verdict.DONE
        if status in refused:
            return Verdict.REFUSED
        return None if status in not_yet else Verdict.UNDECIDED

    return rule


def _confirmed(obj: Mapping[str, Any]) -> Verdict | None:
    status = obj.get("status")
    if status in ("requires_confirmation", "requires_payment_method") and not obj.get(
        "last_payment_error"
    ):
        return None  # never confirmed
    return _payment_intent(obj)


CHANGE_RULES: Final[Mapping[str, ChangeRule]] = {
    "payment_intents.confirm": _confirmed,
    "payment_intents.capture": _states(("succeeded",), ("canceled",), ("requires_capture",)),
    "payment_intents.cancel": _states(
        ("canceled",),
        ("succeeded",),
        (
            "requires_payment_method",
            "requires_confirmation",
            "requires_capture",
            "requires_action",
            "processing",
        ),
    ),
    "refunds.cancel": _states(
        ("canceled",), ("succeeded", "failed"), ("pending", "requires_action")
    ),
    "invoices.finalize_invoice": _states(("open", "paid", "uncollectible", "void"), (), ("draft",)),
    # An open invoice after a pay may be a payment that failed or one still processing.
    "invoices.pay": _states(("paid",), ("void",), ("draft",)),
    "invoices.void_invoice": _states(("void",), ("paid",), ("open", "uncollectible")),
    # What an update changed cannot be read off the subscription's state: a person decides.
    "subscriptions.update": _states(()),
    "subscriptions.cancel": _states(
        ("canceled",), (), ("active", "trialing", "past_due", "unpaid", "incomplete", "paused")
    ),
}


def change_verdict(
    action: str, obj: Mapping[str, Any]
) -> tuple[Verdict | None, str | None, dict[str, str]]:
    """The verdict on a state change from its target ``obj`` (None: it did not happen), the
    target's status word, and the details of a failure it records."""
    decided = CHANGE_RULES[action](obj)
    status = obj.get("status")
    state = status if isinstance(status, str) else None
    if decided in (None, Verdict.DONE) or obj.get("object") != "payment_intent":
        return decided, state, {}
    return decided, state, verdict("payment_intents.create", obj)[2]  # a decline's codes

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


RULES: Final[Mapping[str, Rule]] = {
    "payment_intents.create": _payment_intent,
    "refunds.create": _refund,
    "payouts.create": _payout,
    "subscriptions.create": _subscription,
    "customers.create": _exists,
    "transfers.create": _exists,
    "invoices.create": _exists,
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

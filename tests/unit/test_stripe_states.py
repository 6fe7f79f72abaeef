"""What a found Stripe object's state means for its operation (outbox/providers/stripe/states.py):
never DONE for an effect that did not happen."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox.providers.base import Verdict
from outbox.providers.stripe.actions import ACTIONS
from outbox.providers.stripe.states import CHANGE_RULES, RULES, verdict

DECLINE = {
    "type": "card_error",
    "code": "card_declined",
    "decline_code": "insufficient_funds",
    "message": "Your card has insufficient funds.",
    "charge": "ch_1",
    "param": None,
}
PI = "payment_intents.create"


@pytest.mark.parametrize(
    ("action", "obj", "expected"),
    [
        (PI, {"status": "succeeded"}, Verdict.DONE),
        (PI, {"status": "processing"}, Verdict.DONE),
        (PI, {"status": "requires_capture"}, Verdict.DONE),
        (PI, {"status": "requires_payment_method", "last_payment_error": None}, Verdict.DONE),
        (PI, {"status": "requires_confirmation"}, Verdict.DONE),
        (PI, {"status": "requires_payment_method", "last_payment_error": DECLINE}, Verdict.REFUSED),
        (PI, {"status": "canceled", "cancellation_reason": "abandoned"}, Verdict.REFUSED),
        (PI, {"status": "requires_action"}, Verdict.UNDECIDED),
        (PI, {"status": "a_status_stripe_adds_next_year"}, Verdict.UNDECIDED),
        (PI, {}, Verdict.UNDECIDED),
        ("refunds.create", {"status": "succeeded"}, Verdict.DONE),
        ("refunds.create", {"status": "pending"}, Verdict.DONE),
        (
            "refunds.create",
            {"status": "failed", "failure_reason": "expired_or_canceled_card"},
            Verdict.REFUSED,
        ),
        ("refunds.create", {"status": "canceled"}, Verdict.REFUSED),
        ("refunds.create", {"status": "requires_action"}, Verdict.UNDECIDED),
        ("payouts.create", {"status": "paid"}, Verdict.DONE),
        ("payouts.create", {"status": "in_transit"}, Verdict.DONE),
        ("payouts.create", {"status": "failed"}, Verdict.REFUSED),
        ("subscriptions.create", {"status": "active"}, Verdict.DONE),
        ("subscriptions.create", {"status": "canceled"}, Verdict.DONE),  # it was made
        ("subscriptions.create", {"status": "incomplete"}, Verdict.UNDECIDED),
        ("subscriptions.create", {"status": "incomplete_expired"}, Verdict.REFUSED),
        ("customers.create", {"deleted": True}, Verdict.DONE),
        ("transfers.create", {"reversed": True}, Verdict.DONE),
        ("invoices.create", {"status": "void"}, Verdict.DONE),
        ("balance.transfer_to_the_moon", {"status": "succeeded"}, Verdict.UNDECIDED),
    ],
)
def test_each_state_gets_the_verdict_the_send_path_would_have_recorded(
    action: str, obj: dict[str, Any], expected: Verdict
) -> None:
    assert verdict(action, obj)[0] is expected


def test_every_action_has_a_rule() -> None:
    """A create by the object it made, a change by its target's state: one rule each."""
    assert set(RULES) | set(CHANGE_RULES) == set(ACTIONS)
    assert not set(RULES) & set(CHANGE_RULES)
    assert set(CHANGE_RULES) == {a for a, act in ACTIONS.items() if act.is_change}


def test_a_decline_carries_its_details_and_a_cancel_its_reason() -> None:
    obj = {"status": "requires_payment_method", "last_payment_error": DECLINE}
    assert verdict(PI, obj) == (
        Verdict.REFUSED,
        "requires_payment_method",
        {
            "type": "card_error",
            "code": "card_declined",
            "decline_code": "insufficient_funds",
            "message": "Your card has insufficient funds.",
            "charge": "ch_1",
        },
    )
    canceled = verdict(PI, {"status": "canceled", "cancellation_reason": "fraudulent"})
    assert canceled == (Verdict.REFUSED, "canceled", {"code": "canceled: fraudulent"})
    failed = verdict("refunds.create", {"status": "failed", "failure_reason": "lost_or_stolen"})
    assert failed == (Verdict.REFUSED, "failed", {"code": "lost_or_stolen"})
    assert verdict(PI, {"status": "succeeded", "last_payment_error": DECLINE})[2] == {}


@given(
    status=st.one_of(st.none(), st.text(max_size=30), st.integers()),
    error=st.one_of(st.none(), st.just(DECLINE), st.text(max_size=5)),
)
def test_a_payment_intent_is_done_only_in_a_state_where_the_payment_happened_or_none_was_asked(
    status: Any, error: Any
) -> None:
    decided, state, _ = verdict(PI, {"status": status, "last_payment_error": error})
    if decided is Verdict.DONE:
        assert status in (
            "succeeded",
            "processing",
            "requires_capture",
            "requires_payment_method",
            "requires_confirmation",
        )
        assert not (status == "requires_payment_method" and error)
    assert state == (status if isinstance(status, str) else None)

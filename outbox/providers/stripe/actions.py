"""The Stripe actions outbox can send, and how each is named, sent and reconciled (issue 19).

A *create* makes a new object: it carries outbox's metadata, and the reconciler finds it by
that metadata in its list, or by the event of its creation (stripe/lookup.py). A *change* acts on
an existing object, its *target*, named by the payload's ``id``: the rest of the payload is the
call's parameters, and the reconciler decides by retrieving the target and reading its state
(states.CHANGE_RULES). There is no "any POST" action: only these calls can be made, and
no payload field becomes the key, the API key or the account (``stripe_account`` is only ever
the Stripe-Account header, where the provider allows it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from outbox.providers.base import InvalidRequest

# The payload field that names a change's target.
TARGET: Final = "id"


@dataclass(frozen=True, slots=True)
class Action:
    service: str  # under StripeClient.v1, dotted: "payment_intents", "checkout.sessions"
    method: str  # the SDK's call: create, capture, finalize_invoice...
    target: str | None = None  # a change's target: the id prefix it must have ("pi")

    @property
    def is_change(self) -> bool:
        return self.target is not None

    def resolve(self, v1: Any) -> Any:
        """The SDK's bound call (its async form) on a client's ``v1``."""
        service = v1
        for part in self.service.split("."):
            service = getattr(service, part)
        return getattr(service, f"{self.method}_async")

    def target_of(self, payload: Mapping[str, Any]) -> str:
        """The target's id, checked; raises InvalidRequest."""
        value = payload.get(TARGET)
        pattern = rf"{self.target}_[A-Za-z0-9]{{1,250}}"
        if not isinstance(value, str) or not re.fullmatch(pattern, value):
            raise InvalidRequest(
                f"the payload's {TARGET} must name the {self.target}_... object this action changes"
            )
        return value


def _create(service: str) -> Action:
    return Action(service, "create")


ACTIONS: Final[Mapping[str, Action]] = {
    "payment_intents.create": _create("payment_intents"),
    "refunds.create": _create("refunds"),
    "customers.create": _create("customers"),
    "transfers.create": _create("transfers"),
    "payouts.create": _create("payouts"),
    "invoices.create": _create("invoices"),
    "subscriptions.create": _create("subscriptions"),
    "setup_intents.create": _create("setup_intents"),
    "checkout.sessions.create": _create("checkout.sessions"),
    "payment_intents.confirm": Action("payment_intents", "confirm", "pi"),
    "payment_intents.capture": Action("payment_intents", "capture", "pi"),
    "payment_intents.cancel": Action("payment_intents", "cancel", "pi"),
    "refunds.cancel": Action("refunds", "cancel", "re"),
    "invoices.finalize_invoice": Action("invoices", "finalize_invoice", "in"),
    "invoices.pay": Action("invoices", "pay", "in"),
    "invoices.void_invoice": Action("invoices", "void_invoice", "in"),
    "subscriptions.update": Action("subscriptions", "update", "sub"),
    "subscriptions.cancel": Action("subscriptions", "cancel", "sub"),
}

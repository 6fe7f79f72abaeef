"""What an operation keeps of Stripe's answer (issue 19, case 6): the JSON Stripe sent, whole, but
for the fields of ``redact_fields`` (a PaymentIntent's client_secret by default)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import stripe
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import ConfigError
from outbox.core.model import FailureClass
from outbox.providers.stripe.provider import REDACTED, classify
from outbox.testing.stripe import FakeStripe
from tests.support.dispatch import dispatcher, rows, stripe_provider


def enqueue(url: str, action: str, payload: dict[str, Any]) -> None:
    with psycopg.connect(url) as conn:
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="billing",
            operation_key=action,
            provider="stripe",
            action=action,
            payload=payload,
        )


def results(url: str) -> dict[str, Any]:
    return dict(
        rows(url, "SELECT action, result FROM outbox.operations WHERE status = 'succeeded'")
    )


async def test_decimal_fields_are_kept_and_the_client_secret_is_not(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    """stripe-python turns *_decimal fields into Decimal, which no JSON encoder writes: the
    result was dropped whole. A client_secret confirms the payment from any browser."""
    enqueue(db_url, "subscriptions.create", {"customer": "cus_1", "items": [{"price": "p_1"}]})
    enqueue(db_url, "payment_intents.create", {"amount": 1000, "currency": "usd"})
    provider = stripe_provider("stripe", fake.url)
    try:
        assert await dispatcher(pool, {"stripe": provider}).run_once() == 2
    finally:
        await provider.aclose()
    kept = results(db_url)
    (item,) = kept["subscriptions.create"]["items"]["data"]
    assert (item["plan"]["amount_decimal"], item["price"]["unit_amount_decimal"]) == (
        "1000.5",
        "1000.5",
    )
    (pi,) = fake.objects("payment_intents")
    assert pi["client_secret"].startswith(pi["id"] + "_secret_")
    assert kept["payment_intents.create"]["client_secret"] == REDACTED
    assert kept["payment_intents.create"]["id"] == pi["id"]
    assert pi["client_secret"] not in str(rows(db_url, "SELECT * FROM outbox.operations"))


async def test_redact_fields_names_more_fields_at_any_depth(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    enqueue(db_url, "subscriptions.create", {"customer": "cus_1", "items": [{"price": "p_1"}]})
    provider = stripe_provider("stripe", fake.url, redact_fields=["customer", "unit_amount"])
    try:
        assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
    finally:
        await provider.aclose()
    kept = results(db_url)["subscriptions.create"]
    assert kept["customer"] == REDACTED
    assert kept["items"]["data"][0]["price"]["unit_amount"] == REDACTED
    assert kept["items"]["data"][0]["price"]["unit_amount_decimal"] == "1000.5"


@pytest.mark.parametrize("bad", ["client_secret", [""], [1], {"a": 1}])
def test_redact_fields_must_be_a_list_of_names(fake: FakeStripe, bad: object) -> None:
    with pytest.raises(ConfigError) as refused:
        stripe_provider("stripe", fake.url, redact_fields=bad)
    assert str(refused.value) == "providers.stripe.redact_fields must be a list of field names"


async def test_a_decline_on_the_send_path_keeps_its_codes_and_its_payment_intent(
    db_url: str, pool: AsyncConnectionPool[Any], fake: FakeStripe
) -> None:
    """Issue 19, case 6: the decline code, the advice code and the PaymentIntent the 402 names
    were thrown away. Quarantined as provider_declined, as a check's refused finding is."""
    enqueue(
        db_url,
        "payment_intents.create",
        {
            "amount": 1000,
            "currency": "usd",
            "confirm": True,
            "payment_method": "pm_card_chargeDeclinedInsufficientFunds",
        },
    )
    provider = stripe_provider("stripe", fake.url)
    try:
        assert await dispatcher(pool, {"stripe": provider}).run_once() == 1
    finally:
        await provider.aclose()
    (pi,) = fake.objects("payment_intents")
    charge = pi["last_payment_error"]["charge"]
    assert rows(
        db_url, "SELECT status, status_reason, provider_ref, last_error FROM outbox.operations"
    ) == [
        (
            "quarantined",
            "provider_declined",
            pi["id"],
            "HTTP 402 card_error card_declined; decline_code insufficient_funds; advice_code "
            f"try_again_later; payment_intent {pi['id']}; charge {charge}",
        )
    ]
    assert "Your card" not in str(rows(db_url, "SELECT * FROM outbox.attempts"))


@pytest.mark.parametrize("hostile", ["\x1b[2J", "a\nb", "x" * 65, "", "🙂", "0; DROP"])
def test_a_hostile_card_error_writes_nothing_of_its_own_into_last_error(hostile: str) -> None:
    """A broken or malicious Stripe answers a 402 whose codes and ids are escapes, newlines or
    floods: they are left out, the decline is still a decline."""
    body = {
        "error": {
            "type": "card_error",
            "code": "card_declined",
            "decline_code": hostile,
            "advice_code": hostile,
            "charge": hostile,
            "payment_intent": {"id": hostile, "object": "payment_intent"},
        }
    }
    exc = stripe.CardError("declined", None, "card_declined", http_status=402, json_body=body)  # type: ignore[no-untyped-call]
    failed = classify(exc)
    assert (failed.failure, failed.reason, failed.reference) == (
        FailureClass.PERMANENT,
        "provider_declined",
        None,
    )
    assert failed.message == "HTTP 402 card_error card_declined"

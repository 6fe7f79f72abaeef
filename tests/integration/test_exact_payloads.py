"""Payloads reach the provider exactly as stored: no float rounding, no big-integer surprises.

Issue 17: ``19.999999999999999999`` reached the receiver as ``20.0``, because payloads passed
through Python floats. The webhook now sends PostgreSQL's own JSON text of the payload, byte for
byte; Stripe gets every number as its exact decimal text in the SDK's form encoding. The numbers
here are generated, stored in PostgreSQL, read back the way the dispatcher reads them
(``payload::text``, decoded by outbox.core.payloads) and sent by the real providers to the fakes,
which say what arrived.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import ProviderSettings
from outbox.core import payloads
from outbox.core.model import FailureClass
from outbox.providers.base import Failed, Provider, SendRequest, Succeeded
from outbox.providers.registry import build_providers
from outbox.testing.stripe import DEFAULT_API_KEY, FakeStripe
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, rows

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

# Numbers as a payment payload may hold them: every digit significant, a point anywhere, and
# within the limits outbox.enqueue keeps (less than 1e100 in magnitude).
decimals = st.builds(
    lambda digits, exponent: Decimal(f"{digits}E{exponent}"),  # exact: no context rounding
    st.integers(-(10**40), 10**40),
    st.integers(-40, 40),
).filter(lambda d: not d or d.adjusted() < payloads.MAX_NUMBER_DIGITS)
integers = st.integers(-(10**60), 10**60)
# Text PostgreSQL keeps: UTF-8 (no lone surrogate) without NUL (enqueue refuses one).
texts = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8)
scalars = st.one_of(decimals, integers, texts, st.booleans(), st.none())
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
    max_leaves=12,
)
objects = st.dictionaries(texts, values, max_size=5)


def request(
    payload: Any, *, stored: str | None = None, action: str = "invoice.paid", key: str = "ob1_exact"
) -> SendRequest:
    return SendRequest(
        operation_id=7,
        tenant_id="acme",
        operation_type="t",
        operation_key=key,
        action=action,
        payload=payload,
        idempotency_key=key,
        correlation_id=None,
        attempt=1,
        payload_json=stored,
    )


def exact(text: bytes | str) -> Any:
    """JSON parsed as a careful payment receiver parses it: decimals as Decimal."""
    return json.loads(text, parse_float=Decimal)


@pytest.fixture(scope="module")
def receiver() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeStripe]:
    with FakeStripe() as f:
        yield f


def webhook(url: str) -> Provider:
    ps = ProviderSettings("hook", "webhook", timeout=timedelta(seconds=5), options={"url": url})
    return build_providers({"hook": ps})["hook"]


def stripe(url: str) -> Provider:
    ps = ProviderSettings(
        "stripe",
        "stripe",
        timeout=timedelta(seconds=5),
        options={"api_key_env": "K", "api_base": url},
    )
    return build_providers({"stripe": ps}, {"K": DEFAULT_API_KEY})["stripe"]


def send(provider: Provider, req: SendRequest) -> Any:
    async def once() -> Any:
        try:
            return await provider.send(req)
        finally:
            await provider.aclose()

    return asyncio.run(once())


# --- the webhook: PostgreSQL's text, byte for byte ------------------------------------------


@PROPERTY
@given(payload=objects)
@example(payload={"n": Decimal("19.999999999999999999"), "amount": 1000})
@example(payload={"tiny": Decimal("1E-7"), "round": Decimal("20.0"), "big": 10**60})
def test_the_webhook_body_is_the_stored_json_text_and_parses_to_the_stored_numbers(
    receiver: FakeWebhookReceiver, db_url: str, payload: dict[str, Any]
) -> None:
    with psycopg.connect(db_url) as conn:
        ((stored,),) = conn.execute("SELECT %s::jsonb::text", (payloads.encode(payload),))
    key = f"ob1_{len(receiver.received)}"
    result = send(webhook(receiver.url), request(payloads.decode(stored), stored=stored, key=key))
    assert isinstance(result, Succeeded), result
    (arrived,) = receiver.received_for(key)
    assert arrived.raw == stored.encode()
    assert arrived.headers["content-type"] == "application/json"
    # Every number as generated (jsonb may rewrite 1E+2 as 100, never its value).
    assert exact(arrived.raw) == payload


@PROPERTY
@given(payload=objects)
def test_a_request_built_without_its_stored_text_is_written_exactly(
    receiver: FakeWebhookReceiver, payload: dict[str, Any]
) -> None:
    key = f"ob1_{len(receiver.received)}"
    result = send(webhook(receiver.url), request(payload, key=key))
    assert isinstance(result, Succeeded), result
    (arrived,) = receiver.received_for(key)
    assert arrived.raw == payloads.encode(payload).encode()
    assert exact(arrived.raw) == payload


async def test_the_issues_payload_arrives_through_the_dispatcher_as_enqueued(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    text = '{"n": 19.999999999999999999, "amount": 1000, "big": 123456789012345678901234567890}'
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "SELECT outbox.enqueue(tenant_id => 'acme', operation_type => 'pay', "
            "operation_key => 'exact-1', provider => 'hook', action => 'pay', "
            "payload => %s::jsonb)",
            (text,),
        )
        ((stored, key),) = conn.execute(
            "SELECT payload::text, idempotency_key FROM outbox.operations"
        ).fetchall()
    hook = webhook(receiver.url)
    try:
        assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    finally:
        await hook.aclose()
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("succeeded",)]
    (arrived,) = receiver.received_for(key)
    assert arrived.raw == stored.encode()
    assert arrived.body == {
        "n": Decimal("19.999999999999999999"),
        "amount": 1000,
        "big": 123456789012345678901234567890,
    }


# --- Stripe: exact decimal text in the form -------------------------------------------------


@PROPERTY
@given(number=st.one_of(decimals, integers))
@example(number=Decimal("1E-7"))
@example(number=Decimal("20.0"))
@example(number=Decimal("19.999999999999999999"))
@example(number=Decimal("1E+2"))
@example(number=Decimal("-0.000"))
def test_every_number_reaches_stripe_as_its_exact_decimal_text(
    fake: FakeStripe, number: Decimal | int
) -> None:
    """Wherever it is: top level, in metadata, in a list of objects, in a list in metadata."""
    text = format(number, "f") if isinstance(number, Decimal) else str(number)
    key = f"ob1_{len(fake.received)}"
    payload = {
        "x": number,
        "metadata": {"rate": number, "list": [number]},
        "items": [{"quantity": number}],
    }
    result = send(stripe(fake.url), request(payload, action="customers.create", key=key))
    assert isinstance(result, Succeeded), result
    (arrived,) = fake.received_for(key)
    params = arrived.params
    assert params["x"] == params["metadata"]["rate"] == params["items"][0]["quantity"] == text
    assert params["metadata"]["list"] == [text]
    assert Decimal(text) == number


@PROPERTY
@given(number=st.floats(allow_nan=False, allow_infinity=False, min_value=-1e99, max_value=1e99))
@example(number=1e-07)
@example(number=1e16)
def test_a_float_from_a_hand_built_request_goes_as_the_plain_text_of_its_repr(
    fake: FakeStripe, number: float
) -> None:
    key = f"ob1_{len(fake.received)}"
    result = send(stripe(fake.url), request({"x": number}, action="customers.create", key=key))
    assert isinstance(result, Succeeded), result
    (arrived,) = fake.received_for(key)
    assert arrived.params["x"] == format(Decimal(repr(number)), "f")
    assert "e" not in arrived.params["x"].lower()


@pytest.mark.parametrize(
    "number",
    [
        Decimal("1E+100"),
        Decimal("-1E+100"),
        Decimal("NaN"),
        Decimal("Infinity"),
        Decimal("1E-16384"),
        10**100,
        float("inf"),
        object(),
    ],
    ids=["1e100", "-1e100", "nan", "infinity", "tiny", "huge-int", "float-inf", "object"],
)
def test_a_number_no_stored_payload_can_hold_is_refused_before_anything_is_sent(
    fake: FakeStripe, number: Any
) -> None:
    key = f"ob1_{len(fake.received)}"
    result = send(
        stripe(fake.url), request({"metadata": {"x": number}}, action="customers.create", key=key)
    )
    assert isinstance(result, Failed) and result.failure is FailureClass.PERMANENT
    assert result.error_class == "unencodable_request"
    assert fake.received_for(key) == []

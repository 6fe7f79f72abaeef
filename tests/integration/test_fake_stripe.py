"""The fake Stripe API keeps the promises the dispatcher's tests rely on.

Every test drives the fake with the real stripe-python SDK over loopback HTTP and counts the
objects it created: Stripe's idempotency rules are the point, so they are checked through the
same client code outbox runs in production.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import requests
import stripe
from stripe.params import PaymentIntentCreateParams

from outbox.testing.stripe import (
    DEFAULT_API_KEY,
    FakeStripe,
    StripeFault,
    mask_api_key,
    parse_form,
)

PARAMS: PaymentIntentCreateParams = {
    "amount": 1000,
    "currency": "usd",
    "metadata": {"outbox_id": "42", "tenant": "acme"},
}
OTHER_PARAMS: PaymentIntentCreateParams = {"amount": 2000, "currency": "usd"}


class Clock:
    """A settable unix clock, so objects get distinct ``created`` values without sleeping."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    with FakeStripe() as running:
        yield running


@contextmanager
def stripe_client(
    fake: FakeStripe,
    *,
    api_key: str = DEFAULT_API_KEY,
    timeout: float = 5.0,
    account: str | None = None,
) -> Iterator[stripe.StripeClient]:
    """A client with no SDK retries; its connections close on exit.

    The session is ours: RequestsClient.close() only closes the calling thread's session.
    """
    with requests.Session() as session:
        yield stripe.StripeClient(
            api_key,
            base_addresses={"api": fake.url},
            http_client=stripe.RequestsClient(timeout=timeout, session=session),
            max_network_retries=0,
            stripe_account=account,
        )


@pytest.fixture
def client(fake: FakeStripe) -> Iterator[stripe.StripeClient]:
    with stripe_client(fake) as running:
        yield running


def create(
    client: stripe.StripeClient, key: str, params: PaymentIntentCreateParams = PARAMS
) -> stripe.PaymentIntent:
    return client.v1.payment_intents.create(params, {"idempotency_key": key})


def header(obj: stripe.StripeObject, name: str) -> str | None:
    response = obj.last_response
    assert response is not None
    return response.headers.get(name)


def error_code(exc: stripe.StripeError) -> str | None:
    """``error.code`` from the body: the SDK sets ``exc.code`` only on card/invalid-request."""
    assert exc.error is not None
    return exc.error.code


# --- creating and reading -------------------------------------------------------------------


def test_create_answers_a_stripe_shaped_object_and_records_the_request(fake: FakeStripe) -> None:
    with stripe_client(fake, account="acct_123") as client:
        pi = create(client, "ob_1")
    assert pi.id.startswith("pi_") and pi.object == "payment_intent"
    assert (pi.amount, pi.currency, pi.livemode) == (1000, "usd", False)
    assert pi.metadata.to_dict() == {"outbox_id": "42", "tenant": "acme"}
    assert isinstance(pi.created, int)
    request_id = header(pi, "Request-Id")
    assert request_id is not None and request_id.startswith("req_")
    assert header(pi, "Idempotent-Replayed") is None
    [received] = fake.received
    assert (received.method, received.path, received.idempotency_key) == (
        "POST",
        "/v1/payment_intents",
        "ob_1",
    )
    assert received.params == {
        "amount": "1000",
        "currency": "usd",
        "metadata": {"outbox_id": "42", "tenant": "acme"},
    }
    assert (received.status, received.replayed, received.account) == (200, False, "acct_123")
    assert received.request_id == request_id
    assert fake.objects() == [pi.to_dict()]


def test_every_resource_gets_its_prefix_and_echoes_nested_params(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    v1 = client.v1
    pi = create(client, "ob_pi")
    made: list[stripe.StripeObject] = [
        v1.customers.create({"email": "a@example.com"}),
        v1.refunds.create({"payment_intent": pi.id, "amount": 500}),
        v1.transfers.create({"amount": 700, "currency": "usd", "destination": "acct_1"}),
        v1.payouts.create({"amount": 900, "currency": "usd"}),
        v1.invoices.create({"customer": "cus_1", "days_until_due": 30}),
        v1.subscriptions.create({"customer": "cus_1", "items": [{"price": "price_1"}]}),
    ]
    prefixes = [(obj["object"], obj["id"].split("_")[0]) for obj in made]
    assert prefixes == [
        ("customer", "cus"),
        ("refund", "re"),
        ("transfer", "tr"),
        ("payout", "po"),
        ("invoice", "in"),
        ("subscription", "sub"),
    ]
    refund = fake.objects("refunds")[0]
    assert (refund["payment_intent"], refund["amount"]) == (pi.id, 500)
    # Items as Stripe answers them: a list object, each with its price and decimal amounts.
    (item,) = fake.objects("subscriptions")[0]["items"]["data"]
    assert (item["object"], item["price"]["id"], item["plan"]["amount_decimal"]) == (
        "subscription_item",
        "price_1",
        "1000.5",
    )
    assert fake.objects("invoices")[0]["days_until_due"] == 30
    assert fake.object_count() == 7


def test_retrieve_finds_objects_and_unknown_ids_are_404(client: stripe.StripeClient) -> None:
    pi = create(client, "ob_1")
    assert client.v1.payment_intents.retrieve(pi.id).to_dict() == pi.to_dict()
    with pytest.raises(stripe.InvalidRequestError) as missing:
        client.v1.payment_intents.retrieve("pi_nope")
    assert (missing.value.http_status, missing.value.code) == (404, "resource_missing")
    with pytest.raises(stripe.InvalidRequestError):
        client.v1.refunds.retrieve(pi.id)  # a PaymentIntent is no refund


def test_list_filters_on_created_and_pages_newest_first() -> None:
    clock = Clock(1_700_000_000)
    with FakeStripe(clock=clock) as fake, stripe_client(fake) as client:
        ids = []
        for n in range(5):
            clock.now = 1_700_000_000 + n
            ids.append(create(client, f"ob_{n}").id)
        since = 1_700_000_002
        first = client.v1.payment_intents.list({"created": {"gte": since}, "limit": 2})
        assert [p.id for p in first] == [ids[4], ids[3]]
        assert first.has_more and first.url == "/v1/payment_intents"
        second = first.next_page()
        assert [p.id for p in second] == [ids[2]] and not second.has_more
        every = client.v1.payment_intents.list({"limit": 2}).auto_paging_iter()
        assert [p.id for p in every] == ids[::-1]
        older = client.v1.payment_intents.list({"created": {"lt": since}})
        assert [p.id for p in older] == [ids[1], ids[0]]
        after = client.v1.payment_intents.list({"starting_after": ids[3], "limit": 1})
        assert [p.id for p in after] == [ids[2]] and after.has_more
        assert fake.received[-1].params == {"starting_after": ids[3], "limit": "1"}


def test_list_rejects_bad_limits_and_filters_on_fields(client: stripe.StripeClient) -> None:
    pi = create(client, "ob_pi")
    refund = client.v1.refunds.create({"payment_intent": pi.id})
    client.v1.refunds.create({"payment_intent": "pi_other"})
    mine = client.v1.refunds.list({"payment_intent": pi.id})
    assert [r.id for r in mine] == [refund.id]
    with pytest.raises(stripe.InvalidRequestError) as too_many:
        client.v1.refunds.list({"limit": 101})
    assert (too_many.value.http_status, too_many.value.param) == (400, "limit")


def test_objects_with_metadata_finds_what_outbox_tagged(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    tagged = create(client, "ob_1")
    create(client, "ob_2", {"amount": 1, "currency": "usd", "metadata": {"outbox_id": "43"}})
    client.v1.customers.create({"metadata": {"outbox_id": "42"}})
    found = fake.objects_with_metadata("outbox_id", "42")
    assert [o["object"] for o in found] == ["payment_intent", "customer"]
    assert found[0]["id"] == tagged.id
    assert fake.objects_with_metadata("outbox_id", "44") == []


# --- idempotency ----------------------------------------------------------------------------


def test_same_key_and_params_replays_the_saved_answer(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    first = create(client, "ob_1")
    again = create(client, "ob_1")
    assert again.id == first.id and again.to_dict() == first.to_dict()
    assert header(again, "Idempotent-Replayed") == "true"
    assert header(again, "Original-Request") == header(first, "Request-Id")
    assert header(again, "Request-Id") != header(first, "Request-Id")
    assert fake.object_count() == 1
    assert [r.replayed for r in fake.received_for("ob_1")] == [False, True]


def test_same_key_with_other_params_is_an_idempotency_error(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    create(client, "ob_1")
    with pytest.raises(stripe.IdempotencyError) as conflict:
        create(client, "ob_1", OTHER_PARAMS)
    error = conflict.value
    assert error.http_status == 400 and error.error is not None
    assert error.error.type == "idempotency_error"
    assert "same parameters" in (error.user_message or "")
    assert error.request_id == fake.received[-1].request_id
    with pytest.raises(stripe.IdempotencyError, match="same endpoint"):
        client.v1.customers.create({"email": "a@example.com"}, {"idempotency_key": "ob_1"})
    assert fake.object_count() == 1


def test_a_key_still_executing_gets_409_and_is_not_saved_twice(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    def create_elsewhere() -> str:
        with stripe_client(fake) as other:
            return create(other, "ob_1").id

    with fake.hold("ob_1") as held, ThreadPoolExecutor(1) as pool:
        first = pool.submit(create_elsewhere)
        assert held.arrived.wait(5)
        with pytest.raises(stripe.APIError) as busy:
            create(client, "ob_1")
        held.release()
        first_id = first.result(5)
    error = busy.value
    assert error.http_status == 409 and error_code(error) == "idempotency_key_in_use"
    assert error.headers is not None and error.headers["Stripe-Should-Retry"] == "true"
    assert create(client, "ob_1").id == first_id  # completed now: a replay
    assert fake.object_count() == 1


def test_forgotten_keys_create_a_second_object(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    first = create(client, "ob_1")
    fake.forget_keys()
    second = create(client, "ob_1")
    assert second.id != first.id and header(second, "Idempotent-Replayed") is None
    assert fake.object_count() == 2


def test_keys_are_pruned_after_their_retention() -> None:
    with FakeStripe(key_retention=0.0) as fake, stripe_client(fake) as client:
        create(client, "ob_1")
        create(client, "ob_1")
        assert fake.object_count() == 2


# --- errors that are not saved --------------------------------------------------------------


def test_validation_errors_are_not_saved(fake: FakeStripe, client: stripe.StripeClient) -> None:
    with pytest.raises(stripe.InvalidRequestError) as missing:
        create(client, "ob_1", {"amount": 1000})  # type: ignore[typeddict-item]
    assert (missing.value.param, missing.value.code) == ("currency", "parameter_missing")
    with pytest.raises(stripe.InvalidRequestError) as negative:
        create(client, "ob_1", {"amount": -5, "currency": "usd"})
    assert negative.value.param == "amount"
    create(client, "ob_1")  # other params, same key: executes, no idempotency_error
    assert fake.object_count() == 1


def test_a_429_is_not_saved_and_the_retry_creates_one_object(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    fake.inject(StripeFault.status(429, error_type="invalid_request_error", code_str="rate_limit"))
    with pytest.raises(stripe.RateLimitError) as limited:
        create(client, "ob_1")
    assert limited.value.http_status == 429 and error_code(limited.value) == "rate_limit"
    assert limited.value.headers is not None
    assert limited.value.headers["Stripe-Should-Retry"] == "true"
    assert fake.object_count() == 0
    pi = create(client, "ob_1")
    assert header(pi, "Idempotent-Replayed") is None
    assert fake.object_count() == 1


def test_a_confirmed_create_declined_by_the_issuer_leaves_the_object_and_saves_the_402(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    """As Stripe does: the request executed, so the PaymentIntent exists (requires_payment_method,
    last_payment_error set) and the 402 is the key's saved answer; a retry replays it."""
    declined_params: Any = {**PARAMS, "confirm": True, "payment_method": "pm_card_chargeDeclined"}
    answers = []
    for _ in range(2):
        with pytest.raises(stripe.CardError) as declined:
            create(client, "ob_1", declined_params)
        answers.append(declined.value)
    first, replay = answers
    assert (first.http_status, first.code) == (402, "card_declined")
    assert first.error is not None and first.error.payment_intent is not None
    pi = first.error.payment_intent
    assert pi.status == "requires_payment_method" and pi.last_payment_error is not None
    assert pi.last_payment_error.decline_code == "generic_decline"
    assert replay.headers is not None and replay.headers.get("Idempotent-Replayed") == "true"
    assert [o["id"] for o in fake.objects("payment_intents")] == [pi.id]
    paid = create(client, "ob_2", {**PARAMS, "confirm": True, "payment_method": "pm_card_visa"})
    held = create(
        client,
        "ob_3",
        {**PARAMS, "confirm": True, "payment_method": "pm_card_visa", "capture_method": "manual"},
    )
    unconfirmed = create(client, "ob_4", {**PARAMS, "payment_method": "pm_card_visa"})
    assert [paid.status, held.status, unconfirmed.status, create(client, "ob_5").status] == [
        "succeeded",
        "requires_capture",
        "requires_confirmation",
        "requires_payment_method",
    ]


def test_an_injected_402_is_refused_before_execution_and_not_saved(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    fault = StripeFault.status(402, error_type="card_error", code_str="card_declined")
    fake.inject(fault, key="ob_1")
    create(client, "ob_other")  # another key: the fault waits for ob_1
    with pytest.raises(stripe.CardError) as declined:
        create(client, "ob_1")
    assert (declined.value.http_status, declined.value.code) == (402, "card_declined")
    create(client, "ob_1")
    assert fake.object_count() == 2


@pytest.mark.parametrize(
    ("status", "error_type", "expected", "should_retry"),
    [
        (400, "invalid_request_error", stripe.InvalidRequestError, None),
        (401, "invalid_request_error", stripe.AuthenticationError, None),
        (403, "invalid_request_error", stripe.PermissionError, None),
        (503, "api_error", stripe.APIError, "true"),
    ],
)
def test_injected_statuses_map_to_the_sdk_exceptions(
    fake: FakeStripe,
    client: stripe.StripeClient,
    status: int,
    error_type: str,
    expected: type[stripe.StripeError],
    should_retry: str | None,
) -> None:
    fake.inject(StripeFault.status(status, error_type=error_type, retry_after=2), times=2)
    for _ in range(2):
        with pytest.raises(expected) as failed:
            create(client, "ob_1")
    headers = failed.value.headers or {}
    assert (failed.value.http_status, headers.get("Stripe-Should-Retry")) == (status, should_retry)
    assert headers["Retry-After"] == "2"
    create(client, "ob_1")
    assert fake.object_count() == 1


def test_a_wrong_key_gets_a_masked_401_until_the_key_is_rotated(fake: FakeStripe) -> None:
    wrong = "sk_test_rotatedKey9876"
    with stripe_client(fake, api_key=wrong) as client:
        with pytest.raises(stripe.AuthenticationError) as denied:
            create(client, "ob_1")
        message = denied.value.user_message or ""
        assert "sk_test_****9876" in message and wrong not in message
        assert wrong not in (denied.value.http_body or "")
        fake.set_api_key(wrong)
        create(client, "ob_1")  # the 401 was not saved under ob_1
    assert fake.api_key == wrong and fake.object_count() == 1
    assert mask_api_key("sk_live_abc") == "sk_live_****"


# --- faults after execution began -----------------------------------------------------------


def test_a_500_after_apply_is_saved_and_the_object_exists(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    fake.inject(StripeFault.error_500_after_apply())
    for replayed in (None, "true"):
        with pytest.raises(stripe.APIError) as failed:
            create(client, "ob_1")
        assert failed.value.http_status == 500 and failed.value.headers is not None
        assert failed.value.headers.get("Idempotent-Replayed") == replayed
        assert "Stripe-Should-Retry" not in failed.value.headers
    [obj] = fake.objects("payment_intents")
    assert [p.id for p in client.v1.payment_intents.list()] == [obj["id"]]


def test_a_500_before_apply_is_saved_and_nothing_exists(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    fake.inject(StripeFault.error_500_before_apply())
    for _ in range(2):
        with pytest.raises(stripe.APIError) as failed:
            create(client, "ob_1")
        assert failed.value.http_status == 500
    assert [r.replayed for r in fake.received] == [False, True]
    assert fake.object_count() == 0


def test_a_timeout_after_apply_then_a_retry_replays(fake: FakeStripe) -> None:
    fake.inject(StripeFault.delay_after_apply(2.0))
    with stripe_client(fake, timeout=0.2) as impatient:
        with pytest.raises(stripe.APIConnectionError) as timed_out:
            create(impatient, "ob_1")
        assert timed_out.value.should_retry
    with stripe_client(fake) as client:
        pi = create(client, "ob_1")
    assert header(pi, "Idempotent-Replayed") == "true"
    assert [o["id"] for o in fake.objects()] == [pi.id]


@pytest.mark.parametrize(
    ("fault", "objects"),
    [(StripeFault.reset_before_apply(), 0), (StripeFault.reset_after_apply(), 1)],
)
def test_a_reset_connection_is_a_connection_error(
    fake: FakeStripe, client: stripe.StripeClient, fault: StripeFault, objects: int
) -> None:
    fake.inject(fault)
    with pytest.raises(stripe.APIConnectionError):
        create(client, "ob_1")
    assert fake.received[0].status is None and fake.object_count() == objects
    pi = create(client, "ob_1")
    assert header(pi, "Idempotent-Replayed") == ("true" if objects else None)
    assert fake.object_count() == 1


def test_refused_connections_recover_on_the_same_port(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    create(client, "ob_1")
    port = fake.port
    fake.refuse_connections()
    with pytest.raises(stripe.APIConnectionError):
        create(client, "ob_2")
    fake.accept_connections()
    create(client, "ob_2")
    assert fake.port == port and fake.object_count() == 2


# --- async ----------------------------------------------------------------------------------


# stripe-python 16's HTTPXClient posts the encoded form as `data=<str>`, which httpx 0.28
# deprecates; under `filterwarnings = error` the warning would become an APIConnectionError.
@pytest.mark.filterwarnings("ignore:Use 'content=<...>' to upload raw:DeprecationWarning")
async def test_the_async_client_gets_the_same_semantics(fake: FakeStripe) -> None:
    http = stripe.HTTPXClient(timeout=5.0)
    client = stripe.StripeClient(
        DEFAULT_API_KEY, base_addresses={"api": fake.url}, http_client=http, max_network_retries=0
    )
    try:
        first = await client.v1.payment_intents.create_async(PARAMS, {"idempotency_key": "ob_1"})
        again = await client.v1.payment_intents.create_async(PARAMS, {"idempotency_key": "ob_1"})
    finally:
        await http.close_async()  # type: ignore[no-untyped-call]  # the SDK leaves it untyped
    assert again.id == first.id and header(again, "Idempotent-Replayed") == "true"
    assert fake.object_count() == 1


# --- the wire format ------------------------------------------------------------------------


def test_parse_form_undoes_the_sdk_encoding() -> None:
    form = "a=1&metadata[0]=x&metadata[k]=&items[0][price]=p&items[1][price]=q&expand[]=c"
    assert parse_form(form) == {
        "a": "1",
        "metadata": {"0": "x", "k": ""},
        "items": [{"price": "p"}, {"price": "q"}],
        "expand": ["c"],
    }


# --- bad answers ----------------------------------------------------------------------------


def test_a_bad_answer_still_creates_one_object_and_the_replay_is_the_saved_one(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    """The SDK (requests) reads the whole bomb here: 8 MiB, decoded by requests itself."""
    fake.inject(StripeFault.gzip_bomb_after_apply(8 << 20))
    bombed = create(client, "ob_1")
    (obj,) = fake.objects()
    assert bombed.id == obj["id"]  # the padding is whitespace: the JSON is the object
    assert header(bombed, "Content-Encoding") == "gzip"
    again = create(client, "ob_1")
    assert again.id == obj["id"] and header(again, "Idempotent-Replayed") == "true"
    assert fake.object_count() == 1


def test_a_raw_answer_replaces_the_object_on_the_wire_only(
    fake: FakeStripe, client: stripe.StripeClient
) -> None:
    fake.inject(StripeFault.raw_answer_after_apply(b"<html>oops</html>"))
    with pytest.raises(stripe.APIError) as caught:
        create(client, "ob_1")
    assert caught.value.http_status == 200
    assert fake.object_count() == 1
    assert create(client, "ob_1").id == fake.objects()[0]["id"]

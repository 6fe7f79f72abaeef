"""The loopback fakes of PayPal, Adyen, Checkout.com, Square and a generic internal service keep
the idempotency promises (and break them where the real API does) that outbox's http provider
is tested against.

Every test talks real HTTP with httpx to a fake on loopback and counts the effects it applied.
The first part runs the same checks against all five, from a table of what each API answers;
the rest checks what is particular to each.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import httpx
import pytest

from outbox.testing.apis import (
    FakeAdyen,
    FakeCheckoutCom,
    FakeEffectsService,
    FakePayPal,
    FakeSquare,
)
from outbox.testing.http_api import DAY, HOUR, ApiFault, ErrorAfterApply, FakeHttpApi

SAVED, TRANSIENT, FORGOTTEN = (
    ErrorAfterApply.SAVED,
    ErrorAfterApply.TRANSIENT,
    ErrorAfterApply.FORGOTTEN,
)
ORDER: dict[str, Any] = {
    "intent": "CAPTURE",
    "purchase_units": [{"amount": {"currency_code": "USD", "value": "10.00"}}],
}
ADYEN_PAYMENT: dict[str, Any] = {
    "merchantAccount": "TestMerchant",
    "reference": "ob1_ref",
    "amount": {"value": 1000, "currency": "EUR"},
    "paymentMethod": {"type": "scheme", "encryptedCardNumber": "test_4111111111111111"},
}
CKO_PAYMENT: dict[str, Any] = {
    "source": {"type": "token", "token": "tok_test"},
    "amount": 1000,
    "currency": "USD",
    "reference": "ob1_ref",
}
SQUARE_PAYMENT: dict[str, Any] = {
    "source_id": "cnon:card-nonce-ok",
    "amount_money": {"amount": 1000, "currency": "USD"},
    "reference_id": "ob1_ref",
}
EFFECT: dict[str, Any] = {"kind": "email", "to": "a@example.com"}


def _other(body: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    return {**body, name: value}


@dataclass(frozen=True)
class Api:
    """What one fake answers to the requests every API has in common."""

    id: str
    make: Callable[..., FakeHttpApi]
    path: str
    body: dict[str, Any]
    other: dict[str, Any]
    created: int  # the first answer's status
    replay: int  # a replay's status
    replay_header: bool  # whether a replay says Idempotent-Replayed: true
    mismatch: int | None  # another body under the key (None: not compared, a replay)
    in_progress: int
    max_key: int
    too_long: int
    missing: int | None  # no key (None: applied, unprotected)
    after_500: ErrorAfterApply
    header: str = "Idempotency-Key"
    key_field: str | None = None  # the body field that carries the key
    quoted: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def post(
        self,
        client: httpx.Client,
        fake: FakeHttpApi,
        key: str | None,
        body: dict[str, Any] | None = None,
    ) -> httpx.Response:
        payload = dict(self.body if body is None else body)
        headers = dict(self.extra)
        if key is not None and self.key_field is not None:
            payload[self.key_field] = key
        elif key is not None:
            headers[self.header] = f'"{key}"' if self.quoted else key
        return client.post(fake.url + self.path, json=payload, headers=headers)


APIS = [
    Api(
        "paypal",
        FakePayPal,
        "/v2/checkout/orders",
        ORDER,
        _other(ORDER, "intent", "AUTHORIZE"),
        created=201,
        replay=200,
        replay_header=False,
        mismatch=None,
        in_progress=409,
        max_key=108,
        too_long=400,
        missing=None,
        after_500=TRANSIENT,
        header="PayPal-Request-Id",
    ),
    Api(
        "adyen",
        FakeAdyen,
        "/v71/payments",
        ADYEN_PAYMENT,
        _other(ADYEN_PAYMENT, "reference", "another"),
        created=200,
        replay=200,
        replay_header=False,
        mismatch=None,
        in_progress=409,
        max_key=64,
        too_long=422,
        missing=None,
        after_500=TRANSIENT,
    ),
    Api(
        "checkout_com",
        FakeCheckoutCom,
        "/payments",
        CKO_PAYMENT,
        _other(CKO_PAYMENT, "amount", 999),
        created=201,
        replay=201,
        replay_header=False,
        mismatch=None,
        in_progress=409,
        max_key=255,
        too_long=422,
        missing=None,
        after_500=FORGOTTEN,
        header="Cko-Idempotency-Key",
    ),
    Api(
        "square",
        FakeSquare,
        "/v2/payments",
        SQUARE_PAYMENT,
        _other(SQUARE_PAYMENT, "amount_money", {"amount": 999, "currency": "USD"}),
        created=200,
        replay=200,
        replay_header=False,
        mismatch=400,
        in_progress=409,
        max_key=45,
        too_long=400,
        missing=400,
        after_500=TRANSIENT,
        key_field="idempotency_key",
    ),
    Api(
        "effects",
        FakeEffectsService,
        "/v1/effects",
        EFFECT,
        _other(EFFECT, "to", "b@example.com"),
        created=201,
        replay=201,
        replay_header=True,
        mismatch=422,
        in_progress=409,
        max_key=255,
        too_long=400,
        missing=400,
        after_500=SAVED,
        quoted=True,
    ),
]


@pytest.fixture(params=APIS, ids=lambda api: api.id)
def api(request: pytest.FixtureRequest) -> Api:
    chosen: Api = request.param
    return chosen


@pytest.fixture
def fake(api: Api) -> Iterator[FakeHttpApi]:
    with api.make() as running:
        yield running


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


def statuses(fake: FakeHttpApi) -> list[int | None]:
    return [r.status for r in fake.received]


# --- every API ------------------------------------------------------------------------------


def test_the_url_is_the_bare_base(fake: FakeHttpApi) -> None:
    assert fake.url == f"http://127.0.0.1:{fake.port}"


def test_a_replay_converges_on_one_effect(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    first = api.post(client, fake, "ob1_a")
    again = api.post(client, fake, "ob1_a")
    assert first.status_code == api.created
    assert again.status_code == api.replay
    assert again.json() == first.json() or api.id == "paypal"  # PayPal: the current state
    assert ("idempotent-replayed" in again.headers) is api.replay_header
    assert "idempotent-replayed" not in first.headers
    assert fake.effect_count("ob1_a") == 1
    assert [r.replayed for r in fake.received] == [False, True]


def test_each_key_gets_its_own_effect(api: Api, fake: FakeHttpApi, client: httpx.Client) -> None:
    assert api.post(client, fake, "k1").status_code == api.created
    assert api.post(client, fake, "k2").status_code == api.created
    assert fake.effect_count() == 2
    assert len({e.effect_id for e in fake.effects}) == 2
    assert [e.key for e in fake.effects_for("k2")] == ["k2"]


def test_another_body_under_the_key_is_refused_or_replayed(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    first = api.post(client, fake, "k1")
    other = api.post(client, fake, "k1", api.other)
    if api.mismatch is None:  # the API does not compare: the first request's answer
        assert other.status_code == api.replay
        assert fake.received[-1].replayed
    else:
        assert other.status_code == api.mismatch
        assert not fake.received[-1].replayed
    assert first.status_code == api.created
    assert fake.effect_count() == 1


def test_a_request_while_the_first_is_held_gets_the_in_progress_answer(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    with fake.hold("k1") as hold, ThreadPoolExecutor(1) as pool:
        first = pool.submit(api.post, client, fake, "k1")
        assert hold.arrived.wait(5)
        assert fake.effect_count("k1") == 1  # applied before the answer
        with httpx.Client(timeout=5.0) as other:
            during = api.post(other, fake, "k1")
        assert during.status_code == api.in_progress
        assert fake.received[0].status is None  # the held request has no answer yet
        hold.release()
        assert first.result(5).status_code == api.created
    assert fake.effect_count() == 1
    assert statuses(fake) == [api.created, api.in_progress]


def test_forgotten_keys_apply_a_second_effect(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    api.post(client, fake, "k1")
    fake.forget_keys()
    again = api.post(client, fake, "k1")
    assert again.status_code == api.created
    assert not fake.received[-1].replayed
    assert fake.effect_count("k1") == 2  # the hazard outbox must handle


def test_keys_expire_after_key_retention(api: Api, client: httpx.Client) -> None:
    with api.make(key_retention=0.05) as fake:
        api.post(client, fake, "k1")
        assert api.post(client, fake, "k1").status_code == api.replay
        time.sleep(0.1)
        assert api.post(client, fake, "k1").status_code == api.created
        assert fake.effect_count("k1") == 2


def test_a_key_of_the_longest_length_is_accepted_and_a_longer_one_refused(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    longest = "k" * api.max_key
    assert api.post(client, fake, longest).status_code == api.created
    refused = api.post(client, fake, longest + "k")
    assert refused.status_code == api.too_long
    assert fake.effect_count() == 1
    assert fake.received[-1].key == longest + "k"


def test_a_missing_key_is_refused_or_unprotected(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    first = api.post(client, fake, None)
    second = api.post(client, fake, None)
    if api.missing is None:
        assert (first.status_code, second.status_code) == (api.created, api.created)
        assert fake.effect_count() == 2  # each request is a new effect
        assert [e.key for e in fake.effects] == [None, None]
    else:
        assert (first.status_code, second.status_code) == (api.missing, api.missing)
        assert fake.effect_count() == 0


def test_every_request_is_recorded(api: Api, fake: FakeHttpApi, client: httpx.Client) -> None:
    api.post(client, fake, "ob1_rec")
    [call] = fake.received
    assert (call.method, call.path, call.key, call.status) == (
        "POST",
        api.path,
        "ob1_rec",
        api.created,
    )
    assert call.route is not None
    if api.key_field is None:
        assert call.raw_key == call.headers[api.header.lower()]
        assert call.raw_key == ('"ob1_rec"' if api.quoted else "ob1_rec")
    assert call.body == {**api.body, **({api.key_field: "ob1_rec"} if api.key_field else {})}
    assert json.loads(call.raw) == call.body
    assert call.answered_at is not None and call.answered_at >= call.at
    assert fake.received_for("ob1_rec") == [call]
    [effect] = fake.wait_for_effects(1)
    assert (effect.key, effect.status, effect.route) == ("ob1_rec", api.created, call.route)


def test_an_unknown_route_is_404_and_a_wrong_method_405(
    fake: FakeHttpApi, client: httpx.Client
) -> None:
    assert client.get(fake.url + "/nowhere").status_code == 404
    path = next(r.pattern for r in fake.profile.routes() if "{" not in r.pattern)
    assert client.put(fake.url + path, json={}).status_code == 405
    assert fake.effect_count() == 0
    assert [r.route for r in fake.received] == [None, None]


def test_a_body_that_is_not_json_is_400(api: Api, fake: FakeHttpApi, client: httpx.Client) -> None:
    response = client.post(fake.url + api.path, content=b"{nope", headers={api.header: "k1"})
    assert response.status_code == 400
    assert fake.received[0].body == "{nope"
    assert fake.effect_count() == 0


# --- faults ---------------------------------------------------------------------------------


def test_a_status_before_apply_applies_nothing(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.status(503, retry_after=2), key="k1")
    refused = api.post(client, fake, "k1")
    assert (refused.status_code, refused.headers["retry-after"]) == (503, "2")
    assert fake.effect_count() == 0
    assert api.post(client, fake, "k1").status_code == api.created
    assert fake.effect_count() == 1


def test_a_reset_before_apply_applies_nothing(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.reset_before_apply())
    with pytest.raises(httpx.TransportError):
        api.post(client, fake, "k1")
    assert fake.effect_count() == 0
    assert fake.received[0].status is None
    assert api.post(client, fake, "k1").status_code == api.created


def test_a_reset_after_apply_leaves_one_effect_and_a_replay(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.reset_after_apply())
    with pytest.raises(httpx.TransportError):
        api.post(client, fake, "k1")
    assert fake.effect_count("k1") == 1
    assert api.post(client, fake, "k1").status_code == api.replay
    assert fake.effect_count("k1") == 1


def test_a_500_after_apply_leaves_what_the_api_keeps(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.error_500_after_apply())
    assert api.post(client, fake, "k1").status_code == 500
    again = api.post(client, fake, "k1")
    if api.after_500 is SAVED:
        assert again.status_code == 500
        assert fake.received[-1].replayed
    elif api.after_500 is TRANSIENT:
        assert again.status_code == api.replay
    else:  # nothing was kept: the retry pays twice
        assert again.status_code == api.created
    assert fake.effect_count("k1") == (2 if api.after_500 is FORGOTTEN else 1)


def test_a_delay_after_apply_keeps_the_key_in_progress(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.delay_after_apply(0.5))
    with httpx.Client(timeout=0.1) as impatient, pytest.raises(httpx.ReadTimeout):
        api.post(impatient, fake, "k1")
    assert api.post(client, fake, "k1").status_code == api.in_progress
    fake.wait_idle()
    assert api.post(client, fake, "k1").status_code == api.replay
    assert fake.effect_count() == 1


def test_a_bad_answer_after_apply_saves_the_normal_one(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    fake.inject(ApiFault.huge_answer_after_apply(1 << 20))
    huge = api.post(client, fake, "k1")
    assert huge.status_code == api.created
    assert len(huge.content) >= 1 << 20
    again = api.post(client, fake, "k1")
    assert again.status_code == api.replay
    assert len(again.content) < 4096
    assert again.json() == huge.json() or api.id == "paypal"
    assert fake.effect_count() == 1


def test_refused_connections_then_accepted_on_the_same_port(
    api: Api, fake: FakeHttpApi, client: httpx.Client
) -> None:
    port = fake.port
    fake.refuse_connections()
    assert not fake.listening
    with pytest.raises(httpx.ConnectError):
        api.post(client, fake, "k1")
    fake.accept_connections()
    assert fake.port == port
    assert api.post(client, fake, "k1").status_code == api.created


def test_stop_releases_a_held_request(api: Api, client: httpx.Client) -> None:
    fake = api.make().start()
    held = fake.hold("k1")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(api.post, client, fake, "k1")
        assert held.arrived.wait(5)
        fake.stop()
        assert first.result(5).status_code == api.created
    assert held.released


def test_an_unknown_outcome_is_refused(fake: FakeHttpApi) -> None:
    with pytest.raises(ValueError, match="no outcome"):
        fake.set_outcome("exploded")


# --- PayPal ---------------------------------------------------------------------------------


@pytest.fixture
def paypal() -> Iterator[FakePayPal]:
    with FakePayPal() as running:
        yield running


def _paypal_post(
    client: httpx.Client, paypal: FakePayPal, path: str, key: str | None, **headers: str
) -> httpx.Response:
    if key is not None:
        headers["PayPal-Request-Id"] = key
    return client.post(paypal.url + path, headers=headers)


def test_paypal_keeps_orders_keys_6_hours_and_payments_keys_45_days(paypal: FakePayPal) -> None:
    assert paypal.profile.retention == 6 * HOUR
    retention = {r.name: r.retention for r in paypal.profile.routes() if r.effect}
    assert retention == {
        "create_order": None,
        "capture_order": None,
        "capture_authorization": 45 * DAY,
    }


def test_paypal_create_order_answers_minimal_or_the_representation(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    minimal = client.post(paypal.url + "/v2/checkout/orders", json=ORDER)
    assert minimal.status_code == 201
    assert minimal.json() == {"id": minimal.json()["id"], "status": "CREATED", "links": []}
    headers = {"Prefer": "return=representation", "PayPal-Request-Id": "k1"}
    full = client.post(paypal.url + "/v2/checkout/orders", json=ORDER, headers=headers).json()
    assert (full["status"], full["intent"]) == ("CREATED", "CAPTURE")
    assert full["purchase_units"][0]["amount"] == {"currency_code": "USD", "value": "10.00"}


def test_paypal_a_replay_answers_200_with_the_order_as_it_is_now(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    headers = {"PayPal-Request-Id": "k1"}
    first = client.post(paypal.url + "/v2/checkout/orders", json=ORDER, headers=headers)
    paypal.set_order_status(first.json()["id"], "APPROVED")
    again = client.post(paypal.url + "/v2/checkout/orders", json=ORDER, headers=headers)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["status"] == "APPROVED"


def test_paypal_a_payment_source_without_a_request_id_is_400(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    body = {**ORDER, "payment_source": {"card": {"vault_id": "v1"}}}
    response = client.post(paypal.url + "/v2/checkout/orders", json=body)
    assert response.status_code == 400
    assert response.json()["details"][0]["issue"] == "PAYPAL_REQUEST_ID_REQUIRED"
    assert paypal.effect_count() == 0


def test_paypal_a_too_long_request_id_is_invalid_string_length(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    response = _paypal_post(client, paypal, "/v2/checkout/orders", "x" * 109)
    assert response.status_code == 400
    assert response.json()["name"] == "INVALID_REQUEST"
    assert response.json()["details"][0]["issue"] == "INVALID_STRING_LENGTH"


def test_paypal_capture_completes_an_approved_order_once(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    order_id = paypal.create_approved_order("25.00", "EUR", custom_id="ob1_x")
    path = f"/v2/checkout/orders/{order_id}/capture"
    captured = _paypal_post(client, paypal, path, "cap-1")
    assert captured.status_code == 201
    body = captured.json()
    assert (body["id"], body["status"]) == (order_id, "COMPLETED")
    [capture] = body["purchase_units"][0]["payments"]["captures"]
    assert capture["status"] == "COMPLETED"
    assert capture["amount"] == {"currency_code": "EUR", "value": "25.00"}
    assert capture["custom_id"] == "ob1_x"
    replay = _paypal_post(client, paypal, path, "cap-1")
    assert replay.status_code == 200
    assert replay.json()["purchase_units"][0]["payments"]["captures"] == [capture]
    again = _paypal_post(client, paypal, path, "cap-2")
    assert again.status_code == 422
    assert again.json()["name"] == "UNPROCESSABLE_ENTITY"
    assert again.json()["details"][0]["issue"] == "ORDER_ALREADY_CAPTURED"
    assert paypal.effect_count(route="capture_order") == 1


def test_paypal_capture_refuses_orders_that_cannot_be_captured(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    created = client.post(paypal.url + "/v2/checkout/orders", json=ORDER).json()["id"]
    voided = paypal.create_approved_order()
    paypal.set_order_status(voided, "VOIDED")
    authorize = paypal.create_approved_order(intent="AUTHORIZE")
    issues = {
        order_id: _paypal_post(client, paypal, f"/v2/checkout/orders/{order_id}/capture", None)
        for order_id in (created, voided, authorize, "NOSUCHORDER")
    }
    assert {i: r.status_code for i, r in issues.items()} == {
        created: 422,
        voided: 422,
        authorize: 422,
        "NOSUCHORDER": 404,
    }
    assert [issues[i].json()["details"][0]["issue"] for i in issues] == [
        "ORDER_NOT_APPROVED",
        "ORDER_CANNOT_BE_CAPTURED",
        "ACTION_DOES_NOT_MATCH_INTENT",
        "INVALID_RESOURCE_ID",
    ]
    assert issues["NOSUCHORDER"].json()["name"] == "RESOURCE_NOT_FOUND"


def test_paypal_a_capture_refused_on_one_request_id_can_succeed_on_it_later(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    order_id = paypal.create_approved_order()
    path = f"/v2/checkout/orders/{order_id}/capture"
    paypal.set_outcome("declined")
    declined = _paypal_post(client, paypal, path, "cap-1")
    assert declined.status_code == 422
    assert declined.json()["details"][0]["issue"] == "INSTRUMENT_DECLINED"
    assert paypal.effect_count() == 0
    assert _paypal_post(client, paypal, path, "cap-1").status_code == 201


def test_paypal_show_order_reports_each_status(paypal: FakePayPal, client: httpx.Client) -> None:
    order_id = paypal.create_approved_order(reference_id="ob1_ref")
    shown = client.get(f"{paypal.url}/v2/checkout/orders/{order_id}")
    assert shown.status_code == 200
    assert shown.json()["status"] == "APPROVED"
    assert shown.json()["purchase_units"][0]["reference_id"] == "ob1_ref"
    _paypal_post(client, paypal, f"/v2/checkout/orders/{order_id}/capture", "c")
    assert client.get(f"{paypal.url}/v2/checkout/orders/{order_id}").json()["status"] == "COMPLETED"
    missing = client.get(f"{paypal.url}/v2/checkout/orders/NOPE")
    assert (missing.status_code, missing.json()["name"]) == (404, "RESOURCE_NOT_FOUND")


def test_paypal_in_progress_is_409_previous_request_in_progress(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    order_id = paypal.create_approved_order()
    path = f"/v2/checkout/orders/{order_id}/capture"
    with paypal.hold("cap-1") as hold, ThreadPoolExecutor(1) as pool:
        first = pool.submit(_paypal_post, client, paypal, path, "cap-1")
        assert hold.arrived.wait(5)
        with httpx.Client(timeout=5.0) as other:
            during = _paypal_post(other, paypal, path, "cap-1")
        hold.release()
        assert first.result(5).status_code == 201
    assert during.status_code == 409
    assert during.json()["details"][0]["issue"] == "PREVIOUS_REQUEST_IN_PROGRESS"


def test_paypal_capture_authorization_once_then_already_captured(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    authorization = paypal.create_authorization("5.00")
    path = f"/v2/payments/authorizations/{authorization}/capture"
    body = {"invoice_id": "ob1_inv", "final_capture": True}
    headers = {"PayPal-Request-Id": "cap-a"}
    first = client.post(paypal.url + path, json=body, headers=headers)
    assert first.status_code == 201
    capture = first.json()
    assert (capture["status"], capture["invoice_id"]) == ("COMPLETED", "ob1_inv")
    assert capture["amount"] == {"currency_code": "USD", "value": "5.00"}
    replay = client.post(paypal.url + path, json=body, headers=headers)
    assert (replay.status_code, replay.json()["id"]) == (200, capture["id"])
    again = client.post(paypal.url + path, json=body, headers={"PayPal-Request-Id": "cap-b"})
    assert again.status_code == 422
    assert again.json()["details"][0]["issue"] == "AUTHORIZATION_ALREADY_CAPTURED"
    shown = client.get(f"{paypal.url}/v2/payments/captures/{capture['id']}")
    assert shown.json() == capture
    assert (
        client.get(f"{paypal.url}/v2/payments/authorizations/{authorization}").json()["status"]
        == "CAPTURED"
    )
    long_key = {"PayPal-Request-Id": "y" * 500}
    other = paypal.create_authorization()
    ok = client.post(f"{paypal.url}/v2/payments/authorizations/{other}/capture", headers=long_key)
    assert ok.status_code == 201  # Payments v2 takes longer request ids than Orders v2


def test_paypal_keys_are_scoped_to_their_operation(
    paypal: FakePayPal, client: httpx.Client
) -> None:
    order = client.post(
        paypal.url + "/v2/checkout/orders", json=ORDER, headers={"PayPal-Request-Id": "same"}
    ).json()
    paypal.set_order_status(order["id"], "APPROVED")
    capture = _paypal_post(client, paypal, f"/v2/checkout/orders/{order['id']}/capture", "same")
    assert capture.status_code == 201
    assert paypal.effect_count("same") == 2


# --- Adyen ----------------------------------------------------------------------------------


@pytest.fixture
def adyen() -> Iterator[FakeAdyen]:
    with FakeAdyen() as running:
        yield running


def _adyen_post(
    client: httpx.Client, adyen: FakeAdyen, key: str | None, body: dict[str, Any] = ADYEN_PAYMENT
) -> httpx.Response:
    headers = {} if key is None else {"Idempotency-Key": key}
    return client.post(adyen.url + "/v71/payments", json=body, headers=headers)


def test_adyen_authorises_and_echoes_the_key(adyen: FakeAdyen, client: httpx.Client) -> None:
    response = _adyen_post(client, adyen, "ob1_a")
    assert response.status_code == 200
    body = response.json()
    assert body["resultCode"] == "Authorised"
    assert body["merchantReference"] == "ob1_ref"
    assert body["amount"] == {"value": 1000, "currency": "EUR"}
    assert len(body["pspReference"]) == 16
    assert "refusalReason" not in body
    assert response.headers["idempotency-key"] == "ob1_a"
    assert adyen.effects[0].effect_id == body["pspReference"]
    assert adyen.profile.retention == 31 * DAY


def test_adyen_a_refusal_is_a_200(adyen: FakeAdyen, client: httpx.Client) -> None:
    adyen.set_outcome("refused", key="k1")
    refused = _adyen_post(client, adyen, "k1").json()
    assert (refused["resultCode"], refused["refusalReason"]) == ("Refused", "Refused")
    assert refused["refusalReasonCode"] == "2"
    method = {**ADYEN_PAYMENT["paymentMethod"], "holderName": "Not enough balance"}
    by_name = _adyen_post(client, adyen, "k2", {**ADYEN_PAYMENT, "paymentMethod": method})
    assert by_name.status_code == 200
    assert by_name.json()["refusalReason"] == "Not enough balance"
    replay = _adyen_post(client, adyen, "k1")
    assert replay.json() == refused  # a refusal is the key's answer too
    assert adyen.effect_count() == 2


def test_adyen_in_progress_is_704_with_transient_error(
    adyen: FakeAdyen, client: httpx.Client
) -> None:
    with adyen.hold("k1") as hold, ThreadPoolExecutor(1) as pool:
        first = pool.submit(_adyen_post, client, adyen, "k1")
        assert hold.arrived.wait(5)
        with httpx.Client(timeout=5.0) as other:
            during = _adyen_post(other, adyen, "k1")
        hold.release()
        assert first.result(5).status_code == 200
    assert during.status_code == 409
    assert during.json() == {
        "status": 409,
        "errorCode": "704",
        "message": "request already processed or in progress",
        "errorType": "validation",
    }
    assert during.headers["transient-error"] == "true"


def test_adyen_a_500_after_apply_is_transient_and_the_retry_gets_the_payment(
    adyen: FakeAdyen, client: httpx.Client
) -> None:
    adyen.inject(ApiFault.error_500_after_apply())
    failed = _adyen_post(client, adyen, "k1")
    assert (failed.status_code, failed.headers["transient-error"]) == (500, "true")
    assert failed.json()["errorType"] == "internal"
    retry = _adyen_post(client, adyen, "k1")
    assert retry.json()["pspReference"] == adyen.effects[0].effect_id
    assert adyen.effect_count() == 1


def test_adyen_validation_errors_apply_nothing(adyen: FakeAdyen, client: httpx.Client) -> None:
    body = {k: v for k, v in ADYEN_PAYMENT.items() if k != "reference"}
    response = _adyen_post(client, adyen, "k1", body)
    assert response.status_code == 422
    assert response.json()["errorType"] == "validation"
    assert "reference" in response.json()["message"]
    assert _adyen_post(client, adyen, "k1").status_code == 200  # nothing was saved
    assert adyen.effect_count() == 1


# --- Checkout.com ---------------------------------------------------------------------------


@pytest.fixture
def cko() -> Iterator[FakeCheckoutCom]:
    with FakeCheckoutCom() as running:
        yield running


def _cko_post(
    client: httpx.Client, cko: FakeCheckoutCom, key: str | None, **fields: Any
) -> httpx.Response:
    headers = {} if key is None else {"Cko-Idempotency-Key": key}
    return client.post(cko.url + "/payments", json={**CKO_PAYMENT, **fields}, headers=headers)


def test_cko_authorized_declined_and_pending(cko: FakeCheckoutCom, client: httpx.Client) -> None:
    authorized = _cko_post(client, cko, "k1")
    assert authorized.status_code == 201
    body = authorized.json()
    assert body["id"].startswith("pay_") and len(body["id"]) == 30
    assert (body["status"], body["approved"], body["reference"]) == ("Authorized", True, "ob1_ref")
    assert body["response_code"] == "10000"
    declined = _cko_post(client, cko, "k2", amount=1005)
    assert declined.status_code == 201
    assert (declined.json()["status"], declined.json()["approved"]) == ("Declined", False)
    assert declined.json()["response_code"] == "20005"
    pending = _cko_post(client, cko, "k3", **{"3ds": {"enabled": True}})
    assert (pending.status_code, pending.json()["status"]) == (202, "Pending")
    cko.set_outcome("declined")
    assert _cko_post(client, cko, "k4").json()["status"] == "Declined"
    assert cko.effect_count() == 4
    assert _cko_post(client, cko, "k2", amount=1005).json() == declined.json()


def test_cko_get_payment_and_list_by_reference(cko: FakeCheckoutCom, client: httpx.Client) -> None:
    first = _cko_post(client, cko, "k1").json()
    second = _cko_post(client, cko, "k2").json()
    _cko_post(client, cko, "k3", reference="other")
    shown = client.get(f"{cko.url}/payments/{first['id']}")
    assert shown.status_code == 200
    assert shown.json() == first
    assert client.get(f"{cko.url}/payments/pay_nope").status_code == 404
    listed = client.get(cko.url + "/payments", params={"reference": "ob1_ref"})
    assert listed.status_code == 200
    page = listed.json()
    assert (page["limit"], page["skip"], page["total_count"]) == (10, 0, 2)
    assert [p["id"] for p in page["data"]] == [second["id"], first["id"]]  # newest first
    one = client.get(cko.url + "/payments", params={"reference": "ob1_ref", "limit": 1, "skip": 1})
    assert [p["id"] for p in one.json()["data"]] == [first["id"]]
    assert client.get(cko.url + "/payments").status_code == 422  # the reference is required


def test_cko_a_500_after_apply_is_not_saved_and_the_retry_pays_again(
    cko: FakeCheckoutCom, client: httpx.Client
) -> None:
    cko.inject(ApiFault.error_500_after_apply())
    assert _cko_post(client, cko, "k1").status_code == 500
    assert _cko_post(client, cko, "k1").status_code == 201
    assert cko.effect_count("k1") == 2
    listed = client.get(cko.url + "/payments", params={"reference": "ob1_ref"}).json()
    assert listed["total_count"] == 2  # how a reconciler finds the double


def test_cko_the_lookup_by_reference_outlives_the_key(
    cko: FakeCheckoutCom, client: httpx.Client
) -> None:
    _cko_post(client, cko, "k1")
    cko.forget_keys()
    listed = client.get(cko.url + "/payments", params={"reference": "ob1_ref"}).json()
    assert listed["total_count"] == 1


def test_cko_faults_before_apply_hit_lookups_too(
    cko: FakeCheckoutCom, client: httpx.Client
) -> None:
    cko.inject(ApiFault.status(502))
    assert client.get(cko.url + "/payments", params={"reference": "x"}).status_code == 502
    assert client.get(cko.url + "/payments", params={"reference": "x"}).status_code == 200


# --- Square ---------------------------------------------------------------------------------


@pytest.fixture
def square() -> Iterator[FakeSquare]:
    with FakeSquare() as running:
        yield running


def _square_post(
    client: httpx.Client, square: FakeSquare, key: str | None, **fields: Any
) -> httpx.Response:
    body = {**SQUARE_PAYMENT, **fields}
    if key is not None:
        body["idempotency_key"] = key
    return client.post(square.url + "/v2/payments", json=body)


def test_square_completed_approved_and_failed(square: FakeSquare, client: httpx.Client) -> None:
    completed = _square_post(client, square, "k1")
    assert completed.status_code == 200
    payment = completed.json()["payment"]
    assert (payment["status"], payment["reference_id"]) == ("COMPLETED", "ob1_ref")
    assert payment["amount_money"] == {"amount": 1000, "currency": "USD"}
    approved = _square_post(client, square, "k2", autocomplete=False).json()["payment"]
    assert approved["status"] == "APPROVED"
    failed = _square_post(client, square, "k3", source_id="cnon:card-nonce-declined")
    assert failed.status_code == 400
    assert failed.json()["errors"][0]["code"] == "GENERIC_DECLINE"
    assert failed.json()["errors"][0]["category"] == "PAYMENT_METHOD_ERROR"
    assert failed.json()["payment"]["status"] == "FAILED"
    replay = _square_post(client, square, "k3", source_id="cnon:card-nonce-declined")
    assert replay.json() == failed.json()
    square.set_outcome("approved")
    assert _square_post(client, square, "k4").json()["payment"]["status"] == "APPROVED"
    assert square.effect_count() == 4


def test_square_another_body_under_the_key_is_idempotency_key_reused(
    square: FakeSquare, client: httpx.Client
) -> None:
    _square_post(client, square, "k1")
    reused = _square_post(client, square, "k1", reference_id="other")
    assert reused.status_code == 400
    [error] = reused.json()["errors"]
    assert (error["code"], error["category"]) == ("IDEMPOTENCY_KEY_REUSED", "INVALID_REQUEST_ERROR")


def test_square_key_validation(square: FakeSquare, client: httpx.Client) -> None:
    too_long = _square_post(client, square, "k" * 46).json()["errors"][0]
    missing = _square_post(client, square, None).json()["errors"][0]
    blank = _square_post(client, square, "").json()["errors"][0]
    assert (too_long["code"], too_long["field"]) == ("VALUE_TOO_LONG", "idempotency_key")
    assert (missing["code"], missing["field"]) == ("MISSING_REQUIRED_PARAMETER", "idempotency_key")
    assert blank["code"] == "VALUE_TOO_SHORT"
    assert square.effect_count() == 0


def test_square_get_and_list_payments(square: FakeSquare, client: httpx.Client) -> None:
    first = _square_post(client, square, "k1").json()["payment"]
    second = _square_post(client, square, "k2").json()["payment"]
    shown = client.get(f"{square.url}/v2/payments/{first['id']}")
    assert shown.json() == {"payment": first}
    missing = client.get(f"{square.url}/v2/payments/nope")
    assert missing.status_code == 404
    assert missing.json()["errors"][0]["code"] == "NOT_FOUND"
    listed = client.get(square.url + "/v2/payments").json()["payments"]
    assert [p["id"] for p in listed] == [second["id"], first["id"]]
    oldest = client.get(square.url + "/v2/payments", params={"sort_order": "ASC", "limit": 1})
    assert [p["id"] for p in oldest.json()["payments"]] == [first["id"]]


def test_square_bodies_are_compared_with_decimals(square: FakeSquare, client: httpx.Client) -> None:
    def post(extra: str) -> httpx.Response:
        body = json.dumps({**SQUARE_PAYMENT, "idempotency_key": "k1"})[:-1] + f', "x": {extra}}}'
        return client.post(square.url + "/v2/payments", content=body)

    assert post("19.999999999999999999").status_code == 200
    assert post("19.999999999999999999").status_code == 200
    assert post("20.0").status_code == 400  # another body, though as floats they are equal
    assert square.effects[0].body["x"] == Decimal("19.999999999999999999")


# --- the generic internal service -----------------------------------------------------------


@pytest.fixture
def effects() -> Iterator[FakeEffectsService]:
    with FakeEffectsService() as running:
        yield running


def _effect_post(
    client: httpx.Client, effects: FakeEffectsService, header: str | bytes, body: Any = EFFECT
) -> httpx.Response:
    headers: dict[str, str] | dict[bytes, bytes]
    if isinstance(header, str):
        headers = {"Idempotency-Key": header}
    else:
        headers = {b"Idempotency-Key": header}
    return client.post(effects.url + "/v1/effects", json=body, headers=headers)


def _lookup(client: httpx.Client, effects: FakeEffectsService, key: str) -> httpx.Response:
    return client.get(effects.url + "/v1/effects", params={"key": key})


def test_effects_service_creates_replays_and_looks_up(
    effects: FakeEffectsService, client: httpx.Client
) -> None:
    created = _effect_post(client, effects, '"ob1_a b"')
    assert (created.status_code, created.json()) == (201, {"id": "eff_1", "status": "done"})
    replay = _effect_post(client, effects, "ob1_a b")  # bare is the same key
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.json() == created.json()
    found = _lookup(client, effects, "ob1_a b")
    assert (found.status_code, found.json()) == (
        200,
        {"id": "eff_1", "status": "done", "key": "ob1_a b"},
    )
    absent = _lookup(client, effects, "never")
    assert (absent.status_code, absent.json()) == (404, {"error": "no such key"})
    assert client.get(effects.url + "/v1/effects").status_code == 400
    assert effects.effect_count() == 1


def test_effects_service_lookup_forgets_what_its_keys_forget(client: httpx.Client) -> None:
    with FakeEffectsService(key_retention=0.05) as effects:
        _effect_post(client, effects, '"k1"')
        assert _lookup(client, effects, "k1").status_code == 200
        time.sleep(0.1)
        assert _lookup(client, effects, "k1").status_code == 404  # though eff_1 happened
        assert _effect_post(client, effects, '"k1"').json()["id"] == "eff_2"
    assert effects.effect_count("k1") == 2
    assert FakeEffectsService().profile.retention == 7 * DAY


def test_effects_service_lookup_after_forget_keys(
    effects: FakeEffectsService, client: httpx.Client
) -> None:
    _effect_post(client, effects, '"k1"')
    effects.forget_keys()
    assert _lookup(client, effects, "k1").status_code == 404


def test_effects_service_refuses_keys_it_cannot_carry(
    effects: FakeEffectsService, client: httpx.Client
) -> None:
    not_ascii = _effect_post(client, effects, '"caf\xc3\xa9"'.encode("latin-1"))
    assert not_ascii.status_code == 400
    assert "printable ASCII" in not_ascii.json()["error"]
    assert _effect_post(client, effects, '""').status_code == 400  # empty is missing
    assert effects.effect_count() == 0


def test_effects_service_lookup_during_the_first_request_finds_it(
    effects: FakeEffectsService, client: httpx.Client
) -> None:
    with effects.hold("k1") as hold, ThreadPoolExecutor(1) as pool:
        first = pool.submit(_effect_post, client, effects, '"k1"')
        assert hold.arrived.wait(5)
        with httpx.Client(timeout=5.0) as other:
            assert _lookup(other, effects, "k1").json()["id"] == "eff_1"
        hold.release()
        assert first.result(5).status_code == 201


def test_effects_service_accepts_a_chunked_body(
    effects: FakeEffectsService, client: httpx.Client
) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"kind": '
        yield b'"email"}'

    response = client.post(
        effects.url + "/v1/effects", content=chunks(), headers={"Idempotency-Key": '"k1"'}
    )
    assert response.status_code == 201
    assert effects.effects[0].body == {"kind": "email"}

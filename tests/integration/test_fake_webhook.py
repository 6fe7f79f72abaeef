"""The fake webhook provider keeps the promises the dispatcher's tests rely on.

Every test talks real HTTP to a receiver on loopback and counts the effects it applied.
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal
from typing import Any

import httpx
import pytest

from outbox.testing.webhook import (
    FakeWebhookReceiver,
    WebhookFault,
    WebhookRequest,
    parse_idempotency_key,
)

BODY = {"amount": 1000, "currency": "usd"}


@pytest.fixture
def receiver() -> Iterator[FakeWebhookReceiver]:
    with FakeWebhookReceiver() as running:
        yield running


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=5.0) as c:
        yield c


def post(
    client: httpx.Client,
    receiver: FakeWebhookReceiver,
    key: str | None,
    body: Any = BODY,
    *,
    quoted: bool = True,
) -> httpx.Response:
    """POST ``body`` with ``key`` as a structured-field string (or bare, or no header)."""
    headers = {} if key is None else {"Idempotency-Key": f'"{key}"' if quoted else key}
    return client.post(receiver.url, json=body, headers=headers)


def statuses(received: list[WebhookRequest]) -> list[int | None]:
    return [r.status for r in received]


# --- idempotency --------------------------------------------------------------------------


def test_the_first_request_applies_one_effect_and_answers_201(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    response = post(client, receiver, "ob1_a")
    assert response.status_code == 201
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"id": "wh_1", "key": "ob1_a"}
    assert "idempotent-replayed" not in response.headers
    [effect] = receiver.effects
    assert (effect.effect_id, effect.key, effect.body) == ("wh_1", "ob1_a", BODY)
    assert effect.headers["idempotency-key"] == '"ob1_a"'
    assert receiver.effect_count() == 1


def test_a_replay_returns_the_saved_response_and_applies_nothing(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    first = post(client, receiver, "ob1_a")
    again = post(client, receiver, "ob1_a")
    assert again.status_code == 201
    assert again.json() == first.json() == {"id": "wh_1", "key": "ob1_a"}
    assert again.headers["idempotent-replayed"] == "true"
    assert receiver.effect_count("ob1_a") == 1
    assert [r.replayed for r in receiver.received] == [False, True]


def test_each_key_gets_its_own_effect(receiver: FakeWebhookReceiver, client: httpx.Client) -> None:
    assert post(client, receiver, "k1").json()["id"] == "wh_1"
    assert post(client, receiver, "k2").json()["id"] == "wh_2"
    assert receiver.effect_count() == 2
    assert [e.effect_id for e in receiver.effects_for("k2")] == ["wh_2"]


def test_the_same_key_with_another_body_is_422(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    post(client, receiver, "k1")
    response = post(client, receiver, "k1", {**BODY, "amount": 999})
    assert response.status_code == 422
    assert response.json() == {"error": "idempotency key reused with another body"}
    assert receiver.effect_count() == 1


def test_a_missing_key_is_400_and_recorded(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    response = post(client, receiver, None)
    assert response.status_code == 400
    assert "Idempotency-Key" in response.json()["error"]
    assert receiver.effect_count() == 0
    assert [(r.key, r.status) for r in receiver.received] == [(None, 400)]


def test_quoted_and_bare_keys_are_the_same_key(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    assert post(client, receiver, "ob1_abc", quoted=False).status_code == 201
    replay = post(client, receiver, "ob1_abc", quoted=True)
    assert replay.headers["idempotent-replayed"] == "true"
    assert receiver.effect_count("ob1_abc") == 1
    assert [r.key for r in receiver.received] == ["ob1_abc", "ob1_abc"]


@pytest.mark.parametrize(
    ("header", "key"),
    [('"ob1_abc"', "ob1_abc"), ("ob1_abc", "ob1_abc"), (r'"a\"b\\c"', 'a"b\\c'), ('""', None)],
)
def test_header_values_are_parsed_as_sf_strings_or_bare(header: str, key: str | None) -> None:
    assert parse_idempotency_key(header) == key


def test_a_request_while_the_first_is_held_is_409(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    with receiver.hold("k1") as hold, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, client, receiver, "k1")
        assert hold.arrived.wait(5)
        assert receiver.effect_count("k1") == 1  # applied before the answer
        with httpx.Client(timeout=5.0) as other:
            during = post(other, receiver, "k1")
        assert during.status_code == 409
        assert during.json() == {"error": "in progress"}
        assert receiver.received[0].status is None  # the held request has no answer yet
        hold.release()
        assert first.result(5).status_code == 201
    assert receiver.effect_count() == 1
    assert statuses(receiver.received) == [201, 409]


def test_stop_releases_a_held_request(client: httpx.Client) -> None:
    with FakeWebhookReceiver() as receiver, ThreadPoolExecutor(1) as pool:
        hold = receiver.hold("k1")
        first = pool.submit(post, client, receiver, "k1")
        assert hold.arrived.wait(5)
        receiver.stop()
        assert first.result(5).status_code == 201
    assert receiver.effect_count() == 1


def test_keys_expire_after_the_retention(client: httpx.Client) -> None:
    with FakeWebhookReceiver(key_retention=0.1) as receiver:
        post(client, receiver, "k1")
        assert post(client, receiver, "k1").headers["idempotent-replayed"] == "true"
        # Past the retention the key is new again: a second effect, which outbox must prevent.
        time.sleep(0.15)
        assert post(client, receiver, "k1").json()["id"] == "wh_2"
        assert receiver.effect_count("k1") == 2


def test_forget_keys_makes_a_retry_a_second_effect(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    post(client, receiver, "k1")
    receiver.forget_keys()
    again = post(client, receiver, "k1")
    assert again.status_code == 201
    assert "idempotent-replayed" not in again.headers
    assert again.json()["id"] == "wh_2"
    assert receiver.effect_count("k1") == 2


def test_keep_alive_serves_many_requests_on_one_connection(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    for n in range(3):
        assert post(client, receiver, f"k{n}").status_code == 201
    assert receiver.connections_accepted == 1
    assert receiver.effect_count() == 3


def test_a_wrong_path_is_404_without_effect(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    response = client.post(receiver.url + "x", json=BODY, headers={"Idempotency-Key": '"k"'})
    assert response.status_code == 404
    assert receiver.effect_count() == 0


def test_a_chunked_body_is_read_whole_and_keep_alive_survives(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    parts = iter([b'{"amount": ', b"1000, ", b'"currency": "usd"}'])
    response = client.post(receiver.url, content=parts, headers={"Idempotency-Key": '"k1"'})
    assert response.status_code == 201
    assert receiver.received[0].headers["transfer-encoding"] == "chunked"
    assert post(client, receiver, "k1").headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 1
    assert receiver.connections_accepted == 1


def test_a_body_that_is_not_json_is_400(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    response = client.post(receiver.url, content=b"{nope", headers={"Idempotency-Key": "k1"})
    assert response.status_code == 400
    assert [(r.body, r.status) for r in receiver.received_for("k1")] == [("{nope", 400)]
    assert receiver.effect_count() == 0


def test_wait_for_effects_sees_effects_applied_by_another_thread(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    with ThreadPoolExecutor(1) as pool:
        sent = pool.submit(post, client, receiver, "k1")
        [effect] = receiver.wait_for_effects(1)
        assert sent.result(5).status_code == 201
    assert effect.key == "k1"
    with pytest.raises(TimeoutError):
        receiver.wait_for_effects(2, timeout=0.05)


# --- faults -------------------------------------------------------------------------------


def test_delay_after_apply_times_the_client_out_but_the_effect_exists(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.delay_after_apply(0.7))
    with httpx.Client(timeout=0.2) as impatient, pytest.raises(httpx.ReadTimeout):
        post(impatient, receiver, "k1")
    assert receiver.effect_count("k1") == 1
    # The first request is still being processed: the draft's answer is 409.
    assert post(client, receiver, "k1").status_code == 409
    receiver.wait_idle()
    replay = post(client, receiver, "k1")
    assert (replay.status_code, replay.json()["id"]) == (201, "wh_1")
    assert replay.headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 1


def test_500_after_apply_is_saved_and_replayed(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.error_500_after_apply())
    first = post(client, receiver, "k1")
    assert first.status_code == 500
    assert "idempotent-replayed" not in first.headers
    replay = post(client, receiver, "k1")
    assert replay.status_code == 500
    assert replay.json() == first.json()
    assert replay.headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 1


@pytest.mark.parametrize(
    ("fault", "status", "retry_after"),
    [
        (WebhookFault.status(503, retry_after=7), 503, "7"),
        (WebhookFault.status(429, retry_after=2), 429, "2"),
        (WebhookFault.status(502), 502, None),
        (WebhookFault.status(400), 400, None),
        (WebhookFault.error_500_before_apply(), 500, None),
    ],
)
def test_a_status_before_apply_is_not_saved_so_the_retry_applies_once(
    receiver: FakeWebhookReceiver,
    client: httpx.Client,
    fault: WebhookFault,
    status: int,
    retry_after: str | None,
) -> None:
    receiver.inject(fault)
    refused = post(client, receiver, "k1")
    assert refused.status_code == status
    assert refused.headers.get("retry-after") == retry_after
    assert receiver.effect_count() == 0
    assert post(client, receiver, "k1").status_code == 201
    assert post(client, receiver, "k1").headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 1
    assert statuses(receiver.received) == [status, 201, 201]


def test_reset_before_apply_is_a_transport_error_and_applies_nothing(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.reset_before_apply())
    with pytest.raises(httpx.TransportError):
        post(client, receiver, "k1")
    assert receiver.effect_count() == 0
    assert post(client, receiver, "k1").status_code == 201
    assert receiver.effect_count() == 1
    assert statuses(receiver.received) == [None, 201]


def test_reset_after_apply_loses_the_answer_not_the_effect(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.reset_after_apply())
    with pytest.raises(httpx.TransportError):
        post(client, receiver, "k1")
    assert receiver.effect_count("k1") == 1
    replay = post(client, receiver, "k1")
    assert (replay.status_code, replay.json()["id"]) == (201, "wh_1")
    assert replay.headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 1
    assert statuses(receiver.received) == [None, 201]


def test_a_fault_for_one_key_spares_the_others_and_is_used_up(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.status(503), key="k2", times=2)
    assert post(client, receiver, "k1").status_code == 201
    assert post(client, receiver, "k2").status_code == 503
    assert post(client, receiver, "k2").status_code == 503
    assert post(client, receiver, "k2").status_code == 201
    assert receiver.effect_count() == 2


def test_refused_connections_then_accepted_on_the_same_port(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    url = receiver.url
    assert post(client, receiver, "k1").status_code == 201  # leaves a pooled connection
    receiver.refuse_connections()
    with pytest.raises(httpx.ConnectError):
        post(client, receiver, "k2")
    assert receiver.effect_count() == 1
    receiver.accept_connections()
    assert receiver.url == url
    assert post(client, receiver, "k2").status_code == 201
    assert post(client, receiver, "k1").headers["idempotent-replayed"] == "true"
    assert receiver.effect_count() == 2


# --- bad answers ----------------------------------------------------------------------------


def raw_answer(
    client: httpx.Client, receiver: FakeWebhookReceiver, key: str, body: Any = BODY
) -> tuple[httpx.Response, bytes]:
    """The answer and its body's bytes as they came, whatever its Content-Encoding says."""
    headers = {"Idempotency-Key": f'"{key}"'}
    with client.stream("POST", receiver.url, json=body, headers=headers) as response:
        return response, b"".join(response.iter_raw())


@pytest.mark.parametrize(
    ("coding", "decompress"),
    [("gzip", lambda b: zlib.decompress(b, 16 + zlib.MAX_WBITS)), ("deflate", zlib.decompress)],
)
@pytest.mark.parametrize("chunked", [False, True])
def test_a_gzip_bomb_is_small_on_the_wire_and_decodes_to_the_saved_answer(
    receiver: FakeWebhookReceiver,
    client: httpx.Client,
    coding: str,
    decompress: Callable[[bytes], bytes],
    chunked: bool,
) -> None:
    size = 8 << 20
    receiver.inject(WebhookFault.gzip_bomb_after_apply(size, coding=coding, chunked=chunked))
    bomb, wire = raw_answer(client, receiver, "k1")
    assert bomb.status_code == 201
    assert bomb.headers["content-encoding"] == coding
    assert bomb.headers["connection"] == "close"
    assert ("content-length" in bomb.headers) is not chunked
    assert len(wire) < size // 500
    decoded = decompress(wire)  # zlib checks the checksum and the length
    assert len(decoded) == size and decoded.startswith(b"     ")
    assert json.loads(decoded) == {"id": "wh_1", "key": "k1"}
    # The saved answer is the normal one: the replay gets it, and nothing is applied again.
    replay = post(client, receiver, "k1")
    assert (replay.status_code, replay.json()) == (201, {"id": "wh_1", "key": "k1"})
    assert "content-encoding" not in replay.headers
    assert receiver.effect_count() == 1


def test_a_gzip_bomb_may_come_without_its_content_encoding(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.gzip_bomb_after_apply(1 << 20, content_encoding=None))
    bomb, wire = raw_answer(client, receiver, "k1")
    assert "content-encoding" not in bomb.headers
    assert wire.startswith(b"\x1f\x8b")
    assert len(zlib.decompress(wire, 16 + zlib.MAX_WBITS)) == 1 << 20


@pytest.mark.parametrize("chunked", [False, True])
def test_a_huge_answer_is_the_saved_json_padded(
    receiver: FakeWebhookReceiver, client: httpx.Client, chunked: bool
) -> None:
    receiver.inject(WebhookFault.huge_answer_after_apply(3 << 20, chunked=chunked))
    huge, wire = raw_answer(client, receiver, "k1")
    assert huge.headers.get("transfer-encoding") == ("chunked" if chunked else None)
    assert len(wire) == 3 << 20
    assert json.loads(wire) == {"id": "wh_1", "key": "k1"}
    assert receiver.effect_count() == 1


def test_a_dribbled_answer_comes_a_byte_at_a_time_and_stopping_ends_it() -> None:
    receiver = FakeWebhookReceiver().start()
    try:
        receiver.inject(WebhookFault.dribble_after_apply(0.01, size=1 << 20))
        with (
            httpx.Client(timeout=5.0) as client,
            client.stream(
                "POST", receiver.url, json=BODY, headers={"Idempotency-Key": '"k1"'}
            ) as answer,
        ):
            pieces = answer.iter_raw()
            first = [next(pieces) for _ in range(3)]
            assert int(answer.headers["content-length"]) == 1 << 20
        assert all(len(piece) == 1 for piece in first)
        assert receiver.effect_count("k1") == 1
    finally:
        receiver.stop()  # a dribble the client did not hang up on ends here (at 1 MiB: 3 h)
    assert receiver.received[0].status == 201


def test_a_raw_answer_is_sent_as_given_with_the_coding_it_claims(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    receiver.inject(WebhookFault.raw_answer_after_apply(b"not gzip", content_encoding="gzip"))
    lie, wire = raw_answer(client, receiver, "k1")
    assert (lie.status_code, lie.headers["content-encoding"], wire) == (201, "gzip", b"not gzip")
    assert receiver.effect_count() == 1


def test_bodies_are_parsed_with_exact_decimals_and_kept_as_sent(
    receiver: FakeWebhookReceiver, client: httpx.Client
) -> None:
    raw = b'{"amount": 19.999999999999999999, "n": 1}'
    headers = {"Idempotency-Key": '"k1"', "Content-Type": "application/json"}
    assert client.post(receiver.url, content=raw, headers=headers).status_code == 201
    (arrived,) = receiver.received
    assert arrived.raw == raw
    assert arrived.body == {"amount": Decimal("19.999999999999999999"), "n": 1}
    # 20.0 is another amount, so the same key with it is another body: 422.
    other = b'{"amount": 20.0, "n": 1}'
    assert client.post(receiver.url, content=other, headers=headers).status_code == 422


def test_a_retry_after_can_be_any_text(receiver: FakeWebhookReceiver, client: httpx.Client) -> None:
    receiver.inject(WebhookFault.status(429, retry_after="9" * 5000))
    assert post(client, receiver, "k1").headers["retry-after"] == "9" * 5000

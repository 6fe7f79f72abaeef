"""Nothing a provider answers can take the dispatcher's memory, its time or a completed effect.

Issue 17: a webhook answering 1 MB of gzip that decodes to 1 GiB took the dispatcher to 12.6 GB
and blocked its event loop for 33 s; the lease expired and an operation the receiver had
completed was recorded as unknown, then quarantined. Here real providers (httpx, the stripe SDK)
talk to the fake providers on loopback, which apply the effect, save the normal answer and then
send a bad one: huge, a compression bomb (labelled or not), dribbled, or bytes that lie. Every
test checks three things: the outcome (``unknown`` with its error class wherever the provider
answered but could not be read, since it may have acted), that the effect happened exactly once,
and how many bytes the provider received and decoded (its ``tally``), which must stay within a
small multiple of its cap. No test measures time.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
import zlib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

from outbox.config.settings import DEFAULT_MAX_RESPONSE_BYTES, ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.answers import MAX_REFERENCE_CHARS, READ_PIECE
from outbox.providers.base import Failed, Found, SendRequest, SendResult, Succeeded
from outbox.providers.http.webhook import WebhookProvider
from outbox.providers.registry import build_providers
from outbox.providers.stripe.provider import StripeProvider
from outbox.testing.loopback import compressed
from outbox.testing.stripe import DEFAULT_API_KEY, FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault
from tests.support.dispatch import dispatcher, enqueue_many, make_due, rows, statuses
from tests.support.lookups import lookup_request

CAP = DEFAULT_MAX_RESPONSE_BYTES
GIB = 1 << 30
# One network read: httpcore asks the socket for 64 KiB at a time, and the count of bytes received
# is checked after each read.
NETWORK_READ = 64 * 1024
# The bytes a provider may have received or decoded for one answer: the cap, and one step past.
WIRE_BOUND = CAP + NETWORK_READ
DECODED_BOUND = CAP + READ_PIECE
PROPERTY = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def request(key: str, action: str = "invoice.paid", payload: Any = None) -> SendRequest:
    return SendRequest(
        operation_id=7,
        tenant_id="acme",
        operation_type="t",
        operation_key=key,
        action=action,
        payload=payload or {"amount": 1000, "currency": "usd"},
        idempotency_key=key,
        correlation_id=None,
        attempt=1,
    )


def webhook_provider(url: str, *, timeout: float = 5.0, **options: Any) -> WebhookProvider:
    ps = ProviderSettings(
        "hook", "webhook", timeout=timedelta(seconds=timeout), options={"url": url, **options}
    )
    provider = build_providers({"hook": ps})["hook"]
    assert isinstance(provider, WebhookProvider)
    return provider


def stripe_provider(url: str, *, timeout: float = 5.0, **options: Any) -> StripeProvider:
    ps = ProviderSettings(
        "stripe",
        "stripe",
        timeout=timedelta(seconds=timeout),
        options={"api_key_env": "K", "api_base": url, **options},
    )
    provider = build_providers({"stripe": ps}, {"K": DEFAULT_API_KEY})["stripe"]
    assert isinstance(provider, StripeProvider)
    return provider


def assert_unknown(result: SendResult, error_class: str, status: int | None = None) -> Failed:
    assert isinstance(result, Failed), result
    assert (result.failure, result.error_class) == (FailureClass.UNKNOWN, error_class), result
    assert result.may_have_reached_provider
    if status is not None:
        assert result.http_status == status
    return result


async def send_webhook(url: str, key: str, **options: Any) -> tuple[SendResult, WebhookProvider]:
    provider = webhook_provider(url, **options)
    try:
        return await provider.send(request(key)), provider
    finally:
        await provider.aclose()


# --- the issue's answer ---------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [True, False], ids=["chunked", "content-length"])
async def test_the_issues_1_mib_of_gzip_that_decodes_to_1_gib_is_refused_within_the_cap(
    receiver: FakeWebhookReceiver, chunked: bool
) -> None:
    receiver.inject(WebhookFault.gzip_bomb_after_apply(GIB, chunked=chunked))
    tracemalloc.start()
    try:
        result, provider = await send_webhook(receiver.url, "ob1_bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    failed = assert_unknown(result, "response_too_large", 201)
    assert str(CAP) in failed.message and "max_response_bytes" in failed.message
    assert receiver.effect_count("ob1_bomb") == 1
    tally = provider.tally
    assert (tally.answers, tally.refused) == (1, 1)
    assert tally.most_decoded <= DECODED_BOUND  # the old path decoded all 1 GiB
    assert tally.most_wire <= WIRE_BOUND
    # Everything the process allocated meanwhile, the fake's building of the bomb included:
    # a few MiB, where reading the answer whole takes more than 1 GiB.
    assert peak < 16 * CAP


async def test_httpx_alone_expands_one_network_read_far_past_any_cap(
    receiver: FakeWebhookReceiver,
) -> None:
    """Why the providers decode answers themselves: httpx's gzip decoder hands over what one
    read decompresses to, whole. Against 64 MiB (not the issue's 1 GiB, which would take this
    process past a gigabyte), its first decoded chunk is already many times the cap."""
    receiver.inject(WebhookFault.gzip_bomb_after_apply(64 << 20, chunked=True))
    async with (
        httpx.AsyncClient(timeout=5.0) as client,
        client.stream("POST", receiver.url, json={}, headers={"Idempotency-Key": '"k"'}) as answer,
    ):
        sizes = [len(chunk) async for chunk in answer.aiter_bytes()]
    assert answer.num_bytes_downloaded < CAP / 8  # a few reads of the network...
    assert max(sizes) > 8 * CAP  # ...each handed over whole, decoded
    assert receiver.effect_count() == 1


async def test_through_the_dispatcher_the_bomb_is_one_unknown_attempt_then_the_replay(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    """The issue's operation: the bomb's attempt is unknown (the receiver acted) and costs the
    process nothing; the retry with the same key gets the saved 201 and the one effect."""
    enqueue_many(db_url, 1)
    receiver.inject(WebhookFault.gzip_bomb_after_apply(GIB, chunked=True))
    hook = webhook_provider(receiver.url)
    try:
        d = dispatcher(pool, {"hook": hook})
        assert await d.run_once() == 1
        assert statuses(db_url) == {"pending": 1}
        make_due(db_url)
        assert await d.run_once() == 1
    finally:
        await hook.aclose()
    attempts = rows(
        db_url, "SELECT outcome, error_class, http_status FROM outbox.attempts ORDER BY attempt"
    )
    assert attempts == [("unknown", "response_too_large", 201), ("succeeded", None, 201)]
    assert rows(db_url, "SELECT status, provider_ref FROM outbox.operations") == [
        ("succeeded", "wh_1")
    ]
    assert receiver.effect_count() == 1
    assert hook.tally.most_decoded <= DECODED_BOUND


# --- any size, any coding, any cap ----------------------------------------------------------

SHAPES = ["plain", "chunked", "gzip", "gzip-chunked", "deflate", "deflate-chunked"]


@pytest.fixture(scope="module")
def shared_receiver() -> Iterator[FakeWebhookReceiver]:
    """One receiver for every generated case: each uses a key of its own."""
    with FakeWebhookReceiver() as r:
        yield r


@PROPERTY
@given(cap=st.integers(1, 300_000), size=st.integers(0, 600_000), shape=st.sampled_from(SHAPES))
def test_an_answer_is_read_whole_within_its_cap_and_refused_past_it(
    shared_receiver: FakeWebhookReceiver, cap: int, size: int, shape: str
) -> None:
    """The invariant: an answer is a success exactly when it is within the cap both as sent and
    as decoded; past it, unknown; and never more than one step past the cap is read."""
    receiver = shared_receiver
    coding, _, framing = shape.partition("-")
    chunked = framing == "chunked" or coding == "chunked"
    if coding in ("plain", "chunked"):
        fault = WebhookFault.huge_answer_after_apply(size, chunked=chunked)
    else:
        fault = WebhookFault.gzip_bomb_after_apply(size, coding=coding, chunked=chunked)
    key = f"ob1_{len(receiver.received)}"
    receiver.inject(fault, key=key)
    result, provider = asyncio.run(send_webhook(receiver.url, key, max_response_bytes=cap))
    (effect,) = receiver.effects_for(key)
    text = json.dumps({"id": effect.effect_id, "key": key}).encode()
    decoded = max(size, len(text))
    sent = (
        decoded
        if coding in ("plain", "chunked")
        else len(compressed(text, decoded - len(text), coding))
    )
    if decoded <= cap and sent <= cap:
        assert isinstance(result, Succeeded), result
        assert result.reference == effect.effect_id
    else:
        assert_unknown(result, "response_too_large", 201)
    assert provider.tally.most_decoded <= cap + 1
    assert provider.tally.most_wire <= cap + NETWORK_READ


# --- slow, undecodable and lying answers ----------------------------------------------------


async def test_an_answer_dribbled_a_byte_at_a_time_ends_at_the_timeout(
    receiver: FakeWebhookReceiver,
) -> None:
    """Each byte comes well within the read timeout, so httpx alone would wait for the last of
    them (some 20 minutes here); the body's deadline ends it at the provider's timeout."""
    receiver.inject(WebhookFault.dribble_after_apply(0.02, size=1 << 16))
    result, provider = await send_webhook(receiver.url, "ob1_slow", timeout=0.5)
    failed = assert_unknown(result, "timeout")
    assert "took longer than 0.5s" in failed.message
    assert receiver.effect_count("ob1_slow") == 1
    assert provider.tally.most_wire < 1 << 16  # it stopped reading long before the end


def _gzip(data: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    return c.compress(data) + c.flush()


_ANSWER = b'{"id": "wh_lie"}'


@pytest.mark.parametrize(
    ("body", "coding"),
    [
        (_ANSWER, "gzip"),  # says gzip, is not
        (_gzip(_ANSWER), "br"),  # a coding never asked for
        (_gzip(_gzip(_ANSWER)), "gzip, gzip"),  # two layers: one bomb inside another
        (_gzip(_ANSWER)[:-12], "gzip"),  # ends before its compressed stream does
        (_gzip(_ANSWER) + b"\x1f\x8bnot a member", "gzip"),  # a second member that is garbage
    ],
    ids=["not-gzip", "br", "gzip-twice", "truncated", "bad-second-member"],
)
async def test_an_answer_in_a_coding_it_is_not_or_was_not_asked_for_is_undecodable(
    receiver: FakeWebhookReceiver, body: bytes, coding: str
) -> None:
    receiver.inject(WebhookFault.raw_answer_after_apply(body, content_encoding=coding))
    result, provider = await send_webhook(receiver.url, "ob1_enc")
    assert_unknown(result, "undecodable_response", 201)
    assert receiver.effect_count("ob1_enc") == 1
    assert provider.tally.refused == 1


@pytest.mark.parametrize(
    "body",
    [
        _gzip(_ANSWER) + _gzip(b" "),  # two gzip members: RFC 1952 allows it
        zlib.compress(_ANSWER),  # deflate as the RFC has it (zlib's format)
        zlib.compress(_ANSWER)[2:-4],  # deflate as some servers send it (raw)
    ],
    ids=["gzip-members", "deflate-zlib", "deflate-raw"],
)
async def test_every_honest_form_of_the_codings_asked_for_is_read(
    receiver: FakeWebhookReceiver, body: bytes
) -> None:
    coding = "gzip" if body.startswith(b"\x1f\x8b") else "deflate"
    receiver.inject(WebhookFault.raw_answer_after_apply(body, content_encoding=coding))
    result, _ = await send_webhook(receiver.url, "ob1_ok")
    assert isinstance(result, Succeeded) and result.reference == "wh_lie"


@pytest.mark.parametrize(
    "body",
    [
        b'{"id": "wh_x", "n": ' + b"7" * 5000 + b"}",  # past Python's 4,300-digit int limit
        b"[" * 100_000 + b"]" * 100_000,  # past the JSON decoder's depth
        b'{"id": "wh_x"',  # cut short
        b"<html>OK</html>",
        b"\xff\xfe\x00garbage",
        b'["wh_x"]',
        b"",
    ],
    ids=["huge-int", "deep", "truncated", "html", "binary", "array", "empty"],
)
async def test_a_2xx_with_no_readable_json_object_is_a_success_known_by_its_key(
    receiver: FakeWebhookReceiver, body: bytes
) -> None:
    """A 2xx is the receiver's word that it acted; the body only names the effect. One that
    names nothing readable is never a permanent failure, nor a crash: the key is the name."""
    receiver.inject(WebhookFault.raw_answer_after_apply(body))
    result, _ = await send_webhook(receiver.url, "ob1_lie")
    assert isinstance(result, Succeeded), result
    assert (result.reference, result.result) == ("ob1_lie", None)
    assert receiver.effect_count("ob1_lie") == 1


def documented_reference(value: Any, key: str) -> str:
    """The rule README states: an id that is a string of 1 to 255 printable characters, or an
    integer of at most 255 digits, is the reference; anything else, the idempotency key."""
    if isinstance(value, str) and 0 < len(value) <= MAX_REFERENCE_CHARS and value.isprintable():
        return value
    if type(value) is int and len(str(value)) <= MAX_REFERENCE_CHARS:
        return str(value)
    return key


ids = st.one_of(
    st.text(max_size=2 * MAX_REFERENCE_CHARS),
    st.text(min_size=MAX_REFERENCE_CHARS - 2, max_size=MAX_REFERENCE_CHARS + 2),
    st.integers(),
    st.integers(min_value=10**250, max_value=10**400),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@PROPERTY
@given(value=ids)
def test_the_reference_is_the_answers_id_only_when_that_is_an_identifier(
    shared_receiver: FakeWebhookReceiver, value: Any
) -> None:
    receiver = shared_receiver
    key = f"ob1_ref_{len(receiver.received)}"
    body = json.dumps({"id": value}).encode()
    receiver.inject(WebhookFault.raw_answer_after_apply(body), key=key)
    result, _ = asyncio.run(send_webhook(receiver.url, key))
    assert isinstance(result, Succeeded), result
    assert result.reference == documented_reference(value, key)
    assert receiver.effect_count(key) == 1


async def test_a_retry_after_of_thousands_of_digits_is_the_longest_wait(
    receiver: FakeWebhookReceiver,
) -> None:
    receiver.inject(WebhookFault.status(429, retry_after="9" * 5000))
    result, _ = await send_webhook(receiver.url, "ob1_wait")
    assert isinstance(result, Failed) and result.error_class == "http_429"
    assert result.retry_after == timedelta(hours=1)


# --- Stripe ---------------------------------------------------------------------------------


async def create(fake: FakeStripe, key: str, **options: Any) -> tuple[SendResult, StripeProvider]:
    provider = stripe_provider(fake.url, **options)
    try:
        return await provider.send(request(key, "payment_intents.create")), provider
    finally:
        await provider.aclose()


@pytest.mark.parametrize(
    "fault",
    [
        StripeFault.gzip_bomb_after_apply(GIB, chunked=True),
        StripeFault.gzip_bomb_after_apply(64 << 20, coding="deflate"),
        StripeFault.huge_answer_after_apply(50 << 20),
        StripeFault.huge_answer_after_apply(50 << 20, chunked=True),
    ],
    ids=["gzip-1gib", "deflate", "plain", "plain-chunked"],
)
async def test_a_stripe_answer_past_the_cap_is_unknown_and_the_retry_replays_the_object(
    fake: FakeStripe, fault: StripeFault
) -> None:
    fake.inject(fault)
    result, provider = await create(fake, "ob1_pi")
    assert_unknown(result, "response_too_large", 200)
    assert provider.tally.most_decoded <= DECODED_BOUND
    assert provider.tally.most_wire <= WIRE_BOUND
    again, _ = await create(fake, "ob1_pi")
    (obj,) = fake.objects()
    assert isinstance(again, Succeeded) and again.reference == obj["id"]
    assert [r.replayed for r in fake.received] == [False, True]


@pytest.mark.parametrize(
    ("body", "coding", "error_class", "status"),
    [
        (b'{"id": "pi_x", "amount": ' + b"1" * 5000 + b"}", None, "unreadable_success", 200),
        (b"<html>502 from a proxy, with a 200</html>", None, "unreadable_success", 200),
        (b'{"id": "pi_x"', None, "unreadable_success", 200),
        (b'{"a": ' * 5000 + b"1" + b"}" * 5000, None, "unreadable_success", 200),
        # Parsed, but the SDK's objects choke on it (past the SDK, the status is not known).
        (b'{"a": ' * 900 + b"1" + b"}" * 900, None, "unreadable_success", None),
        (b'["pi_x"]', None, "unreadable_success", None),
        (b'{"id": "pi_x"}', "gzip", "undecodable_response", 200),
    ],
    ids=["huge-int", "html", "truncated", "deep", "deep-for-the-sdk", "array", "not-gzip"],
)
async def test_a_stripe_2xx_the_sdk_cannot_read_is_unknown_never_permanent(
    fake: FakeStripe, body: bytes, coding: str | None, error_class: str, status: int | None
) -> None:
    """It used to be classified by its status like an error: a 200 is not >= 500, so it was
    permanent, and a charge that exists went to quarantine (or, past the SDK, it raised)."""
    fake.inject(StripeFault.raw_answer_after_apply(body, content_encoding=coding))
    result, _ = await create(fake, "ob1_pi")
    assert_unknown(result, error_class, status)
    again, _ = await create(fake, "ob1_pi")
    assert isinstance(again, Succeeded) and again.reference == fake.objects()[0]["id"]
    assert fake.object_count() == 1


@pytest.mark.parametrize(
    "body",
    [b'{"id": "' + b"p" * 300 + b'"}', b'{"id": {"nested": 1}}', b'{"id": true}', b"{}"],
    ids=["long", "object", "boolean", "none"],
)
async def test_a_stripe_object_whose_id_is_no_identifier_is_known_by_its_key(
    fake: FakeStripe, body: bytes
) -> None:
    fake.inject(StripeFault.raw_answer_after_apply(body))
    result, _ = await create(fake, "ob1_pi")
    assert isinstance(result, Succeeded), result
    assert result.reference == "ob1_pi"
    assert fake.object_count() == 1


async def test_a_dribbled_stripe_answer_ends_at_the_timeout(fake: FakeStripe) -> None:
    fake.inject(StripeFault.dribble_after_apply(0.02, size=1 << 16))
    result, provider = await create(fake, "ob1_pi", timeout=0.5)
    assert "took longer than 0.5s" in assert_unknown(result, "timeout").message
    assert fake.object_count() == 1
    assert provider.tally.most_wire < 1 << 16


async def test_a_lookup_page_may_be_larger_than_a_create_answer(fake: FakeStripe) -> None:
    """A list page holds up to 100 objects, so the reconciler's lookups get LIST_PAGE_BYTES
    when max_response_bytes is smaller; a create's answer keeps the cap."""
    cap = 4096
    provider = stripe_provider(fake.url, max_response_bytes=cap)
    try:
        results = [
            await provider.send(request(f"ob1_{i}", "payment_intents.create")) for i in range(30)
        ]
        assert all(isinstance(r, Succeeded) for r in results)
        now = datetime.now(UTC)
        found = await provider.lookup(
            lookup_request("payment_intents.create", 7, "ob1_29", now, now)
        )
        assert provider.tally.most_decoded > cap  # the page was larger than the cap
        fake.inject(StripeFault.huge_answer_after_apply(cap + 1))
        too_large = await provider.send(request("ob1_big", "payment_intents.create"))
    finally:
        await provider.aclose()
    assert isinstance(found, Found)  # every object carries operation 7's id; ob1_29's is found
    assert_unknown(too_large, "response_too_large", 200)


async def test_an_answer_within_the_cap_but_past_64_kib_keeps_its_reference_not_its_body(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver
) -> None:
    """What `result` keeps is bounded (outbox reads it back for operators and get_operation);
    the reference of the effect is always kept."""
    (op,) = enqueue_many(db_url, 1)
    body = json.dumps({"id": "wh_big", "padding": "x" * 200_000}).encode()
    receiver.inject(WebhookFault.raw_answer_after_apply(body))
    hook = webhook_provider(receiver.url)
    try:
        assert await dispatcher(pool, {"hook": hook}).run_once() == 1
    finally:
        await hook.aclose()
    query = "SELECT status, provider_ref, result FROM outbox.operations WHERE id = %s"
    ((status, ref, result),) = rows(db_url, query, (op,))
    assert (status, ref) == ("succeeded", "wh_big")
    assert list(result) == ["outbox_omitted"]
    assert "keeps at most 65536" in result["outbox_omitted"]

"""The dispatcher's verdict on a payload comes from its text, and the object is built only for a
provider that reads it (issue 38, item 2).

A payload dense with brackets cost 0.2 s of the event loop and 19 MB to decode, and the webhook,
which sends the stored text, paid it as well: payloads.carried decoded any text of more than 64
brackets just to learn whether it could be carried. Now carried() reads the verdict from the text
(PostgreSQL's, as the claim hands it over); the verdicts are decode()'s, generated here against
what each text was built to be. A provider that reads the object gets it decoded once, let go
once its request is built, and the rows of a claim do their payload work a turn of the loop
apart, so that the loop reads its sockets between them.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.core import payloads
from outbox.providers.base import Provider, SendRequest, SendResult, Succeeded
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, rows, statuses

# --- the verdict: generated texts, and what decode() must say of each ---------------------------


@dataclass(frozen=True)
class Built:
    """JSON text with what was built into it: how deep its brackets nest (the outermost level 1,
    0 for a scalar), and whether it holds a number of 1e100 or more in magnitude."""

    text: str
    depth: int = 0
    large: bool = False


def _number(text: str) -> Built:
    value = Decimal(text)
    return Built(text, large=bool(value) and value.adjusted() >= payloads.MAX_NUMBER_DIGITS)


# Strings made to mislead a reading of the text: brackets, quotes and backslashes (escaped in
# the JSON), long runs of digits, a point, non-ASCII and control characters.
_PIECES = ["[", "]", "{", "}", '"', "\\", '\\"', "1" * 101, "9" * 150, "0.", ",", ":", "é", "\x01"]
_strings = st.lists(
    st.sampled_from(_PIECES) | st.text(st.characters(codec="utf-8", exclude_characters="\x00")),
    max_size=6,
).map("".join)
_numbers = st.one_of(
    st.integers(-(10**150), 10**150).map(str),
    st.builds(lambda m, e: f"{m}e{e}", st.integers(-(10**30), 10**30), st.integers(-150, 150)),
).map(_number)
_leaves = st.one_of(
    _numbers,
    _strings.map(lambda s: Built(json.dumps(s, ensure_ascii=False))),
    st.sampled_from(["true", "false", "null"]).map(Built),
)


def _array(items: list[Built]) -> Built:
    return Built(
        "[" + ",".join(i.text for i in items) + "]",
        1 + max((i.depth for i in items), default=0),
        any(i.large for i in items),
    )


def _object(members: dict[str, Built]) -> Built:
    text = ",".join(f"{json.dumps(k, ensure_ascii=False)}:{v.text}" for k, v in members.items())
    return Built(
        "{" + text + "}",
        1 + max((v.depth for v in members.values()), default=0),
        any(v.large for v in members.values()),
    )


def _wide(item: Built, count: int) -> Built:
    """One value many times over: many brackets, and no deeper for it."""
    return _array([item] * count)


def _nested(item: Built, levels: int) -> Built:
    """``item`` inside ``levels`` arrays and objects, taking turns."""
    for level in range(levels):
        item = _array([item]) if level % 2 else _object({"k": item})
    return item


_trees = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4).map(_array),
        st.dictionaries(_strings, inner, max_size=4).map(_object),
        # Wide over small arrays only: wide over wide would multiply the text's size.
        st.builds(_wide, st.lists(_leaves, max_size=2).map(_array), st.integers(2, 80)),
    ),
    max_leaves=16,
)
# Mostly objects, as payloads are; sometimes whatever the tree is (an array, a number...).
_payloads = st.builds(
    lambda tree, bare: tree if bare else _object({"p": tree}),
    st.builds(_nested, _trees, st.one_of(st.integers(0, 70), st.sampled_from([120, 1_500, 3_000]))),
    st.integers(0, 4).map(lambda n: n == 0),
)


def _expected(built: Built) -> str | None:
    """decode()'s verdict on what was built: the number, the kind, the depth, in that order."""
    if built.large:
        return "the payload holds a number of 1e100 or more in magnitude"
    if not built.text.startswith("{"):
        kind = {"[": "array", '"': "string", "n": "null", "t": "boolean", "f": "boolean"}
        return f"the payload is a JSON {kind.get(built.text[0], 'number')}, not an object"
    if built.depth > payloads.MAX_DEPTH:
        return "the payload nests deeper than 64 levels"
    return None


def _verdict(read: Any, text: str) -> str | None:
    try:
        read(text)
    except payloads.InvalidPayload as exc:
        return str(exc)
    return None


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(built=_payloads)
@example(built=_nested(Built("1"), 64))  # the deepest carried: 63 levels around a number
@example(built=_nested(Built("1"), 65))
@example(built=_nested(Built("[]"), 64))  # 65 levels, the last an empty array
@example(built=_object({"s": Built('"' + "[" * 70 + '"'), "n": Built("1" * 101, large=True)}))
@example(built=_object({"s": Built('"' + "1" * 150 + '"'), "w": _wide(Built("[]", 1), 70)}))
@example(built=_object({"s": Built(r'"\\"'), "t": Built('"' + "[" * 70 + '"')}))
@example(built=_object({"s": Built(r'"\"["'), "t": _nested(Built("2"), 63)}))
@example(built=_object({"n": _number("1e-150"), "m": _number("-9.99e99")}))
@example(built=_nested(_number("1e100"), 3_000))  # past the scanner's recursion: the number
@example(built=_array([_nested(Built("1"), 3_000)]))  # past it: the kind
@example(built=_nested(Built('"x"'), 0))
def test_the_verdict_from_the_text_is_decodes_on_every_text_postgresql_writes(
    conn: psycopg.Connection[Any], built: Built
) -> None:
    ((text,),) = conn.execute("SELECT %s::jsonb::text", (built.text,)).fetchall()
    expected = _expected(built)
    event(expected or "carried")
    event("past 64 brackets" if text.count("[") + text.count("{") > 64 else "64 brackets or fewer")
    assert _verdict(payloads.decode, text) == expected, text[:300]
    assert _verdict(payloads.carried, text) == expected, text[:300]
    if expected is None:
        decoded = payloads.decode(text)
        assert dict(payloads.carried(text)) == decoded == json.loads(text, parse_float=Decimal)


def test_the_verdict_on_a_dense_text_builds_nothing() -> None:
    """100,000 values (the door's limit) as PostgreSQL writes them; decoded, 6 to 13 MB."""
    text = '{"a": [' + ", ".join(["[]"] * 99_998) + "]}"
    tracemalloc.start()
    try:
        carried = payloads.carried(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(carried, payloads.Decoded)
    assert peak < len(text) // 4, peak


# --- through the dispatcher --------------------------------------------------------------------


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The length of every text outbox.core.payloads decodes into objects, by either decoder."""
    seen: list[int] = []
    # Both decoders of outbox.core.payloads: whatever builds a payload object goes through one.
    for decoder in (payloads._EXACT, payloads._CHECKING):

        def spy(text: str, *args: Any, _real: Any = decoder.decode) -> Any:
            seen.append(len(text))
            return _real(text, *args)

        monkeypatch.setattr(decoder, "decode", spy)
    return seen


def _levels(depth: int) -> list[Any]:
    nested: list[Any] = []
    for _ in range(depth - 1):
        nested = [nested]
    return nested


def dense_payloads() -> dict[str, dict[str, Any]]:
    """Payloads at the door's limits, each as dense with brackets as it lets through."""
    return {
        # 100,000 values (the payload, its list, 99,998 empty lists): 400 KB.
        "values": {"a": [[] for _ in range(99_998)]},
        # 64 levels: 1,612 lists of 62 levels in the payload's list, 99,946 values.
        "depth": {"a": [_levels(62)] * 1_612},
        # Near 1 MiB: brackets, long runs of digits and escaped quotes in a string, and lists.
        "bytes": {"a": [[] for _ in range(60_000)], "s": ('[{"\\' + "9" * 120 + "]}") * 6_000},
    }


async def test_the_webhook_sends_dense_payloads_at_the_limits_without_building_them(
    db_url: str,
    pool: AsyncConnectionPool[Any],
    receiver: FakeWebhookReceiver,
    hook: Provider,
    decodes: list[int],
) -> None:
    with psycopg.connect(db_url) as conn:
        for name, payload in dense_payloads().items():
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="dense",
                operation_key=name,
                provider="hook",
                action="invoice.paid",
                payload=payload,
            )
    stored = dict(rows(db_url, "SELECT idempotency_key, payload::text FROM outbox.operations"))
    assert max(len(text) for text in stored.values()) > 1_000_000
    assert await dispatcher(pool, {"hook": hook}).run_once() == 3
    assert statuses(db_url) == {"succeeded": 3}
    for key, text in stored.items():
        (arrived,) = receiver.received_for(key)
        assert arrived.raw == text.encode()
    assert decodes == []


class Reading:
    """A provider that builds its request from the payload object, as Stripe does: its check
    reads it, its send reads it before its first wait; then the call is in flight."""

    name = "reading"
    key_retention = timedelta(hours=24)

    def __init__(self) -> None:
        self.in_flight = asyncio.Event()
        self.answer = asyncio.Event()
        self.sent: list[Mapping[str, Any]] = []
        self.checks: list[tuple[int, bool]] = []  # (the loop's turn, whether dense)
        self.turn = 0

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        self.checks.append((self.turn, "a" in payload))

    async def send(self, request: SendRequest) -> SendResult:
        reference = f"built-{len(request.payload)}"
        self.sent.append(request.payload)
        self.in_flight.set()
        await self.answer.wait()
        return Succeeded(reference)

    async def aclose(self) -> None:
        """Nothing to close."""


def _enqueue(db_url: str, payloads_: list[dict[str, Any]]) -> None:
    with psycopg.connect(db_url) as conn:
        for n, payload in enumerate(payloads_):
            outbox.enqueue(
                conn,
                tenant_id="acme",
                operation_type="read",
                operation_key=f"read-{n}",
                provider="reading",
                action="create",
                payload=payload,
            )


async def test_a_call_in_flight_holds_no_decoded_payload(
    db_url: str, pool: AsyncConnectionPool[Any], decodes: list[int]
) -> None:
    """Decoded once for the check and the request; once the request is built the object goes:
    read in flight, it is decoded again. 300 calls in flight once held 300 decoded objects."""
    _enqueue(db_url, [dense_payloads()["values"]])
    ((stored,),) = rows(db_url, "SELECT payload::text FROM outbox.operations")
    provider = Reading()
    run = asyncio.create_task(dispatcher(pool, {"reading": provider}).run_once())
    await provider.in_flight.wait()
    await asyncio.sleep(0)  # the turn after the send's first step
    assert decodes == [len(stored)]
    (payload,) = provider.sent
    assert len(payload) == 1
    assert decodes == [len(stored), len(stored)]
    provider.answer.set()
    assert await run == 1
    assert statuses(db_url) == {"succeeded": 1}


async def test_the_rows_of_a_claim_do_their_payload_work_a_turn_apart(
    db_url: str, pool: AsyncConnectionPool[Any]
) -> None:
    """Payloads of 100,000 values, 400 KB each: one to a turn of the loop, which reads its
    sockets between turns (before, the eight checks ran in one turn, each decoding its payload);
    small ones all in a turn."""
    _enqueue(db_url, [dense_payloads()["values"]] * 8 + [{"n": n} for n in range(20)])
    provider = Reading()
    provider.answer.set()
    loop = asyncio.get_running_loop()
    counting = True

    def count() -> None:
        provider.turn += 1
        if counting:
            loop.call_soon(count)

    loop.call_soon(count)
    try:
        assert await dispatcher(pool, {"reading": provider}).run_once() == 28
    finally:
        counting = False
    assert statuses(db_url) == {"succeeded": 28}
    dense = [turn for turn, is_dense in provider.checks if is_dense]
    small = {turn for turn, is_dense in provider.checks if not is_dense}
    assert len(dense) == len(set(dense)) == 8, provider.checks
    assert len(small) <= 2, provider.checks

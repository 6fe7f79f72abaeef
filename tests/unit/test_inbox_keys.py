"""Where the inbox finds a delivery's identity (outbox.inbox.http): the key at a JSON pointer in
the body, the tenant's header, and the defaults. Generated pointers and bodies: any body gives
a key the database can take, or a reason (MissingIdentity) that never quotes the body; nothing
else, and never a crash."""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.core.json_pointer import PointerError
from outbox.inbox import KeyFrom, TenantFrom
from outbox.inbox.core import Fingerprint
from outbox.inbox.http import MAX_KEY, MissingIdentity, fingerprint_of, identity_of
from outbox.providers.base import Intent
from outbox.providers.kit import header_safe, intent_headers

PROPERTY = settings(database=None, deadline=None, max_examples=300)
# Tokens made mostly of the characters a pointer escapes ("~" as "~0", "/" as "~1") and of
# the escapes' own digits, so that "~1", "~0", "~01" and "/0" come up as member names.
TOKENS = st.text(st.sampled_from("~01/aé") | st.characters(codec="utf-8"), max_size=6)
# Values the database takes as a key: no control or format character, not blank.
SAFE = st.characters(codec="utf-8", exclude_categories=("Cc", "Cf", "Zl", "Zp"))
KEYS = st.text(SAFE, min_size=1, max_size=40).filter(str.strip)
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TOKENS, inner, max_size=3),
    max_leaves=12,
)


def escape(token: str) -> str:
    """A member name as a pointer writes it: "~" first, so that the "~" of a "~1" is kept."""
    return token.replace("~", "~0").replace("/", "~1")


def pointer_to(tokens: list[str]) -> str:
    return "".join("/" + escape(token) for token in tokens)


def nested(tokens: list[str], value: Any, decoys: dict[str, Any]) -> Any:
    """An object with ``value`` at ``tokens``, and ``decoys`` beside every step."""
    for token in reversed(tokens):
        value = {**decoys, token: value}
    return value


def read(pointer: str, body: bytes) -> str:
    return KeyFrom.json_pointer(pointer).read({}, body)


def reason(pointer: str, body: bytes) -> str:
    with pytest.raises(MissingIdentity) as refused:
        read(pointer, body)
    return str(refused.value)


@PROPERTY
@given(tokens=st.lists(TOKENS, max_size=4), value=KEYS, decoys=st.dictionaries(TOKENS, JSON))
@example(tokens=["a~1b"], value="right", decoys={"a/b": "wrong"})
@example(tokens=["~1"], value="right", decoys={"/": "wrong"})
@example(tokens=["/0"], value="right", decoys={"~10": "wrong", "/": {"0": "wrong"}})
def test_the_string_at_any_pointer_is_the_key_however_the_body_is_spelled(
    tokens: list[str], value: str, decoys: dict[str, Any]
) -> None:
    document = nested(tokens, value, decoys)
    pointer = pointer_to(tokens)
    expected = f"ptr:{value}"
    assert read(pointer, json.dumps(document).encode()) == expected
    # Another spelling of the same document (order, spacing, escapes) is the same key, as it
    # is the same digest to the inbox.
    respelled = json.dumps(document, ensure_ascii=False, sort_keys=True, indent=1)
    assert read(pointer, respelled.encode()) == expected


def test_unescaping_turns_tilde_one_into_a_slash_before_tilde_zero_into_a_tilde() -> None:
    """RFC 6901 section 4: "~01" is the member "~1", never "/" (which "~0" first would make)."""
    body = json.dumps({"~1": "tilde one", "/": "slash", "a~1b": "kept", "a/b": "split"}).encode()
    assert read("/~01", body) == "ptr:tilde one"
    assert read("/a~01b", body) == "ptr:kept"
    assert read("/~1", body) == "ptr:slash"
    assert read("/a~1b", body) == "ptr:split"


@PROPERTY
@given(
    pointer=st.lists(TOKENS, max_size=3).map(pointer_to),
    body=st.binary(max_size=64)
    | JSON.map(lambda v: json.dumps(v).encode())
    | st.builds(lambda t, v: json.dumps({"id": v, "t": t}).encode(), TOKENS, JSON),
)
@example(pointer="/id", body=b'{"id": "\\u0000"}')
@example(pointer="/id", body=b'{"id": "\\ud800"}')
@example(pointer="/id", body=b"[" * 100_000)
@example(pointer="/id", body=b'{"id": NaN}')
@example(pointer="/id", body=b'\xef\xbb\xbf{"id": "a"}')
def test_any_body_gives_a_key_the_database_takes_or_a_reason_never_a_crash(
    pointer: str, body: bytes
) -> None:
    why: str | None = None
    try:
        key = read(pointer, body)
    except MissingIdentity as refused:
        why = str(refused)
    if why is not None:
        assert pointer in why
        return
    assert key.startswith("ptr:") and key[4:].strip()
    assert len(key) <= MAX_KEY
    key.encode("utf-8")  # no lone surrogate
    assert not {unicodedata.category(c) for c in key} & {"Cc", "Cf", "Zl", "Zp", "Cs"}


@given(value=JSON.filter(lambda v: not isinstance(v, str)))
def test_a_value_that_is_not_a_string_is_refused_by_its_kind_never_quoted(value: Any) -> None:
    kind = reason("/id", json.dumps({"id": value}).encode())
    assert kind.startswith("the body's /id is ") and kind.endswith(", not a string")
    assert kind.removeprefix("the body's /id is ").removesuffix(", not a string") in (
        "null", "a boolean", "a number", "an array", "an object",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b'{"other": "x"}', "the body has nothing at /event/id"),
        (b'{"event": ["x"]}', "the body has nothing at /event/id"),
        (b'{"event": {"id": "   "}}', "the body's /event/id is empty"),
        (b'{"event": {"id": "a\\u202eb"}}', "the body's /event/id holds a control or format"),
        (b'{"event": {"id": "\\ud800"}}', "the body's /event/id holds a control or format"),
        (b"\xff\xfe", "the body is not JSON, so it has nothing at /event/id"),
        (b'{"event": {"id": "a"}', "the body is not JSON, so it has nothing at /event/id"),
        (b'{"event": {"id": Infinity}}', "the body is not JSON, so it has nothing at /event/id"),
    ],
)
def test_what_gives_no_key_is_refused_with_a_reason(body: bytes, why: str) -> None:
    assert reason("/event/id", body).startswith(why)


def test_a_key_is_at_most_what_the_database_takes_and_the_reason_never_quotes_it() -> None:
    longest = MAX_KEY - len("ptr:")
    assert read("/id", json.dumps({"id": "k" * longest}).encode()) == "ptr:" + "k" * longest
    why = reason("/id", json.dumps({"id": "k" * (longest + 1)}).encode())
    assert why == f"the body's /id is longer than {longest} characters"


def test_array_members_and_the_whole_document_are_pointers_too() -> None:
    assert read("/events/1/id", b'{"events": [{"id": "a"}, {"id": "b"}]}') == "ptr:b"
    assert reason("/events/01/id", b'{"events": [{"id": "a"}, {"id": "b"}]}')
    assert read("", b'"evt_1"') == "ptr:evt_1"


@pytest.mark.parametrize("text", ["id", "/~2", "/a~", "event/id"])
def test_text_that_is_no_pointer_is_refused_when_the_source_is_made(text: str) -> None:
    with pytest.raises(PointerError):
        KeyFrom.json_pointer(text)


def test_the_headers_sources_name_what_is_missing() -> None:
    auto, tenant = KeyFrom.auto(), TenantFrom.header()
    assert auto.read({"outbox-operation-id": "0042"}, b"") == "op:42"
    assert auto.read({"idempotency-key": '"a\\"b"'}, b"") == 'key:a"b'
    assert auto.read({"x-cloudtasks-taskname": "t-1"}, b"") == "task:t-1"
    with pytest.raises(MissingIdentity, match="names no idempotency key"):
        auto.read({}, b'{"id": "x"}')
    assert tenant.read({"outbox-tenant-id": "caf%C3%A9"}) == "café"
    with pytest.raises(MissingIdentity, match="names no tenant"):
        tenant.read({})
    with pytest.raises(MissingIdentity, match="Outbox-Tenant-Id is not percent-encoded UTF-8"):
        tenant.read({"outbox-tenant-id": "caf%E9"})
    assert TenantFrom.constant("acme").read({}) == "acme"


def test_an_operation_is_known_by_its_id_and_the_database_that_sent_it() -> None:
    """Outbox-Origin is the identity's origin, lower-case whatever case the UUID arrives in, for
    an operation's key only; the key stays op:<id>. An origin that is not a UUID (or is the nil
    UUID, which the inbox stores for "not named") names no identity: 400, rather than a guess."""
    auto = KeyFrom.auto()
    origin = "4CEBE4FC-21B6-4C07-B313-C7510C7A24F8"
    headers = {"outbox-operation-id": "0042", "outbox-origin": origin}
    identity = identity_of("acme", "work", auto.read(headers, b""), headers)
    assert (identity.key, identity.origin) == ("op:42", origin.lower())
    assert identity_of("acme", "work", "op:42", {}).origin is None
    assert identity_of("acme", "work", "key:k", headers).origin is None
    assert identity != identity_of("acme", "work", "op:42", {})  # two databases' operation 42
    nil = "00000000-0000-0000-0000-000000000000"
    for bad in ("", "4cebe4fc", "4cebe4fc-21b6-4c07-b313-c7510c7a24f8:1", "x" * 36, nil):
        with pytest.raises(MissingIdentity, match="Outbox-Origin is not a UUID"):
            identity_of("acme", "work", "op:1", {"outbox-origin": bad})


@PROPERTY
@given(
    digest=st.binary(min_size=32, max_size=32),
    provider=st.text(min_size=1, max_size=40),
    action=st.text(min_size=1, max_size=40),
    ordering_key=st.none() | st.text(max_size=60),
)
def test_a_fingerprint_reads_back_as_the_sender_wrote_it(
    digest: bytes, provider: str, action: str, ordering_key: str | None
) -> None:
    """Whatever text the provider, action and ordering key hold (quotes, backslashes, "%",
    semicolons, text past ASCII), the receiver reads back what the sender's headers carry."""
    intent = Intent("4cebe4fc-21b6-4c07-b313-c7510c7a24f8", digest, provider, ordering_key)
    headers = {
        name.lower(): value for name, value in intent_headers(intent, body_is_payload=True).items()
    }
    headers["outbox-action"] = header_safe(action)
    assert all(value.isascii() and value.isprintable() for value in headers.values())
    assert fingerprint_of(headers) == Fingerprint(digest, provider, action, ordering_key)


@pytest.mark.parametrize(
    ("value", "action", "reason"),
    [
        (':AAAA:;provider="p"', "a", "not a SHA-256"),
        (f":{'A' * 43}=:", "a", "without its provider"),
        (f':{"A" * 43}=:;provider="p"', None, "without its provider or Outbox-Action"),
        (f':{"A" * 43}=:;provider="%ff"', "a", "not percent-encoded UTF-8"),
        (f'{"A" * 43}=;provider="p"', "a", "not a SHA-256"),
        (f":{'A' * 43}=:;provider=p", "a", "not a SHA-256"),
    ],
)
def test_a_fingerprint_that_cannot_be_read_names_no_identity(
    value: str, action: str | None, reason: str
) -> None:
    headers = {"outbox-fingerprint": value}
    if action is not None:
        headers["outbox-action"] = action
    with pytest.raises(MissingIdentity, match=reason):
        fingerprint_of(headers)
    assert fingerprint_of({"outbox-action": "a"}) is None

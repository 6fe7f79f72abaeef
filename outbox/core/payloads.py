"""Payloads as the dispatcher carries them: decoded one row at a time, numbers kept exact.

A claim hands each payload over as PostgreSQL's own JSON text (``payload::text``), never as a
decoded object: a row whose payload cannot be decoded is that row's problem, quarantined on its
own, and never the claim's (a `json.loads` error in the claim's fetch once stopped the process
with a whole batch leased). Numbers that are not integers decode as ``decimal.Decimal``, so a
payment payload's ``19.999999999999999999`` reaches the provider as written, not as 20.0; the
limits below are the ones ``outbox.enqueue`` enforces at the door (sql/0019), checked again here
for rows written before it did.

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator, Mapping
from decimal import Decimal
from typing import Any, Final

# The deepest nesting of objects and arrays a payload may have: the payload object is level 1.
# Far beyond any request body a provider takes, far below the recursion limits of the decoders
# and encoders a payload meets on its way (Python's json, the Stripe SDK's form encoder).
MAX_DEPTH: Final = 64
# The largest JSON number, as digits before the decimal point: every number is less than 1e100 in
# magnitude. An amount in the smallest unit of any currency or token fits many times over; a
# number of thousands of digits is no amount (jsonb writes 1e5000 out as 5,001 digits), and
# Python refuses to turn more than 4,300 digits into an integer at all.
MAX_NUMBER_DIGITS: Final = 100


class InvalidPayload(ValueError):
    """The stored payload cannot be carried to a provider; the message says why (never what)."""


def carried(text: str) -> Mapping[str, Any]:
    """The payload of ``text`` (PostgreSQL's JSON text) as the dispatcher hands it to a
    provider: a mapping decoded on first use, since a webhook or a queue sends the text itself and
    never looks; or InvalidPayload now, with the reason decode() would give.

    The verdict is read from the text (_problem), never by building the object: a payload dense
    with brackets costs a provider that sends the text a pass of a regular expression, not the
    decoding's allocations (bench/payload_decode.py has both).
    """
    problem = _problem(text)
    if problem is not None:
        raise InvalidPayload(problem)
    return Decoded(text)


class Decoded(Mapping[str, Any]):
    """A payload object decoded the first time it is read, and kept until release(). Made by
    carried(), whose verdict stands: the text is an object within the limits, so decoding it
    needs none of decode()'s checks again."""

    __slots__ = ("_text", "_value")

    def __init__(self, text: str) -> None:
        self._text = text
        self._value: dict[str, Any] | None = None

    def release(self) -> None:
        """Let the decoded object go; read again, it is decoded again. The dispatcher calls it
        once the provider has built its request: a call in flight then holds its request, not a
        decoded payload of up to ~13 MB (bench/payload_decode.py)."""
        self._value = None

    def value(self) -> dict[str, Any]:
        """The decoded object itself (a contract's check reads it whole)."""
        return self._object()

    def _object(self) -> dict[str, Any]:
        if self._value is None:
            self._value = _scan(_EXACT, self._text)  # an object: carried's verdict
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._object()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._object())

    def __len__(self) -> int:
        return len(self._object())

    def __repr__(self) -> str:
        return "Decoded(...)"  # never the payload itself: reprs reach logs


def decode(text: str) -> dict[str, Any]:
    """The payload object of ``text`` (PostgreSQL's JSON text), numbers exact.

    Raises InvalidPayload if it is not a JSON object, nests deeper than MAX_DEPTH, or holds a
    number of more than MAX_NUMBER_DIGITS digits before its point; of these, the first that
    applies in that order (the number, the kind, the depth). The message never quotes the
    payload.
    """
    # PostgreSQL writes every number out in full (1e5000 as 5,001 digits): only a text with a
    # run of that many digits can hold one too large, and only it pays for the checking decoder.
    decoder = _CHECKING if _LONG_RUN.search(text) else _EXACT
    try:
        value = _scan(decoder, text)
    except RecursionError:
        # Deeper than the scanner goes (some hundreds of levels, fewer the deeper the caller's
        # stack): the text says what a shallower one would be refused for, the same anywhere.
        problem = _problem(text.lstrip(_JSON_SPACE))
        raise InvalidPayload(problem or _too_deep()) from None
    except InvalidPayload:
        raise
    except ValueError as exc:
        # json's own messages give a position, never the text.
        raise InvalidPayload(f"the payload is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidPayload(f"the payload is a JSON {_kind(value)}, not an object")
    if _nests_deeper(text):
        raise InvalidPayload(_too_deep())
    return value


def _problem(text: str) -> str | None:
    """Why decode() would refuse ``text``, PostgreSQL's JSON text, read from the text alone, or
    None. What PostgreSQL writes is valid JSON with every number in full and no space before
    its value, so its first character says its kind, a number of 1e100 or more is an integer part
    of more than 100 digits, and its depth is that of its brackets, those in strings aside. A
    usual payload (few brackets, no long run of digits) costs three looks and no pass at all.
    """
    if _LONG_RUN.search(text) and _LONG_INTEGER.search(_STRING.sub('""', text)):
        return _too_large()
    if not text.startswith("{"):
        return f"the payload is a JSON {_KINDS.get(text[:1], 'number')}, not an object"
    if _nests_deeper(text):
        return _too_deep()
    return None


def _nests_deeper(text: str) -> bool:
    """Whether the brackets of ``text``, valid JSON, nest deeper than MAX_DEPTH: a text with
    fewer brackets cannot, any other is matched against _WITHIN_DEPTH, in one linear pass."""
    return text.count("[") + text.count("{") > MAX_DEPTH and not _WITHIN_DEPTH.fullmatch(text)


def _scan(decoder: json.JSONDecoder, text: str) -> Any:
    """``decoder.decode(text)`` with the cyclic collector paused. A payload of 100,000 empty
    arrays is 100,000 tracked containers made in one call, and the collector, left on, walks the
    growing payload again and again: 20 of the 27 ms it took. A payload holds no cycles, so its
    containers go by their counts, and the collector runs again with the next allocations."""
    enabled = gc.isenabled()  # an application that turned it off keeps it off
    gc.disable()
    try:
        return decoder.decode(text)
    finally:
        if enabled:
            gc.enable()


def _integer(text: str) -> int:
    if len(text) - text.startswith("-") > MAX_NUMBER_DIGITS:
        raise InvalidPayload(_too_large())
    return int(text)


def _exact_number(text: str) -> Decimal:
    number = Decimal(text)
    if number.is_finite() and number and number.adjusted() >= MAX_NUMBER_DIGITS:
        raise InvalidPayload(_too_large())
    return number


def _no_constant(name: str) -> Any:
    raise InvalidPayload(f"the payload holds {name}, which is not JSON")


# The decoders, made once: json.loads with a hook builds a new decoder on every call, which was
# a fifth of the decoding's cost. The usual one leaves integers to the C scanner and makes every
# other number a Decimal; the checking one also bounds each number's size.
_EXACT: Final = json.JSONDecoder(parse_float=Decimal, parse_constant=_no_constant)
_CHECKING: Final = json.JSONDecoder(
    parse_float=_exact_number, parse_int=_integer, parse_constant=_no_constant
)
_LONG_RUN: Final = re.compile(f"[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")

# The textual verdict's patterns, each linear in the text: possessive quantifiers never give
# back what they took, so no input makes them backtrack.
# A JSON string, escapes included (a \" does not end it).
_STRING_PATTERN: Final = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_STRING: Final = re.compile(_STRING_PATTERN)
# An integer part of more than MAX_NUMBER_DIGITS digits, in a text with its strings emptied: a
# run not after a digit or a point (a fraction's digits make no number large).
_LONG_INTEGER: Final = re.compile(f"(?<![0-9.])[0-9]{{{MAX_NUMBER_DIGITS + 1}}}")


def _within(depth: int) -> re.Pattern[str]:
    """A pattern whose full match is a text that nests at most ``depth`` brackets deep, strings
    skipped whole: one nested group per level. Types are not paired ("[" with "}"): the texts
    it reads are valid JSON, where they always pair."""
    flat = r'[^"\[\]{}]++|' + _STRING_PATTERN
    content = f"(?:{flat})*+"
    for _ in range(depth):
        content = rf"(?:{flat}|[\[{{]{content}[\]}}])*+"
    return re.compile(content)


_WITHIN_DEPTH: Final = _within(MAX_DEPTH)
# A value's kind by its first character, as PostgreSQL writes it (anything else: a number).
_KINDS: Final = {"[": "array", '"': "string", "n": "null", "t": "boolean", "f": "boolean"}
_JSON_SPACE: Final = " \t\n\r"


def _too_large() -> str:
    return f"the payload holds a number of 1e{MAX_NUMBER_DIGITS} or more in magnitude"


def _too_deep() -> str:
    return f"the payload nests deeper than {MAX_DEPTH} levels"


def _kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return "number"


def encode(value: Any) -> str:
    """``value`` as compact JSON text, decimals written exactly (json.dumps cannot: it writes a
    Decimal only by way of float). For payloads that come without their stored text."""
    return "".join(_encode(value))


def _encode(value: Any) -> Any:
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{value} is not a JSON number")
        yield str(value)
    elif isinstance(value, Mapping):
        yield "{"
        for n, (key, item) in enumerate(value.items()):
            if isinstance(key, int) and not isinstance(key, bool):
                key = str(key)  # noqa: PLW2901 (as json.dumps writes an integer key)
            if not isinstance(key, str):
                raise TypeError(f"a JSON object's keys are strings, not {type(key).__name__}")
            yield ("," if n else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from _encode(item)
        yield "}"
    elif isinstance(value, list | tuple):
        yield "["
        for n, item in enumerate(value):
            if n:
                yield ","
            yield from _encode(item)
        yield "]"
    else:
        yield json.dumps(value, ensure_ascii=False, allow_nan=False)

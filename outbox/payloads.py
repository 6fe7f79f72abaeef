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
    provider: a mapping decoded on first use, since a webhook sends the text itself and never
    looks; or InvalidPayload now, with decode()'s reasons.

    What PostgreSQL writes is valid JSON, so three looks at the text decide what decode() would:
    an object starts with "{"; a number of 1e100 or more is a run of more than 100 digits;
    nesting past MAX_DEPTH takes more brackets than that. Only a text that fails a look is
    decoded now, for the verdict.
    """
    if (
        not text.startswith("{")
        or _LONG_RUN.search(text)
        or text.count("[") + text.count("{") > MAX_DEPTH
    ):
        return decode(text)
    return Decoded(text)


class Decoded(Mapping[str, Any]):
    """A payload object decoded (by decode()) the first time it is read."""

    __slots__ = ("_text", "_value")

    def __init__(self, text: str) -> None:
        self._text = text
        self._value: dict[str, Any] | None = None

    def _object(self) -> dict[str, Any]:
        if self._value is None:
            self._value = decode(self._text)
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
    number of more than MAX_NUMBER_DIGITS digits before its point. The message never quotes
    the payload.
    """
    # PostgreSQL writes every number out in full (1e5000 as 5,001 digits): only a text with a
    # run of that many digits can hold one too large, and only it pays for the checking decoder.
    decoder = _CHECKING if _LONG_RUN.search(text) else _EXACT
    try:
        value = decoder.decode(text)
    except RecursionError:
        raise InvalidPayload(f"the payload nests deeper than {MAX_DEPTH} levels") from None
    except InvalidPayload:
        raise
    except ValueError as exc:
        # json's own messages give a position, never the text.
        raise InvalidPayload(f"the payload is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidPayload(f"the payload is a JSON {_kind(value)}, not an object")
    # Nesting past MAX_DEPTH takes more brackets than that: the usual payload skips the walk.
    if text.count("[") + text.count("{") > MAX_DEPTH and _depth_exceeds(value, MAX_DEPTH):
        raise InvalidPayload(f"the payload nests deeper than {MAX_DEPTH} levels")
    return value


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


def _too_large() -> str:
    return f"the payload holds a number of 1e{MAX_NUMBER_DIGITS} or more in magnitude"


def _depth_exceeds(value: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit``; iterative, so depth costs no stack."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if level > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, level + 1) for c in children if isinstance(c, dict | list))
    return False


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

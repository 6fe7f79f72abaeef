"""JSON pointers (RFC 6901): where an `http` provider finds a reference, a state or a field,
and where the inbox finds a delivery's key in its body (``KeyFrom.json_pointer``). In core, not
in providers, because the inbox must not depend on the sending half.

A pointer is parsed once, when the configuration is read, so that a typo is a ConfigError at
startup and never a surprise on the first answer. Reading never raises: an answer that does not
have the pointed-at member simply has no value there (``MISSING``), since an answer is the
provider's text and may be anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final


class _Missing:
    """Nothing at the pointer (distinct from a JSON null)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


class PointerError(ValueError):
    """The text is not a JSON pointer."""


@dataclass(frozen=True, slots=True)
class Pointer:
    """A parsed pointer; ``tokens`` is empty for "" (the whole document)."""

    text: str
    tokens: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Pointer:
        if text == "":
            return cls(text, ())
        if not text.startswith("/"):
            raise PointerError(f"{text!r} is not a JSON pointer: it starts with '/' (or is '')")
        parts = text[1:].split("/")
        for part in parts:
            # "~" is an escape: only "~0" (a "~") and "~1" (a "/") are defined.
            if part.replace("~0", "").replace("~1", "").count("~"):
                raise PointerError(f"{text!r} is not a JSON pointer: '~' is followed by 0 or 1")
        return cls(text, tuple(p.replace("~1", "/").replace("~0", "~") for p in parts))

    def read(self, document: Any) -> Any:
        """The value at this pointer in ``document``, or MISSING."""
        value = document
        for token in self.tokens:
            value = _step(value, token)
            if value is MISSING:
                return MISSING
        return value

    def with_value(self, document: Mapping[str, Any], value: Any) -> dict[str, Any]:
        """A copy of the object ``document`` with ``value`` at this pointer, whose parents must
        be objects (created when absent). Raises TypeError where a parent is no object."""
        if not self.tokens:
            raise ValueError("the whole document cannot be replaced by a field")
        copy = dict(document)
        node = copy
        for token in self.tokens[:-1]:
            child = node.get(token, {})
            if not isinstance(child, Mapping):
                raise TypeError(f"{self.text}: a parent of the field is not an object")
            node[token] = dict(child)
            node = node[token]
        node[self.tokens[-1]] = value
        return copy

    def __str__(self) -> str:
        return self.text


def _step(value: Any, token: str) -> Any:
    if isinstance(value, Mapping):
        return value.get(token, MISSING)
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        # An array index is digits without a leading zero (RFC 6901 section 4).
        if not token.isascii() or not token.isdigit() or (len(token) > 1 and token[0] == "0"):
            return MISSING
        index = int(token)
        return value[index] if index < len(value) else MISSING
    return MISSING

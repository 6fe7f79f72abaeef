"""What an `http` provider sends for each action, and how it reads the answers: the parsed form
of its configuration (outbox.providers.http.config reads it; docs/providers.md documents it).

Pure: no I/O. Everything here is checked when the configuration is read, so that a provider
that starts can build every request its configuration describes.
"""

from __future__ import annotations

import functools
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

from outbox.core.json_pointer import MISSING, Pointer
from outbox.providers.base import InvalidRequest
from outbox.providers.kit import KeySpec

# The longest text a payload field may put into a URL: far past any identifier, far below what
# a server takes in a request line.
MAX_PLACEHOLDER_CHARS: Final = 1024
_PLACEHOLDER: Final = re.compile(r"\{([^{}]*)\}")
# What a template's literal text may hold: RFC 3986 path and query characters (no "#", no
# space, no "\\", which some servers read as "/").
_LITERAL: Final = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@/?%]*")


@dataclass(frozen=True, slots=True)
class Template:
    """A request target below the base URL: literal text and placeholders, each ``("", text)``
    or ``(kind, name)`` with kind "key", "operation_id" or "payload" (a JSON pointer)."""

    text: str
    parts: tuple[tuple[str, str], ...]

    @classmethod
    def parse(cls, text: str, *, target: bool = True) -> Template:
        """``text`` as a request target (``target``), or as a value to compare (a lookup's
        ``match``: any text)."""
        if not target:
            return cls(text, cls._parts(text))
        if not text.startswith("/"):
            raise ValueError(f"{text!r} must start with '/': a path below base_url")
        parts = cls._parts(text)
        for kind, literal in parts:
            if not kind and not _LITERAL.fullmatch(literal):
                raise ValueError(f"{text!r} holds characters a URL cannot carry as they are")
        if text.startswith("//"):
            raise ValueError(f"{text!r} would name another host")
        return cls(text, parts)

    @staticmethod
    def _parts(text: str) -> tuple[tuple[str, str], ...]:
        parts: list[tuple[str, str]] = []
        at = 0
        for match in _PLACEHOLDER.finditer(text):
            parts.append(("", text[at : match.start()]))
            parts.append(_placeholder(match.group(1)))
            at = match.end()
        parts.append(("", text[at:]))
        return tuple(p for p in parts if p != ("", ""))

    @classmethod
    def literal(cls, text: str) -> Template:
        """A fixed target, taken as it is (the webhook preset's URL path and query)."""
        return cls(text, (("", text),))

    @property
    def uses_key(self) -> bool:
        return any(kind == "key" for kind, _ in self.parts)

    @property
    def parts_vary(self) -> bool:
        """Whether it names a value of the operation (its key, id or a payload value)."""
        return any(kind for kind, _ in self.parts)

    def render(
        self, payload: Mapping[str, Any], *, key: str, operation_id: int, escape: bool = True
    ) -> str:
        """The target with each placeholder's value percent-encoded whole (``escape``), so no
        value can add a path segment, a query or a fragment. Raises InvalidRequest for a
        payload without a value the template needs."""
        out: list[str] = []
        for kind, name in self.parts:
            if not kind:
                out.append(name)
                continue
            if kind == "key":
                value = key
            elif kind == "operation_id":
                value = str(operation_id)
            else:
                value = segment(payload, name)
            out.append(urllib.parse.quote(value, safe="") if escape else value)
        return "".join(out)


def _placeholder(name: str) -> tuple[str, str]:
    if name in ("key", "operation_id"):
        return name, name
    if name.startswith("/"):
        Pointer.parse(name)
        return "payload", name
    raise ValueError(
        f"{{{name}}} is no placeholder: use {{key}}, {{operation_id}} or a JSON pointer into "
        "the payload such as {/order_id}"
    )


@functools.lru_cache(maxsize=1024)
def _parsed(text: str) -> Pointer:
    return Pointer.parse(text)


def segment(payload: Mapping[str, Any], pointer: str) -> str:
    """The payload's text at ``pointer`` for a URL: a non-empty string or an integer. "." and
    ".." are refused, since a server or proxy may resolve them as path steps."""
    value = _parsed(pointer).read(payload)
    if value is MISSING:
        raise InvalidRequest(f"the payload has no {pointer}, which the request's URL needs")
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidRequest(f"the payload's {pointer} is no string or integer, for the URL")
    text = str(value)
    steps = re.split(r"[/\\]", text)  # as a server that decodes %2F or %5C first sees it
    if not text or any(s in (".", "..") for s in steps) or len(text) > MAX_PLACEHOLDER_CHARS:
        raise InvalidRequest(
            f"the payload's {pointer} cannot stand in a URL (empty, a dot step or too long)"
        )
    return text


@dataclass(frozen=True, slots=True)
class StatusRule:
    """An answer's status, and optionally a value of its JSON body (``at``, among ``values``):
    PayPal says "already captured" as 422 with a detail, Adyen "refused" as 200 with a
    resultCode."""

    status: int
    at: Pointer | None = None
    values: frozenset[str] = frozenset()

    def matches(self, status: int, body: Any) -> bool:
        if status != self.status:
            return False
        if self.at is None:
            return True
        value = self.at.read(body)
        return (
            isinstance(value, str | int)
            and not isinstance(value, bool)
            and str(value) in self.values
        )


# The classes an action's status overrides name, in the order they are tried: what each means is
# in docs/providers.md ("Answers").
CLASSES: Final = ("done", "refused", "in_use", "transient", "unknown", "permanent")


@dataclass(frozen=True, slots=True)
class LookupSpec:
    """How to ask the provider for an operation's effect, and how to read the answer."""

    method: str
    target: Template
    found: frozenset[int] = frozenset({200})
    not_found: frozenset[int] = frozenset({404})
    items: Pointer | None = None  # an array of candidates in the answer (a list endpoint)
    # Where a list answer says there is more than its page: a true value (``has_more``), or a
    # count (``total_count``) above the items it holds. Either makes a not-found incomplete.
    more: Pointer | None = None
    total: Pointer | None = None
    state: Pointer | None = None
    done: frozenset[str] = frozenset()
    refused: frozenset[str] = frozenset()
    absent: frozenset[str] = frozenset()  # the object exists, the effect did not happen
    reference: Pointer | None = None
    # A candidate counts only where its value at ``match_at`` is ``match`` filled in: a list
    # endpoint that ignored its filter must not hand over someone else's effect.
    match_at: Pointer | None = None
    match: Template | None = None
    # How long after the first send the provider can still find the effect: past it, "not
    # found" proves nothing. None: as long as the provider keeps its objects.
    retention: timedelta | None = None


WHOLE: Final = Pointer("", ())  # the whole payload
ID: Final = Pointer("/id", ("id",))


@dataclass(frozen=True, slots=True)
class ActionSpec:
    method: str
    target: Template
    key: KeySpec
    key_retention: timedelta
    body: Pointer | None = WHOLE  # None: no body
    reference: Pointer = ID
    rules: Mapping[str, tuple[StatusRule, ...]] = field(default_factory=dict)
    lookup: LookupSpec | None = None
    # False for a provider that keeps no answer but a success under the key (Checkout.com): a
    # retry after a 500 that followed the effect would make a second one, so every unknown
    # outcome goes straight to reconciliation instead of being retried.
    retry_unknown: bool = True

    def classify(self, status: int, body: Any) -> str | None:
        """The configured class of an answer, or None: the default classification."""
        for name in CLASSES:
            if any(rule.matches(status, body) for rule in self.rules.get(name, ())):
                return name
        return None

"""Secrets kept out of what outbox shows: reprs, log lines and error messages.

One helper for every place that prints something a secret may hide in: :func:`scrub` masks the
secrets inside a text, :func:`redact` a structured value (a provider's options, say) by the names
of its keys. Each caller passes the marker it has always shown (``***`` in the config's reprs,
``[redacted]`` in logs, ``********`` for connection strings).

Pure: the standard library only, so the config, the logs and the database layer can all use it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

REDACTED: Final = "***"

# Names (of options, fields, headers) that might hold a secret, matched case-insensitively
# anywhere in the name.
SECRET_WORDS: Final = ("key", "secret", "token", "password", "authorization")

# Secrets that can hide inside any text: a password in a connection URL or a key=value string,
# and Stripe-style API keys. Each is replaced by the marker, after its first group when it keeps
# that, and before the suffix.
_PATTERNS: Final = (
    (re.compile(r"(://[^/:@\s]*:)[^@\s]+@"), True, "@"),
    (re.compile(r"(password\s*=\s*)('[^']*'|\S+)", re.IGNORECASE), True, ""),
    (re.compile(r"\b(sk|rk|pk)_(live|test)_[A-Za-z0-9]{6,}"), False, ""),
)
# Every pattern above needs one of these; most texts have none, and skip the regexes.
_HINTS: Final = ("@", "=", "_live_", "_test_")


def scrub(text: str, *, marker: str = REDACTED, known: Iterable[str | None] = ()) -> str:
    """``text`` with its secrets masked by ``marker``: each secret of ``known`` (a password the
    caller holds) wherever it appears, then the passwords of connection URLs and key=value
    strings, and Stripe-style API keys."""
    for secret in known:
        if secret:
            text = text.replace(secret, marker)
    if not any(hint in text for hint in _HINTS):
        return text
    for pattern, keep, suffix in _PATTERNS:
        text = pattern.sub(_replacement(marker, keep=keep, suffix=suffix), text)
    return text


def _replacement(marker: str, *, keep: bool, suffix: str) -> Callable[[re.Match[str]], str]:
    return lambda match: (match.group(1) if keep else "") + marker + suffix


def looks_secret(name: str) -> bool:
    """True when a key of this name might hold a secret (``api_key``, ``X-Auth-Token``...)."""
    lowered = name.lower()
    return any(word in lowered for word in SECRET_WORDS)


def redact(value: Any, *, marker: str = REDACTED) -> Any:
    """A copy of ``value`` fit to print: tables as dicts and arrays as lists, where every key that
    :func:`looks_secret` has its value replaced by ``marker`` (a table under such a key keeps its
    names, which help, and loses its values), and every text is :func:`scrub`-bed."""
    if isinstance(value, Mapping):
        shown: dict[Any, Any] = {}
        for key, item in value.items():
            if not looks_secret(str(key)):
                shown[key] = redact(item, marker=marker)
            elif isinstance(item, Mapping):
                shown[key] = dict.fromkeys(item, marker)
            else:
                shown[key] = marker
        return shown
    if isinstance(value, list | tuple):
        return [redact(item, marker=marker) for item in value]
    if isinstance(value, str):
        return scrub(value, marker=marker)
    return value

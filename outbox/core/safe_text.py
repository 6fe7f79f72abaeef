"""Text from people and providers, shown safely: stored as given, escaped when printed.

A reason, an actor, a provider's reason phrase or error code may hold a newline that renders as
a fake audit row, an ANSI escape that erases a line or recolours a terminal, or a Unicode
direction override that shows text reversed. Every table and console log line passes its text
through ``printable``: control and format characters become visible escapes (``\\x1b``,
``\\n``, ``\\u202e``), everything else is left alone.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Final

# Cc: C0, DEL and C1 controls; Cf: format characters (bidi overrides, zero-width joiners);
# Zl and Zp: the line and paragraph separators.
_UNSAFE: Final = frozenset({"Cc", "Cf", "Zl", "Zp"})
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape."""
    if text.isprintable():  # the usual case: nothing to do, and no walk in Python
        return text
    return "".join(_escape(ch) for ch in text)


@lru_cache(maxsize=256)
def _escape(ch: str) -> str:
    if ch == " " or unicodedata.category(ch) not in _UNSAFE:
        return ch
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

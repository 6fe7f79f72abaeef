"""What an operation's payload must be for Relay: ``{"to": "+<E.164 number>", "text": "..."}``.

Checked before anything is sent (``Provider.check``, and again in ``send``, which outbox may call
without it): a payload Relay would refuse every time is quarantined at once instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from outbox.providers.base import InvalidRequest

ACTION: Final = "sms.send"
MAX_TEXT: Final = 1600  # characters: ten concatenated SMS, Relay's limit
_E164: Final = re.compile(r"\+[1-9][0-9]{6,14}")


def message(action: str, payload: Mapping[str, Any]) -> dict[str, str]:
    """The JSON body Relay takes for this operation; InvalidRequest says why there is none."""
    if action != ACTION:
        raise InvalidRequest(f"relay_sms cannot do {action[:64]!r}; it can do {ACTION!r}")
    to, text = payload.get("to"), payload.get("text")
    if not isinstance(to, str) or not _E164.fullmatch(to):
        raise InvalidRequest('the payload\'s "to" must be a phone number such as "+15551234567"')
    if not isinstance(text, str) or not 0 < len(text) <= MAX_TEXT:
        raise InvalidRequest(f'the payload\'s "text" must be 1 to {MAX_TEXT} characters')
    return {"to": to, "text": text}

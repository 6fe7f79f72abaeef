"""Fault-injection points for the fault tests: a pause at a named point of the dispatch path, or
of an inbox queue consumer's.

Set ``OUTBOX_FAILPOINTS="after_claim=30"`` to sleep 30 seconds right after a claim commits; a test
then SIGKILLs the process inside that exact window. Unset (always, in production), a failpoint
costs one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import os
from typing import Final

AFTER_CLAIM: Final = "after_claim"  # leased, nothing sent yet
BEFORE_RECORD: Final = "before_record"  # the provider answered; nothing recorded yet
# A queue consumer's message committed and is to be acknowledged; not acknowledged yet.
INBOX_BEFORE_ACK: Final = "inbox_before_ack"
# A simulated bug, once per process: a transaction locking the row is left open before the send
# (its value: the session's idle-in-transaction timeout in seconds, so a test need not wait 60).
LEAK_TRANSACTION: Final = "leak_transaction"
# A simulated bug: the first N rounds of every background loop raise (its value: N), and so does
# the dispatch of the first N operations, before their send.
BUG: Final = "bug"


class SimulatedBug(RuntimeError):
    """Raised where the BUG failpoint says: stands for any exception nobody foresaw."""


_bugs: dict[str, int] = {}


def bug(where: str) -> None:
    """Raise SimulatedBug for the first N calls with ``where`` while BUG=N is set."""
    limit = _ACTIVE.get(BUG)
    if limit is None:
        return
    count = _bugs[where] = _bugs.get(where, 0) + 1
    if count <= limit:
        raise SimulatedBug(f"failpoint {BUG} in {where} ({count} of {limit:g})")


def _parse(spec: str) -> dict[str, float]:
    points: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, seconds = item.partition("=")
        points[name.strip()] = float(seconds or "0")
    return points


_ACTIVE: Final = _parse(os.environ.get("OUTBOX_FAILPOINTS", ""))


def take(name: str) -> float | None:
    """The failpoint's value, once: later calls get None."""
    return _ACTIVE.pop(name, None)


def armed(name: str) -> bool:
    """Whether the failpoint ``name`` is set: lets a hot path skip ``hit``'s await."""
    return name in _ACTIVE


async def hit(name: str) -> None:
    """Pause here if the failpoint ``name`` is set."""
    seconds = _ACTIVE.get(name)
    if seconds:
        await asyncio.sleep(seconds)

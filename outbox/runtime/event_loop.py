"""Which asyncio event loop `outbox run` runs on: uvloop where it is installed, else asyncio's.

uvloop (libuv under asyncio's interface) runs the dispatcher's per-operation tasks, futures and
socket callbacks with less CPU than the standard loop: in bench/throughput.py's A/B it cut the
dispatcher's CPU per operation by about a fifth. ``dispatcher.event_loop = "asyncio"`` keeps the
standard loop, for a platform without uvloop or to rule the loop out while debugging.
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

T = TypeVar("T")

EVENT_LOOPS: Final = ("auto", "uvloop", "asyncio")


def uvloop_available() -> bool:
    """Whether uvloop can be imported here (it is not built for Windows)."""
    return importlib.util.find_spec("uvloop") is not None


def chosen(setting: str) -> str:
    """The loop that ``setting`` (one of EVENT_LOOPS, already checked) runs on."""
    if setting == "auto":
        return "uvloop" if uvloop_available() else "asyncio"
    return setting


def run(main: Coroutine[Any, Any, T], setting: str) -> T:
    """Run ``main`` to completion on the loop ``setting`` names, as asyncio.run would."""
    if chosen(setting) == "uvloop":
        import uvloop  # noqa: PLC0415 (optional: absent where it is not built)

        return uvloop.run(main)
    return asyncio.run(main)

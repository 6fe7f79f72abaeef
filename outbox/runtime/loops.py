"""Background loops that outlive whatever their rounds raise.

One row, one answer or one bug must never end a loop of `outbox run`: a loop that dies takes its
duty with it (leases no longer renewed, dead workers' rows never rescued, gauges frozen at their
last values) while the process looks alive. Expected failures (the database away) are handled
inside each round; this is for the rest: logged with the traceback, counted in
``outbox_internal_errors_total{loop}``, and the round tried again a little later.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, NoReturn

import structlog

from outbox.observability import metrics
from outbox.runtime import failpoints

# A round that raised is tried again after this long: soon enough that a passing fault costs
# little, slow enough that a fault that repeats is not a busy loop filling the log.
ERROR_PAUSE: Final = 1.0

# Every loop that counts its exceptions. Their counters exist at 0 from the start: a counter
# born at its first increment would hide that first one from increase() and the alert.
LOOPS: Final = (
    "claim",
    "dispatch",
    "heartbeat",
    "rescue",
    "ordering_repair",
    "stage",
    "gauges",
    "reconcile",
    "listen",
    "readiness",
    "health",
)
for _name in LOOPS:
    metrics.INTERNAL_ERRORS.labels(_name)

log = structlog.get_logger("outbox.loops")


async def wait_event(event: asyncio.Event, seconds: float) -> bool:
    """Wait for ``event`` at most ``seconds``; True if it was set. Not asyncio.wait_for: on
    Python 3.11 a wait_for whose inner wait ends in the same loop turn as a cancellation swallows
    the cancellation (CPython gh-86296), and a background loop cancelled at shutdown then never
    ends; `outbox run` hung at SIGTERM that way when a last record nudged the stager."""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        return False
    return True


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], *, again_after: float = 1.0) -> None:
    """Cancel background tasks and wait until every one has ended, cancelling again those still
    running after ``again_after`` seconds. Once is not always enough on Python 3.11: a
    cancellation that arrives in the loop turn an inner wait_for ends is swallowed (CPython
    gh-86296), inside our code or a library's (psycopg_pool's getconn): the task goes on, and a
    single cancel() and gather() waited for it for ever at shutdown."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=again_after)


async def forever(name: str, round_: Callable[[], Awaitable[float]]) -> NoReturn:
    """Run ``round_`` again and again; each returns how many seconds to wait before the next."""
    while True:
        wait = await survive(name, round_, ERROR_PAUSE)
        if wait > 0:
            await asyncio.sleep(wait)


async def survive(name: str, round_: Callable[[], Awaitable[float]], fallback: float) -> float:
    """One round of loop ``name``: what it returns, or ``fallback`` if it raised."""
    try:
        if failpoints.armed(failpoints.BUG):
            failpoints.bug(name)
        return await round_()
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 (the point: nothing ends the loop)
        note(name)
        return fallback


def note(name: str) -> None:
    """Count and log the exception being handled, raised in loop ``name``."""
    metrics.INTERNAL_ERRORS.labels(name).inc()
    log.exception("a loop of outbox run failed; it goes on", loop=name)

"""LISTEN for enqueue notifications on a dedicated connection, and wake the dispatcher.

Polling is the fallback: while this connection is down, the dispatcher still claims every
``poll_interval``. A dead connection is noticed by a probe after each quiet spell (and by TCP
keepalives) and re-established with backoff.

LISTEN needs a server session of its own: through a transaction-mode pooler the notifications go
to whichever client holds the session next, that is, nowhere. The daemon then listens on a direct
URL (``database.listen_url``), or not at all and polls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import psycopg
import structlog

from outbox.db import statements
from outbox.db.connect import answered_by_pooler, connection_options
from outbox.observability import metrics
from outbox.runtime import failpoints, loops

# How long the connection may stay quiet before a probe checks that it still works.
PROBE_INTERVAL: Final = 5.0
PROBE_TIMEOUT: Final = 10.0
RECONNECT_MIN: Final = 0.2
RECONNECT_MAX: Final = 10.0

log = structlog.get_logger("outbox.wakeup")


def _ignore(listening: bool) -> None:
    """The default ``on_listening``: nobody needs to know."""


async def listen_forever(
    dsn: str,
    wake: Callable[[str], None],
    *,
    probe_interval: float = PROBE_INTERVAL,
    expect_direct: bool = False,
    on_listening: Callable[[bool], None] = _ignore,
) -> None:
    """Call ``wake`` with each notification's payload, until cancelled; survives lost
    connections.

    ``expect_direct``: ``dsn`` is meant to bypass a pooler; say so loudly when it does not.
    ``on_listening`` is told True once notifications can arrive, False when the connection is
    lost or this task ends: meanwhile only polling wakes the dispatcher.
    """
    delay = RECONNECT_MIN

    def connected() -> None:
        nonlocal delay
        delay = RECONNECT_MIN

    try:
        while True:
            try:
                if failpoints.armed(failpoints.BUG):
                    failpoints.bug("listen")
                await _listen(
                    dsn,
                    wake,
                    probe_interval,
                    connected=connected,
                    expect_direct=expect_direct,
                    on_listening=on_listening,
                )
            except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
                on_listening(False)
                metrics.DB_ERRORS.labels("listen").inc()
                log.warning(
                    "LISTEN connection lost; reconnecting",
                    error_class=type(exc).__name__,
                    retry_in_s=round(delay, 2),
                )
            except Exception:  # noqa: BLE001 (wake-ups must outlive whatever went wrong)
                on_listening(False)
                loops.note("listen")
            await asyncio.sleep(delay)
            delay = min(delay * 2, RECONNECT_MAX)
    finally:
        on_listening(False)


async def _listen(
    dsn: str,
    wake: Callable[[str], None],
    probe_interval: float,
    *,
    connected: Callable[[], None],
    expect_direct: bool,
    on_listening: Callable[[bool], None],
) -> None:
    options = connection_options(dsn, "outbox-listen")
    # Nothing here gains from preparing, and a mistaken pooled URL must not fail on it.
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, prepare_threshold=None, **options
    ) as conn:
        await conn.execute(statements.LISTEN)
        connected()
        if expect_direct and await answered_by_pooler(conn):
            log.warning(
                "the LISTEN URL does not reach PostgreSQL directly: through a transaction-mode "
                "pooler notifications are lost and only polling wakes the dispatcher; point "
                "database.listen_url at the server itself"
            )
        else:
            on_listening(True)
        log.info("listening for enqueue notifications", channel=statements.ENQUEUE_CHANNEL)
        # Anything committed while we were not listening sent its NOTIFY to nobody, and may
        # have taken this dispatcher's mark.
        wake(statements.WAKE_TAKEN)
        while True:
            async for notification in conn.notifies(timeout=probe_interval):
                wake(notification.payload)
            await _probe(conn)


async def _probe(conn: psycopg.AsyncConnection[Any]) -> None:
    """One round trip, bounded: a peer gone silent while the kernel still acknowledges (a hung
    proxy, a frozen server) defeats keepalives, and would leave us listening to nothing."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT):
            await conn.execute(statements.PROBE)
    except TimeoutError as exc:
        raise psycopg.OperationalError(
            f"no answer to a probe within {PROBE_TIMEOUT:.0f} s"
        ) from exc

"""A queue consumer's messages under way, one task each, and how a stop drains them.

On a stop (the ``stop`` event set, or the consuming task cancelled) a consumer takes no more
messages, lets the ones under way finish for ``grace`` seconds, and cuts short the rest: each is
rolled back and given back to its broker at once, never acknowledged (docs/design.md, "Queue
consumers", "A stop drains"). Only what settle returned, after its COMMIT, is ever acknowledged.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Final

import structlog

from outbox.inbox.queues import Consumer, Settled, Verdict
from outbox.runtime import failpoints

# Seconds the messages under way get to finish after a stop: with CUT_SHORT_WAIT, inside
# Kubernetes' default 30 s termination grace period, with 5 s left for closing the connections
# before SIGKILL.
DEFAULT_GRACE: Final = 20.0
# Seconds the messages cut short get to roll back and be given back. A broker that does not
# answer in time redelivers them anyway, after its ack wait or visibility timeout.
CUT_SHORT_WAIT: Final = 5.0
log = structlog.get_logger("outbox.inbox")

Answer = Callable[[Settled], Awaitable[None]]  # tells the broker a settled message's verdict
GiveBack = Callable[[], Awaitable[None]]  # hands a message back, to be delivered again at once


class InFlight:
    """The messages one ``consume`` is handling, each in a task of its own so that a stop can
    wait for them, and cut short only those that outlast its grace."""

    def __init__(self, consumer: Consumer, stop: asyncio.Event) -> None:
        self.consumer = consumer
        self.stop = stop
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False  # the consume is on its way out: it takes nothing more

    def __len__(self) -> int:
        return len(self._tasks)

    def take(
        self, headers: Mapping[str, str], body: bytes, answer: Answer, give_back: GiveBack
    ) -> None:
        """Handle one message in a task of its own. One that arrives after the stop (from a
        fetch under way when it came) is given back unread."""
        if self._closed or self.stop.is_set():
            work = _given_back(self.consumer.handler, give_back)
        else:
            work = handle(self.consumer, headers, body, answer, give_back)
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        """Take nothing more: what still arrives is given back unread."""
        self._closed = True

    async def room(self, limit: int) -> int:
        """How many more messages to take, waiting while ``limit`` are under way; 0 once the
        stop is set."""
        while len(self._tasks) >= limit and not self.stop.is_set():
            stopped = asyncio.create_task(self.stop.wait())
            try:
                await asyncio.wait({*self._tasks, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
        return 0 if self.stop.is_set() else limit - len(self._tasks)

    async def drain(self, grace: float) -> None:
        """Let the messages under way finish within ``grace`` seconds, then cut the rest short.
        Cancelled meanwhile (a second stop), it cuts them all short at once."""
        self.close()
        under_way = len(self._tasks)
        try:
            if self._tasks:
                # asyncio.wait yields first: every task has begun, and so will reach its give-back
                # if it is cancelled below.
                await asyncio.wait(set(self._tasks), timeout=grace)
        finally:
            cut_short = set(self._tasks)
            for task in cut_short:
                task.cancel()
        if cut_short:
            await asyncio.wait(cut_short, timeout=CUT_SHORT_WAIT)
        handler, cut = self.consumer.handler, len(cut_short)
        log.info("inbox consumer stopped", handler=handler, under_way=under_way, cut_short=cut)


@asynccontextmanager
async def draining(
    consumer: Consumer, stop: asyncio.Event, grace: float
) -> AsyncIterator[InFlight]:
    """The messages one ``consume`` takes, drained on its way out however it ends: its stop, a
    cancel of its task (passed on once drained), or a broker's error."""
    in_flight = InFlight(consumer, stop)
    try:
        yield in_flight
    finally:
        await in_flight.drain(grace)


async def handle(
    consumer: Consumer,
    headers: Mapping[str, str],
    body: bytes,
    answer: Answer,
    give_back: GiveBack,
) -> None:
    """Settle one message, then tell its broker the verdict. Cut short before that (its task
    cancelled: a stop's grace ran out), the message is given back, never acknowledged.

    A cut that lands while COMMIT is under way does not stop the COMMIT (Inbox.deliver shields
    it), and settle raises without knowing how it ended: so the message goes back here too. The
    give-back waits for the COMMIT to end all the same (on the way out, psycopg rolls back the
    delivery's connection, which waits on the connection's lock that the COMMIT holds), so the
    redelivery replays what committed and runs again what did not, never "in progress"."""
    try:
        settled = await consumer.settle(headers, body)
        if settled.verdict is Verdict.ACK and failpoints.armed(failpoints.INBOX_BEFORE_ACK):
            await failpoints.hit(failpoints.INBOX_BEFORE_ACK)
        await answer(settled)
    except asyncio.CancelledError:
        await _given_back(consumer.handler, give_back)
        raise


async def _given_back(handler: str, give_back: GiveBack) -> None:
    try:
        async with asyncio.timeout(CUT_SHORT_WAIT):
            await give_back()
    except Exception as exc:  # noqa: BLE001 (the broker redelivers it anyway, later)
        log.warning("inbox message not given back", handler=handler, error=type(exc).__name__)


def stop_on_signals(*signals: signal.Signals) -> asyncio.Event:
    """An event that the first SIGTERM or SIGINT (or ``signals``) sets: pass it as ``stop`` to a
    consume, so that the signal drains it. A second signal acts as if this were never called
    (SIGTERM ends the process at once; what it had not acknowledged is delivered again)."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    caught = signals or (signal.SIGTERM, signal.SIGINT)

    def on_signal(signum: signal.Signals) -> None:
        log.info("inbox consumer stopping", signal=signum.name)
        stop.set()
        for each in caught:
            loop.remove_signal_handler(each)

    for signum in caught:
        loop.add_signal_handler(signum, on_signal, signum)
    return stop

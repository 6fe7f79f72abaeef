"""A queue consumer's stop (outbox.inbox.draining): the messages under way finish within the
grace, the rest are given back and never acknowledged, whether the stop is the event or a
cancel. Here ``settle`` stands for the inbox (each message's body is how long its work takes);
tests/integration/test_inbox_queue_stop.py runs the real one against the brokers."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
import structlog

import outbox.inbox.draining as draining_module
from outbox.inbox import Inbox
from outbox.inbox.draining import InFlight, draining
from outbox.inbox.http import KeyFrom, TenantFrom
from outbox.inbox.queues import Consumer, Settled, Verdict

ACK = Settled(Verdict.ACK, "new")


@dataclass(frozen=True)
class Timed(Consumer):
    """Settles each message after as many seconds as its body says; ``commits`` shields that
    wait, as Inbox.deliver shields its COMMIT."""

    commits: bool = False
    ran: list[bytes] = field(default_factory=list)
    committed: list[bytes] = field(default_factory=list)

    async def settle(self, headers: Any, body: bytes) -> Settled:
        self.ran.append(body)
        if self.commits:
            await asyncio.shield(self._commit(body))
        else:
            await asyncio.sleep(float(body))
        return ACK

    async def _commit(self, body: bytes) -> None:
        await asyncio.sleep(float(body))
        self.committed.append(body)


def timed(*, commits: bool = False) -> Timed:
    async def never(*_: object) -> None:
        raise AssertionError("settle is replaced here")

    # No database: settle, overridden, never reaches the inbox.
    inbox = Inbox(cast(Any, None))
    return Timed(inbox, "stop.unit", never, KeyFrom.auto(), TenantFrom.header(), commits=commits)


class Broker:
    """What the consumer told the broker of each message, by name."""

    def __init__(self, give_back_fails: bool = False) -> None:
        self.told: dict[str, str] = {}
        self.give_back_fails = give_back_fails

    def send(self, in_flight: InFlight, name: str, seconds: float) -> None:
        async def answer(settled: Settled) -> None:
            self.told[name] = settled.verdict.value

        async def give_back() -> None:
            if self.give_back_fails:
                raise ConnectionError("the broker is gone")
            self.told[name] = "given back"

        in_flight.take({}, str(seconds).encode(), answer, give_back)


async def test_a_stop_lets_work_finish_within_the_grace_and_gives_back_the_rest() -> None:
    stop, broker = asyncio.Event(), Broker()
    in_flight = InFlight(timed(), stop)
    for name, seconds in (("a", 0.05), ("b", 0.2), ("c", 30)):
        broker.send(in_flight, name, seconds)
    stop.set()
    started = time.monotonic()
    await in_flight.drain(0.5)
    assert 0.5 <= time.monotonic() - started < 2
    assert broker.told == {"a": "ack", "b": "ack", "c": "given back"}
    assert len(in_flight) == 0


async def test_a_message_taken_after_the_stop_is_given_back_unread() -> None:
    stop, broker, consumer = asyncio.Event(), Broker(), timed()
    in_flight = InFlight(consumer, stop)
    stop.set()
    broker.send(in_flight, "late", 0)
    await in_flight.drain(5)
    assert broker.told == {"late": "given back"}
    assert consumer.ran == []


async def test_room_waits_for_a_slot_and_is_none_once_stopped() -> None:
    stop, broker = asyncio.Event(), Broker()
    in_flight = InFlight(timed(), stop)
    broker.send(in_flight, "a", 0.1)
    broker.send(in_flight, "b", 30)
    started = time.monotonic()
    assert await in_flight.room(2) == 1  # once "a" is done
    assert time.monotonic() - started >= 0.1
    broker.send(in_flight, "c", 30)
    asyncio.get_running_loop().call_later(0.1, stop.set)
    assert await in_flight.room(2) == 0  # full, until the stop
    await in_flight.drain(0)
    assert broker.told == {"a": "ack", "b": "given back", "c": "given back"}


async def test_a_cancel_of_the_consuming_task_drains_then_passes_the_cancel_on() -> None:
    stop, broker = asyncio.Event(), Broker()

    async def consuming() -> None:
        async with draining(timed(), stop, 0.5) as in_flight:
            broker.send(in_flight, "a", 0.1)
            broker.send(in_flight, "b", 30)
            await asyncio.sleep(60)

    task = asyncio.create_task(consuming())
    await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert broker.told == {"a": "ack", "b": "given back"}


async def test_a_second_cancel_during_the_drain_cuts_everything_short_at_once() -> None:
    stop, broker = asyncio.Event(), Broker()
    in_flight = InFlight(timed(), stop)
    broker.send(in_flight, "a", 30)
    draining_task = asyncio.create_task(in_flight.drain(30))
    await asyncio.sleep(0.05)
    draining_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await draining_task
    await asyncio.sleep(0.05)  # the cut-short task gives its message back on its own
    assert broker.told == {"a": "given back"}


async def test_a_cut_during_a_shielded_commit_is_given_back_never_acknowledged() -> None:
    # The COMMIT goes on after the cut; settle cannot say whether it ended well, so the message
    # goes back, and its redelivery replays what committed.
    stop, broker, consumer = asyncio.Event(), Broker(), timed(commits=True)
    in_flight = InFlight(consumer, stop)
    broker.send(in_flight, "a", 0.3)
    stop.set()
    await in_flight.drain(0.1)
    assert broker.told == {"a": "given back"}
    await asyncio.sleep(0.3)
    assert consumer.committed == [b"0.3"]


async def test_a_broker_that_cannot_take_a_message_back_is_logged_by_class_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A fresh logger: an earlier test in this process may have configured logging at warning
    # with cache_logger_on_first_use, and capture_logs cannot see through a cached logger.
    monkeypatch.setattr(draining_module, "log", structlog.get_logger("outbox.inbox"))
    stop, broker = asyncio.Event(), Broker(give_back_fails=True)
    in_flight = InFlight(timed(), stop)
    broker.send(in_flight, "a", 30)
    stop.set()
    with structlog.testing.capture_logs() as logs:
        await in_flight.drain(0.05)
    assert broker.told == {}
    failed, stopped = logs
    assert failed == {
        "event": "inbox message not given back",
        "handler": "stop.unit",
        "error": "ConnectionError",  # the class only: an exception's text may quote the message
        "log_level": "warning",
    }
    assert (stopped["event"], stopped["under_way"], stopped["cut_short"]) == (
        "inbox consumer stopped",
        1,
        1,
    )

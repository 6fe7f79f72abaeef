"""The background loops' own waits end when the loop is cancelled, whatever else happens in the
same turn (outbox.runtime.loops.wait_event)."""

from __future__ import annotations

import asyncio
import contextlib

from outbox.runtime import loops


async def _nudged_loop(event: asyncio.Event) -> None:
    while True:  # as the stager waits for its nudge
        event.clear()
        await loops.wait_event(event, 5)


async def test_a_loop_cancelled_in_the_turn_its_wait_ends_stops() -> None:
    """On Python 3.11 asyncio.wait_for swallowed the cancellation here, and `outbox run` hung at
    SIGTERM waiting for its stager."""
    for _ in range(20):
        event = asyncio.Event()
        task = asyncio.create_task(_nudged_loop(event))
        await asyncio.sleep(0.001)
        event.set()  # a last record nudges the loop ...
        await asyncio.sleep(0)  # ... and in the next turn the dispatcher cancels it
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=2)
        assert done == {task} and task.cancelled()


async def test_wait_event_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await loops.wait_event(event, 0.01)
    asyncio.get_running_loop().call_later(0.01, event.set)
    assert await loops.wait_event(event, 5)


async def _swallows_one_cancel() -> None:
    """A task that swallows the first cancellation, as a library's wait_for can on 3.11."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.sleep(10)
    await asyncio.sleep(10)


async def test_stop_tasks_cancels_again_what_swallowed_a_cancellation() -> None:
    tasks = [asyncio.create_task(_swallows_one_cancel()) for _ in range(3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(loops.stop_tasks(tasks, again_after=0.05), 5)
    assert all(task.done() for task in tasks)

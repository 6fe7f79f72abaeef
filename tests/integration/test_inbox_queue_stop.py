"""A queue consumer stopped during its work (issue 40), on NATS JetStream, RabbitMQ and SQS
(moto): a real consumer process (tests/support/queue_consumer.py) is stopped with SIGTERM while
its handlers sleep mid-transaction, or SIGKILLed between a COMMIT and its ack; then a second
process takes over. Whatever happened, each message ends as exactly one business row, written
by one run of the handler that committed (docs/design.md, "Queue consumers", "A stop drains").
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path
from typing import Final

import psycopg
import pytest

from tests.support.moto_server import aws_env, moto
from tests.support.queue_beds import (
    GRACE,
    Bed,
    active_sessions,
    bed,
    events,
    redeliver_after,
    rows_by_message,
    settled,
    start,
    wait_held,
    wait_until,
)
from tests.support.queue_consumer import prepare

__all__ = ["aws_env", "bed", "moto", "redeliver_after"]  # the fixtures, used by name
pytestmark = pytest.mark.usefixtures("aws_env")

# How long handlers go on after the stop. A short one outlasts the fetch under way at the stop
# (0.5 s on JetStream, 1 s on SQS here), after which a stop without grace would cut it, and ends
# well within the grace; the grace cuts a long one short.
SHORT: Final = 1.5
LONG: Final = 60.0
# Every COMMIT of a transaction that wrote a business row sleeps a while in a deferred trigger.
SLOW_COMMIT: Final = """
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_sleep(1.5);
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON stop_rows DEFERRABLE INITIALLY DEFERRED
    FOR EACH ROW EXECUTE FUNCTION slow_commit();
"""


# Long: what was cut short comes again because it was given back, not because it was left.
@pytest.mark.parametrize("redeliver_after", [30])
async def test_a_sigterm_drains_acks_what_committed_and_gives_back_what_it_cut_short(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    prepare(db_url)
    short, long = [0, 1, 2], [3, 4, 5]
    await bed.publish([{"n": n, "sleep": SHORT if n in short else LONG} for n in short + long])
    with start(bed, db_url, tmp_path, "first", "--sleep") as first:
        await wait_until(
            lambda: len(events(tmp_path, "began")) == 6, "every handler to begin", first
        )
        stopped = time.monotonic()
        assert first.terminate(timeout=GRACE + 10) == 0, first.said()
        took = time.monotonic() - stopped
    in_grace = [(n, "new", "ack") for n in short]
    assert settled(tmp_path) == in_grace, "the short ones finished within the grace"
    # It waited for the grace (the long ones), and no longer than the grace and a give-back.
    assert GRACE <= took < GRACE + 5, took
    assert sorted(e["n"] for e in events(tmp_path, "cut_short")) == long
    assert rows_by_message(db_url) == {n: [first.pid] for n in short}, "cut short: rolled back"
    await wait_held(bed, len(long), first)  # given back, never acknowledged

    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(
            lambda: len(events(tmp_path, "settled", second.pid)) == len(long),
            "the cut-short messages to come again",
            second,
        )
        await asyncio.sleep(0.3)  # an acknowledged message that came again would be here by now
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(n, "new", "ack") for n in long]
    assert rows_by_message(db_url) == {
        **{n: [first.pid] for n in short},
        **{n: [second.pid] for n in long},
    }
    assert await bed.held() == 0


async def test_a_sigkill_between_commit_and_ack_is_replayed_by_the_redelivery(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    prepare(db_url)
    messages = [0, 1, 2]
    await bed.publish([{"n": n, "sleep": 0} for n in messages])
    env = {"OUTBOX_FAILPOINTS": "inbox_before_ack=60"}
    with start(bed, db_url, tmp_path, "first", **env) as first:
        await wait_until(
            lambda: len(events(tmp_path, "settled")) == len(messages), "every COMMIT", first
        )
        first.kill()
    assert rows_by_message(db_url) == {n: [first.pid] for n in messages}
    await wait_held(bed, len(messages), first)  # committed, never acknowledged
    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(
            lambda: len(events(tmp_path, "settled", second.pid)) == len(messages),
            "the redeliveries",
            second,
        )
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(n, "replayed", "ack") for n in messages]
    began = Counter(e["n"] for e in events(tmp_path, "began"))
    assert began == Counter(messages), "the handler ran once for each message"
    assert rows_by_message(db_url) == {n: [first.pid] for n in messages}
    assert await bed.held() == 0


@pytest.mark.parametrize("redeliver_after", [30])
async def test_a_stop_that_cuts_a_commit_under_way_gives_it_back_and_it_replays(
    db_url: str, tmp_path: Path, bed: Bed
) -> None:
    # A COMMIT that takes longer than the grace: a deferred trigger sleeps in it. The cut cannot
    # stop it (it is shielded) and settle cannot know how it ended, so the message goes back;
    # after the COMMIT ended, so that the redelivery replays at once, never "in progress".
    prepare(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(SLOW_COMMIT)
    await bed.publish([{"n": 0, "sleep": 0}])
    with start(bed, db_url, tmp_path, "first", "--grace", "0.3") as first:
        await wait_until(lambda: len(events(tmp_path, "began")) == 1, "the handler", first)
        assert first.terminate(timeout=15) == 0, first.said()
    assert active_sessions(db_url) == 0, "it let go of a COMMIT under way"
    assert [e["n"] for e in events(tmp_path, "cut_short")] == [0]
    assert settled(tmp_path) == []
    assert rows_by_message(db_url) == {0: [first.pid]}, "the COMMIT went on after the cut"
    await wait_held(bed, 1, first)  # given back, never acknowledged
    with start(bed, db_url, tmp_path, "second") as second:
        await wait_until(lambda: len(settled(tmp_path)) == 1, "the redelivery", second)
        assert second.terminate(timeout=10) == 0, second.said()
    assert settled(tmp_path, second.pid) == [(0, "replayed", "ack")]
    assert len(events(tmp_path, "began")) == 1
    assert await bed.held() == 0

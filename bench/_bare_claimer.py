"""The least a LISTEN/NOTIFY dispatcher can do, for bench/latency.py to read `outbox run` against.

In a process of its own: it marks itself waiting as an idle `outbox run` does (so producers'
commits notify, through the same trigger), LISTENs on the same channel, and on each
notification claims every due row with one UPDATE ... FOR UPDATE SKIP LOCKED, POSTs each to the
receiver with one httpx client (the operation id in the header the receiver stamps), and marks
them succeeded. No lease, no attempt history, no limits, no metrics: what is left of COMMIT to
request received is the machine's own (the wake-ups, the claim, the send), measured in the same
run as the daemon.

Run by :class:`BareClaimer`; by hand: ``python bench/_bare_claimer.py DB_URL RECEIVER_URL``
prints ``READY`` once it listens, and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg

WORKER = "bench-bare-claimer"
# Every due row at once, as a dispatcher with free slots would; the oldest first.
CLAIM = """
UPDATE outbox.operations SET status = 'in_flight', lease_owner = %(worker)s,
       lease_token = gen_random_uuid(), lease_expires_at = now() + interval '1 minute',
       attempts = attempts + 1
WHERE id = ANY (ARRAY(
    SELECT id FROM outbox.operations
    WHERE status = 'pending' AND NOT ordering_blocked AND NOT scheduled AND available_at <= now()
    ORDER BY available_at, id LIMIT 100 FOR UPDATE SKIP LOCKED))
RETURNING id
"""
FINISH = """
UPDATE outbox.operations SET status = 'succeeded', provider_ref = 'bare', lease_owner = NULL,
       lease_token = NULL, lease_expires_at = NULL, finished_at = now()
WHERE id = ANY (%(ids)s)
"""
MARK_WAITING = """
INSERT INTO outbox.waiting_dispatchers (worker) VALUES (%(worker)s)
ON CONFLICT (worker) DO UPDATE SET seen_at = now()
"""
# The fallback poll, as `outbox run`'s poll_interval: only a lost notification waits for it.
POLL_S = 1.0


async def serve(db_url: str, receiver_url: str) -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    listen = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
    work = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
    async with listen, work, httpx.AsyncClient(timeout=10) as client:
        await listen.execute("LISTEN outbox_enqueue")
        await work.execute(MARK_WAITING, {"worker": WORKER})
        print("READY", flush=True)
        while not stop.is_set():
            while ids := [
                r[0] for r in await (await work.execute(CLAIM, {"worker": WORKER})).fetchall()
            ]:
                await asyncio.gather(
                    *(
                        client.post(
                            receiver_url, json={"n": i}, headers={"Outbox-Operation-Id": str(i)}
                        )
                        for i in ids
                    )
                )
                await work.execute(FINISH, {"ids": ids})
            # Wake on the next notification, or poll; notifications that came during the claim
            # are queued on the connection and end this wait at once.
            async for _ in listen.notifies(timeout=POLL_S, stop_after=1):
                pass


class BareClaimer:
    """The claimer in a subprocess of its own; ready when the constructor returns."""

    def __init__(self, db_url: str, receiver_url: str) -> None:
        args = [sys.executable, str(Path(__file__).resolve()), db_url, receiver_url]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)  # noqa: S603
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if line.strip() != "READY":
            self.stop()
            raise RuntimeError(f"the bare claimer did not start: {line!r}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> BareClaimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    asyncio.run(serve(sys.argv[1], sys.argv[2]))

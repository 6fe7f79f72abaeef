"""A provider's connections spread over several small HTTP clients.

httpcore's pool walks all of its connections and waiting requests on every request and every
release, and checks each idle connection's socket with a system call. With one pool of 64
connections a call cost 2.7 ms of CPU, where 64 clients of one connection cost 1.0
(bench/http_webhook.py, its two bare loops); a Stripe create through the SDK, 1.58 ms against
0.87 ms with 8 clients of 8 (bursts of 64 against the fake Stripe). So each provider that talks
HTTP splits its connections over clients of at most SHARD_CONNECTIONS.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Final, Generic, TypeVar

SHARD_CONNECTIONS: Final = 8

C = TypeVar("C")


def shard_sizes(connections: int) -> list[int]:
    """``connections`` split over clients of at most SHARD_CONNECTIONS each, as evenly as
    possible, adding up to exactly ``connections``."""
    shards = max(1, -(-connections // SHARD_CONNECTIONS))
    size, extra = divmod(connections, shards)
    return [size + (1 if i < extra else 0) for i in range(shards)]


def connection_cap(concurrency: int, max_in_flight: int | None) -> int:
    """How many connections an HTTP provider needs: its ``max_in_flight`` when set (the
    dispatcher never has more of its calls in flight), else the dispatcher's ``concurrency``;
    never more than ``concurrency``, which bounds every provider's calls together."""
    return concurrency if max_in_flight is None else min(max_in_flight, concurrency)


class Shards(Generic[C]):
    """Clients, each with a count of the connections no call of ours is using."""

    __slots__ = ("_free", "clients")

    def __init__(self, clients: Sequence[C], sizes: Sequence[int]) -> None:
        if len(clients) != len(sizes) or not clients:
            raise ValueError("one size per client, and at least one client")
        self.clients: tuple[C, ...] = tuple(clients)
        self._free = list(sizes)

    @contextmanager
    def take(self) -> Iterator[C]:
        """The client with the most connections to spare, for one call: while the calls in
        flight stay within the sizes one is always free (no call waits inside a client for a
        connection), and when idle the first client's warm connections go first."""
        free = self._free
        shard = free.index(max(free))
        free[shard] -= 1
        try:
            yield self.clients[shard]
        finally:
            free[shard] += 1

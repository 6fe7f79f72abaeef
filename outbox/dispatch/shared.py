"""What the dispatcher's parts share: its collaborators, and the operations it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from outbox.config.settings import DispatcherSettings
from outbox.db.store import Store
from outbox.dispatch.flight import InFlight, Phase
from outbox.dispatch.limits import Limits
from outbox.dispatch.meters import Meters
from outbox.dispatch.pauses import ActionPauses
from outbox.dispatch.rules import ProviderRules
from outbox.observability.metric_labels import Labels
from outbox.providers.base import Provider


@dataclass(eq=False)
class Shared:
    store: Store
    providers: Mapping[str, Provider]
    settings: DispatcherSettings
    worker: str
    labels: Labels
    limits: Limits
    action_pauses: ActionPauses
    rules: ProviderRules
    meters: Meters
    inflight: dict[int, InFlight] = field(default_factory=dict)
    # The running loop, looked up once: on Python 3.11 every asyncio.create_task and
    # get_running_loop makes a getpid system call, and there are several per operation.
    loop: asyncio.AbstractEventLoop | None = None
    stopping: bool = False  # draining: nothing more is sent
    # Leased operations whose call is over and whose outcome is being written: they hold no
    # call slot (`concurrency` counts provider calls), only a lease (see ClaimScheduler.free).
    recording: int = 0
    on_call_over: Callable[[InFlight], None] | None = None

    def call_over(self, flight: InFlight) -> None:
        """The flight's call is over (or never happened): from now on it only records."""
        if flight.phase is Phase.RECORDING:
            return
        flight.phase = Phase.RECORDING
        self.recording += 1
        # Rows being recorded may be as many again as the calls (ClaimScheduler.free): they
        # keep no payload, so the text they hold stays within `concurrency` payloads.
        flight.row = flight.row._replace(payload=None)
        if self.on_call_over is not None:
            self.on_call_over(flight)

    def running_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop or asyncio.get_running_loop()

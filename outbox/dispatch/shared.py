"""What the dispatcher's parts share: its collaborators, and the operations it holds."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from outbox.config.settings import DispatcherSettings
from outbox.db.store import Store
from outbox.dispatch.flight import InFlight
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

    def running_loop(self) -> asyncio.AbstractEventLoop:
        return self.loop or asyncio.get_running_loop()

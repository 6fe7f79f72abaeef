"""A provider's optional start (outbox.providers.lifecycle): a refusal ends `outbox run` with its
message; a system that is merely down does not."""

from __future__ import annotations

from datetime import timedelta

from outbox.config.settings import ConfigError
from outbox.providers.base import Provider
from outbox.providers.lifecycle import start_all
from outbox.providers.noop import NoopProvider


class _Starting(NoopProvider):
    def __init__(self, name: str, error: Exception | None = None) -> None:
        super().__init__(name, timedelta(hours=1))
        self.error = error
        self.started = 0

    async def start(self) -> None:
        self.started += 1
        if self.error is not None:
            raise self.error


async def test_every_start_is_awaited_and_a_system_that_is_down_is_no_refusal() -> None:
    down = _Starting("down", ConnectionRefusedError(111, "refused"))
    fine = _Starting("fine")
    providers: dict[str, Provider] = {"down": down, "fine": fine, "plain": NoopProvider("p", _H)}
    assert await start_all(providers) is None
    assert (down.started, fine.started) == (1, 1)


async def test_a_refusal_is_the_reason_outbox_run_gives() -> None:
    refusing = _Starting("queue", ConfigError("providers.queue.key_retention (1h) is longer"))
    providers: dict[str, Provider] = {"queue": refusing, "other": _Starting("other")}
    assert await start_all(providers) == "providers.queue.key_retention (1h) is longer"


_H = timedelta(hours=1)

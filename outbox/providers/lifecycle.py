"""Starting providers: the optional ``start()`` of the provider interface (outbox.providers.base),
awaited by `outbox run` before its first claim, so that a configuration the live system
contradicts (a key_retention longer than a JetStream stream's duplicate_window) ends the run
with its fix instead of dispatching under a promise the queue does not keep."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Final

import structlog

from outbox.config.settings import ConfigError
from outbox.providers.base import Provider

# The most one provider's start may take: a start bounds its own calls by its timeout; this only
# keeps a hung plug-in from holding `outbox run` before its first claim for ever.
START_GUARD: Final = 60.0

log = structlog.get_logger("outbox.providers")


async def start_all(providers: Mapping[str, Provider]) -> str | None:
    """Start every provider that declares ``start``; None, or why `outbox run` must not start
    (the first refusal, a ConfigError's message). A start that fails otherwise is logged and
    the run goes on: the provider's sends fail transient until its system answers."""
    for name, provider in sorted(providers.items()):
        start = getattr(provider, "start", None)
        if start is None:
            continue
        try:
            await asyncio.wait_for(start(), START_GUARD)
        except ConfigError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 (a plug-in's start may raise anything)
            log.warning(
                "provider could not start; its sends fail transient until it can",
                provider=name,
                error_class=type(exc).__name__,
            )
    return None

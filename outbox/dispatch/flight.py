"""One leased operation on its way, as the dispatcher's parts pass it between them."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import structlog

from outbox.core.model import Status
from outbox.db.store import Claimed
from outbox.providers.base import Failed, Provider, SendResult

log = structlog.get_logger("outbox.dispatcher")


class Phase(enum.Enum):
    CLAIMED = "claimed"  # leased, not sent: may be released untouched
    SENDING = "sending"
    RECORDING = "recording"


@dataclass(eq=False)
class InFlight:
    """A leased operation and what this process knows of its lease."""

    row: Claimed
    claimed_mono: float
    lease_deadline: float  # local monotonic estimate, never later than the database's
    phase: Phase = Phase.CLAIMED
    task: asyncio.Task[None] | None = None
    send_task: asyncio.Task[SendResult] | None = None
    # While sending: resolved when the call ends, or by the call guard at guard_at (loop time).
    waiter: asyncio.Future[None] | None = None
    guard_at: float | None = None
    scope: str | None = None  # where the send went, as its provider names it (Provider.scope)
    _log: Any = None

    @property
    def log(self) -> Any:
        """A logger bound to the operation's fields. Bound on first use: a success, the common
        case, logs at debug, so most operations never need one."""
        if self._log is None:
            row = self.row
            self._log = log.bind(
                operation_id=row.id,
                tenant_id=row.tenant_id,
                operation_type=row.operation_type,
                operation_key=row.operation_key,
                provider=row.provider,
                action=row.action,
                attempt=row.attempts,
                correlation_id=row.correlation_id,
            )
        return self._log

    def db_now(self) -> datetime:
        """The database clock now: its reading at the claim plus the time elapsed since."""
        return self.row.claimed_at + timedelta(seconds=time.monotonic() - self.claimed_mono)

    def elapsed_ms(self) -> float:
        return round((time.monotonic() - self.claimed_mono) * 1000, 1)


class Aside(NamedTuple):
    """Where a claimed row goes instead of its provider: with ``failure``, recorded as an
    attempt that never left; without, handed back (to ``status``) without one."""

    status: Status
    reason: str | None
    failure: Failed | None = None
    delay: timedelta | None = None  # handed back: due again after this long (None: at once)


def api_version(row: Claimed, provider: Provider | None) -> str | None:
    """The version of the operation's first send, or, before one, the provider's own."""
    return row.api_version or getattr(provider, "api_version", None)


def release(waiter: asyncio.Future[None], _: object = None) -> None:
    """End a send's wait: its call ended, or the call guard's deadline passed."""
    if not waiter.done():
        waiter.set_result(None)

"""A provider that succeeds at once, in process: for benchmarks of the dispatcher's own cost
and for demos. Never use it for real work: its effects exist nowhere."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

from outbox.providers.base import SendRequest, SendResult, Succeeded


class NoopProvider:
    def __init__(self, name: str, key_retention: timedelta) -> None:
        self._name = name
        self._key_retention = key_retention

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._key_retention

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Accepts everything."""

    async def send(self, request: SendRequest) -> SendResult:
        return Succeeded(f"noop_{request.operation_id}")

    async def aclose(self) -> None:
        """Holds no resources."""

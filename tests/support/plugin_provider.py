"""A third-party provider, registered through the entry point group in the plug-in test."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox.config.settings import ProviderSettings
from outbox.providers.base import SendRequest, SendResult, Succeeded


class EchoProvider:
    def __init__(self, settings: ProviderSettings) -> None:
        self.name = settings.name
        self.key_retention = settings.key_retention
        self.prefix = str(settings.options.get("prefix", "echo"))

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        """Accepts everything."""

    async def send(self, request: SendRequest) -> SendResult:
        return Succeeded(f"{self.prefix}_{request.idempotency_key}")

    async def aclose(self) -> None:
        """Nothing to close."""


def factory(settings: ProviderSettings) -> EchoProvider:
    return EchoProvider(settings)

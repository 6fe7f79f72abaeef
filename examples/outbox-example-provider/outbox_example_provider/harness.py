"""The conformance harness (outbox.testing.conformance) for the Relay provider and FakeRelay:
how the suite builds a provider, makes a request, reads the fake and arms its faults."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Final

from outbox.config import ProviderSettings
from outbox.core import payloads
from outbox.providers.base import LookupRequest, Provider, SendRequest
from outbox.testing.conformance import (
    GZIP_BOMB_BYTES,
    HUGE_ANSWER_FACTOR,
    RETRY_AFTER_SECONDS,
    Fault,
    LookupFault,
)

from outbox_example_provider.fake import FakeRelay, RelayFault
from outbox_example_provider.messages import ACTION
from outbox_example_provider.provider import build

TOKEN_VARIABLE: Final = "RELAY_CONFORMANCE_TOKEN"  # noqa: S105 (a variable's name)


class RelayHarness:
    """A Harness and LookupHarness: RelayProvider, built as outbox builds it, against FakeRelay."""

    name = "relay_sms"

    def __init__(
        self, fake: FakeRelay, *, timeout: float = 1.0, max_response_bytes: int = 64 * 1024
    ) -> None:
        self.fake = fake
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._ids: dict[str, int] = {}
        self._next = itertools.count(1)

    def provider(self) -> Provider:
        return build(
            ProviderSettings(
                "sms",
                "relay_sms",
                key_retention=timedelta(hours=72),
                timeout=timedelta(seconds=self.timeout),
                options={
                    "api_base": self.fake.url,
                    "token_env": TOKEN_VARIABLE,
                    "max_response_bytes": self.max_response_bytes,
                },
            ),
            {TOKEN_VARIABLE: self.fake.token},
        )

    def send_request(self, key: str, attempt: int) -> SendRequest:
        operation_id = self._ids.setdefault(key, next(self._next))
        payload = {"to": "+15551234567", "text": f"Your code is {operation_id:06d}"}
        return SendRequest(
            operation_id=operation_id,
            tenant_id="acme",
            operation_type="login.code",
            operation_key=f"code-{operation_id}",
            action=ACTION,
            payload=payload,
            idempotency_key=key,
            correlation_id=None,
            attempt=attempt,
            payload_json=payloads.encode(payload),
        )

    def unknown_action(self) -> str | None:
        return "sms.recall"

    def effects(self, key: str) -> int:
        return self.fake.message_count(key)

    def keys_received(self) -> Sequence[str | None]:
        return [r.key for r in self.fake.received if r.method == "POST"]

    def arm(self, fault: Fault, key: str) -> bool:
        if fault is Fault.REFUSED:
            self.fake.refuse_connections()
        else:
            self.fake.inject(_FAULTS[fault](self), key=key)
        return True

    def restore(self) -> None:
        if not self.fake.listening:
            self.fake.accept_connections()

    def lookup_request(
        self, sent: SendRequest, first_sent_at: datetime, now: datetime
    ) -> LookupRequest:
        return LookupRequest(
            action=sent.action,
            operation_id=sent.operation_id,
            idempotency_key=sent.idempotency_key,
            keys=frozenset({sent.idempotency_key}),
            first_sent_at=first_sent_at,
            last_attempt_at=now,
            search_until=now,
            checked_now=now,
            payload=sent.payload,
        )

    def arm_lookup(self, fault: LookupFault) -> bool:
        if fault is LookupFault.REFUSED:
            self.fake.refuse_connections()
        elif fault is LookupFault.ERROR:
            self.fake.inject(RelayFault.lookup_status(503))
        elif fault is LookupFault.TIMEOUT:
            self.fake.inject(RelayFault.lookup_delay(self.timeout + 1.0))
        else:
            self.fake.forget_keys()
        return True


_FAULTS: Final[dict[Fault, Callable[[RelayHarness], RelayFault]]] = {
    Fault.RESET_BEFORE_ACTING: lambda h: RelayFault.reset_before_apply(),
    Fault.RESET_AFTER_ACTING: lambda h: RelayFault.reset_after_apply(),
    Fault.TIMEOUT_AFTER_ACTING: lambda h: RelayFault.delay_after_apply(h.timeout + 1.0),
    Fault.ERROR_AFTER_ACTING: lambda h: RelayFault.error_500_after_apply(),
    Fault.UNAVAILABLE_BEFORE_ACTING: lambda h: RelayFault.status(503),
    Fault.RATE_LIMITED: lambda h: RelayFault.status(429, retry_after=RETRY_AFTER_SECONDS),
    Fault.KEY_IN_USE: lambda h: RelayFault.status(409),
    Fault.CREDENTIALS_REFUSED: lambda h: RelayFault.status(401),
    Fault.PERMANENT_REFUSAL: lambda h: RelayFault.status(400),
    Fault.HUGE_ANSWER: lambda h: RelayFault.huge_answer_after_apply(
        HUGE_ANSWER_FACTOR * h.max_response_bytes, chunked=True
    ),
    Fault.GZIP_BOMB: lambda h: RelayFault.gzip_bomb_after_apply(GZIP_BOMB_BYTES, chunked=True),
    Fault.UNDECODABLE_ANSWER: lambda h: RelayFault.raw_answer_after_apply(
        b"not gzip", content_encoding="gzip"
    ),
}


@contextmanager
def relay_harness() -> Iterator[RelayHarness]:
    """A RelayHarness on a FakeRelay of its own."""
    with FakeRelay() as fake:
        yield RelayHarness(fake)

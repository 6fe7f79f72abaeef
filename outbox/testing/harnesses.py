"""Conformance harnesses (``outbox.testing.conformance``) for outbox's own providers and fakes:
the webhook provider against FakeWebhookReceiver, the Stripe provider (``payment_intents.create``
and its lookup) against FakeStripe, and noop, which has no fake.

A provider that wraps the webhook or Stripe provider reuses these through ``build``: it gets the
ProviderSettings outbox's registry would get and returns the provider to test::

    with webhook_harness(build=lambda ps: Signing(build_providers({ps.name: ps})[ps.name])) as h:
        assert_conforms(h)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any, Final, TypeVar

from outbox.config.schema import as_timedelta
from outbox.config.settings import PROVIDER_KEYS, ProviderSettings
from outbox.core import payloads
from outbox.providers.base import LookupRequest, Provider, SendRequest
from outbox.providers.registry import build_providers
from outbox.testing.conformance.harness import (
    GZIP_BOMB_BYTES,
    HUGE_ANSWER_FACTOR,
    RETRY_AFTER_SECONDS,
    Fault,
    LookupFault,
    Unsupported,
)
from outbox.testing.http_api import ApiFault, FakeHttpApi
from outbox.testing.loopback import LoopbackFake
from outbox.testing.stripe import FakeStripe, StripeFault
from outbox.testing.webhook import FakeWebhookReceiver, WebhookFault

Build = Callable[[ProviderSettings], Provider]
# Short, so the timeout check takes a second; small, so the huge answers stay small too.
TIMEOUT: Final = 1.0
MAX_RESPONSE_BYTES: Final = 64 * 1024
_NAME: Final = "conformance"
STRIPE_KEY_VARIABLE: Final = "OUTBOX_CONFORMANCE_STRIPE_KEY"
# A body labelled gzip that is not gzip.
_NOT_GZIP: Final = b"this is not gzip at all"
# The fakes whose faults are made alike.
F = TypeVar("F", WebhookFault, ApiFault)


def _registry(ps: ProviderSettings, environ: Mapping[str, str] | None = None) -> Provider:
    return build_providers({ps.name: ps}, environ)[ps.name]


class _Base:
    """What the harnesses share: settings, operation ids per key, the request's shape."""

    action = "invoice.paid"

    def __init__(self, *, timeout: float, max_response_bytes: int, build: Build | None) -> None:
        self.timeout = timeout
        self.max_response_bytes = max_response_bytes
        self._build = build
        self._ids: dict[str, int] = {}
        self._next = itertools.count(1)

    def payload(self, operation_id: int) -> dict[str, Any]:
        return {"invoice": f"inv-{operation_id}", "amount": Decimal("19.99"), "currency": "usd"}

    def send_request(self, key: str, attempt: int) -> SendRequest:
        operation_id = self._ids.setdefault(key, next(self._next))
        payload = self.payload(operation_id)
        return SendRequest(
            operation_id=operation_id,
            tenant_id="acme",
            operation_type="invoice.charge",
            operation_key=f"inv-{operation_id}",
            action=self.action,
            payload=payload,
            idempotency_key=key,
            correlation_id=None,
            attempt=attempt,
            payload_json=payloads.encode(payload),
        )

    def settings(self, kind: str, options: Mapping[str, Any]) -> ProviderSettings:
        return ProviderSettings(
            _NAME,
            kind,
            timeout=timedelta(seconds=self.timeout),
            options={"max_response_bytes": self.max_response_bytes, **options},
        )


class _OnLoopback(_Base):
    """A harness whose fake is a loopback fake: a refused connection is the fake's listener
    closed, every other fault injected for the next request with the key."""

    fake: LoopbackFake[Any, Any]

    def injected(self, fault: Fault, key: str) -> tuple[Any, str]:
        """The fake's fault for ``fault``, and the key as the fake sees it."""
        raise NotImplementedError

    def arm(self, fault: Fault, key: str) -> bool:
        if fault is Fault.REFUSED:
            self.fake.refuse_connections()
            return True
        made, wire = self.injected(fault, key)
        self.fake.inject(made, key=wire)
        return True

    def restore(self) -> None:
        if not self.fake.listening:
            self.fake.accept_connections()


class WebhookHarness(_OnLoopback):
    """outbox's webhook provider (or ``build``'s) against a started FakeWebhookReceiver."""

    name = "webhook"
    fake: FakeWebhookReceiver

    def __init__(
        self,
        fake: FakeWebhookReceiver,
        *,
        timeout: float = TIMEOUT,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        build: Build | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(timeout=timeout, max_response_bytes=max_response_bytes, build=build)
        self.fake = fake
        self._options = dict(options or {})

    def provider(self) -> Provider:
        ps = self.settings("webhook", {"url": self.fake.url, **self._options})
        return (self._build or _registry)(ps)

    def unknown_action(self) -> str | None:
        return None  # an action is an event name: the receiver decides what it means

    def effects(self, key: str) -> int:
        return self.fake.effect_count(key)

    def keys_received(self) -> Sequence[str | None]:
        return [r.key for r in self.fake.received]

    def injected(self, fault: Fault, key: str) -> tuple[Any, str]:
        return _webhook_fault(fault, self.timeout, self.max_response_bytes), key


def _lookup_request(sent: SendRequest, first_sent_at: datetime, now: datetime) -> LookupRequest:
    """The reconciler's question about the operation ``sent`` once sent, asked at ``now``."""
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


def _webhook_fault(fault: Fault, timeout: float, cap: int) -> WebhookFault:
    return _fault_of(WebhookFault, fault, timeout, cap)


def _fault_of(kind: type[F], fault: Fault, timeout: float, cap: int) -> F:
    """``fault`` as a fake whose faults are made as WebhookFault's are (ApiFault too)."""
    huge = HUGE_ANSWER_FACTOR * cap  # chunked: no Content-Length to refuse it by
    made: dict[Fault, Callable[[], F]] = {
        Fault.RESET_BEFORE_ACTING: kind.reset_before_apply,
        Fault.RESET_AFTER_ACTING: kind.reset_after_apply,
        Fault.TIMEOUT_AFTER_ACTING: lambda: kind.delay_after_apply(timeout + 1.0),
        Fault.ERROR_AFTER_ACTING: kind.error_500_after_apply,
        Fault.UNAVAILABLE_BEFORE_ACTING: lambda: kind.status(503),
        Fault.RATE_LIMITED: lambda: kind.status(429, retry_after=RETRY_AFTER_SECONDS),
        Fault.KEY_IN_USE: lambda: kind.status(409),
        Fault.CREDENTIALS_REFUSED: lambda: kind.status(401),
        Fault.PERMANENT_REFUSAL: lambda: kind.status(422),
        Fault.HUGE_ANSWER: lambda: kind.huge_answer_after_apply(huge, chunked=True),
        Fault.GZIP_BOMB: lambda: kind.gzip_bomb_after_apply(GZIP_BOMB_BYTES, chunked=True),
        Fault.UNDECODABLE_ANSWER: lambda: kind.raw_answer_after_apply(
            _NOT_GZIP, content_encoding="gzip"
        ),
    }
    return made[fault]()


class StripeHarness(_OnLoopback):
    """outbox's Stripe provider (``payment_intents.create``, and its lookup) against a started
    FakeStripe. The settings name the API key by ``api_key_env = STRIPE_KEY_VARIABLE``: a
    ``build`` of its own reads it from ``{STRIPE_KEY_VARIABLE: fake.api_key}``."""

    name = "stripe"
    fake: FakeStripe
    action = "payment_intents.create"

    def __init__(
        self,
        fake: FakeStripe,
        *,
        timeout: float = TIMEOUT,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        build: Build | None = None,
    ) -> None:
        super().__init__(timeout=timeout, max_response_bytes=max_response_bytes, build=build)
        self.fake = fake

    def payload(self, operation_id: int) -> dict[str, Any]:
        return {"amount": 1000 + operation_id, "currency": "usd", "metadata": {"n": "1"}}

    def provider(self) -> Provider:
        ps = self.settings(
            "stripe", {"api_key_env": STRIPE_KEY_VARIABLE, "api_base": self.fake.url}
        )
        if self._build is not None:
            return self._build(ps)
        return _registry(ps, {STRIPE_KEY_VARIABLE: self.fake.api_key})

    def unknown_action(self) -> str | None:
        return "payment_intents.levitate"

    def effects(self, key: str) -> int:
        # Each object's creation makes an event naming the key of the request that caused it.
        return sum(e["request"]["idempotency_key"] == key for e in self.fake.events())

    def keys_received(self) -> Sequence[str | None]:
        return [r.idempotency_key for r in self.fake.received if r.method == "POST"]

    def injected(self, fault: Fault, key: str) -> tuple[Any, str]:
        return _stripe_fault(fault, self.timeout, self.max_response_bytes), key

    def lookup_request(
        self, sent: SendRequest, first_sent_at: datetime, now: datetime
    ) -> LookupRequest:
        return _lookup_request(sent, first_sent_at, now)

    def arm_lookup(self, fault: LookupFault) -> bool:
        if fault is LookupFault.TIMEOUT:
            # FakeStripe delays only a POST that executes, never a lookup's GET.
            raise Unsupported("FakeStripe cannot hold back the answer to a GET")
        if fault is LookupFault.REFUSED:
            self.fake.refuse_connections()
        elif fault is LookupFault.ERROR:
            self.fake.inject(StripeFault.status(500, error_type="api_error"))
        else:
            self.fake.forget_keys()
        return True


def _stripe_fault(fault: Fault, timeout: float, cap: int) -> StripeFault:
    invalid = "invalid_request_error"
    huge = HUGE_ANSWER_FACTOR * cap  # chunked: no Content-Length to refuse it by
    made: dict[Fault, Callable[[], StripeFault]] = {
        Fault.RESET_BEFORE_ACTING: StripeFault.reset_before_apply,
        Fault.RESET_AFTER_ACTING: StripeFault.reset_after_apply,
        Fault.TIMEOUT_AFTER_ACTING: lambda: StripeFault.delay_after_apply(timeout + 1.0),
        Fault.ERROR_AFTER_ACTING: StripeFault.error_500_after_apply,
        Fault.UNAVAILABLE_BEFORE_ACTING: lambda: StripeFault.status(503, error_type="api_error"),
        Fault.RATE_LIMITED: lambda: StripeFault.status(
            429, error_type=invalid, code_str="rate_limit", retry_after=RETRY_AFTER_SECONDS
        ),
        Fault.KEY_IN_USE: lambda: StripeFault.status(
            409, error_type=invalid, code_str="idempotency_key_in_use"
        ),
        Fault.CREDENTIALS_REFUSED: lambda: StripeFault.status(401, error_type=invalid),
        Fault.PERMANENT_REFUSAL: lambda: StripeFault.status(
            400, error_type=invalid, code_str="parameter_invalid_integer"
        ),
        Fault.HUGE_ANSWER: lambda: StripeFault.huge_answer_after_apply(huge, chunked=True),
        Fault.GZIP_BOMB: lambda: StripeFault.gzip_bomb_after_apply(GZIP_BOMB_BYTES, chunked=True),
        Fault.UNDECODABLE_ANSWER: lambda: StripeFault.raw_answer_after_apply(
            _NOT_GZIP, content_encoding="gzip"
        ),
    }
    return made[fault]()


class NoopHarness(_Base):
    """The noop provider: it acts nowhere and sends nothing, so only what needs no fake (send
    never raises, check) can be judged; every other check is skipped with the reason."""

    name = "noop"

    def __init__(self, *, build: Build | None = None) -> None:
        super().__init__(timeout=TIMEOUT, max_response_bytes=MAX_RESPONSE_BYTES, build=build)

    def provider(self) -> Provider:
        return (self._build or _registry)(self.settings("noop", {}))

    def settings(self, kind: str, options: Mapping[str, Any]) -> ProviderSettings:
        return ProviderSettings(_NAME, kind, options=dict(options))

    def unknown_action(self) -> str | None:
        return None  # noop accepts every action

    def effects(self, key: str) -> int:
        raise Unsupported("noop acts nowhere: there is no effect to count")

    def keys_received(self) -> Sequence[str | None]:
        raise Unsupported("noop sends nothing: there is no wire to look at")

    def arm(self, fault: Fault, key: str) -> bool:
        raise Unsupported("noop has no API, so no fault can strike it")

    def restore(self) -> None:
        """Nothing lasts."""


@contextmanager
def webhook_harness(**options: Any) -> Iterator[WebhookHarness]:
    """A WebhookHarness on a FakeWebhookReceiver of its own; ``options`` go to the harness."""
    with FakeWebhookReceiver() as fake:
        yield WebhookHarness(fake, **options)


@contextmanager
def stripe_harness(**options: Any) -> Iterator[StripeHarness]:
    """A StripeHarness on a FakeStripe of its own; ``options`` go to the harness."""
    with FakeStripe() as fake:
        yield StripeHarness(fake, **options)


@contextmanager
def noop_harness(**options: Any) -> Iterator[NoopHarness]:
    """A NoopHarness (there is no fake to start)."""
    yield NoopHarness(**options)


class HttpApiHarness(_OnLoopback):
    """An `http` provider configured by ``table`` (a ``[providers.<name>]`` table as TOML reads
    it; its base_url is replaced by the fake's) against a started FakeHttpApi, sending
    ``action`` with ``payload(n)`` as the n-th operation's payload.

    Keys are reported as stored: a provider whose key form is ``uuid`` or ``sha256`` sends
    another text, and each key received is mapped back to the stored key it was made of. A
    forgotten key (``LookupFault.FORGOTTEN_KEY``) is what the API's retention does, so the
    lookup that follows is asked as the reconciler would ask it after that retention.
    """

    name = "http"
    fake: FakeHttpApi

    def __init__(
        self,
        fake: FakeHttpApi,
        table: Mapping[str, Any],
        *,
        action: str,
        payload: Callable[[int], dict[str, Any]],
        timeout: float = TIMEOUT,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        build: Build | None = None,
    ) -> None:
        super().__init__(timeout=timeout, max_response_bytes=max_response_bytes, build=build)
        self.fake = fake
        self.action = action
        self._payload = payload
        # The keys every provider has are fields of ProviderSettings; the rest are options.
        options = {k: v for k, v in table.items() if k not in PROVIDER_KEYS}
        options.update(base_url=fake.url, secret_headers={}, headers=table.get("headers", {}))
        self._retention = as_timedelta(table.get("key_retention", "24h")) or timedelta(hours=24)
        self._settings = dataclasses.replace(
            self.settings("http", options), key_retention=self._retention
        )
        provider = _registry(self._settings)
        spec = getattr(provider, "spec", lambda action: None)(action)
        self._wire: Callable[[str], str] = spec.key.wire if spec is not None else str
        self._stored: dict[str, str] = {}
        self._forgotten = False

    def payload(self, operation_id: int) -> dict[str, Any]:
        return self._payload(operation_id)

    def provider(self) -> Provider:
        return (self._build or _registry)(self._settings)

    def send_request(self, key: str, attempt: int) -> SendRequest:
        self._stored[self._wire(key)] = key
        return super().send_request(key, attempt)

    def unknown_action(self) -> str | None:
        return "no.such.action"

    def effects(self, key: str) -> int:
        return self.fake.effect_count(key=self._wire(key))

    def keys_received(self) -> Sequence[str | None]:
        sends = (r for r in self.fake.received if r.method != "GET")
        return [None if r.key is None else self._stored.get(r.key, r.key) for r in sends]

    def injected(self, fault: Fault, key: str) -> tuple[Any, str]:
        return _api_fault(fault, self.timeout, self.max_response_bytes), self._wire(key)

    def lookup_request(
        self, sent: SendRequest, first_sent_at: datetime, now: datetime
    ) -> LookupRequest:
        if self._forgotten:  # the key was forgotten because its retention passed
            now += self._retention + timedelta(seconds=1)
        return _lookup_request(sent, first_sent_at, now)

    def arm_lookup(self, fault: LookupFault) -> bool:
        if fault is LookupFault.TIMEOUT:
            raise Unsupported("FakeHttpApi delays only a request that applies an effect")
        if fault is LookupFault.REFUSED:
            self.fake.refuse_connections()
        elif fault is LookupFault.ERROR:
            self.fake.inject(ApiFault.status(500))
        else:
            self.fake.forget_keys()
            self._forgotten = True
        return True


def _api_fault(fault: Fault, timeout: float, cap: int) -> ApiFault:
    return _fault_of(ApiFault, fault, timeout, cap)

"""A fake webhook provider: a real HTTP server on loopback that honours ``Idempotency-Key``.

It behaves like a careful provider following the IETF draft "The Idempotency-Key HTTP Header
Field": the first request with a key applies one business effect and saves its response; a
retry with the same body gets that response replayed (``Idempotent-Replayed: true``); a retry
with another body gets 422; a retry while the first is still being processed gets 409; keys
are forgotten ``key_retention`` seconds after their first request.

The receiver runs inside the pytest process, so its ledger of effects outlives a dispatcher
subprocess that a test SIGKILLs. Faults (delays, 5xx, connection resets, refused connections,
and bad answers: huge, compression bombs, dribbled, or any bytes at all) and holds let tests put
the dispatcher in every awkward spot between "the provider applied the effect" and "the
dispatcher recorded it".

Bodies are parsed as a careful payment receiver parses them: numbers with a point as
``decimal.Decimal``, so ``19.999999999999999999`` and ``20.0`` are different bodies (and a
retry that changed one into the other gets 422). ``WebhookRequest.raw`` keeps the bytes.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from outbox.testing.loopback import (
    HOST,
    ApplyFault,
    BadAnswer,
    Connections,
    FaultKind,
    Hold,
    InvalidJson,
    JsonHandler,
    KeyEntry,
    Ledger,
    LoopbackFake,
    LoopbackServer,
    Plan,
    Reply,
    parse_json_body,
)

__all__ = [
    "HOST",
    "BadAnswer",
    "Effect",
    "FakeWebhookReceiver",
    "Hold",
    "WebhookFault",
    "WebhookFaultKind",
    "WebhookRequest",
    "parse_idempotency_key",
]


@dataclass(frozen=True)
class Effect:
    """One business effect the receiver applied (what outbox must never do twice per key).

    ``key`` is unquoted; header names are lower-case; ``at`` is ``time.monotonic()``.
    """

    effect_id: str
    key: str
    body: Any
    headers: dict[str, str]
    at: float


@dataclass(frozen=True)
class WebhookRequest:
    """One request that arrived, whatever became of it.

    ``body`` is the parsed JSON, numbers with a point as Decimal (None for an empty body; the
    raw text when it is not JSON); ``raw`` is the body's bytes as they came.
    ``status`` is None while the request is still being processed (held, delayed) and stays
    None when the connection was reset instead of answered. Header names are lower-case.
    """

    key: str | None
    body: Any
    headers: dict[str, str]
    status: int | None
    replayed: bool
    at: float
    answered_at: float | None = None  # time.monotonic() when answered or reset
    raw: bytes = b""


# The webhook's fault kinds are those every fake that applies effects has.
WebhookFaultKind = FaultKind


@dataclass(frozen=True)
class WebhookFault(ApplyFault):
    """A misbehaviour to inject; build one with the class methods, e.g.
    ``WebhookFault.status(503)``.

    Before-apply faults hit any request carrying a key (a replay too): nothing is applied or
    saved. After-apply faults hit only a request that applies a new effect; a 500 after apply
    is saved as the key's answer (replays repeat it). The bad answers
    (``huge_answer_after_apply``, ``gzip_bomb_after_apply``, ``dribble_after_apply``,
    ``raw_answer_after_apply``) come from :class:`BadAnswerFaults`.
    """


def parse_idempotency_key(value: str | None) -> str | None:
    """The key in an ``Idempotency-Key`` header value, or None when absent or empty.

    The draft makes the value an RFC 8941 string (``"abc"``, with ``\\"`` and ``\\\\``
    escapes); bare values are accepted too, as many clients send them.
    """
    if value is None:
        return None
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] == '"':
        value = re.sub(r'\\(["\\])', r"\1", value[1:-1])
    return value or None


def _error(status: int, message: str) -> Reply:
    return Reply(status, {"error": message})


@dataclass
class _Entry(KeyEntry):
    """What the ledger remembers about one key: the body a retry must repeat."""

    body: Any


class _Ledger(Ledger[WebhookFault, WebhookRequest, _Entry]):
    """The provider's state: keys, effects, requests, armed faults and holds, under one lock."""

    def __init__(self, key_retention: float) -> None:
        super().__init__("fake webhook", key_retention)
        self._effects: list[Effect] = []

    def admit(self, key: str, body: Any, headers: dict[str, str]) -> Plan:
        """Decide a valid request's fate, applying its effect if the key is new."""
        with self.cond:
            fault = self._take_fault(key, lambda f: f.before_apply)
            if fault is not None:
                return Plan(_before_apply_reply(fault))
            now = time.monotonic()
            entry = self._live_entry(key, now)
            if entry is not None:
                return Plan(_existing_reply(entry, body))
            return self._apply(key, body, headers, now)

    def _apply(self, key: str, body: Any, headers: dict[str, str], now: float) -> Plan:
        fault = self._take_fault(key, lambda f: not f.before_apply)
        effect = Effect(f"wh_{len(self._effects) + 1}", key, body, headers, now)
        self._effects.append(effect)
        if fault is not None and fault.kind is WebhookFaultKind.ERROR_500_AFTER_APPLY:
            saved = _error(500, "injected 500 after apply")
        else:
            saved = Reply(201, {"id": effect.effect_id, "key": key})
        entry = _Entry(body, reply=saved, expires_at=now + self._retention)
        self._entries[key] = entry
        self.cond.notify_all()
        reset = fault is not None and fault.kind is WebhookFaultKind.RESET_AFTER_APPLY
        delay = fault.seconds if fault is not None else 0.0
        reply = saved if fault is None or fault.answer is None else saved.badly(fault.answer)
        return Plan(None if reset else reply, entry, self._holds.pop(key, None), delay)

    def effects(self) -> list[Effect]:
        with self.cond:
            return list(self._effects)

    def effect_total(self) -> int:
        """The number of effects (call with the lock held)."""
        return len(self._effects)


def _before_apply_reply(fault: WebhookFault) -> Reply | None:
    if fault.kind is WebhookFaultKind.RESET_BEFORE_APPLY:
        return None
    headers = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
    return Reply(fault.code, {"error": f"injected {fault.code}"}, headers)


def _existing_reply(entry: _Entry, body: Any) -> Reply:
    if entry.in_progress:
        return _error(409, "in progress")
    if entry.body != body:
        return _error(422, "idempotency key reused with another body")
    return entry.reply.as_replay()


class _Server(LoopbackServer):
    """The listener; deliveries go to ``hook_path`` and nowhere else."""

    ledger: _Ledger

    def __init__(
        self, port: int, ledger: _Ledger, connections: Connections, hook_path: str
    ) -> None:
        self.hook_path = hook_path
        super().__init__(port, ledger, connections, _Handler)


class _Handler(JsonHandler):
    """Serves one connection; chunked bodies are read, as some webhook clients send them."""

    accepts_chunked = True
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server dispatches to this name)
        """Serve a webhook delivery."""
        self._serve(self._decide)

    def do_GET(self) -> None:  # noqa: N802 (likewise)
        """Only POST is a delivery; other methods get 405 (and are still recorded)."""
        self._serve(lambda key, body, headers: _error(405, "method not allowed"))

    do_PUT = do_PATCH = do_DELETE = do_GET  # noqa: N815 (the names http.server dispatches to)

    def _serve(self, decide: Callable[[str | None, Any, dict[str, str]], Reply | None]) -> None:
        raw = self._read_body()
        if raw is None:
            return
        key = parse_idempotency_key(self.headers.get("Idempotency-Key"))
        body = parse_json_body(raw)
        headers = {name.lower(): str(value) for name, value in self.headers.items()}
        recorded = body.text if isinstance(body, InvalidJson) else body
        self._respond(
            lambda at: WebhookRequest(key, recorded, headers, None, False, at, raw=raw),
            lambda: decide(key, body, headers),
        )

    def _decide(self, key: str | None, body: Any, headers: dict[str, str]) -> Reply | None:
        """The answer to a delivery (None: reset), after any hold or delay it must sit out."""
        rejection = self._validate(key, body)
        if rejection is not None:
            return rejection
        assert key is not None  # noqa: S101 (_validate rejected the request otherwise)
        plan = self.server.ledger.admit(key, body, headers)
        self.server.ledger.sit_out(plan)
        return plan.reply

    def _validate(self, key: str | None, body: Any) -> Reply | None:
        if urlsplit(self.path).path != self.server.hook_path:
            return _error(404, "not found")
        if key is None:
            return _error(400, "missing Idempotency-Key header")
        if isinstance(body, InvalidJson):
            return _error(400, "body is not JSON")
        return None


class FakeWebhookReceiver(LoopbackFake[WebhookFault, WebhookRequest]):
    """A loopback webhook provider that applies each idempotency key's effect once.

    Use as a context manager (or ``start()``/``stop()``); ``url`` is valid once started.
    Lifecycle calls (start, stop, refuse/accept_connections) belong to the test's thread;
    everything else is thread-safe. The lifecycle, ``received``, ``connections_accepted``,
    ``wait_idle``, ``inject``, ``hold`` and ``forget_keys`` come from :class:`LoopbackFake`.
    """

    _noun = "receiver"
    _thread_name = "fake-webhook"
    _ledger: _Ledger

    def __init__(self, *, key_retention: float = 86400.0, path: str = "/hook") -> None:
        if not path.startswith("/"):
            raise ValueError("path must start with '/'")
        if key_retention < 0:
            raise ValueError("key_retention must not be negative")
        self.path = path
        super().__init__(_Ledger(key_retention))

    def _make_server(self, port: int) -> _Server:
        return _Server(port, self._ledger, self._connections, self.path)

    @property
    def url(self) -> str:
        """Where to POST deliveries: ``http://127.0.0.1:<port><path>``."""
        return f"http://{HOST}:{self.port}{self.path}"

    # --- what happened --------------------------------------------------------------------

    @property
    def effects(self) -> list[Effect]:
        """A snapshot of the effects applied, in order."""
        return self._ledger.effects()

    def effect_count(self, key: str | None = None) -> int:
        """The number of effects applied, for ``key`` or in all."""
        return len(self.effects if key is None else self.effects_for(key))

    def effects_for(self, key: str) -> list[Effect]:
        """The effects applied for ``key``, in order."""
        return [e for e in self.effects if e.key == key]

    def received_for(self, key: str) -> list[WebhookRequest]:
        """The requests that carried ``key``, in order of arrival."""
        return [r for r in self.received if r.key == key]

    def wait_for_effects(self, count: int, timeout: float = 5.0) -> list[Effect]:
        """Wait until at least ``count`` effects exist; raise TimeoutError otherwise."""
        ledger = self._ledger
        ledger.wait_for(lambda: ledger.effect_total() >= count, timeout, f"{count} effects")
        return self.effects

"""A fake Relay API on loopback, built on outbox.testing.loopback: what the provider's tests and
the conformance suite talk to instead of the real service.

It keeps Relay's documented idempotency: the first ``POST /v1/messages`` with an
``X-Request-Key`` queues one message (an effect) and saves its 202; the same key and body replay
it (``Idempotent-Replayed: true``); the same key with another body gets 422; the same key while
the first is still being processed gets 409; a key is forgotten ``key_retention`` seconds after
its first use, and ``GET /v1/messages?request_key=`` finds messages only by keys still kept,
saying since when it keeps them (``keys_retained_since``). Faults (:class:`RelayFault`) strike a
send before or after its effect, or a lookup.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Self
from urllib.parse import parse_qs, urlsplit

from outbox.testing.loopback import (
    HOST,
    BadAnswer,
    BadAnswerFaults,
    JsonHandler,
    KeyEntry,
    Ledger,
    LoopbackFake,
    LoopbackServer,
    Plan,
    Reply,
)

DEFAULT_TOKEN = "relay_test_token"  # noqa: S105 (the fake's own, known to every test)
KEY_RETENTION = 72 * 3600.0  # seconds, as Relay documents
_PATH = "/v1/messages"
_E164 = re.compile(r"\+[1-9][0-9]{6,14}")


class RelayFaultKind(enum.Enum):
    STATUS = "status"  # a send, before acting
    RESET_BEFORE_APPLY = "reset_before_apply"
    DELAY_AFTER_APPLY = "delay_after_apply"
    ERROR_500_AFTER_APPLY = "error_500_after_apply"
    RESET_AFTER_APPLY = "reset_after_apply"
    BAD_ANSWER_AFTER_APPLY = "bad_answer_after_apply"
    LOOKUP_STATUS = "lookup_status"
    LOOKUP_DELAY = "lookup_delay"


_BEFORE = frozenset({RelayFaultKind.STATUS, RelayFaultKind.RESET_BEFORE_APPLY})
_LOOKUP = frozenset({RelayFaultKind.LOOKUP_STATUS, RelayFaultKind.LOOKUP_DELAY})


@dataclass(frozen=True)
class RelayFault(BadAnswerFaults):
    """A misbehaviour to inject with ``FakeRelay.inject``; build one with the class methods."""

    kind: RelayFaultKind
    code: int = 500
    retry_after: int | None = None
    seconds: float = 0.0
    answer: BadAnswer | None = None

    @classmethod
    def status(cls, code: int, retry_after: int | None = None) -> RelayFault:
        """Answer a send ``code`` without acting or saving anything."""
        return cls(RelayFaultKind.STATUS, code=code, retry_after=retry_after)

    @classmethod
    def reset_before_apply(cls) -> RelayFault:
        return cls(RelayFaultKind.RESET_BEFORE_APPLY)

    @classmethod
    def delay_after_apply(cls, seconds: float) -> RelayFault:
        """Queue the message and save its 202, then wait ``seconds`` before answering."""
        return cls(RelayFaultKind.DELAY_AFTER_APPLY, seconds=seconds)

    @classmethod
    def error_500_after_apply(cls) -> RelayFault:
        """Queue the message, then answer 500 (a replay gets the saved 202)."""
        return cls(RelayFaultKind.ERROR_500_AFTER_APPLY)

    @classmethod
    def reset_after_apply(cls) -> RelayFault:
        return cls(RelayFaultKind.RESET_AFTER_APPLY)

    @classmethod
    def bad_answer_after_apply(cls, answer: BadAnswer) -> Self:
        return cls(RelayFaultKind.BAD_ANSWER_AFTER_APPLY, answer=answer)

    @classmethod
    def lookup_status(cls, code: int) -> RelayFault:
        """Answer the next lookup ``code``."""
        return cls(RelayFaultKind.LOOKUP_STATUS, code=code)

    @classmethod
    def lookup_delay(cls, seconds: float) -> RelayFault:
        """Answer the next lookup ``seconds`` late."""
        return cls(RelayFaultKind.LOOKUP_DELAY, seconds=seconds)


@dataclass(frozen=True)
class RelayRequest:
    """One request that arrived; ``key`` is a send's X-Request-Key, ``query`` a lookup's."""

    method: str
    key: str | None
    query: str
    raw: bytes
    status: int | None
    replayed: bool
    at: float
    answered_at: float | None = None


@dataclass
class _Entry(KeyEntry):
    body: Any
    message: dict[str, Any]


def _error(status: int, code: str, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
    return Reply(status, {"error": {"code": code}}, headers)


class _Ledger(Ledger[RelayFault, RelayRequest, _Entry]):
    def __init__(self, token: str, key_retention: float) -> None:
        super().__init__("fake relay", key_retention)
        self._token = token
        self._messages: list[dict[str, Any]] = []
        self.kept_since = time.time()  # wall clock: Relay states it as a date

    def admit_send(self, key: str, body: Any, authorization: str | None) -> Plan:
        with self.cond:
            if authorization != f"Bearer {self._token}":
                return Plan(_error(401, "invalid_token"))
            fault = self._take_fault(key, lambda f: f.kind in _BEFORE)
            if fault is not None:
                return Plan(_before_reply(fault))
            now = time.monotonic()
            entry = self._live_entry(key, now)
            if entry is not None:
                if entry.in_progress:
                    return Plan(_error(409, "request_key_in_use"))
                if entry.body != body:
                    return Plan(_error(422, "request_key_reused"))
                return Plan(entry.reply.as_replay())
            return self._apply(key, body, now)

    def _apply(self, key: str, body: Any, now: float) -> Plan:
        if not _valid(body):
            return Plan(_error(400, "invalid_message"))
        fault = self._take_fault(key, lambda f: f.kind not in _BEFORE | _LOOKUP)
        sms = {"to": body["to"], "text": body["text"]}
        sent = {"id": f"msg_{len(self._messages) + 1:06d}", "status": "queued", **sms}
        self._messages.append({**sent, "request_key": key})
        saved = Reply(202, {"id": sent["id"], "status": "queued"})
        entry = _Entry(body, sent, reply=saved, expires_at=now + self._retention)
        self._entries[key] = entry
        self.cond.notify_all()
        plan = _after_plan(fault, saved, entry)
        return dataclasses.replace(plan, hold=self._holds.pop(key, None))

    def admit_lookup(self, key: str, authorization: str | None) -> Plan:
        with self.cond:
            if authorization != f"Bearer {self._token}":
                return Plan(_error(401, "invalid_token"))
            fault = self._take_fault(None, lambda f: f.kind in _LOOKUP)
            entry = self._live_entry(key, time.monotonic())
            data = [] if entry is None or entry.in_progress else [entry.message]
            since = datetime.fromtimestamp(self.kept_since, UTC).isoformat()
            reply = Reply(200, {"data": data, "keys_retained_since": since})
            if fault is not None and fault.kind is RelayFaultKind.LOOKUP_STATUS:
                return Plan(_error(fault.code, "injected"))
            return Plan(reply, delay=fault.seconds if fault is not None else 0.0)

    def forget(self) -> None:
        """Every key expires now, and Relay says it keeps keys only from now on."""
        self.forget_keys()
        with self.cond:
            self.kept_since = time.time()

    def messages(self) -> list[dict[str, Any]]:
        with self.cond:
            return [dict(m) for m in self._messages]


def _valid(body: Any) -> bool:
    """A message Relay takes: an E.164 number and 1 to 1,600 characters of text."""
    if not isinstance(body, dict):
        return False
    to, text = body.get("to"), body.get("text")
    return (
        isinstance(to, str)
        and _E164.fullmatch(to) is not None
        and isinstance(text, str)
        and 0 < len(text) <= 1600
    )


def _before_reply(fault: RelayFault) -> Reply | None:
    if fault.kind is RelayFaultKind.RESET_BEFORE_APPLY:
        return None
    headers = () if fault.retry_after is None else (("Retry-After", str(fault.retry_after)),)
    return _error(fault.code, "injected", headers)


def _after_plan(fault: RelayFault | None, saved: Reply, entry: _Entry) -> Plan:
    if fault is None:
        return Plan(saved, entry)
    if fault.kind is RelayFaultKind.RESET_AFTER_APPLY:
        return Plan(None, entry)
    if fault.kind is RelayFaultKind.ERROR_500_AFTER_APPLY:
        return Plan(_error(500, "internal"), entry)
    reply = saved if fault.answer is None else saved.badly(fault.answer)
    return Plan(reply, entry, delay=fault.seconds)


class _Server(LoopbackServer):
    ledger: _Ledger


class _Handler(JsonHandler):
    server: _Server

    def do_POST(self) -> None:  # noqa: N802 (http.server dispatches to this name)
        self._serve()

    do_GET = do_POST  # noqa: N815 (likewise)

    def _serve(self) -> None:
        raw = self._read_body()
        if raw is None:
            return
        url = urlsplit(self.path)
        key = self.headers.get("X-Request-Key") if self.command == "POST" else None

        def received(at: float) -> RelayRequest:
            return RelayRequest(self.command, key, url.query, raw, None, False, at)

        self._respond(received, lambda: self._decide(url.path, url.query, key, raw))

    def _decide(self, path: str, query: str, key: str | None, raw: bytes) -> Reply | None:
        ledger, auth = self.server.ledger, self.headers.get("Authorization")
        if path != _PATH:
            return _error(404, "not_found")
        if self.command == "GET":
            keys = parse_qs(query).get("request_key")
            if not keys:
                return _error(400, "request_key_required")
            plan = ledger.admit_lookup(keys[0], auth)
        elif not key:
            return _error(400, "request_key_required")
        else:
            try:
                body = json.loads(raw)
            except ValueError:
                return _error(400, "invalid_json")
            plan = ledger.admit_send(key, body, auth)
        try:
            if plan.hold is not None:  # FakeRelay.hold(key): acted, not answered yet
                plan.hold.arrived.set()
                plan.hold.wait_released()
        finally:
            if plan.entry is not None:  # complete before answering: a retry sees a replay
                ledger.complete(plan.entry)
        if plan.delay:
            ledger.stopping.wait(plan.delay)
        return plan.reply


class FakeRelay(LoopbackFake[RelayFault, RelayRequest]):
    """Relay on 127.0.0.1, in a thread of this process; use it as a context manager."""

    _noun = "fake Relay"
    _thread_name = "fake-relay"
    _ledger: _Ledger

    def __init__(
        self,
        *,
        token: str = DEFAULT_TOKEN,
        key_retention: float = KEY_RETENTION,
    ) -> None:
        self.token = token
        super().__init__(_Ledger(token, key_retention))

    def _make_server(self, port: int) -> _Server:
        return _Server(port, self._ledger, self._connections, _Handler)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Every message queued (each an effect), with the ``request_key`` that made it."""
        return self._ledger.messages()

    def message_count(self, key: str) -> int:
        return sum(m["request_key"] == key for m in self.messages)

    def forget_keys(self) -> None:
        """As if 72 hours had passed: keys expire, messages stay, lookups by key find none."""
        self._ledger.forget()

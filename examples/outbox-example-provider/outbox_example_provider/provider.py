"""The Relay provider: sends an SMS through Relay's API (fictional; see README.md) for each
operation, with outbox's idempotency key as ``X-Request-Key``, and looks messages up by key for
the reconciler.

outbox builds it through the entry point ``relay_sms`` (``factory``) from a config table::

    [providers.sms]
    type = "relay_sms"
    token_env = "RELAY_TOKEN"      # or token_file; never the token itself
    key_retention = "72h"          # at most Relay's 72 hours
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

import httpx
from outbox.config import DEFAULT_MAX_RESPONSE_BYTES, ConfigError, ProviderSettings, read_secret
from outbox.providers import building
from outbox.providers.answers import AnswerLimits, AnswerRefused, Tally, reference
from outbox.providers.base import (
    Failed,
    Found,
    InvalidRequest,
    LookupRequest,
    NotFound,
    SendRequest,
    SendResult,
    permanent,
    unknown,
)

from outbox_example_provider.answers import classify, transport_failure
from outbox_example_provider.messages import ACTION, message

DEFAULT_API_BASE: Final = "https://api.relay.example"
# How long Relay remembers a request key (its documentation): outbox's key window must fit.
RELAY_KEY_RETENTION: Final = timedelta(hours=72)
# Relay's clock and the database's may disagree: a lookup claims a complete search only when
# Relay kept its keys from this long before the operation's first send.
CLOCK_SLACK: Final = timedelta(minutes=5)
_OPTIONS: Final = frozenset({"api_base", "token_env", "token_file", "max_response_bytes"})
_SOURCE: Final = "Relay messages by request_key"


class LookupFailed(Exception):
    """Relay did not answer a lookup usably: the lookup proves nothing (the reconciler retries
    it later)."""


@dataclass(frozen=True, slots=True)
class RelayOptions:
    api_base: str
    token: str
    timeout: timedelta
    key_retention: timedelta
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __repr__(self) -> str:  # never the token
        return f"RelayOptions(api_base={self.api_base!r})"


class RelayProvider:
    """Relay's ``POST /v1/messages`` for sends, ``GET /v1/messages?request_key=`` for lookups."""

    def __init__(
        self, name: str, options: RelayOptions, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self._name = name
        self._options = options
        # Every answer read within bounds: a huge one or a gzip bomb is refused past the cap.
        self._limits = AnswerLimits(options.max_response_bytes, options.timeout.total_seconds())
        self._client = httpx.AsyncClient(
            base_url=options.api_base,
            timeout=options.timeout.total_seconds(),
            headers={"Authorization": f"Bearer {options.token}"},
            event_hooks=self._limits.event_hooks,
            follow_redirects=False,  # a redirect would replay the POST somewhere unconfigured
            transport=transport,
        )

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    @property
    def actions(self) -> frozenset[str]:
        return frozenset({ACTION})

    @property
    def tally(self) -> Tally:
        """The bytes Relay's answers came to (the conformance suite reads it)."""
        return self._limits.tally

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        message(action, payload)

    async def send(self, request: SendRequest) -> SendResult:
        try:
            body = message(request.action, request.payload)
        except InvalidRequest as exc:  # send is called without check too: never raise
            return permanent("invalid_request", str(exc), not_sent=True, request_only=True)
        built = self._built(request.idempotency_key, body)
        if not isinstance(built, httpx.Request):
            return built
        try:
            response = await self._client.send(built)
        except AnswerRefused as exc:  # Relay answered, too much or undecodably: it may have acted
            return unknown(exc.error_class, str(exc), http_status=exc.status)
        except building.NOT_WRITTEN as exc:  # h11 refused to write the head: nothing left
            return building.not_built(exc)
        except httpx.HTTPError as exc:
            return transport_failure(exc)
        return classify(response, request.idempotency_key)

    def _built(self, key: str, body: dict[str, str]) -> httpx.Request | Failed:
        """The request, or what to record when it cannot be built (not sent)."""
        problem = building.key_problem(key)
        if problem is not None:
            return problem
        try:
            return self._client.build_request(
                "POST", "/v1/messages", json=body, headers={"X-Request-Key": key}
            )
        except building.BUILD_ERRORS as exc:  # a lone surrogate in the text, say
            return building.not_built(exc)

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        """The messages sent under any of the operation's keys. Relay finds a message by its
        request key only while it keeps the key (72 hours, and it says since when in
        ``keys_retained_since``): past that, finding nothing proves nothing."""
        found: list[str] = []
        kept_since: datetime | None = None
        for key in sorted(request.keys):
            if request.pace is not None:
                await request.pace()
            ids, since = await self._messages_by_key(key)
            found += [i for i in ids if i not in found]
            kept_since = since if kept_since is None else max(kept_since, since)
        if found:
            return Found(found[0], tuple(found[1:]))
        window = (request.first_sent_at, request.search_until)
        if kept_since is None or kept_since > request.first_sent_at - CLOCK_SLACK:
            reason = f"Relay keeps request keys only since {kept_since}: they may be forgotten"
            return NotFound((_SOURCE,), *window, complete=False, reason=reason)
        return NotFound((_SOURCE,), *window)

    async def _messages_by_key(self, key: str) -> tuple[list[str], datetime]:
        response = await self._client.get("/v1/messages", params={"request_key": key})
        if response.status_code != 200:
            raise LookupFailed(f"Relay answered the lookup with HTTP {response.status_code}")
        try:
            page = response.json()
            since = datetime.fromisoformat(page["keys_retained_since"])
            ids = [reference(m.get("id")) for m in page["data"]]
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise LookupFailed(
                f"Relay's lookup answer is unreadable: {type(exc).__name__}"
            ) from None
        if since.tzinfo is None or None in ids:
            raise LookupFailed("Relay's lookup answer is unreadable: no time zone or no id")
        return [i for i in ids if i is not None], since

    async def aclose(self) -> None:
        await self._client.aclose()


def factory(settings: ProviderSettings) -> RelayProvider:
    """What outbox's registry calls for ``type = "relay_sms"`` (the entry point)."""
    return build(settings)


def build(settings: ProviderSettings, environ: Mapping[str, str] | None = None) -> RelayProvider:
    """The provider of ``settings``, its token read from ``environ`` (default: os.environ) or
    its file; ConfigError names the key of any problem."""
    where = f"providers.{settings.name}"
    unknown_keys = sorted(set(settings.options) - _OPTIONS)
    if unknown_keys:
        raise ConfigError(f"{where}.{unknown_keys[0]} is not a relay_sms setting")
    if settings.key_retention > RELAY_KEY_RETENTION:
        raise ConfigError(
            f"{where}.key_retention is {settings.key_retention}; Relay keeps keys for 72 hours",
            key=f"{where}.key_retention",
        )
    return RelayProvider(settings.name, _options(settings, where, environ))


def _options(
    settings: ProviderSettings, where: str, environ: Mapping[str, str] | None
) -> RelayOptions:
    options = settings.options
    if "token_env" in options:
        spec = {"env": str(options["token_env"])}
        token = read_secret(spec, key=f"{where}.token_env", environ=environ)
    elif "token_file" in options:
        spec = {"file": str(options["token_file"])}
        token = read_secret(spec, key=f"{where}.token_file", environ=environ)
    else:
        raise ConfigError(f"{where} needs token_env or token_file (never the token itself)")
    cap = options.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ConfigError(f"{where}.max_response_bytes must be a positive integer (bytes)")
    api_base = str(options.get("api_base", DEFAULT_API_BASE))
    if not api_base.startswith(("https://", "http://127.0.0.1", "http://localhost")):
        raise ConfigError(f"{where}.api_base must be https:// (http:// only to loopback)")
    return RelayOptions(api_base, token, settings.timeout, settings.key_retention, cap)

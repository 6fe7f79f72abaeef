"""What the Relay provider sends and how it reads Relay, beyond the conformance suite."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import pytest
from outbox.model import FailureClass
from outbox.providers.base import Failed, Found, InvalidRequest, NotFound, Succeeded

from outbox_example_provider import RelayProvider
from outbox_example_provider.harness import RelayHarness, relay_harness

T = TypeVar("T")


def with_provider(harness: RelayHarness, use: Callable[[RelayProvider], Awaitable[T]]) -> T:
    """``use`` a fresh provider in an event loop of its own, then close it."""

    async def run() -> T:
        provider = harness.provider()
        assert isinstance(provider, RelayProvider)
        try:
            return await use(provider)
        finally:
            await provider.aclose()

    return asyncio.run(run())


def test_check_refuses_what_relay_would_refuse_every_time() -> None:
    with relay_harness() as harness:
        provider = harness.provider()
    provider.check("sms.send", {"to": "+15551234567", "text": "hi"})
    for payload in ({"to": "5551234567", "text": "hi"}, {"to": "+15551234567"}):
        with pytest.raises(InvalidRequest):
            provider.check("sms.send", payload)
    with pytest.raises(InvalidRequest, match=r"it can do 'sms\.send'"):
        provider.check("sms.recall", {})
    asyncio.run(provider.aclose())


def test_a_message_is_sent_with_the_key_and_found_by_it() -> None:
    async def send_and_look(provider: RelayProvider) -> tuple[object, object]:
        request = harness.send_request("ob1_abc", 1)
        sent = await provider.send(request)
        now = datetime.now(UTC)
        return sent, await provider.lookup(
            harness.lookup_request(request, now - timedelta(hours=1), now)
        )

    with relay_harness() as harness:
        sent, found = with_provider(harness, send_and_look)
        (arrived,) = [r for r in harness.fake.received if r.method == "POST"]
    assert isinstance(sent, Succeeded)
    assert sent.reference.startswith("msg_")
    assert arrived.key == "ob1_abc"
    assert json.loads(arrived.raw) == {"to": "+15551234567", "text": "Your code is 000001"}
    assert found == Found(sent.reference)


def test_a_lookup_past_relays_retention_proves_nothing() -> None:
    with relay_harness() as harness:
        harness.fake.forget_keys()
        now = datetime.now(UTC)
        asked = harness.lookup_request(harness.send_request("ob1_old", 1), now, now)
        found = with_provider(harness, lambda provider: provider.lookup(asked))
    assert isinstance(found, NotFound)
    assert not found.complete
    assert "Relay keeps request keys only since" in (found.reason or "")


def test_an_unknown_action_sent_anyway_is_permanent_and_not_sent() -> None:
    with relay_harness() as harness:
        odd = dataclasses.replace(harness.send_request("ob1_x", 1), action="sms.recall")
        result = with_provider(harness, lambda provider: provider.send(odd))
        assert harness.fake.received == []
    assert isinstance(result, Failed)
    assert result.failure is FailureClass.PERMANENT
    assert result.not_sent

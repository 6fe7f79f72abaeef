"""outbox finds the provider through its entry point, once this package is installed
(`pip install -e examples/outbox-example-provider`), and checks its settings as it starts."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from importlib.metadata import entry_points

import pytest
from outbox.config import ConfigError, ProviderSettings
from outbox.providers.base import Lookup, Provider
from outbox.providers.registry import ENTRY_POINT_GROUP, build_providers

from outbox_example_provider import RelayProvider


def test_outbox_builds_relay_sms_from_its_entry_point(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    names = {ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert "relay_sms" in names, "install the example first: pip install -e ."
    monkeypatch.setenv("RELAY_TOKEN", "relay_live_token")
    settings = ProviderSettings("sms", "relay_sms", options={"token_env": "RELAY_TOKEN"})
    provider = build_providers({"sms": settings})["sms"]
    try:
        assert isinstance(provider, RelayProvider)
        assert isinstance(provider, Provider)
        assert isinstance(provider, Lookup)
        assert provider.name == "sms"
    finally:
        asyncio.run(provider.aclose())


@pytest.mark.parametrize(
    ("options", "retention", "says"),
    [
        ({}, timedelta(hours=24), "needs token_env or token_file"),
        ({"token_env": "RELAY_TOKEN"}, timedelta(hours=96), "Relay keeps keys for 72 hours"),
        ({"token_env": "RELAY_TOKEN", "url": "x"}, timedelta(hours=1), "url is not a relay_sms"),
        ({"token_env": "UNSET_RELAY_TOKEN"}, timedelta(hours=1), "UNSET_RELAY_TOKEN is not set"),
        (
            {"token_env": "RELAY_TOKEN", "api_base": "http://relay.example"},
            timedelta(hours=1),
            "must be https://",
        ),
    ],
)
def test_a_bad_setting_is_a_config_error_naming_it(
    monkeypatch: pytest.MonkeyPatch, options: dict[str, str], retention: timedelta, says: str
) -> None:
    monkeypatch.setenv("RELAY_TOKEN", "relay_live_token")
    monkeypatch.delenv("UNSET_RELAY_TOKEN", raising=False)
    settings = ProviderSettings("sms", "relay_sms", key_retention=retention, options=options)
    with pytest.raises(ConfigError, match=says):
        build_providers({"sms": settings})

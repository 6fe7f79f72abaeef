"""The README's config example is a config that works."""

from __future__ import annotations

import re
import tomllib
from datetime import timedelta
from pathlib import Path

from outbox.config import ProviderLimits, settings_from_mapping
from outbox.providers.registry import stripe_options, webhook_options

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_config_loads_with_its_secret_from_the_environment() -> None:
    (block,) = re.findall(r"```toml\n(# outbox.toml\n.*?)```", README.read_text(), re.DOTALL)
    settings = settings_from_mapping(tomllib.loads(block), environ={})
    assert settings.dispatcher.lease == timedelta(seconds=30)
    options = webhook_options(settings.providers["billing"], {"BILLING_TOKEN": "Bearer t0k"})
    assert options.secret_headers == {"Authorization": "Bearer t0k"}
    assert options.url == "https://billing.internal/outbox"
    assert settings.providers["billing"].limits == ProviderLimits(
        max_in_flight=16,
        rate=100.0,
        burst=100,
        breaker_failures=5,
        breaker_open_for=timedelta(seconds=30),
    )
    assert "t0k" not in repr(options) and "t0k" not in repr(settings)


def test_the_readme_stripe_block_loads() -> None:
    (block,) = re.findall(
        r"```toml\n(\[providers\.stripe\]\n.*?)```", README.read_text(), re.DOTALL
    )
    settings = settings_from_mapping(tomllib.loads(block), environ={})
    options = stripe_options(settings.providers["stripe"], {"STRIPE_API_KEY": "sk_test_x"})
    assert options.api_key == "sk_test_x"
    assert options.key_retention == timedelta(hours=24)
    assert options.timeout == timedelta(seconds=20)

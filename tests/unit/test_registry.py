"""Providers are built from settings: the built-in types, plug-ins, and clear errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from outbox.config import ConfigError, ProviderSettings
from outbox.providers.base import Provider
from outbox.providers.registry import build_providers, stripe_options


def test_a_plugin_registered_as_an_entry_point_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = tmp_path / "outbox_echo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: outbox-echo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[outbox.providers]\necho = tests.support.plugin_provider:factory\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = ProviderSettings("mine", "echo", key_retention=timedelta(hours=2),
                                options={"prefix": "x"})  # fmt: skip
    provider = build_providers({"mine": settings})["mine"]
    assert isinstance(provider, Provider)
    assert (provider.name, provider.key_retention) == ("mine", timedelta(hours=2))


def test_an_unknown_type_names_the_key_and_the_entry_point_group() -> None:
    with pytest.raises(ConfigError, match=r"providers\.x\.type: unknown provider type 'nope'"):
        build_providers({"x": ProviderSettings("x", "nope")})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"providers\.hook\.url must be an http"),
        ({"url": "ftp://x"}, r"providers\.hook\.url must be an http"),
        ({"url": "http://x", "colour": "red"}, r"providers\.hook\.colour is not a webhook"),
        ({"url": "http://x", "headers": {"A": 1}}, r"providers\.hook\.headers\.A must be a string"),
        ({"url": "http://x", "secret_headers": {"A": "plain"}}, r"never written in the config"),
        ({"url": "http://x", "secret_headers": {"A": {"env": "NOPE_UNSET"}}}, "NOPE_UNSET"),
    ],
)
def test_webhook_settings_errors_name_the_key(options: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_providers({"hook": ProviderSettings("hook", "webhook", options=options)}, environ={})


def test_stripe_reads_its_key_from_the_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "payments").write_text("sk_test_from_systemd\n")
    ps = ProviderSettings("payments", "stripe")
    options = stripe_options(ps, {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert options.api_key == "sk_test_from_systemd"
    assert "sk_test" not in repr(options)


@pytest.mark.parametrize(
    ("options", "environ", "message"),
    [
        ({}, {}, r"providers\.s needs api_key_env or api_key_file"),
        ({"api_key_env": "NOPE"}, {}, r"providers\.s\.api_key: environment variable NOPE"),
        ({"api_key": "sk_live_x"}, {}, r"providers\.s\.api_key is not a stripe provider setting"),
        ({"api_key_env": "K", "api_base": "api.stripe.com"}, {"K": "x"}, r"api_base must be"),
    ],
)
def test_stripe_settings_errors_name_the_key(
    options: dict[str, object], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message) as caught:
        stripe_options(ProviderSettings("s", "stripe", options=options), environ)
    assert "sk_live_x" not in str(caught.value)

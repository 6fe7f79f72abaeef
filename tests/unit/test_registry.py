"""Providers are built from settings: the built-in types, plug-ins, and clear errors."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path

import pytest
import structlog

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.providers.base import Lookup, Provider
from outbox.providers.noop import NoopProvider
from outbox.providers.registry import QUEUE_TYPES, build_providers, may_look_up, stripe_options


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
    settings = ProviderSettings(
        "mine", "echo", key_retention=timedelta(hours=2), options={"prefix": "x"}
    )
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


# --- issue 21, case 10: a config that cannot work, or leaks, is refused at start ---------------


def _webhook(options: Mapping[str, object], env: dict[str, str] | None = None) -> None:
    ps = ProviderSettings(
        "hook", "webhook", options={"url": "https://hooks.example.com/", **options}
    )
    build_providers({"hook": ps}, environ=env or {})


@pytest.mark.parametrize("value", ["Bearer x\r\nX-Evil: 1", "Bearer x\n", "a\x00b", "Bearer ü"])
def test_a_header_no_request_could_carry_is_refused_and_never_quoted(value: str) -> None:
    with pytest.raises(ConfigError, match="no HTTP header may carry") as refused:
        _webhook({"secret_headers": {"Authorization": {"env": "TOKEN"}}}, {"TOKEN": value})
    assert value.strip() not in str(refused.value)
    with pytest.raises(ConfigError, match="no HTTP header may carry"):
        _webhook({"headers": {"X-Source": value}})


@pytest.mark.parametrize("name", ["Authorization", "X-Api-Key", "x-auth-token", "Cookie"])
def test_a_secret_written_in_plain_headers_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="looks like a secret: move it to secret_headers"):
        _webhook({"headers": {name: "Bearer hunter2"}})


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://hooks.example.com/", False),
        ("http://127.0.0.1:8080/", True),
        ("http://localhost/", True),
        ("https://hooks.example.com/", True),
    ],
)
def test_secrets_never_travel_in_clear_text_to_another_host(url: str, allowed: bool) -> None:
    options = {"url": url, "secret_headers": {"Authorization": {"env": "TOKEN"}}}
    env = {"TOKEN": "Bearer t"}
    if allowed:
        _webhook(options, env)
    else:
        with pytest.raises(ConfigError, match="clear text: use https://, or set allow_insecure"):
            _webhook(options, env)
        _webhook({**options, "allow_insecure": True}, env)
    _webhook({"url": url})  # without secrets, clear text is the receiver's business


def test_credentials_in_a_url_are_refused() -> None:
    with pytest.raises(ConfigError, match="holds credentials"):
        _webhook({"url": "https://user:hunter2@hooks.example.com/"})


def test_stripe_never_sends_its_key_in_clear_text_to_another_host() -> None:
    base = {"api_key_env": "KEY"}
    env = {"KEY": "sk_test_x"}
    with pytest.raises(ConfigError, match="clear text"):
        stripe_options(
            ProviderSettings("s", "stripe", options={**base, "api_base": "http://api.example.com"}),
            env,
        )
    stripe_options(
        ProviderSettings("s", "stripe", options={**base, "api_base": "http://127.0.0.1:12111"}), env
    )


def test_a_secret_file_others_can_read_is_warned_of(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("Bearer t\n")
    secret.chmod(0o644)
    with structlog.testing.capture_logs() as logs:
        _webhook({"secret_headers": {"Authorization": {"file": str(secret)}}})
        secret.chmod(0o600)
        _webhook({"secret_headers": {"Authorization": {"file": str(secret)}}})
    warned = "a secret file is readable by its group or by everyone: chmod 600 it"
    assert [(e["event"], e["mode"]) for e in logs] == [(warned, "0o644")]


def test_the_types_said_to_have_no_lookup_have_none() -> None:
    """`reconcile check` skips building a provider may_look_up says has none (issue 37): that
    must stay true of the types' classes, or a check would answer no_lookup for one that has."""
    classes: dict[str, type] = {"noop": NoopProvider}
    for kind, (module, _client) in QUEUE_TYPES.items():
        loaded = importlib.import_module(f"outbox.providers.{module}")
        (classes[kind],) = [
            getattr(loaded, n) for n in dir(loaded) if n.endswith("Provider") and n != "Provider"
        ]
    for kind, cls in classes.items():
        has = issubclass(cls, Lookup)
        assert may_look_up(ProviderSettings("p", kind)) == has, kind


@pytest.mark.parametrize(
    ("kind", "options", "asks"),
    [
        ("webhook", {"url": "https://x.example/h"}, False),
        ("webhook", {"url": "https://x.example/h", "lookup": {"path": "/h/{key}"}}, True),
        ("http", {"actions": {"a": {"path": "/a"}, "b": {"path": "/b"}}}, False),
        ("http", {"actions": {"a": {"path": "/a"}, "b": {"lookup": {"path": "/b/{key}"}}}}, True),
        ("http", {}, True),  # nothing to judge by: built, and its errors said
        ("stripe", {}, True),
        ("my-plugin", {}, True),
    ],
)
def test_a_provider_may_look_up_unless_its_settings_say_it_cannot(
    kind: str, options: dict[str, object], asks: bool
) -> None:
    assert may_look_up(ProviderSettings("p", kind, options=options)) is asks

from __future__ import annotations

import dataclasses
import locale
import math
import re
import sys
import tomllib
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example as hypothesis_example
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from outbox.config.loader import load_settings, settings_from_mapping
from outbox.config.options import PROVIDER_OPTIONS
from outbox.config.reference import COMMAND, reference
from outbox.config.schema import settings_of
from outbox.config.secrets import read_secret
from outbox.config.settings import (
    DEFAULT_KEY_RETENTION,
    DEFAULT_TIMEOUT,
    MAX_CONCURRENCY,
    TABLES,
    ConfigError,
    DatabaseSettings,
    DispatcherSettings,
    ProviderLimits,
    ProviderSettings,
    Settings,
    format_rate,
)
from outbox.errors import OutboxError
from outbox.observability import logs, redaction
from outbox.providers import registry
from outbox.providers.http import webhook
from outbox.providers.stripe import provider as stripe
from outbox.runtime import event_loop

PROPERTY = hypothesis_settings(database=None, deadline=None)

EXAMPLE = """\
log_level = "info"        # optional top-level: debug|info|warning|error

[dispatcher]
concurrency = 64          # provider calls in flight, per process
batch_size = 100          # rows claimed per claim query
lease = "30s"
poll_interval = "1s"      # fallback when no NOTIFY arrives
shutdown_grace = "25s"
max_attempts = 10
backoff_base = "1s"
backoff_max = "10m"
retention_margin = "1h"   # route to reconciliation this long before the provider forgets a key

[providers.stripe]
type = "stripe"
api_key_env = "STRIPE_API_KEY"      # or api_key_file; never on the command line
api_base = "https://api.stripe.com"
key_retention = "24h"
timeout = "20s"

[providers.billing]
type = "webhook"
url = "https://billing.internal/outbox"
key_retention = "24h"
timeout = "10s"
headers = { "X-Source" = "outbox" }                       # plain, non-secret headers
secret_headers = { Authorization = { env = "BILLING_TOKEN" } }   # or { file = "/path" }
reference_field = "id"
"""


@pytest.fixture
def example(tmp_path: Path) -> Path:
    path = tmp_path / "outbox.toml"
    path.write_text(EXAMPLE, encoding="utf-8")
    return path


def load(data: dict[str, Any], **environ: str) -> Settings:
    return settings_from_mapping(data, environ)


def config_error(data: dict[str, Any], **environ: str) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        settings_from_mapping(data, environ)
    return caught.value


# --- Defaults and the example ------------------------------------------------------------------


def test_no_file_means_the_defaults() -> None:
    settings = load_settings(None, environ={})
    assert settings == Settings(dispatcher=DispatcherSettings(), providers={})
    dispatcher = settings.dispatcher
    assert (dispatcher.concurrency, dispatcher.batch_size, dispatcher.max_attempts) == (64, 100, 10)
    assert dispatcher.lease == timedelta(seconds=30)
    assert dispatcher.poll_interval == timedelta(seconds=1)
    assert dispatcher.shutdown_grace == timedelta(seconds=25)
    assert dispatcher.backoff_base == timedelta(seconds=1)
    assert dispatcher.backoff_max == timedelta(minutes=10)
    assert dispatcher.retention_margin == timedelta(hours=1)
    assert dispatcher.heartbeat is None
    assert dispatcher.heartbeat_interval == timedelta(seconds=10)
    assert settings.log_level == "info"
    assert dict(settings.providers) == {}


def test_no_file_still_takes_environment_overrides() -> None:
    settings = load_settings(None, environ={"OUTBOX_DISPATCHER__CONCURRENCY": "8"})
    assert settings.dispatcher.concurrency == 8


def test_the_example_parses_to_typed_values(example: Path) -> None:
    settings = load_settings(example, environ={})
    assert settings.log_level == "info"
    assert settings.dispatcher == DispatcherSettings()
    assert list(settings.providers) == ["stripe", "billing"]
    stripe = settings.providers["stripe"]
    assert stripe == ProviderSettings(
        name="stripe",
        type="stripe",
        key_retention=timedelta(hours=24),
        timeout=timedelta(seconds=20),
        options={"api_key_env": "STRIPE_API_KEY", "api_base": "https://api.stripe.com"},
    )
    billing = settings.providers["billing"]
    assert (billing.type, billing.timeout) == ("webhook", timedelta(seconds=10))
    assert billing.options == {
        "url": "https://billing.internal/outbox",
        "headers": {"X-Source": "outbox"},
        "secret_headers": {"Authorization": {"env": "BILLING_TOKEN"}},
        "reference_field": "id",
    }


def test_settings_are_read_only_all_the_way_down(example: Path) -> None:
    settings = load_settings(example, environ={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.log_level = "debug"  # type: ignore[misc]
    with pytest.raises(TypeError):
        settings.providers["x"] = settings.providers["stripe"]  # type: ignore[index]
    with pytest.raises(TypeError):
        settings.providers["billing"].options["headers"]["X-Source"] = "other"


def test_provider_defaults_and_numbers_as_seconds() -> None:
    settings = load(
        {"dispatcher": {"lease": 45, "poll_interval": 0.5}, "providers": {"n": {"type": "noop"}}}
    )
    assert settings.dispatcher.lease == timedelta(seconds=45)
    assert settings.dispatcher.poll_interval == timedelta(milliseconds=500)
    provider = settings.providers["n"]
    assert (provider.key_retention, provider.timeout) == (DEFAULT_KEY_RETENTION, DEFAULT_TIMEOUT)
    assert provider.options == {}


def test_a_provider_s_limits_default_to_a_breaker_alone() -> None:
    limits = load({"providers": {"n": {"type": "noop"}}}).providers["n"].limits
    assert limits == ProviderLimits(
        max_in_flight=None, rate=None, breaker_failures=5, breaker_open_for=timedelta(seconds=30)
    )


@pytest.mark.parametrize(
    ("table", "expected"),
    [
        ({"rate_limit": "100/s"}, ProviderLimits(rate=100.0, burst=100)),
        ({"rate_limit": "600/m"}, ProviderLimits(rate=10.0, burst=10)),
        ({"rate_limit": " 30 / m "}, ProviderLimits(rate=0.5, burst=1)),  # at least one
        ({"rate_limit": "2.5/s", "rate_burst": 7}, ProviderLimits(rate=2.5, burst=7)),
        (
            {"max_in_flight": 4, "breaker_failures": 2, "breaker_open_for": "1m"},
            ProviderLimits(
                max_in_flight=4, breaker_failures=2, breaker_open_for=timedelta(minutes=1)
            ),
        ),
        (
            {"breaker_failure_rate": "50%", "breaker_window": 100},
            ProviderLimits(breaker_failure_rate=0.5, breaker_window=100),
        ),
        ({"breaker_failure_rate": " 100 % "}, ProviderLimits(breaker_failure_rate=1.0)),
        ({"breaker_failure_rate": "2.5%"}, ProviderLimits(breaker_failure_rate=0.025)),
    ],
)
def test_a_provider_s_limits_from_the_file(table: dict[str, Any], expected: ProviderLimits) -> None:
    provider = load({"providers": {"n": {"type": "noop", **table}}}).providers["n"]
    assert provider.limits == expected
    assert provider.options == {}  # every provider has these keys: none is left to the type


def test_a_provider_s_limits_from_the_environment() -> None:
    environ = {
        "OUTBOX_PROVIDERS__N__MAX_IN_FLIGHT": "3",
        "OUTBOX_PROVIDERS__N__RATE_LIMIT": "25/s",
        "OUTBOX_PROVIDERS__N__RATE_BURST": "5",
        "OUTBOX_PROVIDERS__N__BREAKER_FAILURES": "9",
        "OUTBOX_PROVIDERS__N__BREAKER_OPEN_FOR": "2m",
    }
    provider = load({"providers": {"n": {"type": "noop"}}}, **environ).providers["n"]
    assert provider.limits == ProviderLimits(3, 25.0, 5, 9, timedelta(minutes=2))
    assert "rate_limit='25/s'" in repr(provider)


def test_zero_is_allowed_where_it_means_something() -> None:
    dispatcher = load({"dispatcher": {"shutdown_grace": "0s", "retention_margin": 0}}).dispatcher
    assert dispatcher.shutdown_grace == dispatcher.retention_margin == timedelta(0)


def test_heartbeat_sets_the_interval() -> None:
    dispatcher = load({"dispatcher": {"heartbeat": "5s"}}).dispatcher
    assert dispatcher.heartbeat == dispatcher.heartbeat_interval == timedelta(seconds=5)


def test_log_level_is_case_insensitive() -> None:
    assert load({"log_level": "WARNING"}).log_level == "warning"


# --- Environment overrides ---------------------------------------------------------------------


def test_environment_overrides_the_file(example: Path) -> None:
    settings = load_settings(
        example,
        environ={
            "OUTBOX_LOG_LEVEL": "debug",
            "OUTBOX_DISPATCHER__CONCURRENCY": "128",
            "OUTBOX_DISPATCHER__LEASE": "45s",
            "OUTBOX_PROVIDERS__BILLING__TIMEOUT": "3s",
            "OUTBOX_PROVIDERS__BILLING__URL": "https://other.internal/hook",
            "OUTBOX_PROVIDERS__stripe__key_retention": "12h",
        },
    )
    assert settings.log_level == "debug"
    assert settings.dispatcher.concurrency == 128
    assert settings.dispatcher.lease == timedelta(seconds=45)
    assert settings.providers["billing"].timeout == timedelta(seconds=3)
    assert settings.providers["billing"].options["url"] == "https://other.internal/hook"
    assert settings.providers["stripe"].key_retention == timedelta(hours=12)


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(DispatcherSettings)])
def test_every_dispatcher_setting_can_come_from_the_environment(field: str) -> None:
    value, expected = {
        "concurrency": ("2", 2),
        "batch_size": ("2", 2),
        "max_attempts": ("2", 2),
        "auto_reconcile": ("false", False),
        "event_loop": ("asyncio", "asyncio"),
    }.get(field, ("2s", timedelta(seconds=2)))
    settings = load({}, **{f"OUTBOX_DISPATCHER__{field.upper()}": value})
    assert getattr(settings.dispatcher, field) == expected


@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_a_boolean_in_the_file_must_be_a_toml_boolean(value: object) -> None:
    with pytest.raises(ConfigError, match=r"dispatcher\.auto_reconcile .*must be true or false"):
        load({"dispatcher": {"auto_reconcile": value}})


def test_a_provider_name_matches_ignoring_case_with_dashes_as_underscores() -> None:
    data = {"providers": {"billing-eu": {"type": "webhook", "url": "https://a"}}}
    settings = load(data, OUTBOX_PROVIDERS__BILLING_EU__URL="https://b")
    assert list(settings.providers) == ["billing-eu"]
    assert settings.providers["billing-eu"].options["url"] == "https://b"


def test_an_option_matches_ignoring_case_and_type_can_be_replaced() -> None:
    data = {"providers": {"pay": {"type": "webhook", "Reference_Field": "id"}}}
    settings = load(
        data, OUTBOX_PROVIDERS__PAY__REFERENCE_FIELD="ref", OUTBOX_PROVIDERS__PAY__TYPE="x"
    )
    assert settings.providers["pay"].type == "x"
    assert settings.providers["pay"].options == {"Reference_Field": "ref"}


def test_the_environment_can_add_a_provider_that_sets_its_type() -> None:
    settings = load({}, OUTBOX_PROVIDERS__AUDIT__TYPE="noop", OUTBOX_PROVIDERS__AUDIT__TIMEOUT="2s")
    assert settings.providers["audit"] == ProviderSettings(
        name="audit", type="noop", timeout=timedelta(seconds=2)
    )


def test_the_environment_cannot_add_a_provider_without_a_type() -> None:
    error = config_error({}, OUTBOX_PROVIDERS__AUDIT__TIMEOUT="2s")
    assert "OUTBOX_PROVIDERS__AUDIT__TIMEOUT" in str(error)
    assert "OUTBOX_PROVIDERS__AUDIT__TYPE" in str(error)


def test_other_outbox_variables_are_ignored() -> None:
    settings = load(
        {}, OUTBOX_DATABASE_URL="postgresql://x", OUTBOX_CONFIG="/etc/outbox.toml", PATH="/bin"
    )
    assert settings == Settings(dispatcher=DispatcherSettings(), providers={})


def test_an_unknown_dispatcher_variable_is_named() -> None:
    error = config_error({}, OUTBOX_DISPATCHER__LEESE="45s")
    assert str(error).startswith("OUTBOX_DISPATCHER__LEESE")
    assert "lease" in str(error) and error.key == "OUTBOX_DISPATCHER__LEESE"


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("OUTBOX_DISPATCHER__CONCURRENCY", "many", 'must be a positive integer, not "many"'),
        ("OUTBOX_DISPATCHER__BATCH_SIZE", "0", "must be a positive integer"),
        ("OUTBOX_DISPATCHER__LEASE", "soon", "must be a duration greater than zero"),
        ("OUTBOX_LOG_LEVEL", "loud", "must be one of debug, info, warning, error"),
        ("OUTBOX_PROVIDERS__BILLING__TIMEOUT", "-1s", "must be a duration greater than zero"),
        ("OUTBOX_PROVIDERS__BILLING__HEADERS", "X=1", "is a table"),
        ("OUTBOX_PROVIDERS__BILLING__RATE_LIMIT", "fast", "providers.billing.rate_limit (from "),
        ("OUTBOX_PROVIDERS__BILLING__MAX_IN_FLIGHT", "0", "providers.billing.max_in_flight"),
        ("OUTBOX_PROVIDERS__BILLING__BREAKER_OPEN_FOR", "x", "providers.billing.breaker_open_for"),
        ("OUTBOX_PROVIDERS__BILLING", "x", "OUTBOX_PROVIDERS__<NAME>__<KEY>"),
        ("OUTBOX_PROVIDERS__BILLING__A__B", "x", "OUTBOX_PROVIDERS__<NAME>__<KEY>"),
    ],
)
def test_a_bad_environment_value_names_its_variable(
    example: Path, variable: str, value: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_settings(example, environ={variable: value})
    assert variable in str(caught.value)


def test_an_ambiguous_provider_variable_is_refused() -> None:
    data = {"providers": {"a-b": {"type": "noop"}, "a_b": {"type": "noop"}}}
    error = config_error(data, OUTBOX_PROVIDERS__A_B__TIMEOUT="1s")
    assert "OUTBOX_PROVIDERS__A_B__TIMEOUT" in str(error) and "a-b or a_b" in str(error)


@pytest.mark.parametrize("text", ["true", "1", "yes", "on", " YES ", "On"])
def test_a_boolean_from_the_environment_may_be_any_word_for_true(text: str) -> None:
    data = {"dispatcher": {"auto_reconcile": False}, "database": {"listen": False}}
    settings = load(data, OUTBOX_DISPATCHER__AUTO_RECONCILE=text, OUTBOX_DATABASE__LISTEN=text)
    assert settings.dispatcher.auto_reconcile is True and settings.database.listen is True


@PROPERTY
@given(number=st.integers(-1000, 10**19))
@hypothesis_example(number=1)
@hypothesis_example(number=0)
@hypothesis_example(number=MAX_CONCURRENCY)
@hypothesis_example(number=MAX_CONCURRENCY + 1)
@hypothesis_example(number=9223372036854775807)
def test_a_count_is_any_integer_from_one_up(number: int) -> None:
    """Concurrency stops at MAX_CONCURRENCY (issue 21: 2**63 - 1 was taken without a word)."""
    if number > MAX_CONCURRENCY:
        error = config_error({"dispatcher": {"concurrency": number}})
        assert str(error) == (
            f"dispatcher.concurrency (in <config>) must be at most "
            f"{MAX_CONCURRENCY:,}, not {number}"
        )
    if number >= 1:
        if number <= MAX_CONCURRENCY:
            concurrency = load({"dispatcher": {"concurrency": number}}).dispatcher.concurrency
            assert concurrency == number
        from_env = load({}, OUTBOX_DISPATCHER__BATCH_SIZE=str(number)).dispatcher
        assert from_env.batch_size == number
    else:
        error = config_error({"dispatcher": {"concurrency": number}})
        assert str(error) == (
            f"dispatcher.concurrency (in <config>) must be a positive integer, not {number}"
        )


def test_settings_read_the_process_environment_unless_given_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_DISPATCHER__CONCURRENCY", "7")
    assert settings_from_mapping({}).dispatcher.concurrency == 7
    assert settings_from_mapping({}, {}).dispatcher.concurrency == 64


def test_a_bad_log_level_variable_names_the_key_and_the_variable() -> None:
    error = config_error({}, OUTBOX_LOG_LEVEL="loud")
    assert error.key == "log_level"
    assert str(error) == (
        'log_level (from OUTBOX_LOG_LEVEL) must be one of debug, info, warning, error, not "loud"'
    )


def test_an_unknown_dispatcher_variable_lists_every_valid_key() -> None:
    error = config_error({}, OUTBOX_DISPATCHER__LEESE="45s")
    valid = ", ".join(f.name for f in dataclasses.fields(DispatcherSettings))
    assert str(error) == (
        "OUTBOX_DISPATCHER__LEESE: the dispatcher has no setting 'leese'; "
        f"the valid keys are {valid}"
    )


@pytest.mark.parametrize("variable", ["OUTBOX_PROVIDERS__BILLING", "OUTBOX_PROVIDERS__B__C__D"])
def test_a_provider_variable_of_another_shape_is_refused_with_the_shape(variable: str) -> None:
    error = config_error({}, **{variable: "x"})
    assert error.key == variable
    assert str(error) == (
        f"{variable}: write provider overrides as OUTBOX_PROVIDERS__<NAME>__<KEY> (keys inside a "
        "provider's tables cannot be set from the environment)"
    )


def test_a_provider_only_the_environment_mentions_is_named_by_its_key() -> None:
    error = config_error({}, OUTBOX_PROVIDERS__AUDIT__TIMEOUT="2s")
    assert error.key == "providers.audit"
    assert str(error) == (
        "providers.audit (from OUTBOX_PROVIDERS__AUDIT__TIMEOUT) is not in the config file; "
        "set OUTBOX_PROVIDERS__AUDIT__TYPE to add it"
    )
    error = config_error({}, OUTBOX_PROVIDERS___AUDIT__TYPE="noop")
    assert error.key == "providers._audit"
    assert str(error).startswith(
        "providers._audit (from OUTBOX_PROVIDERS___AUDIT__TYPE) is not a valid provider name"
    )


def test_a_table_cannot_be_replaced_from_the_environment() -> None:
    data = {"providers": {"billing": {"type": "webhook", "headers": {"X-Source": "outbox"}}}}
    error = config_error(data, OUTBOX_PROVIDERS__BILLING__HEADERS="X=1")
    assert error.key == "providers.billing.headers"
    assert str(error) == (
        "providers.billing.headers (from OUTBOX_PROVIDERS__BILLING__HEADERS) is a table; "
        "it cannot be replaced from the environment"
    )


def test_an_ambiguous_provider_variable_is_named_as_the_key() -> None:
    data = {"providers": {"a-b": {"type": "noop"}, "a_b": {"type": "noop"}}}
    error = config_error(data, OUTBOX_PROVIDERS__A_B__TIMEOUT="1s")
    assert error.key == "OUTBOX_PROVIDERS__A_B__TIMEOUT"
    assert str(error) == (
        "OUTBOX_PROVIDERS__A_B__TIMEOUT could mean provider a-b or a_b: rename one of them"
    )


# --- Errors in the file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        (
            {"loglevel": "info"},
            "loglevel",
            "valid keys are database, dispatcher, log_level, providers",
        ),
        ({"dispatcher": {"leese": "30s"}}, "dispatcher.leese", "valid keys are concurrency"),
        ({"dispatcher": "fast"}, "dispatcher", 'must be a table, not "fast"'),
        ({"providers": {"a": "webhook"}}, "providers.a", 'must be a table, not "webhook"'),
        (
            {"dispatcher": {"concurrency": "many"}},
            "dispatcher.concurrency",
            'dispatcher.concurrency (in <config>) must be a positive integer, not "many"',
        ),
        ({"dispatcher": {"concurrency": "64"}}, "dispatcher.concurrency", 'not "64"'),
        ({"dispatcher": {"concurrency": True}}, "dispatcher.concurrency", "not true"),
        ({"dispatcher": {"batch_size": 0}}, "dispatcher.batch_size", "positive integer, not 0"),
        ({"dispatcher": {"max_attempts": 2.5}}, "dispatcher.max_attempts", "not 2.5"),
        ({"dispatcher": {"lease": "-5s"}}, "dispatcher.lease", "greater than zero"),
        ({"dispatcher": {"lease": -5}}, "dispatcher.lease", "not -5"),
        ({"dispatcher": {"lease": 0}}, "dispatcher.lease", "greater than zero"),
        ({"dispatcher": {"poll_interval": "1 second"}}, "dispatcher.poll_interval", "like 500ms"),
        ({"dispatcher": {"backoff_max": True}}, "dispatcher.backoff_max", "not true"),
        ({"dispatcher": {"lease": float("inf")}}, "dispatcher.lease", "not inf"),
        ({"dispatcher": {"lease": [1]}}, "dispatcher.lease", "not an array"),
        ({"dispatcher": {"shutdown_grace": "-1s"}}, "dispatcher.shutdown_grace", "zero or more"),
        ({"dispatcher": {"retention_margin": -1}}, "dispatcher.retention_margin", "zero or more"),
        ({"log_level": "verbose"}, "log_level", 'not "verbose"'),
        ({"providers": {"a": {"type": 5}}}, "providers.a.type", "not 5"),
        ({"providers": {"a": {"type": " "}}}, "providers.a.type", "provider type"),
        ({"providers": {"a": {"type": "noop", "timeout": "0s"}}}, "providers.a.timeout", "zero"),
        (
            {"providers": {"a": {"type": "noop", "key_retention": "1d2"}}},
            "providers.a.key_retention",
            'not "1d2"',
        ),
        (
            {"providers": {"a": {"type": "noop", "max_in_flight": 0}}},
            "providers.a.max_in_flight",
            "positive integer, not 0",
        ),
        (
            {"providers": {"a": {"type": "noop", "max_in_flight": "2"}}},
            "providers.a.max_in_flight",
            'not "2"',
        ),
        (
            {"providers": {"a": {"type": "noop", "rate_limit": 100}}},
            "providers.a.rate_limit",
            'must be a rate such as "100/s" or "600/m"',
        ),
        (
            {"providers": {"a": {"type": "noop", "rate_limit": "100/h"}}},
            "providers.a.rate_limit",
            'not "100/h"',
        ),
        (
            {"providers": {"a": {"type": "noop", "rate_limit": "0/s"}}},
            "providers.a.rate_limit",
            'not "0/s"',
        ),
        (
            {"providers": {"a": {"type": "noop", "rate_limit": "1/s", "rate_burst": -1}}},
            "providers.a.rate_burst",
            "positive integer, not -1",
        ),
        (
            {"providers": {"a": {"type": "noop", "rate_burst": 5}}},
            "providers.a.rate_burst",
            "applies only with providers.a.rate_limit",
        ),
        (
            {"providers": {"a": {"type": "noop", "breaker_failures": 0}}},
            "providers.a.breaker_failures",
            "positive integer, not 0",
        ),
        (
            {"providers": {"a": {"type": "noop", "breaker_open_for": "0s"}}},
            "providers.a.breaker_open_for",
            "greater than zero",
        ),
        *(
            (
                {"providers": {"a": {"type": "noop", "breaker_failure_rate": bad}}},
                "providers.a.breaker_failure_rate",
                "must be a percentage",
            )
            for bad in ("0%", "101%", "0.8", 0.8, "80", "-5%", "nan%")
        ),
        (
            {"providers": {"a": {"type": "noop", "breaker_window": 1001}}},
            "providers.a.breaker_window",
            "at most 1,000",
        ),
    ],
)
def test_a_bad_value_names_its_key(data: dict[str, Any], key: str, message: str) -> None:
    error = config_error(data)
    assert error.key == key
    assert str(error).startswith((key, f"unknown key {key}")) and message in str(error)


@pytest.mark.parametrize("name", ["Billing", "-x", "_x", "a.b", "a b", "", "x" * 65])
def test_a_bad_provider_name_is_refused(name: str) -> None:
    error = config_error({"providers": {name: {"type": "noop"}}})
    assert "is not a valid provider name" in str(error) and "[a-z0-9]" in str(error)


def test_the_longest_provider_name_is_accepted() -> None:
    assert list(load({"providers": {"x" * 64: {"type": "noop"}}}).providers) == ["x" * 64]


def test_a_provider_needs_a_type() -> None:
    error = config_error({"providers": {"billing": {"url": "https://a"}}})
    assert error.key == "providers.billing.type" and "is required" in str(error)


def test_backoff_base_may_not_exceed_backoff_max() -> None:
    error = config_error({"dispatcher": {"backoff_base": "5m", "backoff_max": "1m"}})
    assert "dispatcher.backoff_base (5m)" in str(error) and "dispatcher.backoff_max (1m)" in str(
        error
    )
    assert load({"dispatcher": {"backoff_base": "1m", "backoff_max": "1m"}})


@pytest.mark.parametrize("heartbeat", ["30s", "1m"])
def test_heartbeat_must_be_shorter_than_the_lease(heartbeat: str) -> None:
    error = config_error({"dispatcher": {"heartbeat": heartbeat, "lease": "30s"}})
    assert error.key == "dispatcher.heartbeat" and "dispatcher.lease (30s)" in str(error)


def test_retention_margin_must_be_shorter_than_every_key_retention() -> None:
    providers = {"a": {"type": "noop"}, "b": {"type": "noop", "key_retention": "1h"}}
    error = config_error({"providers": providers})
    assert error.key == "providers.b.key_retention"
    assert "providers.b.key_retention (1h)" in str(error)
    assert "dispatcher.retention_margin (1h)" in str(error)
    error = config_error(
        {"providers": {"a": {"type": "noop"}}}, OUTBOX_DISPATCHER__RETENTION_MARGIN="2d"
    )
    assert "providers.a.key_retention (24h)" in str(error)


def test_a_providers_own_retention_margin_replaces_the_dispatchers_for_it_alone() -> None:
    # A JetStream stream keeps ids for 2 minutes: a margin of an hour would leave no window.
    providers = {
        "queue": {"type": "noop", "key_retention": "2m", "retention_margin": "30s"},
        "stripe": {"type": "noop"},
    }
    settings = load({"providers": providers})
    assert settings.margins == {"queue": timedelta(seconds=30)}
    assert settings.margin_of(settings.providers["stripe"]) == timedelta(hours=1)
    providers["queue"]["retention_margin"] = "2m"
    error = config_error({"providers": providers})
    assert error.key == "providers.queue.key_retention"
    assert "must be longer than providers.queue.retention_margin (2m)" in str(error)
    del providers["queue"]["retention_margin"]
    assert "dispatcher.retention_margin (1h)" in str(config_error({"providers": providers}))
    # A margin thinner than one call: a retry begun inside the window could land after it.
    providers["queue"].update(retention_margin="5s", timeout="10s")
    error = config_error({"providers": providers})
    assert error.key == "providers.queue.retention_margin"
    assert "must be at least providers.queue.timeout (10s)" in str(error)


def test_config_error_is_an_outbox_error() -> None:
    assert issubclass(ConfigError, OutboxError)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"dispatcher": {"concurrency": False}},
            "dispatcher.concurrency (in <config>) must be a positive integer, not false",
        ),
        (
            {"dispatcher": {"concurrency": "drei€"}},
            'dispatcher.concurrency (in <config>) must be a positive integer, not "drei€"',
        ),
        (
            {"dispatcher": {"concurrency": {"n": 1}}},
            "dispatcher.concurrency (in <config>) must be a positive integer, not a table",
        ),
        (
            {"dispatcher": {"shutdown_grace": "-1s"}},
            "dispatcher.shutdown_grace (in <config>) must be a duration zero or more (like 500ms, "
            '30s, 10m, 24h, 1h30m or a number of seconds), not "-1s"',
        ),
        (
            {"dispatcher": {"heartbeat": "0s"}},
            "dispatcher.heartbeat (in <config>) must be a duration greater than zero (like 500ms, "
            '30s, 10m, 24h, 1h30m or a number of seconds), not "0s"',
        ),
        (
            {"dispatcher": {"lease time": "30s"}},
            'unknown key dispatcher."lease time" (in <config>); the valid keys are concurrency, '
            "batch_size, lease, poll_interval, shutdown_grace, max_attempts, backoff_base, "
            "backoff_max, retention_margin, heartbeat, auto_reconcile, reconcile_interval, "
            "gauge_interval, event_loop",
        ),
        (
            {"providers": {"a.b": {"type": "noop"}}},
            'providers."a.b" (in <config>) is not a valid provider name: names must match '
            '^[a-z0-9][a-z0-9_-]{0,63}$ (lower-case letters, digits, "_" and "-", at most 64 '
            "characters)",
        ),
        (
            {"providers": {"billing": {"url": "https://a"}}},
            "providers.billing.type (in <config>) is required: the provider's type, such as "
            '"webhook", "stripe" or "noop"',
        ),
        (
            {"providers": {"a": {"type": "noop"}, "b": {"type": "noop", "key_retention": "1h"}}},
            "providers.b.key_retention (1h) must be longer than dispatcher.retention_margin (1h): "
            "operations go to reconciliation that long before the provider forgets a key",
        ),
        (
            {"dispatcher": {"heartbeat": "30s", "lease": "30s"}},
            "dispatcher.heartbeat (30s) must be shorter than dispatcher.lease (30s): a lease "
            "renewed less often than it lasts runs out while its worker is still busy",
        ),
        (
            {"dispatcher": {"backoff_base": "5m", "backoff_max": "1m"}},
            "dispatcher.backoff_base (5m) must not be longer than dispatcher.backoff_max (1m)",
        ),
    ],
)
def test_a_bad_value_is_explained_in_full(data: dict[str, Any], message: str) -> None:
    assert str(config_error(data)) == message


def test_backoff_base_longer_than_backoff_max_is_blamed_on_the_base() -> None:
    error = config_error({"dispatcher": {"backoff_base": "5m", "backoff_max": "1m"}})
    assert error.key == "dispatcher.backoff_base"


def test_a_key_that_is_not_a_bare_word_is_quoted_as_toml_quotes_it() -> None:
    assert config_error({"dispatcher": {"lease time": "30s"}}).key == 'dispatcher."lease time"'
    assert config_error({"providers": {"a.b": {"type": "noop"}}}).key == 'providers."a.b"'


def test_a_document_that_is_not_a_table_is_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        settings_from_mapping(["log_level"], {})  # type: ignore[arg-type]
    assert str(caught.value).strip() == "(in <config>) must be a table, not an array"


# --- Reading the file --------------------------------------------------------------------------


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match="does not exist") as caught:
        load_settings(path, environ={})
    assert str(path) in str(caught.value)


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file") as caught:
        load_settings(tmp_path, environ={})  # a directory
    assert str(caught.value) == f"cannot read config file {tmp_path}: Is a directory"


def test_a_toml_syntax_error_gives_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "outbox.toml"
    path.write_text('log_level = "info"\n[dispatcher]\nlease = 30s\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="not valid TOML") as caught:
        load_settings(path, environ={})
    assert str(path) in str(caught.value) and "line 3" in str(caught.value)


def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "outbox.toml"
    path.write_bytes(b'log_level = "\xff"\n')
    with pytest.raises(ConfigError, match="not UTF-8") as caught:
        load_settings(path, environ={})
    assert str(path) in str(caught.value)


def test_value_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "outbox.toml"
    path.write_text("[dispatcher]\nlease = 0\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^dispatcher\.lease \(in {re.escape(str(path))}\)"):
        load_settings(path, environ={})


# --- Settings built in Python ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: DispatcherSettings(concurrency=0), "dispatcher.concurrency"),
        (lambda: DispatcherSettings(lease=timedelta(seconds=-1)), "dispatcher.lease"),
        (lambda: ProviderSettings(name="Bad", type="noop"), "providers.Bad"),
        (
            lambda: ProviderSettings(name="a", type="noop", timeout=timedelta(0)),
            "providers.a.timeout",
        ),
        (
            lambda: Settings(DispatcherSettings(), {"b": ProviderSettings(name="a", type="noop")}),
            "providers.b",
        ),
        (lambda: Settings(DispatcherSettings(), {}, log_level="loud"), "log_level"),
        (
            lambda: ProviderSettings(name="a", type="noop", rate_limit=-1.0),
            "providers.a.rate_limit",
        ),
        (
            lambda: ProviderSettings(name="a", type="noop", max_in_flight=0),
            "providers.a.max_in_flight",
        ),
    ],
)
def test_settings_built_in_code_follow_the_same_rules(
    build: Callable[[], object], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.key == key and str(caught.value).startswith(key)


@pytest.mark.parametrize(
    ("build", "key"),
    [
        (lambda: DispatcherSettings(heartbeat=timedelta(0)), "dispatcher.heartbeat"),
        (lambda: ProviderSettings(name="a", type=" "), "providers.a.type"),
        (
            lambda: ProviderSettings(name="a", type="noop", key_retention=timedelta(0)),
            "providers.a.key_retention",
        ),
        (
            lambda: ProviderSettings(name="a", type="noop", rate_limit=1.0, rate_burst=0),
            "providers.a.rate_burst",
        ),
        (
            lambda: ProviderSettings(name="a", type="noop", breaker_failures=0),
            "providers.a.breaker_failures",
        ),
        (
            lambda: ProviderSettings(name="a", type="noop", breaker_open_for=timedelta(0)),
            "providers.a.breaker_open_for",
        ),
        (lambda: DatabaseSettings(pool_mode="pooled"), "database.pool_mode"),
        (lambda: DatabaseSettings(listen="yes"), "database.listen"),  # type: ignore[arg-type]
        (lambda: DatabaseSettings(listen_url=" "), "database.listen_url"),
        (lambda: DatabaseSettings(listen_url=5), "database.listen_url"),  # type: ignore[arg-type]
        (lambda: DatabaseSettings(startup_wait=timedelta(0)), "database.startup_wait"),
    ],
)
def test_more_settings_built_in_code_follow_the_same_rules(
    build: Callable[[], object], key: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert caught.value.key == key and str(caught.value).startswith(f"{key} ")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (
            lambda: DispatcherSettings(concurrency=0),
            "dispatcher.concurrency must be a positive integer, not 0",
        ),
        (
            lambda: DispatcherSettings(lease=timedelta(seconds=-5)),
            "dispatcher.lease must be a duration greater than zero (like 500ms, 30s, 10m, 24h, "
            "1h30m or a number of seconds), not -5s",
        ),
        (
            lambda: DispatcherSettings(lease=timedelta(0)),
            "dispatcher.lease must be a duration greater than zero (like 500ms, 30s, 10m, 24h, "
            "1h30m or a number of seconds), not 0ms",
        ),
        (
            lambda: DatabaseSettings(pool_mode="pooled"),
            'database.pool_mode must be one of session, transaction, not "pooled"',
        ),
        (lambda: DatabaseSettings(listen_url=""), "database.listen_url must be a connection URL"),
        (
            lambda: DatabaseSettings(listen="yes"),  # type: ignore[arg-type]
            'database.listen must be true or false, not "yes"',
        ),
        (
            lambda: ProviderSettings(name="a", type=" "),
            'providers.a.type must name a provider type such as "http", "webhook", "stripe" or '
            '"noop", not " "',
        ),
    ],
)
def test_settings_built_in_code_explain_in_full(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        build()
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("rate", "shown"),
    [(0.0, "0.0"), (-1.0, "-1.0"), (math.inf, "inf"), (True, "true"), ("100/s", '"100/s"')],
)
def test_a_rate_built_in_code_is_a_positive_finite_number(rate: Any, shown: str) -> None:
    with pytest.raises(ConfigError) as caught:
        ProviderSettings(name="a", type="noop", rate_limit=rate)
    assert caught.value.key == "providers.a.rate_limit"
    assert str(caught.value) == (
        f"providers.a.rate_limit must be a number of calls per second greater than zero, "
        f"not {shown}"
    )


# --- Secrets -----------------------------------------------------------------------------------

KEY = "providers.billing.secret_headers.Authorization"


def test_a_secret_from_the_environment() -> None:
    assert read_secret({"env": "TOKEN"}, key=KEY, environ={"TOKEN": "s3cr3t"}) == "s3cr3t"


@pytest.mark.parametrize("environ", [{}, {"BILLING_TOKEN": ""}])
def test_a_missing_environment_secret_names_key_and_variable(environ: dict[str, str]) -> None:
    with pytest.raises(ConfigError) as caught:
        read_secret({"env": "BILLING_TOKEN"}, key=KEY, environ=environ)
    assert str(caught.value).startswith(f"{KEY}: environment variable BILLING_TOKEN is not set")


@pytest.mark.parametrize(
    ("content", "secret"),
    [
        ("s3cr3t\n", "s3cr3t"),
        ("s3cr3t\r\n", "s3cr3t"),
        ("s3cr3t\n\n", "s3cr3t\n"),
        ("s3cr3t", "s3cr3t"),
    ],
)
def test_a_secret_from_a_file_loses_one_trailing_newline(
    tmp_path: Path, content: str, secret: str
) -> None:
    path = tmp_path / "token"
    path.write_text(content, encoding="utf-8", newline="")
    assert read_secret({"file": str(path)}, key=KEY, environ={}) == secret


def test_a_relative_secret_file_is_found_in_the_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "billing-token").write_text("s3cr3t\n", encoding="utf-8")
    environ = {"CREDENTIALS_DIRECTORY": str(tmp_path)}
    assert read_secret({"file": "billing-token"}, key=KEY, environ=environ) == "s3cr3t"


def test_an_absolute_secret_file_ignores_the_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("s3cr3t", encoding="utf-8")
    environ = {"CREDENTIALS_DIRECTORY": "/nonexistent"}
    assert read_secret({"file": str(tmp_path / "token")}, key=KEY, environ=environ) == "s3cr3t"


def test_a_missing_secret_file_names_key_and_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist") as caught:
        read_secret({"file": "token"}, key=KEY, environ={"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert str(caught.value).startswith(KEY) and str(tmp_path / "token") in str(caught.value)


def test_an_unreadable_or_empty_secret_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read secret file"):
        read_secret({"file": str(tmp_path)}, key=KEY, environ={})
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="is empty"):
        read_secret({"file": str(tmp_path / "empty")}, key=KEY, environ={})


@pytest.mark.parametrize(
    "spec",
    ["sk_live_123", {"value": "sk_live_123"}, {"env": "A", "file": "sk_live_123"}, {"env": ""}],
)
def test_a_secret_written_in_the_config_is_refused_without_repeating_it(spec: Any) -> None:
    with pytest.raises(ConfigError, match="secrets are never written in the config file") as caught:
        read_secret(spec, key=KEY, environ={})
    assert str(caught.value).startswith(f"{KEY} must be {{env = ")
    assert "sk_live_123" not in str(caught.value)


@pytest.mark.parametrize(
    ("environ", "state"), [({}, "is not set"), ({"BILLING_TOKEN": ""}, "is not set (it is empty)")]
)
def test_a_missing_environment_secret_says_whether_it_is_empty(
    environ: dict[str, str], state: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        read_secret({"env": "BILLING_TOKEN"}, key=KEY, environ=environ)
    assert caught.value.key == KEY
    assert str(caught.value) == f"{KEY}: environment variable BILLING_TOKEN {state}"


def test_a_secret_is_read_from_the_process_environment_unless_given_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BILLING_TOKEN", "s3cr3t")
    assert read_secret({"env": "BILLING_TOKEN"}, key=KEY) == "s3cr3t"


def test_a_secret_written_in_the_config_is_refused_in_full() -> None:
    with pytest.raises(ConfigError) as caught:
        read_secret("sk_live_123", key=KEY, environ={})
    assert caught.value.key == KEY
    assert str(caught.value) == (
        f'{KEY} must be {{env = "VARIABLE"}} or {{file = "/path"}}; '
        "secrets are never written in the config file"
    )


def test_a_relative_secret_file_without_a_credentials_directory_is_found_from_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("s3cr3t\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert read_secret({"file": "token"}, key=KEY, environ={}) == "s3cr3t"


@pytest.fixture
def ascii_locale() -> Iterator[None]:
    """The C locale, whose preferred encoding is ASCII (as a service may run with)."""
    before = locale.setlocale(locale.LC_CTYPE)
    locale.setlocale(locale.LC_CTYPE, "C")
    try:
        yield
    finally:
        locale.setlocale(locale.LC_CTYPE, before)


@pytest.mark.usefixtures("ascii_locale")
def test_a_secret_file_is_utf8_whatever_the_locale(tmp_path: Path) -> None:
    (tmp_path / "token").write_bytes("pässwörd\n".encode())
    assert read_secret({"file": str(tmp_path / "token")}, key=KEY, environ={}) == "pässwörd"


def test_every_secret_file_problem_names_the_key_and_the_path(tmp_path: Path) -> None:
    missing, directory = tmp_path / "missing", tmp_path
    (tmp_path / "empty").write_text("\n", encoding="utf-8")
    (tmp_path / "latin1").write_bytes(b"p\xe4ss\n")
    for path, problem in [
        (missing, f"secret file {missing} does not exist"),
        (directory, f"cannot read secret file {directory}: Is a directory"),
        (tmp_path / "empty", f"secret file {tmp_path / 'empty'} is empty"),
        (tmp_path / "latin1", f"secret file {tmp_path / 'latin1'} is not UTF-8 text"),
    ]:
        with pytest.raises(ConfigError) as caught:
            read_secret({"file": str(path)}, key=KEY, environ={})
        assert caught.value.key == KEY
        assert str(caught.value) == f"{KEY}: {problem}"


# --- [database]: behind a transaction-mode pooler ------------------------------------------------

LISTEN_URL = "postgresql://outbox:hunter2@db-primary:5432/app"


def test_the_database_defaults_to_a_session_of_its_own_and_no_listen_url() -> None:
    database = load({}).database
    assert database == DatabaseSettings(pool_mode="session", listen_url=None, listen=True)
    assert not database.transaction_pooling


def test_listen_from_the_file_or_the_environment() -> None:
    assert not load({"database": {"listen": False}}).database.listen
    for text in ("false", "0", "no", "off", " FALSE "):
        assert not load({}, OUTBOX_DATABASE__LISTEN=text).database.listen
    overridden = load({"database": {"listen": False}}, OUTBOX_DATABASE__LISTEN="true")
    assert overridden.database.listen
    # Off wins over a direct URL: it is kept (and never shown) but goes unused.
    both = load({"database": {"listen": False}}, OUTBOX_LISTEN_DATABASE_URL=LISTEN_URL)
    assert not both.database.listen and both.database.listen_url == LISTEN_URL


def test_pool_mode_from_the_file_or_the_environment() -> None:
    assert load({"database": {"pool_mode": "Transaction"}}).database.transaction_pooling
    from_env = load({}, OUTBOX_DATABASE__POOL_MODE="transaction").database
    assert from_env.pool_mode == "transaction"
    overridden = load(
        {"database": {"pool_mode": "transaction"}}, OUTBOX_DATABASE__POOL_MODE="session"
    )
    assert not overridden.database.transaction_pooling


def test_the_listen_url_comes_from_its_variable_by_default() -> None:
    assert load({}, OUTBOX_LISTEN_DATABASE_URL=LISTEN_URL).database.listen_url == LISTEN_URL
    # An env file's empty placeholder means no LISTEN URL, not an empty one.
    assert load({}, OUTBOX_LISTEN_DATABASE_URL="").database.listen_url is None


def test_the_listen_url_from_a_named_variable_or_credentials_file(tmp_path: Path) -> None:
    named = {"database": {"listen_url_env": "DIRECT_URL"}}
    assert load(named, DIRECT_URL=LISTEN_URL).database.listen_url == LISTEN_URL
    (tmp_path / "listen-url").write_text(LISTEN_URL + "\n")
    in_file = {"database": {"listen_url_file": "listen-url"}}
    loaded = load(in_file, CREDENTIALS_DIRECTORY=str(tmp_path), OUTBOX_LISTEN_DATABASE_URL="x")
    assert loaded.database.listen_url == LISTEN_URL
    from_env = load({}, OUTBOX_DATABASE__LISTEN_URL_ENV="DIRECT_URL", DIRECT_URL=LISTEN_URL)
    assert from_env.database.listen_url == LISTEN_URL


@pytest.mark.parametrize(
    ("data", "environ", "key", "message"),
    [
        (
            {"database": {"pool_mode": "statement"}},
            {},
            "database.pool_mode",
            'cannot be "statement"',
        ),
        (
            {"database": {"pool_mode": "pooled"}},
            {},
            "database.pool_mode",
            'must be one of session, transaction, not "pooled"',
        ),
        (
            {},
            {"OUTBOX_DATABASE__POOL_MODE": "tx"},
            "database.pool_mode",
            "(from OUTBOX_DATABASE__POOL_MODE) must be one of session, transaction",
        ),
        (
            {"database": {"listen_url_env": "DIRECT_URL"}},
            {},
            "database.listen_url_env",
            "environment variable DIRECT_URL is not set",
        ),
        (
            {"database": {"listen_url_env": "A", "listen_url_file": "b"}},
            {},
            "database.listen_url_file",
            "keep one",
        ),
        (
            {"database": {"poolmode": "transaction"}},
            {},
            "database.poolmode",
            "unknown key database.poolmode",
        ),
        (
            {},
            {"OUTBOX_DATABASE__POOLMODE": "transaction"},
            "OUTBOX_DATABASE__POOLMODE",
            "the database has no setting 'poolmode'; the valid keys are pool_mode, listen_url_env",
        ),
        ({"database": "transaction"}, {}, "database", 'must be a table, not "transaction"'),
        (
            {"database": {"listen": "false"}},
            {},
            "database.listen",
            'must be true or false, not "false"',
        ),
        ({"database": {"listen": 0}}, {}, "database.listen", "must be true or false, not 0"),
        (
            {},
            {"OUTBOX_DATABASE__LISTEN": "maybe"},
            "database.listen",
            '(from OUTBOX_DATABASE__LISTEN) must be true or false, not "maybe"',
        ),
    ],
)
def test_a_bad_database_setting_names_its_key(
    data: dict[str, Any], environ: dict[str, str], key: str, message: str
) -> None:
    error = config_error(data, **environ)
    assert error.key == key
    assert message in str(error)


@pytest.mark.parametrize(
    ("data", "environ"),
    [
        ({"database": {"listen_url": LISTEN_URL}}, {}),
        ({"database": {"listen_url_env": LISTEN_URL}}, {}),
        ({}, {"OUTBOX_DATABASE__LISTEN_URL": LISTEN_URL}),
    ],
)
def test_a_listen_url_where_a_name_belongs_is_refused_without_repeating_it(
    data: dict[str, Any], environ: dict[str, str]
) -> None:
    error = config_error(data, **environ)
    assert "hunter2" not in str(error) and "db-primary" not in str(error)
    assert "OUTBOX_LISTEN_DATABASE_URL" in str(error)


def test_repr_never_shows_the_listen_url() -> None:
    settings = load(
        {"database": {"pool_mode": "transaction"}}, OUTBOX_LISTEN_DATABASE_URL=LISTEN_URL
    )
    for text in (repr(settings), str(settings), repr(settings.database)):
        assert "hunter2" not in text and "db-primary" not in text
    shown = (
        "DatabaseSettings(pool_mode='transaction', listen_url='***', listen=True, "
        "startup_wait='1m')"
    )
    assert shown in repr(settings)


def test_the_pgbouncer_guide_s_settings_load() -> None:
    guide = (Path(__file__).resolve().parents[2] / "docs" / "pgbouncer.md").read_text()
    env_file = re.search(r"```sh\n# /etc/outbox/outbox.env.*?```", guide, re.DOTALL)
    assert env_file is not None
    environ = dict(re.findall(r"^(OUTBOX_\w+)=(\S+)$", env_file.group(0), re.MULTILINE))
    database = load({}, **environ).database
    assert database.transaction_pooling
    assert database.listen_url == "postgresql://outbox_run@db-primary:5432/app"
    tables = re.findall(r"```toml\n(.*?)```", guide, re.DOTALL)
    assert len(tables) == 2
    for table in tables:
        loaded = load(tomllib.loads(table), APP_DIRECT_DATABASE_URL=LISTEN_URL)
        assert loaded.database.transaction_pooling


@pytest.mark.parametrize(
    ("data", "key", "message"),
    [
        (
            {"database": {"pool_mode": 5}},
            "database.pool_mode",
            "database.pool_mode (in <config>) must be one of session, transaction, not 5",
        ),
        (
            {"database": {"pool_mode": "statement"}},
            "database.pool_mode",
            'database.pool_mode (in <config>) cannot be "statement": statement pooling forbids the '
            "multi-statement transactions that outbox's producers and operator commands rely on; "
            'use pool_mode = "transaction" in the pooler and here',
        ),
        (
            {"database": {"listen_url_env": "postgresql://x"}},
            "database.listen_url_env",
            "database.listen_url_env (in <config>) must name an environment variable, such as "
            "OUTBOX_LISTEN_DATABASE_URL",
        ),
        (
            {"database": {"listen_url_file": 5}},
            "database.listen_url_file",
            "database.listen_url_file (in <config>) must be a file name, not 5",
        ),
        (
            {"database": {"listen_url_file": " "}},
            "database.listen_url_file",
            'database.listen_url_file (in <config>) must be a file name, not " "',
        ),
        (
            {"database": {"listen_url_env": "A", "listen_url_file": "b"}},
            "database.listen_url_file",
            "database.listen_url_file (in <config>) and database.listen_url_env both say where the "
            "LISTEN URL is; keep one",
        ),
        (
            {"database": {"listen_url": LISTEN_URL}},
            "database.listen_url",
            "database.listen_url (in <config>) is never written in the config file, as it may "
            "carry "
            "a password: set OUTBOX_LISTEN_DATABASE_URL, or name where it is with "
            "database.listen_url_env or database.listen_url_file",
        ),
    ],
)
def test_a_bad_database_setting_is_explained_in_full(
    data: dict[str, Any], key: str, message: str
) -> None:
    error = config_error(data)
    assert error.key == key
    assert str(error) == message


def test_a_listen_url_variable_may_have_a_lower_case_name() -> None:
    named = {"database": {"listen_url_env": "direct_url"}}
    assert load(named, direct_url=LISTEN_URL).database.listen_url == LISTEN_URL


def test_a_missing_listen_url_file_is_named_by_its_key(tmp_path: Path) -> None:
    data = {"database": {"listen_url_file": "nope"}}
    error = config_error(data, CREDENTIALS_DIRECTORY=str(tmp_path))
    assert error.key == "database.listen_url_file"
    assert str(error) == f"database.listen_url_file: secret file {tmp_path / 'nope'} does not exist"


def test_repr_shows_that_there_is_no_listen_url() -> None:
    assert repr(DatabaseSettings()) == (
        "DatabaseSettings(pool_mode='session', listen_url=None, listen=True, startup_wait='1m')"
    )


# --- Redaction ---------------------------------------------------------------------------------


def test_repr_never_shows_a_secret() -> None:
    data = {
        "providers": {
            "pay": {
                "type": "stripe",
                "api_key": "sk_live_123",
                "url": "https://user:hunter2@pay.example/hook",
                "headers": {"X-Api-Key": "abc987", "X-Source": "outbox"},
                "secret_headers": {"Authorization": "Bearer tok_456"},
                "nested": [{"Password": "pw789"}],
                "reference_field": "id",
            }
        }
    }
    settings = load(data)
    for text in (repr(settings), str(settings), repr(settings.providers["pay"])):
        for secret in ("sk_live_123", "hunter2", "abc987", "tok_456", "pw789"):
            assert secret not in text
        assert "'reference_field': 'id'" in text and "'X-Source': 'outbox'" in text
        assert "'secret_headers': {'Authorization': '***'}" in text
    assert settings.providers["pay"].options["api_key"] == "sk_live_123"  # redacted only in repr


def test_loading_leaves_the_callers_mapping_alone() -> None:
    data: dict[str, Any] = {"providers": {"pay": {"type": "webhook", "retries": 3}}}
    settings = load(data, OUTBOX_PROVIDERS__PAY__RETRIES="5", OUTBOX_PROVIDERS__NEW__TYPE="noop")
    assert data == {"providers": {"pay": {"type": "webhook", "retries": 3}}}
    # Options from the environment stay text: the provider's factory parses its own options.
    assert settings.providers["pay"].options["retries"] == "5"


def test_repr_replaces_secrets_and_keeps_everything_else() -> None:
    options = {
        "api_key": "sk_live_123",
        "tags": ["a", "https://u:pw@h/"],
        "nested": [{"Password": "pw789", "n": 1}],
    }
    provider = ProviderSettings(name="pay", type="stripe", options=options)
    assert provider.options["tags"] == ("a", "https://u:pw@h/")  # arrays become tuples
    assert provider.options["nested"][0] == {"Password": "pw789", "n": 1}
    assert repr(provider).endswith(
        "options={'api_key': '***', 'tags': ['a', 'https://u:***@h/'], "
        "'nested': [{'Password': '***', 'n': 1}]})"
    )


@pytest.mark.parametrize(
    ("per_second", "text"),
    [
        (100.0, "100/s"),
        (1.0, "1/s"),
        (1.5, "1.5/s"),
        (0.5, "30/m"),
        (0.25, "15/m"),
        (1 / 7, "0.14285714285714285/s"),  # not a whole number a minute either
        (31 / 60, "31/m"),  # 31/60 * 60 is 30.999999999999996
        (1e6, "1000000/s"),  # never an exponent: "1e+06/s" is no config value
        (1e-5, "0.00001/s"),
        (1e-7, "0.0000001/s"),  # str() of the Decimal would say 1E-7
        (1e16, "10000000000000000/s"),  # no point to strip zeros after
    ],
)
def test_a_rate_is_written_per_second_or_per_minute_under_one_a_second(
    per_second: float, text: str
) -> None:
    assert format_rate(per_second) == text


@PROPERTY
@given(calls=st.integers(1, 10**9), unit=st.sampled_from(["s", "m"]))
@hypothesis_example(calls=31, unit="m")
@hypothesis_example(calls=1_000_000, unit="s")
def test_a_rate_in_repr_loads_back_as_the_same_rate(calls: int, unit: str) -> None:
    provider = load({"providers": {"n": {"type": "noop", "rate_limit": f"{calls}/{unit}"}}})
    rate = provider.providers["n"].rate_limit
    assert rate is not None
    shown = format_rate(rate)
    assert f"rate_limit={shown!r}" in repr(provider.providers["n"])
    again = load({"providers": {"n": {"type": "noop", "rate_limit": shown}}})
    assert again.providers["n"].rate_limit == pytest.approx(rate, rel=1e-12)
    if unit == "m" and calls < 60:
        assert shown == f"{calls}/m"


@pytest.mark.parametrize(
    ("content", "secret"),
    [
        (b"ab\rcd", "ab\rcd"),
        (b"ab\r\ncd", "ab\r\ncd"),
        (b"tok\r", "tok\r"),
        (b"tok\r\n", "tok"),
        (b"tok\n", "tok"),
        (b"tok\n\n", "tok\n"),
    ],
)
def test_a_secret_file_is_read_as_it_is_but_for_one_final_newline(
    tmp_path: Path, content: bytes, secret: str
) -> None:
    (tmp_path / "token").write_bytes(content)
    assert read_secret({"file": str(tmp_path / "token")}, key=KEY, environ={}) == secret


# --- The event loop ------------------------------------------------------------------------------


def test_the_event_loop_is_uvloop_where_installed_unless_asyncio_is_asked_for() -> None:
    assert load({}).dispatcher.event_loop == "auto"
    assert event_loop.chosen("auto") == "uvloop"  # a dependency wherever it is built
    assert load({"dispatcher": {"event_loop": " UVLOOP "}}).dispatcher.event_loop == "uvloop"
    from_env = load({}, OUTBOX_DISPATCHER__EVENT_LOOP="asyncio").dispatcher
    assert from_env.event_loop == "asyncio" and event_loop.chosen("asyncio") == "asyncio"
    assert DispatcherSettings(event_loop="AsyncIO").event_loop == "asyncio"


@pytest.mark.parametrize(
    ("data", "environ", "message"),
    [
        (
            {"dispatcher": {"event_loop": "trio"}},
            {},
            'dispatcher.event_loop (in <config>) must be one of auto, uvloop, asyncio, not "trio"',
        ),
        (
            {"dispatcher": {"event_loop": True}},
            {},
            "must be one of auto, uvloop, asyncio, not true",
        ),
        (
            {},
            {"OUTBOX_DISPATCHER__EVENT_LOOP": "tokio"},
            "(from OUTBOX_DISPATCHER__EVENT_LOOP) must be one of auto, uvloop, asyncio, not "
            '"tokio"',
        ),
    ],
)
def test_a_bad_event_loop_names_its_key(
    data: dict[str, Any], environ: dict[str, str], message: str
) -> None:
    error = config_error(data, **environ)
    assert error.key == "dispatcher.event_loop"
    assert message in str(error)


@pytest.fixture
def no_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop cannot be imported, as on a platform it is not built for."""
    monkeypatch.setitem(sys.modules, "uvloop", None)


@pytest.mark.usefixtures("no_uvloop")
def test_without_uvloop_only_uvloop_itself_is_refused() -> None:
    assert load({"dispatcher": {"event_loop": "auto"}}).dispatcher.event_loop == "auto"
    assert load({}, OUTBOX_DISPATCHER__EVENT_LOOP="asyncio").dispatcher.event_loop == "asyncio"
    error = config_error({"dispatcher": {"event_loop": "uvloop"}})
    assert error.key == "dispatcher.event_loop"
    assert str(error) == (
        'dispatcher.event_loop (in <config>) is "uvloop", which is not installed here; '
        'use "auto" or "asyncio"'
    )
    with pytest.raises(ConfigError, match=r'^dispatcher\.event_loop is "uvloop", which is not'):
        DispatcherSettings(event_loop="UVLOOP")


# --- Declared once --------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def test_the_config_reference_is_made_from_the_declarations() -> None:
    written = (ROOT / "docs" / "config-reference.md").read_text(encoding="utf-8")
    if written != reference():
        pytest.fail(f"docs/config-reference.md is stale: run `{COMMAND}`", pytrace=False)
    assert reference().isascii()  # the command writes it through any locale's stdout


def test_every_key_says_what_it_does() -> None:
    declared = [
        *settings_of(Settings),
        *settings_of(ProviderSettings),
        *(s for cls in TABLES.values() for s in settings_of(cls)),
        *(s for options in PROVIDER_OPTIONS.values() for s in options),
    ]
    # The console's 4 ([web]); the webhook's 7, http's 8, stripe's 8 options.
    queues = sum(len(PROVIDER_OPTIONS[q]) for q in ("nats", "amqp", "sqs", "cloudtasks"))
    assert queues >= 4 * 3  # every queue type declares its options: no type takes any key
    assert len(declared) == 1 + 11 + 14 + 4 + 4 + 7 + 8 + 8 + queues
    for setting in declared:
        assert setting.doc.endswith("."), setting.name
        assert f"`{setting.name}" in reference(), setting.name


def test_the_built_in_types_declare_the_options_their_factories_read() -> None:
    """Until the providers take these from outbox.config, they must agree with it."""
    options = {t: {s.name: s for s in declared} for t, declared in PROVIDER_OPTIONS.items()}
    keys = {
        t: tuple(k for s in declared for k in s.file_keys())
        for t, declared in PROVIDER_OPTIONS.items()
    }
    assert keys["webhook"] == registry._WEBHOOK_KEYS
    assert keys["stripe"] == registry._STRIPE_KEYS
    assert options["webhook"]["reference_field"].default == webhook.DEFAULT_REFERENCE_FIELD
    assert options["stripe"]["stripe_version"].default == stripe.DEFAULT_STRIPE_VERSION
    assert options["stripe"]["redact_fields"].default == stripe.DEFAULT_REDACTED
    assert options["stripe"]["api_base"].default == registry.DEFAULT_STRIPE_API


HOOK = {"type": "webhook", "url": "https://hooks.example.com/"}


@pytest.mark.parametrize("text", ["true", "yes", "1", " On "])
def test_a_boolean_option_may_come_from_the_environment(text: str) -> None:
    data = {"providers": {"hook": HOOK, "pay": {"type": "stripe"}}}
    settings = load(
        data,
        OUTBOX_PROVIDERS__HOOK__ALLOW_INSECURE=text,
        OUTBOX_PROVIDERS__PAY__OPERATION_ACCOUNTS=text,
    )
    assert settings.providers["hook"].options["allow_insecure"] is True
    assert settings.providers["pay"].options["operation_accounts"] is True


def test_a_boolean_option_in_the_file_is_checked_where_it_is_written() -> None:
    error = config_error({"providers": {"hook": {**HOOK, "allow_insecure": "yes"}}})
    assert error.key == "providers.hook.allow_insecure"
    assert str(error) == (
        'providers.hook.allow_insecure (in <config>) must be true or false, not "yes"'
    )


def test_a_plug_in_s_options_stay_as_written() -> None:
    data = {"providers": {"p": {"type": "acme", "allow_insecure": "yes", "max_response_bytes": 0}}}
    assert load(data).providers["p"].options == {"allow_insecure": "yes", "max_response_bytes": 0}


@pytest.mark.parametrize(
    "text",
    [
        "connect to postgresql://app:hunter2@db/app failed",
        "host=db user=app password=hunter2 dbname=app",
        "password = 'hunter 2' and PASSWORD=x",
        "Invalid API Key provided: sk_live_abcdef123456",
        "rk_test_abcdef and pk_live_0123456789",
        "https://u:p/w@h/ and nothing else",
        "no secret here",
        "",
    ],
)
def test_one_scrubber_masks_what_the_logs_mask(text: str) -> None:
    assert redaction.scrub(text, marker=logs.REDACTED) == logs.scrub_text(text)


def test_the_scrubber_masks_a_known_secret_anywhere() -> None:
    shown = redaction.scrub("auth failed for hunter2 (hunter2)", marker="#", known=["hunter2", ""])
    assert shown == "auth failed for # (#)"


def test_redaction_keeps_the_names_of_a_secret_table() -> None:
    options = {"secret_headers": {"Authorization": {"env": "T"}}, "api_token": "t0k", "n": (1, 2)}
    assert redaction.redact(options) == {
        "secret_headers": {"Authorization": "***"},
        "api_token": "***",
        "n": [1, 2],
    }


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("lease", "2d", "24h"),
        ("backoff_max", "367d", "8784h"),
        ("max_attempts", 1001, "1,000"),
    ],
)
def test_the_dispatchers_bounds_are_the_databases(key: str, value: object, bound: str) -> None:
    """sql/0040 refuses a lease past a day, a retry past 366 days and a rescue's budget past
    1,000 attempts: a config past them fails at start-up, not at every claim or record."""
    error = config_error({"dispatcher": {key: value}})
    assert str(error).startswith(f"dispatcher.{key} (in <config>) must be at most {bound}, not")

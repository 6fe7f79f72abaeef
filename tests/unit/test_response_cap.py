"""``max_response_bytes``: one setting for the webhook and Stripe providers, checked where it is
written (the file or the environment) and again for settings built in Python; and the rule for
what becomes an operation's reference."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.config.loader import settings_from_mapping as load
from outbox.config.settings import DEFAULT_MAX_RESPONSE_BYTES, ConfigError, ProviderSettings
from outbox.providers.answers import MAX_REFERENCE_CHARS, reference
from outbox.providers.registry import build_providers, stripe_options, webhook_options

HOOK = {"type": "webhook", "url": "http://127.0.0.1:9/hook"}
STRIPE = {"type": "stripe", "api_key_env": "K"}


def test_the_default_is_one_mebibyte_for_both_types() -> None:
    assert DEFAULT_MAX_RESPONSE_BYTES == 1048576
    s = load({"providers": {"hook": HOOK, "pay": STRIPE}}, environ={})
    assert webhook_options(s.providers["hook"]).max_response_bytes == DEFAULT_MAX_RESPONSE_BYTES
    assert stripe_options(s.providers["pay"], {"K": "x"}).max_response_bytes == 1048576


def test_the_file_and_the_environment_set_it() -> None:
    data = {"providers": {"hook": {**HOOK, "max_response_bytes": 4096}, "pay": STRIPE}}
    env = {"OUTBOX_PROVIDERS__PAY__MAX_RESPONSE_BYTES": "65536"}
    s = load(data, environ=env)
    assert webhook_options(s.providers["hook"]).max_response_bytes == 4096
    assert stripe_options(s.providers["pay"], {"K": "x"}).max_response_bytes == 65536


@pytest.mark.parametrize(
    ("data", "env", "message"),
    [
        ({"max_response_bytes": 0}, {}, r"hook\.max_response_bytes \(in <config>\) must be"),
        ({"max_response_bytes": -1}, {}, r"must be a positive integer, not -1"),
        ({"max_response_bytes": "4096"}, {}, r'must be a positive integer, not "4096"'),
        ({"max_response_bytes": 1.5}, {}, r"must be a positive integer"),
        ({"max_response_bytes": True}, {}, r"must be a positive integer, not true"),
        (
            {},
            {"OUTBOX_PROVIDERS__HOOK__MAX_RESPONSE_BYTES": "1MiB"},
            r"max_response_bytes \(from OUTBOX_PROVIDERS__HOOK__MAX_RESPONSE_BYTES\) must be",
        ),
    ],
)
def test_a_value_that_is_no_byte_count_names_its_key(
    data: dict[str, Any], env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load({"providers": {"hook": {**HOOK, **data}}}, environ=env)


@pytest.mark.parametrize("value", [0, -5, True, "1048576", 2.0, None])
def test_settings_built_in_python_are_checked_too(value: object) -> None:
    ps = ProviderSettings("hook", "webhook", options={**_url(), "max_response_bytes": value})
    with pytest.raises(ConfigError, match=r"providers\.hook\.max_response_bytes must be"):
        build_providers({"hook": ps})


def test_a_provider_that_reads_no_answers_has_no_such_setting() -> None:
    ps = ProviderSettings("n", "noop", options={"max_response_bytes": 10})
    with pytest.raises(ConfigError, match=r"providers\.n\.max_response_bytes is not a noop"):
        build_providers({"n": ps})


def _url() -> dict[str, str]:
    return {"url": HOOK["url"]}


@settings(database=None)
@given(st.text(max_size=2 * MAX_REFERENCE_CHARS))
def test_a_string_is_a_reference_when_it_is_short_printable_and_not_empty(value: str) -> None:
    expected = value if 0 < len(value) <= MAX_REFERENCE_CHARS and value.isprintable() else None
    assert reference(value) == expected


@settings(database=None)
@given(st.integers(-(10**300), 10**300) | st.integers())
def test_an_integer_is_a_reference_of_its_digits_up_to_the_same_length(value: int) -> None:
    text = str(value)
    assert reference(value) == (text if len(text) <= MAX_REFERENCE_CHARS else None)


@pytest.mark.parametrize(
    "value",
    [None, True, False, 1.5, [1], {"id": 1}, 10**5000, b"pi_1"],
    ids=["none", "true", "false", "float", "list", "object", "10**5000", "bytes"],
)
def test_anything_else_is_no_reference(value: object) -> None:
    assert reference(value) is None  # and 10**5000 never became text on the way

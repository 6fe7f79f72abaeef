"""Retry-After in both of its forms, and in every form a broken or malicious receiver may send."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.providers.http.wire import retry_after as _retry_after
from outbox.providers.kit import MAX_RETRY_AFTER


def answer(value: str) -> httpx.Response:
    # As bytes off the wire: httpx reads a header as UTF-8 (or Latin-1) whatever it holds.
    return httpx.Response(503, headers=[(b"Retry-After", value.encode())])


def test_seconds() -> None:
    assert _retry_after(answer("120")) == timedelta(seconds=120)


def test_an_http_date() -> None:
    when = datetime.now(UTC) + timedelta(seconds=90)
    delay = _retry_after(answer(email.utils.format_datetime(when, usegmt=True)))
    assert delay is not None and timedelta(seconds=85) <= delay <= timedelta(seconds=90)


@pytest.mark.parametrize("value", ["soon", "", "-5"])
def test_nonsense_is_ignored(value: str) -> None:
    assert _retry_after(answer(value)) is None


def test_a_huge_value_is_capped() -> None:
    assert _retry_after(answer("999999")) == MAX_RETRY_AFTER


def test_thousands_of_digits_are_the_longest_wait_not_an_error() -> None:
    # int() refuses more than 4,300 digits; a receiver may send any number of them.
    assert _retry_after(answer("9" * 5000)) == MAX_RETRY_AFTER
    assert _retry_after(answer("0" * 5000 + "7")) == timedelta(seconds=7)


def test_digits_that_are_not_ascii_are_ignored() -> None:
    # str.isdigit() takes these; int() refuses the first.
    assert _retry_after(answer("²")) is None
    assert _retry_after(answer("١٢")) is None


@settings(database=None)
@given(st.one_of(st.text(), st.text("0123456789 ", max_size=6000), st.integers(0, 10**9).map(str)))
def test_no_retry_after_raises_and_every_delay_is_within_bounds(value: str) -> None:
    delay = _retry_after(answer(value))
    assert delay is None or timedelta(0) <= delay <= MAX_RETRY_AFTER
    digits = value.strip()
    if digits and digits.isascii() and digits.isdigit():
        seconds = int(digits) if len(digits.lstrip("0")) < 10 else 10**10
        assert delay == min(timedelta(seconds=seconds), MAX_RETRY_AFTER)

"""Retry-After in both of its forms."""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from outbox.providers.webhook import MAX_RETRY_AFTER, _retry_after


def answer(value: str) -> httpx.Response:
    return httpx.Response(503, headers={"Retry-After": value})


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

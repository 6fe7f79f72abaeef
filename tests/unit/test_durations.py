from __future__ import annotations

from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.core.durations import format_duration, parse_duration, to_postgres_interval


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("30s", timedelta(seconds=30)),
        ("10m", timedelta(minutes=10)),
        ("24h", timedelta(hours=24)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1.5s", timedelta(seconds=1.5)),
        ("2d", timedelta(days=2)),
        ("15", timedelta(seconds=15)),
        (" 5s ", timedelta(seconds=5)),
    ],
)
def test_parse(text: str, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "s", "5x", "-5s", "5 s", "1h 30m", "five seconds", "5s5"])
def test_parse_refuses_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="write it like 500ms, 30s"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(milliseconds=250), "250ms"),
        (timedelta(seconds=42), "42s"),
        (timedelta(seconds=1.5), "1.5s"),
        (timedelta(minutes=5, seconds=3), "5m3s"),
        (timedelta(minutes=10), "10m"),
        (timedelta(hours=26), "26h"),
        (timedelta(hours=1, minutes=30), "1h30m"),
    ],
)
def test_format(value: timedelta, text: str) -> None:
    assert format_duration(value) == text


def test_postgres_interval_is_whole_milliseconds_and_never_zero() -> None:
    assert to_postgres_interval(timedelta(seconds=5)) == "5000ms"
    assert to_postgres_interval(timedelta(0)) == "1ms"


PROPERTY = settings(database=None, deadline=None)


@PROPERTY
@given(st.integers(0, 999))
def test_under_a_second_is_whole_milliseconds(ms: int) -> None:
    text = format_duration(timedelta(milliseconds=ms))
    assert text == f"{ms}ms"
    assert parse_duration(text) == timedelta(milliseconds=ms)


@PROPERTY
@given(st.integers(1, 3599))
def test_whole_seconds_under_an_hour_read_back_exactly(seconds: int) -> None:
    text = format_duration(timedelta(seconds=seconds))
    assert not text.endswith("ms") and "." not in text
    assert parse_duration(text) == timedelta(seconds=seconds)


def test_one_second_is_written_in_seconds() -> None:
    assert format_duration(timedelta(seconds=1)) == "1s"
    assert format_duration(timedelta(milliseconds=999)) == "999ms"


@given(st.text(alphabet="0123456789.smhd ", max_size=400))
def test_any_text_is_a_bounded_duration_or_a_value_error(text: str) -> None:
    # A flag or setting of extra digits (99999999999d, a thousand 9s) was an OverflowError's
    # traceback; now it is a message, as any other bad duration.
    try:
        parsed = parse_duration(text)
    except ValueError:
        return
    assert timedelta(0) <= parsed <= timedelta(days=36500)


def test_a_duration_past_a_century_is_refused_by_name() -> None:
    for text in ("99999999999d", "9" * 1000 + "s", "36501d"):
        with pytest.raises(ValueError, match="longer than 36500 days"):
            parse_duration(text)
    assert parse_duration("36500d") == timedelta(days=36500)

"""Durations as people write them in config files and flags: "500ms", "30s", "10m", "24h", "1h30m".

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import re
from datetime import timedelta

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
# No setting or flag means more than a century; past it a timedelta (or PostgreSQL's interval
# arithmetic on now()) overflows, and a typo of extra digits deserves a message, not a traceback.
MAX_DURATION = timedelta(days=36500)


class DurationTooLong(ValueError):
    """A duration written correctly, but past MAX_DURATION."""


def parse_duration(text: str) -> timedelta:
    """Parse a duration: one or more number-unit pairs (ms, s, m, h, d), or bare seconds.

    Raises ValueError with the accepted forms for anything else, including negative values and
    durations over MAX_DURATION.
    """
    value = text.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        seconds = float(value)
    else:
        parts = _PART.findall(value)
        if not value or "".join(number + unit for number, unit in parts) != value:
            raise ValueError(
                f"invalid duration {text!r}: write it like 500ms, 30s, 10m, 24h or 1h30m"
            )
        seconds = sum(float(number) * _UNITS[unit] for number, unit in parts)
    if not seconds <= MAX_DURATION.total_seconds():  # also inf, from a thousand digits
        raise DurationTooLong(f"duration {text[:40]!r} is longer than {MAX_DURATION.days} days")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """A short human form of ``value``: 250ms, 42s, 5m3s, 26h."""
    seconds = value.total_seconds()
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s".replace(".0s", "s")
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs}s" if secs else f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m" if minutes else f"{hours}h"


def to_postgres_interval(value: timedelta) -> str:
    """The value as a PostgreSQL time setting in whole milliseconds (at least 1: 0 disables)."""
    return f"{max(1, round(value.total_seconds() * 1000))}ms"

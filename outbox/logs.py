"""structlog setup: JSON lines when not on a terminal, readable lines on one; secrets dropped."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, Final

import structlog

# Keys whose values are never logged, wherever they appear in an event.
_SECRET_KEYS: Final = frozenset(
    {"payload", "api_key", "password", "dsn", "authorization", "secret", "token", "headers"}
)
REDACTED: Final = "[redacted]"


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor that masks the values of secret-bearing keys."""
    for key in event:
        if key.lower() in _SECRET_KEYS:
            event[key] = REDACTED
    return event


def configure(level: str = "info", *, json: bool | None = None) -> None:
    """Configure structlog for the process. ``json=None``: JSON unless stderr is a terminal."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            redact_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )

"""structlog setup: JSON lines when not on a terminal, readable lines on one; secrets dropped."""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, Final, TextIO

import structlog

from outbox.core.safe_text import printable
from outbox.observability import redaction

# Keys whose values are never logged, wherever they appear in an event.
_SECRET_KEYS: Final = frozenset(
    {"payload", "api_key", "password", "dsn", "authorization", "secret", "token", "headers"}
)
REDACTED: Final = "[redacted]"


# A PostgreSQL error's DETAIL line quotes data: "Failing row contains (...)" is every column of
# the row, payload and provider answer included; "Key (...)=(...)" the values of a key.
_ERROR_DETAIL: Final = re.compile(r"^DETAIL:.*$", re.MULTILINE)


def redact_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """A structlog processor that masks secret-bearing keys, and secrets inside any text; in a
    traceback (``exception``, rendered before this runs) also the database's DETAIL lines."""
    for key, value in event.items():
        if key.lower() in _SECRET_KEYS:
            event[key] = REDACTED
        elif isinstance(value, str):
            text = _ERROR_DETAIL.sub(f"DETAIL: {REDACTED}", value) if key == "exception" else value
            event[key] = scrub_text(text)
    return event


def scrub_text(text: str) -> str:
    """``text`` with connection-string passwords and API keys masked
    (outbox.observability.redaction)."""
    return redaction.scrub(text, marker=REDACTED)


def escape_controls(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Console lines: no value may start a line of its own or drive the terminal (a reason
    phrase, an actor, a tenant id). A traceback keeps its newlines."""
    for name, value in event.items():
        if isinstance(value, str) and name != "exception":
            event[name] = printable(value)
    return event


# The handler outbox puts on the root logger, replaced by each configure().
_STDLIB_HANDLER: logging.Handler | None = None


def _route_stdlib(out: TextIO, level: str, shared: list[Any], renderer: Any) -> None:
    """Library loggers (psycopg_pool, httpx, asyncio) through the same processors: in JSON mode
    every line is one JSON event, a traceback or a multi-line message included."""
    global _STDLIB_HANDLER  # noqa: PLW0603 (one root handler per process, swapped, never added)
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    if _STDLIB_HANDLER is not None:
        root.removeHandler(_STDLIB_HANDLER)
    root.addHandler(handler)
    # Libraries' warnings and errors only, whatever outbox's own level: httpx alone logs every
    # request at info, and none of their chatter is worth a line per operation.
    root.setLevel(max(logging.WARNING, logging.getLevelNamesMapping()[level.upper()]))
    _STDLIB_HANDLER = handler


def configure(
    level: str = "info", *, json: bool | None = None, stream: TextIO | None = None
) -> None:
    """Configure structlog for the process: lines to ``stream`` (default stderr), as JSON
    unless ``json`` is False or (``json=None``) the stream is a terminal."""
    out = sys.stderr if stream is None else stream
    use_json = (not out.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        # Tracebacks rendered first, so that redaction sees them too.
        structlog.processors.format_exc_info,
        redact_secrets,
        # JSON escapes control characters itself; a terminal must not act on them.
        *(() if use_json else (escape_controls,)),
    ]
    _route_stdlib(out, level, shared, renderer)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=True,
    )


def unconfigure() -> None:
    """Back to structlog's defaults, and no handler of outbox's on the root logger (tests)."""
    global _STDLIB_HANDLER  # noqa: PLW0603 (the one handler configure() put there)
    structlog.reset_defaults()
    if _STDLIB_HANDLER is not None:
        logging.getLogger().removeHandler(_STDLIB_HANDLER)
        _STDLIB_HANDLER = None

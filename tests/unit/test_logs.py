"""Log lines: JSON when not on a terminal, and no payload, API key or password in any of them."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from outbox.observability import logs


@pytest.fixture
def lines() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logs.configure("debug", json=True, stream=stream)
    yield stream
    logs.unconfigure()


def test_lines_are_json_and_secrets_never_appear(lines: io.StringIO) -> None:
    log = structlog.get_logger("test")
    log.info(
        "attempt recorded",
        operation_id=7,
        outcome="succeeded",
        payload={"card": "4242424242424242"},
        api_key="sk_live_abcdefgh12345678",
        dsn="postgresql://app:hunter2@db/app",
        error="connect to postgresql://app:hunter2@db/app failed; key sk_test_zyxw98765432",
        detail="host=db password=hunter2 dbname=app",
    )
    (line,) = lines.getvalue().strip().splitlines()
    event = json.loads(line)
    assert event["event"] == "attempt recorded" and event["operation_id"] == 7
    assert event["level"] == "info" and "timestamp" in event
    for secret in (
        "4242424242424242",
        "sk_live_abcdefgh12345678",
        "hunter2",
        "sk_test_zyxw98765432",
    ):
        assert secret not in line, secret
    assert "db/app failed" in event["error"]  # the rest of the message survives


def test_levels_filter() -> None:
    stream = io.StringIO()
    logs.configure("warning", json=True, stream=stream)
    try:
        log = structlog.get_logger("test")
        log.info("hidden")
        log.warning("shown")
    finally:
        logs.unconfigure()
    assert "shown" in stream.getvalue() and "hidden" not in stream.getvalue()


def test_a_traceback_keeps_no_row_a_database_error_quoted(lines: io.StringIO) -> None:
    """psycopg's message of a constraint violation ends with the row: every column, payload
    and provider answer included. A loop that survives it logs the traceback
    (outbox.runtime.loops)."""
    log = structlog.get_logger("test")
    message = (
        'new row for relation "operations" violates check constraint "x"\n'
        'DETAIL:  Failing row contains (7, acme, {"card": "4242424242424242"}, '
        "sk_live_abcdefgh12345678)."
    )
    log.error(
        "a loop of outbox run failed; it goes on", loop="claim", exc_info=RuntimeError(message)
    )
    (line,) = lines.getvalue().strip().splitlines()
    event = json.loads(line)
    assert "violates check constraint" in event["exception"]  # the cause survives
    for secret in ("4242424242424242", "sk_live_abcdefgh12345678", "Failing row"):
        assert secret not in line, secret


def test_library_loggers_write_json_lines_too(lines: io.StringIO) -> None:
    """Issue 21, case 7: psycopg_pool's and any stdlib logger's lines bypassed structlog, plain
    and some on several lines, during an outage. Each is one JSON event now, redacted."""
    logging.getLogger("psycopg.pool").warning(
        "error connecting in %r: %s",
        "outbox",
        "connection refused\nis the server running? password=hunter2",
    )
    try:
        _ = 1 // 0
    except ZeroDivisionError:
        logging.getLogger("asyncio").exception("Task exception was never retrieved")
    logging.getLogger("httpx").info("HTTP Request: POST https://api.stripe.com/v1/x")  # dropped
    events = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert [(e["logger"], e["level"]) for e in events] == [
        ("psycopg.pool", "warning"),
        ("asyncio", "error"),
    ]
    assert "hunter2" not in lines.getvalue() and "ZeroDivisionError" in events[1]["exception"]

"""The audit tells the truth, and nothing shown can lie on screen (issue 20, case 3).

`--actor` is free text: the audit now records the database user beside it, and `show` shows
both. Reasons and provider text may hold newlines, ANSI escapes or direction overrides that
render as fake audit rows or erase lines: they are stored as given and escaped wherever shown.
Reasons are bounded, and `ordering set-mode` writes its audit row too.
"""

from __future__ import annotations

import io
import json
import os
import unicodedata
from typing import Any

import psycopg
import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.core.safe_text import printable
from outbox.observability import logs
from outbox.oncall import operators
from outbox.oncall.text_tables import render_table
from tests.support.cli import outbox_cli
from tests.support.dispatch import enqueue_many, rows

HOSTILE = (
    "paid\n2026-12-01 09:00  mallory  resolve  quarantined  succeeded  fine\x1b[2K\x1b[1A\u202e"
)


def quarantined(db_url: str, count: int = 1) -> list[int]:
    ids = enqueue_many(db_url, count)
    with psycopg.connect(db_url) as conn:
        conn.execute(
            "UPDATE outbox.operations SET status = 'quarantined', status_reason = "
            "'permanent_failure', last_error = %s",
            (HOSTILE,),
        )
    return ids


def env(db_url: str) -> dict[str, str]:
    return {**os.environ, "OUTBOX_DATABASE_URL": db_url}


def test_show_names_the_database_user_beside_the_claimed_actor_and_escapes_the_text(
    db_url: str,
) -> None:
    op, _ = quarantined(db_url, 2)
    done = outbox_cli(
        env(db_url), "quarantine", "cancel", str(op), "--reason", HOSTILE, "--actor", "the-ceo"
    )
    assert done.returncode == 0, done.stderr
    ((stored, actor, user),) = rows(db_url, "SELECT reason, actor, db_user FROM outbox.audit")
    assert (stored, actor) == (HOSTILE, "the-ceo")  # stored as given
    shown = outbox_cli(env(db_url), "quarantine", "show", str(op)).stdout
    assert "\x1b" not in shown and "\u202e" not in shown
    assert "\\x1b[2K" in shown and "\\u202e" in shown
    audit = shown[shown.index("DB USER") :].splitlines()
    assert len(audit) == 2  # the header and the one real row: no fake row drawn
    assert "the-ceo" in audit[1] and user in audit[1]
    listed = outbox_cli(env(db_url), "quarantine", "list").stdout
    assert "\x1b" not in listed and len(listed.splitlines()) == 2


def test_a_reason_is_bounded_and_a_refusal_changes_nothing(db_url: str) -> None:
    (op,) = quarantined(db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        for reason, actor in (
            ("x" * 2001, "alice"),
            ("x" * 5_000_000, "alice"),
            ("fine", "a" * 256),
        ):
            with pytest.raises(operators.ActionRefused, match="at most"):
                operators.cancel(conn, op, reason=reason, actor=actor)
        operators.cancel(conn, op, reason="x" * 2000, actor="a" * 255)
    assert rows(db_url, "SELECT status FROM outbox.operations") == [("cancelled",)]
    assert rows(db_url, "SELECT length(reason) FROM outbox.audit") == [(2000,)]


def test_ordering_set_mode_writes_its_audit_row(db_url: str) -> None:
    done = outbox_cli(
        env(db_url),
        "ordering",
        "set-mode",
        "invoice.charge",
        "skip",
        "--actor",
        "bob",
        "--reason",
        "incident 7",
    )
    assert done.returncode == 0, done.stderr
    again = outbox_cli(
        env(db_url), "ordering", "set-mode", "invoice.charge", "block", "--actor", "bob"
    )
    assert again.returncode == 0, again.stderr
    audit = rows(
        db_url,
        "SELECT operation_id, actor, action, reason, details->>'on_failure', "
        "details->>'before', db_user IS NOT NULL FROM outbox.audit "
        "ORDER BY id",
    )
    assert audit == [
        (None, "bob", "ordering_mode", "incident 7", "skip", "block", True),
        (None, "bob", "ordering_mode", "ordering set-mode, no reason given", "block", "skip", True),
    ]


def test_console_logs_escape_what_they_are_given() -> None:
    out = io.StringIO()
    logs.configure("info", json=False, stream=out)
    try:
        structlog.get_logger("t").warning("provider answered", reason=HOSTILE, tenant_id="a\nb")
    finally:
        # Not another configure: it caches loggers, and later tests' capture_logs miss them.
        logs.unconfigure()
    text = out.getvalue()
    assert "\x1b[2K" not in text and "\u202e" not in text and text.count("\n") == 1


def test_json_logs_keep_the_text_exact() -> None:
    out = io.StringIO()
    logs.configure("info", json=True, stream=out)
    try:
        structlog.get_logger("t").warning("provider answered", reason=HOSTILE)
    finally:
        logs.unconfigure()
    assert json.loads(out.getvalue())["reason"] == HOSTILE


UNSAFE = {"Cc", "Cf", "Zl", "Zp"}


@settings(database=None, deadline=None, max_examples=300)
@given(st.text())
def test_printable_leaves_nothing_a_terminal_acts_on(text: str) -> None:
    shown = printable(text)
    assert not any(unicodedata.category(ch) in UNSAFE for ch in shown)
    assert "\n" not in shown and "\r" not in shown
    if text.isprintable():
        assert shown == text  # nothing harmless is changed


@settings(database=None, deadline=None, max_examples=100)
@given(st.lists(st.lists(st.text(), min_size=2, max_size=2), max_size=5))
def test_a_table_has_one_line_per_row_whatever_its_cells(cells: list[list[Any]]) -> None:
    table = render_table(["a", "b"], cells)
    assert table.count("\n") == len(cells)  # a row of blank cells is a blank line

"""Identities refuse a space at either end, and caller keys outbox's own forms in any case
(issue 38; sql/0036).

'acme' and 'acme' followed by U+00A0 NO-BREAK SPACE look the same in a log line, a terminal or a
web page, yet were two tenants; only a value of spaces alone was refused (as empty). Now no
identity field may begin or end with a character of Unicode's category Zs, derived here from
Python's unicodedata at every code point, never from a list. And a caller's key of the derived
keys' form in another case (OB1_..., ...:R2) was accepted, where a provider that compares keys
without regard to case takes it for outbox's own.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import psycopg
import pytest

import outbox
from outbox import InvalidOperation
from tests.integration.test_identity_characters import (
    FIELDS,
    code_points,
    rows_of,
    sql_args,
    sql_error,
)
from tests.support.producers import charge, count

SPACES = [c for c in code_points() if unicodedata.category(chr(c)) == "Zs"]


def test_the_spaces_are_unicodes_and_check_ends_matches_exactly_them(
    conn: psycopg.Connection[Any],
) -> None:
    """check_ends and enqueue's usual path match one class, exactly Zs at every code point."""
    assert 0x20 in SPACES and 0xA0 in SPACES and 0x3000 in SPACES and len(SPACES) == 17
    sources = dict(
        rows_of(
            conn,
            "SELECT p.proname, p.prosrc FROM pg_proc p "
            "WHERE p.pronamespace = 'outbox'::regnamespace "
            "AND p.proname IN ('check_ends', 'enqueue')",
        )
    )
    found = {name: set(re.findall(r"(\[\\u0020[^\]]*\])", src)) for name, src in sources.items()}
    assert len(found["check_ends"]) == 1
    assert found["enqueue"] == found["check_ends"]
    (pattern,) = found["check_ends"]
    matched = {
        c
        for (c,) in rows_of(
            conn,
            "SELECT c FROM generate_series(1, 1114111) c "
            "WHERE c NOT BETWEEN 55296 AND 57343 AND chr(c) ~ %s",
            (pattern,),
        )
    }
    assert sorted(matched) == SPACES


@pytest.mark.parametrize("field", FIELDS)
def test_sql_enqueue_refuses_a_space_at_either_end_of_each_field(
    conn: psycopg.Connection[Any], db_url: str, field: str
) -> None:
    for code in SPACES:
        for value, at in ((f"{chr(code)}x", 1), (f"xy{chr(code)}", 3)):
            args = sql_args(charge(**{field: value}))
            names = ", ".join(f"{name} => %({name})s" for name in args)
            error = sql_error(conn, f"SELECT * FROM outbox.enqueue({names})", args)  # noqa: S608
            assert (error.sqlstate, error.diag.column_name) == ("OB002", field), hex(code)
            assert error.diag.message_primary == (
                f"{field} must not begin or end with a space (U+{code:04X} at character {at})"
            )
    conn.commit()
    assert count(db_url) == 0


@pytest.mark.parametrize("field", FIELDS)
def test_python_enqueue_refuses_a_space_at_either_end_of_each_field(
    conn: psycopg.Connection[Any], db_url: str, field: str
) -> None:
    for value in ("acme\u00a0", "\u00a0acme", " acme", "acme ", "acme\u2009", "\u3000acme"):
        refusal = pytest.raises(InvalidOperation, match="must not begin or end")
        with refusal as caught, conn.transaction():
            outbox.enqueue(conn, **charge(**{field: value}))
        assert caught.value.field == field, repr(value)
    conn.commit()
    assert count(db_url) == 0


def test_spaces_inside_a_value_are_accepted_and_the_first_field_is_named(
    conn: psycopg.Connection[Any],
) -> None:
    inside = {f: f"a {chr(0xA0)}b{chr(0x3000)}c {f}" for f in FIELDS}
    assert outbox.enqueue(conn, **charge(**inside)).outcome is outbox.EnqueueOutcome.ACCEPTED
    for i, bad in enumerate(FIELDS):
        values = {f: f"{f}-{i}" + (" " if j >= i else "") for j, f in enumerate(FIELDS)}
        with pytest.raises(InvalidOperation) as caught, conn.transaction():
            outbox.enqueue(conn, **charge(**values))
        assert caught.value.field == bad


@pytest.mark.parametrize(
    "key", ["OB1_anything", "Ob1_x", "oB1_x", "order-1:R2", "x:R10", "OB1_" + "a" * 64]
)
def test_outbox_key_forms_are_refused_in_any_case(
    conn: psycopg.Connection[Any], db_url: str, key: str
) -> None:
    with pytest.raises(InvalidOperation, match="in any case") as caught:
        outbox.enqueue(conn, **charge(idempotency_key=key))
    assert caught.value.field == "idempotency_key"
    conn.rollback()
    assert count(db_url) == 0


@pytest.mark.parametrize("key", ["OB1-x", "ob1x", "xob1_", "r2", "a:rb", "a:R", "order:r2x"])
def test_keys_merely_near_those_forms_are_accepted(conn: psycopg.Connection[Any], key: str) -> None:
    assert outbox.enqueue(conn, **charge(idempotency_key=key)).outcome.value == "accepted"

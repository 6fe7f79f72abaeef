"""Identities refuse the characters that act on what shows them, as they refuse control
characters (issue 21; sql/0028).

tenant_id, operation_type, operation_key, provider, action, correlation_id and ordering_key end
up in log lines, HTTP headers and operators' terminals. enqueue refused [[:cntrl:]] in them but
took a U+202E RIGHT-TO-LEFT OVERRIDE (a key shown reversed), a U+200B ZERO WIDTH SPACE (two keys
that look the same) or a U+2028 LINE SEPARATOR. It now refuses the class outbox/core/safe_text.py
escapes when it prints: Unicode's general categories Cc, Cf, Zl and Zp. PostgreSQL's regular
expressions know no categories, so the class is written out as code points; these tests derive
the expected class from Python's unicodedata, code point by code point, never from a list.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox import InvalidOperation
from outbox.core.safe_text import printable
from outbox.providers.base import Provider
from outbox.testing.webhook import FakeWebhookReceiver
from tests.support.dispatch import dispatcher, rows
from tests.support.producers import charge, count

UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})
# Format characters since Unicode 15.0 (Egyptian hieroglyph format controls), refused already;
# unassigned in the Unicode of Python 3.11's unicodedata (14.0), format in any later one.
NEWER_FORMAT = range(0x13439, 0x13440)
LAST_CODE_POINT = 0x10FFFF
SURROGATES = range(0xD800, 0xE000)
FIELDS = (
    "tenant_id",
    "operation_type",
    "operation_key",
    "provider",
    "action",
    "correlation_id",
    "ordering_key",
)
# A field's longest value (check_text's max_length).
LONGEST = {
    "tenant_id": 128,
    "operation_type": 128,
    "operation_key": 255,
    "provider": 64,
    "action": 128,
    "correlation_id": 255,
    "ordering_key": 255,
}


def code_points() -> Iterator[int]:
    """Every code point a PostgreSQL text can hold: not NUL, not a surrogate."""
    return (c for c in range(1, LAST_CODE_POINT + 1) if c not in SURROGATES)


def refused(code: int) -> bool:
    """What enqueue must refuse, from Python's own tables."""
    return unicodedata.category(chr(code)) in UNSAFE_CATEGORIES or code in NEWER_FORMAT


REFUSED = [c for c in code_points() if refused(c)]


def test_pythons_class_is_what_safe_text_escapes() -> None:
    """The oracle of these tests is the printer's: a character enqueue refuses is one that
    outbox escapes when it shows text, and no other."""
    escaped = {c for c in code_points() if printable(chr(c)) != chr(c)}
    assert escaped == {c for c in REFUSED if unicodedata.category(chr(c)) in UNSAFE_CATEGORIES}
    # The issue's own examples are in it.
    for c in (
        0x061C,
        *range(0x200B, 0x2010),
        0x2028,
        0x2029,
        *range(0x202A, 0x202F),
        *range(0x2060, 0x2065),
        *range(0x2066, 0x206A),
        0xFEFF,
    ):
        assert c in REFUSED, hex(c)
    for c in NEWER_FORMAT:
        assert unicodedata.category(chr(c)) in ("Cn", "Cf"), hex(c)


def test_the_sql_class_is_pythons_at_every_code_point(conn: psycopg.Connection[Any]) -> None:
    """The pattern check_text and enqueue's usual path match is one and the same, and it
    matches exactly Python's class, at each of the 1,112,063 code points."""
    sources = dict(
        rows_of(
            conn,
            "SELECT p.proname, p.prosrc FROM pg_proc p "
            "WHERE p.pronamespace = 'outbox'::regnamespace "
            "AND p.proname IN ('check_text', 'enqueue')",
        )
    )
    found = {name: set(re.findall(r"'(\[\\u0001[^']*\])'", src)) for name, src in sources.items()}
    assert len(found["check_text"]) == 1
    assert found["enqueue"] == found["check_text"]
    (pattern,) = found["check_text"]
    matched = {
        c
        for (c,) in rows_of(
            conn,
            "SELECT c FROM generate_series(1, %s) c "
            "WHERE c NOT BETWEEN 55296 AND 57343 AND chr(c) ~ %s",
            (LAST_CODE_POINT, pattern),
        )
    }
    assert sorted(matched - set(REFUSED)) == []
    assert sorted(set(REFUSED) - matched) == []


def test_enqueue_accepts_every_other_code_point(conn: psycopg.Connection[Any]) -> None:
    """Every code point outside the class, run through enqueue itself as operation keys of 255
    characters (4,380 of them): letters of every script, marks, symbols, private use,
    unassigned, spaces inside a value (never at its ends: sql/0036)."""
    accepted = [chr(c) for c in code_points() if not refused(c)]
    keys = ["k" + "".join(accepted[i : i + 253]) + "k" for i in range(0, len(accepted), 253)]
    ((stored,),) = rows_of(
        conn,
        "SELECT count(*) FROM unnest(%s::text[]) k, LATERAL "
        "outbox.enqueue('acme', 'every.character', k, 'hook', "
        "'invoice.paid', '{}')",
        (keys,),
    )
    assert stored == len(keys)
    conn.commit()
    assert rows_of(
        conn, "SELECT count(*) FROM outbox.operations WHERE operation_key = ANY(%s)", (keys,)
    ) == [(len(keys),)]


def test_check_text_refuses_each_one_naming_the_character(conn: psycopg.Connection[Any]) -> None:
    """The helper itself (set_ordering_mode checks with it too), at every refused code point,
    and at every position: the first, the middle and the last of a value."""
    for i, code in enumerate(REFUSED):
        value = ("a" * (i % 3)) + chr(code) + ("b" * (i % 2))
        error = sql_error(conn, "SELECT outbox.check_text('actor', %s, 255)", (value,))
        assert (error.sqlstate, error.diag.column_name) == ("OB002", "actor"), hex(code)
        assert error.diag.message_primary == (
            f"actor must not contain control characters (U+{code:04X} at character {i % 3 + 1})"
        )


@pytest.mark.parametrize("field", FIELDS)
def test_sql_enqueue_refuses_every_such_character_in_each_field(
    conn: psycopg.Connection[Any], db_url: str, field: str
) -> None:
    for code in REFUSED:
        args = sql_args(charge(**{field: f"x{chr(code)}y"}))
        names = ", ".join(f"{name} => %({name})s" for name in args)
        error = sql_error(conn, f"SELECT * FROM outbox.enqueue({names})", args)  # noqa: S608
        assert (error.sqlstate, error.diag.column_name) == ("OB002", field), hex(code)
        assert f"U+{code:04X} at character 2" in (error.diag.message_primary or "")
    conn.commit()
    assert count(db_url) == 0


@pytest.mark.parametrize("field", FIELDS)
def test_python_enqueue_refuses_every_such_character_in_each_field(
    conn: psycopg.Connection[Any], db_url: str, field: str
) -> None:
    for code in REFUSED:
        with pytest.raises(InvalidOperation) as caught, conn.transaction():
            outbox.enqueue(conn, **charge(**{field: chr(code)}))
        assert caught.value.field == field, hex(code)
        assert f"U+{code:04X}" in str(caught.value)
    conn.commit()
    assert count(db_url) == 0


def test_the_error_names_the_first_field_that_holds_one(conn: psycopg.Connection[Any]) -> None:
    """The usual path tests all seven fields with one match; the error still names the first
    field, in check_text's order, that holds such a character, every field at its longest."""
    for i, bad in enumerate(FIELDS):
        values = {
            f: "v" * (LONGEST[f] - 1) + ("\u2066" if j >= i else "v") for j, f in enumerate(FIELDS)
        }
        with pytest.raises(InvalidOperation) as caught, conn.transaction():
            outbox.enqueue(conn, **charge(**values))
        assert caught.value.field == bad


ORDINARY = [
    "é",
    "日本",
    "😀",
    "Ελληνικά",
    "עברית",
    "العربية",
    "Ünïcödé ünd spåces",
    "👍🏽",
    "🇫🇷",
    "ﬁ",
    "\u0301e",
    "\ue000",
]


@pytest.mark.parametrize("value", ORDINARY)
def test_ordinary_non_ascii_is_accepted_in_every_field_as_it_is(
    conn: psycopg.Connection[Any], value: str
) -> None:
    values = {f: f"{value}-{f}" for f in FIELDS}
    result = outbox.enqueue(conn, **charge(**values))
    assert result.outcome is outbox.EnqueueOutcome.ACCEPTED
    stored = rows_of(
        conn,
        f"SELECT {', '.join(FIELDS)} FROM outbox.operations "  # noqa: S608
        "WHERE id = %s",
        (result.operation_id,),
    )
    assert stored == [tuple(values[f] for f in FIELDS)]


async def test_the_rows_behind_a_refused_identity_are_enqueued_and_delivered(
    db_url: str, pool: AsyncConnectionPool[Any], receiver: FakeWebhookReceiver, hook: Provider
) -> None:
    """A producer's batch where one identity is refused: the others commit, the refused one
    leaves no row and no turn of its ordering key behind, and every accepted one is sent."""

    def enqueue(conn: psycopg.Connection[Any], i: int, key: str) -> None:
        outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice.charge",
            operation_key=key,
            provider="hook",
            action="invoice.paid",
            payload={"n": i},
            ordering_key="customer-7",
        )

    with psycopg.connect(db_url) as conn:
        for i in range(6):
            if i != 2:
                enqueue(conn, i, f"op-{i}")
                continue
            with pytest.raises(InvalidOperation) as caught, conn.transaction():
                enqueue(conn, i, "op-\u202e2")
            assert caught.value.field == "operation_key"
    assert count(db_url) == 5
    d = dispatcher(pool, {"hook": hook})
    for _ in range(10):  # one at a time: they share an ordering key
        await d.run_once()
    assert rows(db_url, "SELECT status, count(*) FROM outbox.operations GROUP BY 1") == [
        ("succeeded", 5)
    ]
    assert [e.body["n"] for e in receiver.effects] == [0, 1, 3, 4, 5]


def test_set_ordering_mode_refuses_them_too(conn: psycopg.Connection[Any]) -> None:
    """check_text is set_ordering_mode's check as well (sql/0025)."""
    for column, args in (
        ("operation_type", ("invoice\u200b.charge", "skip", "me")),
        ("actor", ("invoice.charge", "skip", "me\u2028root")),
    ):
        error = sql_error(conn, "SELECT outbox.set_ordering_mode(%s, %s, %s)", args)
        assert (error.sqlstate, error.diag.column_name) == ("OB002", column)


def rows_of(conn: psycopg.Connection[Any], query: Any, params: Any = None) -> list[Any]:
    return conn.execute(query, params).fetchall()


def sql_error(conn: psycopg.Connection[Any], query: Any, params: Any) -> psycopg.Error:
    """The error ``query`` raises, in a savepoint rolled back after it."""
    try:
        with conn.transaction():
            conn.execute(query, params)
    except psycopg.Error as exc:
        return exc
    raise AssertionError(f"no error: {params!r}")


def sql_args(args: dict[str, Any]) -> dict[str, Any]:
    return {**args, "payload": json.dumps(args["payload"])}

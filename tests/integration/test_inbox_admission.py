"""inbox_begin's one-test admission (sql/0049) against the helpers it stands in for.

0049 checks the common case of a delivery in one expression and sends anything else through
check_between and inbox_admit, which raise as they always did. The promise: the fast test admits
nothing the helpers refuse, and what it admits has the helpers' effects (the transaction bound
to the tenant, the same digest). Generated identities sit on every edge the helpers draw: empty,
blank, one character short of and past each length, each end of the handler's alphabet, the
control, format and separator characters of 0028, a transaction bound to another tenant.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Characters on both sides of each line the helpers draw: 0028's class (controls, bidi and
# zero-width formats, separators, tags) and their neighbours that are allowed.
EDGES = (
    "a",
    "Z",
    "0",
    " ",
    ".",
    "_",
    "-",
    "é",
    "\t",
    "\n",
    "\x1f",
    "\x7f",
    "\x85",
    "\xa0",
    "\xad",
    "\u061c",
    "\u200b",
    "\u200e",
    "\u2028",
    "\u202e",
    "\u2065",
    "\ufeff",
    "\ufffc",
    "\U000e0001",
    "\U000e0002",
    "\U0001d173",
)
HANDLER_EDGES = ("a", "z", "0", "9", ".", "_", "-", "A", "/", " ", "é", "\n")


def edged(alphabet: tuple[str, ...], limit: int, base: str) -> st.SearchStrategy[str | None]:
    """A valid ``base`` changed on one edge: None, empty, ``base`` with one character of
    ``alphabet`` put in anywhere or in place of its first, or texts of ``base``'s first
    character from two short of ``limit`` to one past it."""
    one_in = st.tuples(st.integers(0, len(base)), st.sampled_from(alphabet)).map(
        lambda at: base[: at[0]] + at[1] + base[at[0] :]
    )
    first = st.sampled_from(alphabet).map(lambda c: c + base[1:])
    long = st.integers(limit - 2, limit + 1).map(lambda n: base[0] * n)
    return st.sampled_from([None, "", " ", base]) | one_in | first | long


BODIES = st.sampled_from(
    [
        ('{"b": 1, "a": [true, null]}', None),
        ("[1, 2.50, 1e3]", None),
        ("not json", None),
        (None, b"\x00\xff raw"),
        (None, None),
        ("{}", b"both"),
    ]
)
WAITS = st.sampled_from([None, "-1 s", "0", "1 ms", "60 s", "61 s"])
RETENTIONS = st.sampled_from([None, "59 min", "1 hour", "400 days", "401 days"])
BASE: dict[str, Any] = {
    "tenant": "acme",
    "handler": "invoice.create",
    "key": "k-1",
    "body": ('{"a": 1}', None),
    "wait": "1 s",
    "retention": "1 day",
    "bound": None,
}
# One field on an edge, the others valid (so that the fast test alone decides), or two at once.
CHANGES = st.one_of(
    st.tuples(st.just("tenant"), edged(EDGES, 128, "acme")),
    st.tuples(st.just("handler"), edged(HANDLER_EDGES, 128, "invoice.create")),
    st.tuples(st.just("key"), edged(EDGES, 512, "k-1")),
    st.tuples(st.just("body"), BODIES),
    st.tuples(st.just("wait"), WAITS),
    st.tuples(st.just("retention"), RETENTIONS),
    st.tuples(st.just("bound"), st.sampled_from([None, "same", "other", ""])),
)


BEGIN = "SELECT decision FROM outbox.inbox_begin(%s, %s, %s, %s, %s, %s::interval, %s::interval)"
# The record inbox_begin just wrote (the test's database holds no other).
RECORDED = "SELECT state, body_digest FROM outbox.inbox ORDER BY id DESC LIMIT 1"
CHECK_BETWEEN = "SELECT outbox.check_between(%s, %s::interval, %s::interval, %s::interval)"
ADMIT = "SELECT 'in_progress', outbox.inbox_admit(%s, %s, %s, %s, %s)"


def outcome(
    conn: psycopg.Connection[Any], steps: list[tuple[Any, tuple[Any, ...]]]
) -> tuple[Any, ...]:
    """("ok", the transaction's bound tenant, the last step's row) or the first error."""
    try:
        for query, args in steps:
            row = conn.execute(query, args).fetchone()
        bound = conn.execute("SELECT outbox.bound_tenant()").fetchone()
    except psycopg.Error as exc:
        conn.rollback()
        return ("error", exc.sqlstate, exc.diag.message_primary)
    conn.rollback()
    return ("ok", bound, row)


@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(changes=st.lists(CHANGES, min_size=1, max_size=2))
def test_the_fast_admission_refuses_what_the_helpers_refuse_and_binds_as_they_do(
    db_url: str, changes: list[tuple[str, Any]]
) -> None:
    assert_agree(db_url, {**BASE, **dict(changes)})


# The body's bound, one byte either side of 16 MiB, as text to read as JSON and as bytes.
LIMIT = 16 * 1024 * 1024


@pytest.mark.parametrize(
    "body",
    [
        ('"' + "a" * (LIMIT - 2) + '"', None),
        ('"' + "a" * (LIMIT - 1) + '"', None),
        (None, b"a" * LIMIT),
        (None, b"a" * (LIMIT + 1)),
    ],
    ids=["json-at", "json-past", "raw-at", "raw-past"],
)
def test_the_fast_admission_bounds_the_body_as_the_helpers_do(
    db_url: str, body: tuple[str | None, bytes | None]
) -> None:
    assert_agree(db_url, {**BASE, "body": body})


def assert_agree(db_url: str, case: dict[str, Any]) -> None:
    """inbox_begin and the helpers, each in a transaction of its own bound as ``case`` says,
    end the same way: the same error, or the same tenant bound and the same digest."""
    tenant, handler, key = case["tenant"], case["handler"], case["key"]
    wait, retention, bound = case["wait"], case["retention"], case["bound"]
    body_json, body_raw = case["body"]
    with psycopg.connect(db_url) as conn:

        def bind() -> None:
            if bound is not None:
                to = {"same": tenant or "x", "other": "someone-else", "": ""}[bound]
                conn.execute("SELECT set_config('outbox.tenant_id', %s, true)", (to,))
                conn.execute(
                    "SELECT set_config('outbox.tenant_bound_at', to_char(transaction_timestamp()"
                    " AT TIME ZONE 'UTC', 'YYYYMMDDHH24MISSUS'), true)"
                )

        args = (tenant, handler, key, body_json, body_raw, wait, retention)
        bind()
        fast = outcome(conn, [(BEGIN, args), (RECORDED, ())])
        bind()
        helpers = outcome(
            conn,
            [
                (CHECK_BETWEEN, ("wait", wait, "0", "60 seconds")),
                (CHECK_BETWEEN, ("retention", retention, "1 hour", "400 days")),
                (ADMIT, (tenant, handler, key, body_json, body_raw)),
            ],
        )
    assert fast == helpers
    assert fast[0] == "ok" or case != BASE  # the valid case is admitted


def test_the_fast_admission_takes_the_common_case(db_url: str) -> None:
    """Not a test that only ever sees refusals: the common delivery is admitted and recorded."""
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT decision FROM outbox.inbox_begin('acme', 'invoice.create', 'k-1', '{}', NULL,"
            " %s, %s)",
            (timedelta(seconds=1), timedelta(days=1)),
        ).fetchone()
        assert row == ("new",)
        assert conn.execute("SELECT outbox.bound_tenant()").fetchone() == ("acme",)
        conn.rollback()

"""Bad input at enqueue: a clear error that names the field, and no row, in SQL and Python alike."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox import InvalidOperation
from outbox.core import payloads
from tests.support.dispatch import rows
from tests.support.producers import charge, count, nested_payload

# (field, bad value, what the message must say)
BAD_TEXT = [
    ("tenant_id", "", "tenant_id must not be empty"),
    ("tenant_id", "   ", "tenant_id must not be empty"),
    ("tenant_id", "t" * 129, "tenant_id is 129 characters long; at most 128"),
    ("operation_type", "", "operation_type must not be empty"),
    ("operation_type", "x" * 129, "operation_type is 129 characters long"),
    ("operation_key", "", "operation_key must not be empty"),
    ("operation_key", "k" * 10_000, "operation_key is 10000 characters long; at most 255"),
    ("operation_key", "line\nbreak", "operation_key must not contain control characters"),
    ("provider", "", "provider must not be empty"),
    ("provider", "p" * 65, "provider is 65 characters long"),
    ("action", "", "action must not be empty"),
    ("correlation_id", "c" * 256, "correlation_id is 256 characters long"),
    ("idempotency_key", "has space", "idempotency_key must be 1 to 255 visible ASCII"),
    ("idempotency_key", "k" * 256, "idempotency_key must be 1 to 255 visible ASCII"),
    ("idempotency_key", "ключ", "idempotency_key must be 1 to 255 visible ASCII"),
    ("traceparent", "not-a-trace", "traceparent must be a W3C trace context"),
]
BAD_PAYLOAD_JSON = [
    ("[1, 2]", "payload must be a JSON object, not array"),
    ('"text"', "payload must be a JSON object, not string"),
    ("null", "payload must be a JSON object, not null"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_TEXT)
def test_python_names_the_field_and_writes_nothing(
    conn: psycopg.Connection[Any], db_url: str, field: str, value: str, message: str
) -> None:
    with pytest.raises(InvalidOperation, match=message) as caught:
        outbox.enqueue(conn, **charge(**{field: value}))
    assert caught.value.field == field
    conn.rollback()
    assert count(db_url) == 0


@pytest.mark.parametrize(("field", "value", "message"), BAD_TEXT)
def test_sql_names_the_field_with_its_sqlstate_and_writes_nothing(
    conn: psycopg.Connection[Any], db_url: str, field: str, value: str, message: str
) -> None:
    args = charge(**{field: value})
    args["payload"] = json.dumps(args["payload"])
    names = ", ".join(f"{name} => %({name})s" for name in args)
    with pytest.raises(psycopg.Error, match=message) as caught:
        conn.execute(f"SELECT * FROM outbox.enqueue({names})", args)  # noqa: S608 (fixed names)
    assert caught.value.sqlstate == "OB002"
    assert caught.value.diag.column_name == field
    conn.rollback()
    assert count(db_url) == 0


# Every text field enqueue checks, with its longest accepted value and whether it is required:
# check_text's four rules (sql/0004), which sql/0017 tests at once on the usual path.
TEXT_FIELDS = {
    "tenant_id": (128, True),
    "operation_type": (128, True),
    "operation_key": (255, True),
    "provider": (64, True),
    "action": (128, True),
    "correlation_id": (255, False),
    "ordering_key": (255, False),
}
RULE_CASES = [
    *[(field, None, f"{field} is required") for field, (_, req) in TEXT_FIELDS.items() if req],
    *[(field, "   ", f"{field} must not be empty") for field in TEXT_FIELDS],
    *[
        (field, "é" * (limit + 1), f"{field} is {limit + 1} characters long; at most {limit} are")
        for field, (limit, _) in TEXT_FIELDS.items()
    ],
    *[(field, "a\x7fb", f"{field} must not contain control characters") for field in TEXT_FIELDS],
]


@pytest.mark.parametrize(("field", "value", "message"), RULE_CASES)
def test_sql_applies_every_rule_to_every_text_field(
    conn: psycopg.Connection[Any], db_url: str, field: str, value: str | None, message: str
) -> None:
    args = charge(ordering_key="customer-1", correlation_id="req-1")
    args[field] = value
    args["payload"] = json.dumps(args["payload"])
    names = ", ".join(f"{name} => %({name})s" for name in args)
    with pytest.raises(psycopg.Error, match=message) as caught:
        conn.execute(f"SELECT * FROM outbox.enqueue({names})", args)  # noqa: S608 (fixed names)
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", field)
    conn.rollback()
    assert count(db_url) == 0


def test_the_longest_accepted_values_are_accepted(conn: psycopg.Connection[Any]) -> None:
    """Multibyte characters count as one each, as in check_text."""
    longest = {field: "é" * limit for field, (limit, _) in TEXT_FIELDS.items()}
    result = outbox.enqueue(conn, **charge(**longest))
    assert result.outcome == "accepted"
    op = outbox.get_operation(
        conn, longest["tenant_id"], longest["operation_type"], longest["operation_key"]
    )
    assert op is not None and op.correlation_id == longest["correlation_id"]


# What a hostile producer can write in 15 bytes or a few more, and enqueue now refuses (OB002,
# COLUMN payload): the dispatcher could not carry any of it (issue 17).
HOSTILE_PAYLOADS = [
    ('{"n": 1e5000}', "number of 1e100 or more"),
    ('{"n": -1e100}', "number of 1e100 or more"),
    ('{"n": [1, {"m": 1e131071}]}', "number of 1e100 or more"),
    (nested_payload(65), "deeper than 64 levels"),
    (nested_payload(1000), "deeper than 64 levels"),
]


@pytest.mark.parametrize(("payload", "message"), BAD_PAYLOAD_JSON + HOSTILE_PAYLOADS)
def test_sql_refuses_a_payload_that_is_not_an_object_or_cannot_be_carried(
    conn: psycopg.Connection[Any], db_url: str, payload: str, message: str
) -> None:
    with pytest.raises(psycopg.Error, match=message) as caught:
        conn.execute(
            "SELECT * FROM outbox.enqueue(tenant_id => 'a', operation_type => 't', "
            "operation_key => 'k', provider => 'p', action => 'x', payload => %s::jsonb)",
            (payload,),
        )
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", "payload")
    conn.rollback()
    assert count(db_url) == 0


def test_sql_requires_every_identity_field(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(psycopg.Error, match="operation_key is required") as caught:
        conn.execute(
            "SELECT * FROM outbox.enqueue(tenant_id => 'a', operation_type => 't', "
            "operation_key => NULL, provider => 'p', action => 'x', payload => '{}')"
        )
    assert caught.value.diag.column_name == "operation_key"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ([1, 2], "payload must be a JSON object \\(a mapping\\), not list"),
        ("{}", "payload must be a JSON object \\(a mapping\\), not str"),
        ({"amount": float("nan")}, "payload is not valid JSON"),
        ({"when": object()}, "payload is not valid JSON"),
        ({"note": "nul\x00byte"}, "payload must not contain NUL characters"),
        ({"nul\x00key": 1}, "payload must not contain NUL characters"),
        ({"nested": [{"deep": "\x00"}]}, "payload must not contain NUL characters"),
        ({"after": "a backslash \\\x00"}, "payload must not contain NUL characters"),
    ],
    ids=["list", "str", "nan", "object", "nul-value", "nul-key", "nul-nested", "nul-escaped"],
)
def test_python_refuses_a_payload_that_cannot_be_a_json_object(
    conn: psycopg.Connection[Any], db_url: str, payload: Any, message: str
) -> None:
    with pytest.raises(InvalidOperation, match=message) as caught:
        outbox.enqueue(conn, **charge(payload=payload))
    assert caught.value.field == "payload"
    conn.rollback()
    assert count(db_url) == 0


def test_text_that_merely_spells_an_escaped_nul_is_kept(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    spelled = {"regex": "\\u0000", "two": "\\\\u0000", "key \\u0000": "ok"}
    outbox.enqueue(conn, **charge(payload=spelled))
    conn.commit()
    assert rows(db_url, "SELECT payload FROM outbox.operations") == [(spelled,)]


@pytest.mark.parametrize("field", ["tenant_id", "operation_key", "provider", "correlation_id"])
def test_python_refuses_nul_characters_in_text_fields(
    conn: psycopg.Connection[Any], db_url: str, field: str
) -> None:
    with pytest.raises(InvalidOperation, match=f"{field} must not contain NUL") as caught:
        outbox.enqueue(conn, **charge(**{field: "a\x00b"}))
    assert caught.value.field == field
    assert count(db_url) == 0


def test_the_payload_limit_is_the_schema_owners_and_no_session_can_lift_it(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    # Before 0019 the limit was this setting, and any producer's session could lift it.
    conn.execute("SET outbox.max_payload_bytes = 300000000")
    with pytest.raises(InvalidOperation, match="at most 1048576 are allowed"):
        outbox.enqueue(conn, **charge(payload={"blob": "x" * 2_000_000}))
    conn.rollback()
    with psycopg.connect(db_url) as owner:
        owner.execute("UPDATE outbox.limits SET max_payload_bytes = 5000")
    outbox.enqueue(conn, **charge(payload={"note": "x" * 4900}))
    with pytest.raises(
        InvalidOperation, match=r"payload is 50[0-9]{2} bytes of JSON; at most 5000"
    ):
        outbox.enqueue(conn, **charge(operation_key="big", payload={"note": "x" * 5000}))
    conn.rollback()
    assert count(db_url) == 0
    with psycopg.connect(db_url) as owner, pytest.raises(psycopg.errors.CheckViolation):
        owner.execute("UPDATE outbox.limits SET max_payload_bytes = 100")  # below 4 KiB


def test_the_default_payload_limit_refuses_ten_megabytes(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    with pytest.raises(InvalidOperation, match="at most 1048576 are allowed"):
        outbox.enqueue(conn, **charge(payload={"blob": "x" * 10_000_000}))
    conn.rollback()
    assert count(db_url) == 0


def test_sql_metacharacters_are_data(conn: psycopg.Connection[Any], db_url: str) -> None:
    nasty = "'; DROP TABLE outbox.operations; --"
    outbox.enqueue(
        conn,
        **charge(
            tenant_id=nasty, operation_key=nasty, correlation_id=nasty, payload={nasty: nasty}
        ),
    )
    conn.commit()
    op = outbox.get_operation(conn, nasty, "invoice.charge", nasty)
    assert op is not None and op.correlation_id == nasty
    assert count(db_url) == 1


def test_max_attempts_below_one_is_refused(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(InvalidOperation, match="max_attempts must be at least 1, not 0"):
        outbox.enqueue(conn, **charge(max_attempts=0))


def test_the_largest_accepted_numbers_and_depth_arrive_stored_exactly(
    conn: psycopg.Connection[Any],
) -> None:
    exact = '{"big": -9.99e99, "cents": 19.999999999999999999, "deep": ' + nested_payload(63) + "}"
    conn.execute(
        "SELECT * FROM outbox.enqueue(tenant_id => 'a', operation_type => 't', "
        "operation_key => 'k', provider => 'p', action => 'x', payload => %s::jsonb)",
        (exact,),
    )
    ((text,),) = conn.execute("SELECT payload::text FROM outbox.operations").fetchall()
    decoded = payloads.decode(text)  # what the dispatcher will carry
    assert decoded["cents"] == Decimal("19.999999999999999999")
    assert decoded["big"] == Decimal("-9.99e99")


@pytest.mark.parametrize(
    ("available_at", "message"),
    [
        ("infinity", "not infinity"),
        ("-infinity", "not -infinity"),
        ("12000-01-01 00:00:00+00", "at most 10 years ahead"),
        ("now() + interval '10 years 1 day'", "at most 10 years ahead"),
    ],
)
def test_sql_refuses_an_available_at_that_is_no_schedule(
    conn: psycopg.Connection[Any], db_url: str, available_at: str, message: str
) -> None:
    value = available_at if available_at.startswith("now()") else f"'{available_at}'"
    with pytest.raises(psycopg.Error, match=message) as caught:
        conn.execute(
            "SELECT * FROM outbox.enqueue(tenant_id => 'a', operation_type => 't', "  # noqa: S608
            "operation_key => 'k', provider => 'p', action => 'x', payload => '{}', "
            f"available_at => ({value})::timestamptz)"
        )
    assert (caught.value.sqlstate, caught.value.diag.column_name) == ("OB002", "available_at")
    conn.rollback()
    assert count(db_url) == 0


def test_a_past_available_at_means_now_and_a_future_one_is_scheduled(
    conn: psycopg.Connection[Any],
) -> None:
    """A producer can neither page the on-call engineer through the oldest-pending gauge with a
    time in 1970 nor jump its own group's line with it."""
    outbox.enqueue(conn, **charge(available_at=datetime(1970, 1, 1, tzinfo=UTC)))
    later = datetime.now(UTC) + timedelta(days=1)
    outbox.enqueue(conn, **charge(operation_key="later", available_at=later))
    got = conn.execute(
        "SELECT operation_key, available_at = now(), scheduled FROM outbox.operations ORDER BY id"
    ).fetchall()
    assert got == [("invoice-42-charge", True, False), ("later", False, True)]
    op = outbox.get_operation(conn, "acme", "invoice.charge", "later")
    assert op is not None and abs(op.available_at - later) < timedelta(seconds=1)


def test_max_attempts_above_the_cap_is_refused(conn: psycopg.Connection[Any]) -> None:
    outbox.enqueue(conn, **charge(max_attempts=1000))
    for value in (1001, 2_147_483_647):
        with pytest.raises(
            InvalidOperation, match=f"max_attempts may be at most 1000, not {value}"
        ):
            outbox.enqueue(conn, **charge(operation_key=f"k{value}", max_attempts=value))
        conn.rollback()


# JSON values as hypothesis builds them: numbers of every size and precision (text, as PostgreSQL
# reads them), strings, nesting to either side of the limit.
_NUMBER = st.one_of(
    st.integers(min_value=-(10**120), max_value=10**120).map(str),
    st.decimals(allow_nan=False, allow_infinity=False, places=None).map(str),
    st.builds(lambda m, e: f"{m}e{e}", st.integers(-999, 999), st.integers(-150, 150)),
)
_SCALAR = st.one_of(_NUMBER, st.sampled_from(["true", "false", "null", '"x"', '"19.99"']))


def _json_tree(leaves: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.recursive(
        leaves,
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(lambda items: "[" + ",".join(items) + "]"),
            st.dictionaries(st.sampled_from("abcde"), inner, max_size=3).map(
                lambda d: "{" + ",".join(f'"{k}":{v}' for k, v in d.items()) + "}"
            ),
        ),
        max_leaves=12,
    )


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=_json_tree(_SCALAR), depth=st.integers(1, 70))
def test_enqueue_accepts_exactly_what_the_dispatcher_can_carry(
    conn: psycopg.Connection[Any], body: str, depth: int
) -> None:
    """The door (SQL) and the dispatcher's decoder (Python) agree on every payload: what one
    accepts the other does, and what is accepted decodes to the stored numbers exactly."""
    payload = '{"v":' + "[" * (depth - 1) + body + "]" * (depth - 1) + "}"
    try:
        ((text,),) = conn.execute("SELECT %s::jsonb::text", (payload,)).fetchall()
    except psycopg.errors.NumericValueOutOfRange:
        conn.rollback()
        return  # not even PostgreSQL can hold it
    try:
        decoded: dict[str, Any] | None = payloads.decode(text)
    except payloads.InvalidPayload:
        decoded = None
    conn.execute("SAVEPOINT attempt")
    refused: psycopg.Error | None = None
    try:
        conn.execute(
            "SELECT * FROM outbox.enqueue(tenant_id => 'a', operation_type => 't', "
            "operation_key => 'k', provider => 'p', action => 'x', payload => %s::jsonb)",
            (text,),
        )
    except psycopg.Error as exc:
        refused = exc
    conn.execute("ROLLBACK TO SAVEPOINT attempt")
    if refused is not None:
        assert (refused.sqlstate, refused.diag.column_name) == ("OB002", "payload"), refused
    assert (refused is None) == (decoded is not None), (text[:300], refused)
    if decoded is not None:
        # Exact: PostgreSQL reads the decoded numbers back as the very same jsonb.
        same = conn.execute("SELECT %s::jsonb = %s::jsonb", (payloads.encode(decoded), text))
        assert same.fetchone() == (True,)


def test_an_emptied_limits_table_falls_back_to_the_default_limit(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    with psycopg.connect(db_url) as owner:
        owner.execute("DELETE FROM outbox.limits")
    with pytest.raises(InvalidOperation, match="at most 1048576 are allowed"):
        outbox.enqueue(conn, **charge(payload={"blob": "x" * 2_000_000}))


def test_python_refuses_a_payload_nested_past_its_recursion_limit(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    deep: dict[str, Any] = {}
    inner = deep
    for _ in range(5000):
        inner["a"] = inner = {}
    with pytest.raises(InvalidOperation, match="nests too deep") as caught:
        outbox.enqueue(conn, **charge(payload=deep))
    assert caught.value.field == "payload"
    conn.rollback()
    assert count(db_url) == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"note": "\ud800"}, "lone surrogate"),
        ({"\udc00key": 1}, "lone surrogate"),
        ({"n": [{"deep": "a\udbff b"}]}, "lone surrogate"),
        ({"note": "\ud800", "amount": Decimal("1.5")}, "lone surrogate"),  # the exact encoder
        ({"amount": Decimal("1E+200000")}, "a number of 1e100 or more"),
        ({"amount": Decimal("-1E+100")}, "a number of 1e100 or more"),
        ({"amount": Decimal("1E-20000")}, "more than 16383 digits after the decimal point"),
        ({"amount": Decimal("0E-16384")}, "more than 16383 digits after the decimal point"),
    ],
    ids=[
        "surrogate",
        "surrogate-key",
        "surrogate-nested",
        "surrogate-exact",
        "huge",
        "minus",
        "tiny",
        "zero-scale",
    ],
)
def test_python_refuses_what_postgresql_would_refuse_as_a_raw_error_before_sending_it(
    conn: psycopg.Connection[Any], db_url: str, payload: Any, message: str
) -> None:
    """Out-of-range Decimals and lone surrogates once reached the server, and came back as the
    driver's own errors; the surrogate's quoted a fragment of the payload into the server's log
    (issue 38). Refused in Python, naming the payload and quoting none of it; nothing is sent,
    so the caller's transaction goes on."""
    with pytest.raises(InvalidOperation, match=message) as caught:
        outbox.enqueue(conn, **charge(payload=payload))
    assert caught.value.field == "payload"
    assert "deep" not in str(caught.value) and "note" not in str(caught.value)
    assert conn.info.transaction_status is not psycopg.pq.TransactionStatus.INERROR
    outbox.enqueue(conn, **charge())  # the transaction was never touched
    conn.commit()
    assert count(db_url) == 1


def test_the_most_postgresql_holds_is_accepted_from_python(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    exact = {
        "small": Decimal("1E-16383"),
        "large": Decimal("9.99E+99"),
        "zero": Decimal("0E+200000"),
        "emoji": "\U0001f600",
        "spelled": "\\ud800",
    }
    outbox.enqueue(conn, **charge(payload=exact))
    conn.commit()
    ((stored,),) = rows(db_url, "SELECT payload::text FROM outbox.operations")
    assert "\U0001f600" in stored and '"\\\\ud800"' in stored


# --- the number of values (issue 38; sql/0037) ---------------------------------------------------


def values(n: int) -> dict[str, Any]:
    """A payload of exactly ``n`` JSON values, as dense as JSON gets: itself, a list, and n - 2
    empty lists in it (the decoder's costliest value, about 3 bytes of text each)."""
    return {"a": [[] for _ in range(n - 2)]}


def test_a_payload_of_more_values_than_the_limit_is_refused_naming_both(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    """Dense with brackets, a payload far under max_payload_bytes cost the dispatcher 0.2 s of
    its event loop and 19 MB to decode; the count is bounded at the door, as the depth is."""
    outbox.enqueue(conn, **charge(operation_key="at-the-limit", payload=values(100_000)))
    with pytest.raises(
        InvalidOperation,
        match=r"^payload holds 100001 JSON values \(objects, arrays, strings, numbers, booleans "
        r"and nulls, itself included\); at most 100000 are allowed$",
    ) as caught:
        outbox.enqueue(conn, **charge(operation_key="past-it", payload=values(100_001)))
    assert caught.value.field == "payload"
    conn.rollback()
    args = charge(payload=json.dumps(values(260_000)))  # about 1 MiB of [] as jsonb writes it
    names = ", ".join(f"{name} => %({name})s" for name in args)
    with pytest.raises(psycopg.Error, match="payload holds 260000 JSON values") as refused:
        conn.execute(f"SELECT * FROM outbox.enqueue({names})", args)  # noqa: S608 (fixed names)
    assert (refused.value.sqlstate, refused.value.diag.column_name) == ("OB002", "payload")
    assert "max_payload_elements" in (refused.value.diag.message_hint or "")
    conn.rollback()
    assert count(db_url) == 0


async def test_the_async_enqueue_refuses_it_too(aconn: psycopg.AsyncConnection[Any]) -> None:
    with pytest.raises(InvalidOperation, match="payload holds 100001 JSON values") as caught:
        await outbox.enqueue_async(aconn, **charge(payload=values(100_001)))
    assert caught.value.field == "payload"


@pytest.mark.parametrize(
    "payload",
    [
        # A megabyte of data: records of four short fields, about 70,000 values.
        {
            "records": [
                {"id": 10_000 + n, "amount": 1999, "currency": "usd", "note": "a, b"}
                for n in range(13_000)
            ]
        },
        # Strings full of commas and brackets: they look dense and are counted, and pass.
        {"text": ["[{,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,,]}"] * 9_000},
        # 99,999 numbers of six digits: values of their own, one under the limit with the rest.
        {"ids": list(range(100_000, 199_998))},
    ],
    ids=["records", "punctuation-in-strings", "ids"],
)
def test_payloads_of_data_under_a_megabyte_are_accepted(
    conn: psycopg.Connection[Any], payload: dict[str, Any]
) -> None:
    assert len(json.dumps(payload)) < 1_048_576
    assert outbox.enqueue(conn, **charge(payload=payload)).outcome is outbox.EnqueueOutcome.ACCEPTED


def test_the_values_limit_is_the_schema_owners_and_no_session_can_lift_it(
    conn: psycopg.Connection[Any], db_url: str
) -> None:
    with psycopg.connect(db_url) as owner:
        owner.execute("UPDATE outbox.limits SET max_payload_elements = 10000")
    outbox.enqueue(conn, **charge(payload=values(10_000)))
    with pytest.raises(
        InvalidOperation, match=r"payload holds 10001 JSON values \(.*\); at most 10000 are"
    ):
        outbox.enqueue(conn, **charge(operation_key="more", payload=values(10_001)))
    conn.rollback()
    with psycopg.connect(db_url) as owner:
        owner.execute("UPDATE outbox.limits SET max_payload_elements = 200000")
    outbox.enqueue(conn, **charge(payload=values(150_000)))
    conn.rollback()
    for bound in (9_999, 50_000_001):
        with psycopg.connect(db_url) as owner, pytest.raises(psycopg.errors.CheckViolation):
            owner.execute("UPDATE outbox.limits SET max_payload_elements = %s", (bound,))
    with psycopg.connect(db_url) as owner:
        owner.execute("DELETE FROM outbox.limits")  # the row gone: the defaults
    with pytest.raises(InvalidOperation, match="at most 100000 are allowed"):
        outbox.enqueue(conn, **charge(payload=values(100_001)))

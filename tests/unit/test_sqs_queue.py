"""The sqs provider's parts that need no server: the reading of its configuration, the message it
builds (attributes, group, key, size, characters), and the reading of SQS's answers and
botocore's exceptions into outbox's classes, with the error shapes botocore gives for SQS's
AWS JSON protocol (both the Query code and the shape name)."""

from __future__ import annotations

import hashlib
import re
import types
from datetime import timedelta
from typing import Any

import aiohttp
import pytest
from botocore import exceptions as boto

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.durations import parse_duration
from outbox.core.model import FailureClass
from outbox.providers import queue_kit
from outbox.providers.base import InvalidRequest, SendRequest, Succeeded
from outbox.providers.registry import build_providers
from outbox.providers.sqs.answers import answer, client_error, transport_error
from outbox.providers.sqs.provider import SqsProvider, build

FIFO = "https://sqs.eu-west-1.amazonaws.com/123456789012/orders.fifo"
STANDARD = "https://sqs.eu-west-1.amazonaws.com/123456789012/events"
DERIVED = "ob1_" + "ab" * 32
# What SQS takes as a message attribute's name (the Developer Guide, "Message attributes").
ATTRIBUTE_NAME = re.compile(r"(?!(?i:aws\.|amazon\.))(?!\.)(?!.*\.\.)[A-Za-z0-9_.-]{1,256}(?<!\.)")


def settings(
    actions: dict[str, Any] | None = None, *, key_retention: str = "5m", **options: Any
) -> ProviderSettings:
    table: dict[str, Any] = {
        "region": "eu-west-1",
        "actions": {"*": {"queue_url": FIFO, "message_group": "{tenant_id}"}}
        if actions is None
        else actions,
    }
    return ProviderSettings(
        name="sqs",
        type="sqs",
        key_retention=parse_duration(key_retention),
        options={**table, **options},
    )


def provider(actions: dict[str, Any] | None = None, **options: Any) -> SqsProvider:
    return build(settings(actions, **options), {}, concurrency=8)


def request(**fields: Any) -> SendRequest:
    base: dict[str, Any] = {
        "operation_id": 7,
        "tenant_id": "acme",
        "operation_type": "invoice.charge",
        "operation_key": "inv-1",
        "action": "invoice.paid",
        "payload": {"n": 1},
        "idempotency_key": DERIVED,
        "correlation_id": "corr-1",
        "attempt": 1,
        "payload_json": '{"n": 1}',
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    return SendRequest(**{**base, **fields})


# --- configuration ----------------------------------------------------------------------------


def test_a_fifo_provider_builds_through_the_registry() -> None:
    built = build_providers({"sqs": settings()})["sqs"]
    assert isinstance(built, SqsProvider)
    assert built.key_retention == timedelta(minutes=5)
    assert built.retries_unknown("x")


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"region": None}, "region"),
        ({"region": "Europe"}, "region"),
        ({"endpoint_url": "http://sqs.internal.example:9324"}, "endpoint_url"),
        ({"endpoint_url": "https://user:pw@sqs.example.com"}, "endpoint_url"),
        ({"endpoint_url": "ftp://example.com"}, "endpoint_url"),
        ({"key_form": "uuid"}, "key_form"),
        ({"max_message_bytes": 10}, "max_message_bytes"),
        ({"max_message_bytes": 2 << 20}, "max_message_bytes"),
        ({"aws_secret_access_key": "x"}, "aws_secret_access_key"),
        ({"actions": {}}, "actions"),
    ],
)
def test_each_mistake_is_named(change: dict[str, Any], key: str) -> None:
    options = {k: v for k, v in change.items() if v is not None}
    ps = settings(**options)
    if "region" in change and change["region"] is None:
        ps = ProviderSettings(
            name="sqs",
            type="sqs",
            key_retention=timedelta(minutes=5),
            options={"actions": {"*": {"queue_url": STANDARD}}},
        )
    with pytest.raises(ConfigError) as caught:
        build(ps, {}, concurrency=8)
    assert key in str(caught.value)


@pytest.mark.parametrize(
    ("action", "words"),
    [
        ({}, "queue_url is required"),
        ({"queue_url": FIFO}, "message_group is required"),
        ({"queue_url": STANDARD, "message_group": "g"}, "applies only to a FIFO"),
        ({"queue_url": FIFO, "message_group": "g", "delay_seconds": 5}, "no delay per message"),
        ({"queue_url": STANDARD, "delay_seconds": 901}, "0 to 900"),
        ({"queue_url": STANDARD, "delay_seconds": True}, "0 to 900"),
        ({"queue_url": FIFO, "message_group": "{customer}"}, "is no placeholder"),
        ({"queue_url": FIFO, "message_group": "caf\u00e9"}, "visible ASCII"),
        ({"queue_url": FIFO, "message_group": "x" * 129}, "visible ASCII"),
        ({"queue_url": "https://sqs.eu-west-1.amazonaws.com/orders"}, "queue URL"),
        ({"queue_url": "http://sqs.eu-west-1.amazonaws.com/1/q"}, "clear text"),
        ({"queue_url": "https://sqs.us-east-1.amazonaws.com/1/q"}, "another region"),
        ({"queue_url": STANDARD, "retry": 1}, "is not known"),
    ],
)
def test_each_action_mistake_is_named(action: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        provider({"pay": action})


def test_a_fifo_queue_refuses_a_retention_past_its_five_minutes() -> None:
    with pytest.raises(ConfigError, match="deduplication interval") as caught:
        build(settings(key_retention="24h"), {}, concurrency=8)
    assert caught.value.key == "providers.sqs.key_retention"
    # A standard queue keeps no key: its consumers remember ids as long as the user says.
    build(settings({"*": {"queue_url": STANDARD}}, key_retention="24h"), {}, concurrency=8)


def test_loopback_and_allow_insecure_take_http() -> None:
    local = "http://127.0.0.1:5000/123456789012/q"
    provider({"*": {"queue_url": local}}, endpoint_url="http://127.0.0.1:5000")
    remote = "http://sqs.lan:9324/123456789012/q"
    with pytest.raises(ConfigError, match="clear text"):
        provider({"*": {"queue_url": remote}}, endpoint_url="http://sqs.lan:9324")
    provider({"*": {"queue_url": remote}}, endpoint_url="http://sqs.lan:9324", allow_insecure=True)


# --- the message ------------------------------------------------------------------------------


def params(p: SqsProvider, req: SendRequest) -> dict[str, Any]:
    target = p._target(req.action)
    built, body = p._message(target, req)
    assert body == req.payload_json
    return built


def test_a_fifo_message_carries_the_key_group_and_identity() -> None:
    p = provider()
    sent = params(p, request())
    wire = hashlib.sha256(DERIVED.encode()).hexdigest()
    assert sent["MessageDeduplicationId"] == wire
    assert sent["MessageGroupId"] == "acme"
    assert "DelaySeconds" not in sent
    attributes = sent["MessageAttributes"]
    assert attributes[queue_kit.OPERATION_ID] == {"DataType": "String", "StringValue": "7"}
    assert attributes[queue_kit.IDEMPOTENCY_KEY]["StringValue"] == wire
    assert attributes[queue_kit.TRACEPARENT]["StringValue"].startswith("00-0af7")
    assert len(attributes) <= 10
    assert all(ATTRIBUTE_NAME.fullmatch(name) for name in attributes)


def test_a_standard_message_has_no_key_field_but_the_delay() -> None:
    p = provider({"*": {"queue_url": STANDARD, "delay_seconds": 30}}, key_form="stored")
    sent = params(p, request(correlation_id=None, traceparent=None))
    assert "MessageDeduplicationId" not in sent
    assert "MessageGroupId" not in sent
    assert sent["DelaySeconds"] == 30
    assert sent["MessageAttributes"][queue_kit.IDEMPOTENCY_KEY]["StringValue"] == DERIVED
    assert queue_kit.CORRELATION_ID not in sent["MessageAttributes"]


def test_hostile_identities_travel_percent_encoded() -> None:
    p = provider({"*": {"queue_url": FIFO, "message_group": "t-{tenant_id}-{/customer}"}})
    req = request(
        tenant_id="caf\u00e9\r\nX-Evil: 1",
        correlation_id="\u2603\x00",
        payload={"customer": "c 1"},
    )
    sent = params(p, req)
    group = sent["MessageGroupId"]
    assert group == "t-caf%C3%A9%0D%0AX-Evil:%201-c%201"
    for value in sent["MessageAttributes"].values():
        assert re.fullmatch(r"[!-~]+", value["StringValue"])


def test_a_group_too_long_travels_hashed_and_stays_the_same() -> None:
    p = provider({"*": {"queue_url": FIFO, "message_group": "{operation_key}"}})
    first = params(p, request(operation_key="k" * 200))["MessageGroupId"]
    again = params(p, request(operation_key="k" * 200, attempt=2))["MessageGroupId"]
    assert first == again == hashlib.sha256(b"k" * 200).hexdigest()


def test_check_refuses_what_can_never_be_sent() -> None:
    p = provider({"pay": {"queue_url": FIFO, "message_group": "{/customer}"}})
    with pytest.raises(InvalidRequest, match="no action"):
        p.check("refund", {"customer": "c"})
    with pytest.raises(InvalidRequest, match="/customer"):
        p.check("pay", {"n": 1})
    with pytest.raises(InvalidRequest, match="U\\+FFFF"):
        p.check("pay", {"customer": "c", "text": "\uffff"})
    with pytest.raises(InvalidRequest, match="at most 2,048"):
        provider(max_message_bytes=2048).check("pay", {"blob": "x" * 3000})
    p.check("pay", {"customer": "c", "text": "caf\u00e9 \U0001f600 \x00"})  # NUL travels escaped


def test_the_exact_size_counts_the_attributes() -> None:
    p = provider(max_message_bytes=1024)
    body = '{"x": "' + "y" * 900 + '"}'
    p.check("any", {"x": "y" * 900})  # the body alone fits
    with pytest.raises(InvalidRequest, match="with its attributes"):
        params(p, request(payload_json=body))


def test_check_key_refuses_a_stored_key_fifo_cannot_take() -> None:
    long_key = "k" * 200
    provider().check_key("pay", long_key)  # sha256: every key fits
    stored = provider(key_form="stored")
    stored.check_key("pay", DERIVED)
    with pytest.raises(InvalidRequest, match="MessageDeduplicationId"):
        stored.check_key("pay", long_key)
    provider({"*": {"queue_url": STANDARD}}, key_form="stored").check_key("pay", long_key)


async def test_an_unbuildable_message_is_not_sent() -> None:
    p = provider()
    result = await p.send(request(payload_json='{"t": "\ufffe"}'))
    assert not isinstance(result, Succeeded)
    assert result.failure is FailureClass.PERMANENT
    assert result.not_sent
    assert "U+FFFE" in result.message
    bad_key = await p.send(request(idempotency_key="with space"))
    assert not isinstance(bad_key, Succeeded)
    assert bad_key.not_sent
    await p.aclose()


# --- answers ----------------------------------------------------------------------------------


def error(code: str, status: int = 400, query: str | None = None, **headers: str) -> Any:
    shape: dict[str, Any] = {"Code": code, "Message": "the body said {secret}", "Type": "Sender"}
    if query:
        shape["QueryErrorCode"] = query
    meta = {"HTTPStatusCode": status, "RequestId": "req-1", "HTTPHeaders": headers}
    return client_error(boto.ClientError({"Error": shape, "ResponseMetadata": meta}, "SendMessage"))


@pytest.mark.parametrize(
    ("code", "query", "status"),
    [
        ("RequestThrottled", None, 403),
        ("ThrottlingException", None, 400),
        ("OverLimit", None, 403),
        ("KmsThrottled", None, 400),
        ("SomethingNew", None, 429),
    ],
)
def test_throttling_waits_without_spending(code: str, query: str | None, status: int) -> None:
    failed = error(code, status, query)
    assert failed.failure is FailureClass.TRANSIENT
    assert not failed.spends_attempt
    assert failed.retry_after == timedelta(seconds=1)
    assert failed.error_class == "throttled"


def test_a_throttle_honours_retry_after() -> None:
    assert error("RequestThrottled", 403, **{"retry-after": "7"}).retry_after == timedelta(
        seconds=7
    )


@pytest.mark.parametrize(
    ("code", "query"),
    [
        ("AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"),
        ("QueueDoesNotExist", None),
    ],
)
def test_a_missing_queue_is_unroutable(code: str, query: str | None) -> None:
    failed = error(code, 400, query)
    assert failed.failure is FailureClass.PERMANENT
    assert failed.reason == "unroutable"
    assert "secret" not in failed.message


@pytest.mark.parametrize(
    "code", ["InvalidClientTokenId", "SignatureDoesNotMatch", "UnrecognizedClientException"]
)
def test_refused_credentials_pause_the_provider(code: str) -> None:
    failed = error(code, 403)
    assert failed.failure is FailureClass.TRANSIENT
    assert failed.pause


@pytest.mark.parametrize("code", ["AccessDenied", "KmsAccessDenied", "KmsDisabled"])
def test_a_queue_that_refuses_us_pauses_its_action(code: str) -> None:
    failed = error(code, 403)
    assert failed.pause_action
    assert not failed.pause


@pytest.mark.parametrize(
    ("code", "query"),
    [
        ("InvalidParameterValue", None),
        ("InvalidMessageContents", None),
        ("MissingParameter", "MissingRequiredParameterException"),
        ("SomethingElse", None),
    ],
)
def test_a_refused_message_is_permanent(code: str, query: str | None) -> None:
    failed = error(code, 400, query)
    assert failed.failure is FailureClass.PERMANENT
    assert failed.reason is None


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_5xx_may_have_stored_it(status: int) -> None:
    assert error("InternalError", status).failure is FailureClass.UNKNOWN


def connector_error() -> aiohttp.ClientConnectorError:
    key = types.SimpleNamespace(host="127.0.0.1", port=1, ssl=False)
    return aiohttp.ClientConnectorError(key, ConnectionRefusedError(111, "refused"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("exc", "failure", "error_class"),
    [
        (
            boto.EndpointConnectionError(endpoint_url="u", error=connector_error()),
            FailureClass.TRANSIENT,
            "connect_refused",
        ),
        (
            boto.EndpointConnectionError(endpoint_url="u", error=OSError("no route")),
            FailureClass.TRANSIENT,
            "connect_refused",
        ),
        (
            boto.EndpointConnectionError(
                endpoint_url="u", error=aiohttp.ClientOSError(104, "Connection reset by peer")
            ),
            FailureClass.UNKNOWN,
            "connection_lost",
        ),
        (
            boto.ConnectionClosedError(endpoint_url="u", error=None, request=None),
            FailureClass.UNKNOWN,
            "connection_lost",
        ),
        (boto.ConnectTimeoutError(endpoint_url="u", error=None), FailureClass.TRANSIENT, None),
        (boto.ReadTimeoutError(endpoint_url="u", error=None), FailureClass.UNKNOWN, "timeout"),
        (TimeoutError(), FailureClass.UNKNOWN, "timeout"),
        (boto.NoCredentialsError(), FailureClass.TRANSIENT, "no_credentials"),
        (RuntimeError("?"), FailureClass.UNKNOWN, "RuntimeError"),
    ],
)
def test_transport_errors(exc: Exception, failure: FailureClass, error_class: str | None) -> None:
    failed = transport_error(exc)
    assert failed.failure is failure
    if error_class is not None:
        assert failed.error_class == error_class


def test_no_credentials_pause() -> None:
    assert transport_error(boto.NoCredentialsError()).pause


def test_the_answer_gives_the_message_id_and_sequence() -> None:
    body = '{"n": 1}'
    md5 = hashlib.md5(body.encode()).hexdigest()  # noqa: S324 (SQS's checksum)
    meta = {"ResponseMetadata": {"RequestId": "r"}}
    got = answer({"MessageId": "m-1", "SequenceNumber": "18", "MD5OfMessageBody": md5, **meta},
                 body, fifo=True)  # fmt: skip
    assert isinstance(got, Succeeded)
    assert got.reference == "m-1"
    assert got.result == {"message_id": "m-1", "sequence_number": "18"}
    lying = answer({"MessageId": "m-2", "MD5OfMessageBody": "0" * 32}, body, fifo=True)
    assert not isinstance(lying, Succeeded)
    assert lying.failure is FailureClass.UNKNOWN
    assert lying.reconcile
    empty = answer({}, body, fifo=False)
    assert not isinstance(empty, Succeeded)
    assert empty.error_class == "unreadable_success"

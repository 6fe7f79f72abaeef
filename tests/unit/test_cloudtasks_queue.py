"""`type = "cloudtasks"` without a server: its configuration read and refused key by key, the task
each operation becomes, and every gRPC answer of CreateTask classified."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import pytest
from google.protobuf import duration_pb2  # type: ignore[import-untyped]
from google.rpc import error_details_pb2  # type: ignore[import-untyped]

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.base import Failed, InvalidRequest, SendRequest
from outbox.providers.cloudtasks.answers import DEFAULT_THROTTLE, MESSAGE_CHARS, failure
from outbox.providers.cloudtasks.client import gexc, tasks_v2
from outbox.providers.cloudtasks.config import TASK_ID, TASK_NAME_WINDOW, options
from outbox.providers.cloudtasks.provider import CloudTasksProvider, build
from outbox.providers.registry import build_providers

QUEUE = "projects/acme-prod/locations/europe-west1/queues/orders"


def settings(**overrides: Any) -> ProviderSettings:
    table: dict[str, Any] = {
        "project": "acme-prod",
        "location": "europe-west1",
        "actions": {"*": {"queue": "orders", "url": "https://worker.example.com/tasks"}},
    }
    retention = overrides.pop("key_retention", timedelta(hours=1))
    table.update(overrides)
    return ProviderSettings(name="tasks", type="cloudtasks", key_retention=retention, options=table)


def request(**fields: Any) -> SendRequest:
    base: dict[str, Any] = {
        "operation_id": 12,
        "tenant_id": "acme",
        "operation_type": "invoice.charge",
        "operation_key": "inv-1",
        "action": "invoice.paid",
        "payload": {"amount": 1000},
        "idempotency_key": "ob1_" + "a" * 64,
        "correlation_id": "corr-1",
        "attempt": 2,
        "payload_json": '{"amount": 1000}',
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    }
    return SendRequest(**{**base, **fields})


# --- configuration ------------------------------------------------------------------------------


def test_a_minimal_configuration_reads() -> None:
    opts = options(settings())
    target = opts.targets["*"]
    assert (opts.project, opts.location, opts.endpoint, opts.emulator) == (
        "acme-prod",
        "europe-west1",
        None,
        False,
    )
    assert (target.queue, target.method, target.headers) == (QUEUE, "POST", None)
    assert not opts.retry_unroutable


def test_the_registry_builds_it() -> None:
    provider = build_providers({"tasks": settings()})["tasks"]
    assert isinstance(provider, CloudTasksProvider)
    assert provider.key_retention == timedelta(hours=1)


def test_a_loopback_endpoint_is_an_emulator_and_another_host_the_real_api() -> None:
    assert options(settings(endpoint="127.0.0.1:8123")).emulator
    assert options(settings(endpoint="[::1]:8123")).emulator
    real = options(settings(endpoint="europe-west1-cloudtasks.googleapis.com:443"))
    assert not real.emulator


@pytest.mark.parametrize(
    ("overrides", "key", "words"),
    [
        ({"key_retention": timedelta(hours=2)}, "providers.tasks.key_retention", "task-name"),
        ({"key_retention": timedelta(hours=24)}, "providers.tasks.key_retention", "at most 1h"),
        ({"project": None}, "providers.tasks.project", "required"),
        ({"project": "acme prod"}, "providers.tasks.project", "must match"),
        ({"location": "Europe/West"}, "providers.tasks.location", "must match"),
        ({"endpoint": "http://127.0.0.1:8123"}, "providers.tasks.endpoint", "host:port"),
        ({"endpoint": "127.0.0.1"}, "providers.tasks.endpoint", "host:port"),
        ({"unroutable": "drop"}, "providers.tasks.unroutable", "quarantine"),
        ({"actions": {}}, "providers.tasks.actions", "at least one action"),
        ({"credentials": "{...}"}, None, "credentials"),
    ],
)
def test_each_mistake_names_its_key(overrides: dict[str, Any], key: str | None, words: str) -> None:
    table = {k: v for k, v in overrides.items() if v is not None}
    ps = settings(**table)
    if "project" in overrides and overrides["project"] is None:
        ps = ProviderSettings(
            name="tasks",
            type="cloudtasks",
            key_retention=timedelta(hours=1),
            options={k: v for k, v in ps.options.items() if k != "project"},
        )
    with pytest.raises(ConfigError, match=words) as caught:
        options(ps)
    if key is not None:
        assert caught.value.key == key


@pytest.mark.parametrize(
    ("action", "key", "words"),
    [
        ({"url": "https://w.example.com/"}, "queue", "required"),
        ({"queue": "orders"}, "url", "required"),
        ({"queue": "or_ders", "url": "https://w.example.com/"}, "queue", "must match"),
        ({"queue": "orders", "url": "http://w.example.com/"}, "url", "https://"),
        ({"queue": "orders", "url": "https://u:p@w.example.com/"}, "url", "credentials"),
        ({"queue": "orders", "url": "ftp://w.example.com/"}, "url", "http:// or https://"),
        ({"queue": "orders", "url": "https://w.example.com/", "method": "GET"}, "method", "POST"),
        (
            {"queue": "orders", "url": "https://w.example.com/", "oidc_service_account": "x"},
            "oidc_service_account",
            "must match",
        ),
        (
            {"queue": "orders", "url": "https://w.example.com/", "oidc_audience": "a"},
            "oidc_audience",
            "needs oidc_service_account",
        ),
        (
            {"queue": "orders", "url": "https://w.example.com/", "headers": {"X-Api-Key": "s"}},
            "headers.X-Api-Key",
            "secret",
        ),
        (
            {"queue": "orders", "url": "https://w.example.com/", "headers": {"Authorization": "s"}},
            "headers.Authorization",
            "secret",
        ),
        (
            {
                "queue": "orders",
                "url": "https://w.example.com/",
                "headers": {"Outbox-Operation-Id": "1"},
            },
            "headers.Outbox-Operation-Id",
            "itself",
        ),
        (
            {"queue": "orders", "url": "https://w.example.com/", "headers": {"X-A": "a\r\nB: c"}},
            "headers.X-A",
            "line break",
        ),
        ({"queue": "orders", "url": "https://w.example.com/", "delay": "1s"}, None, "not known"),
    ],
)
def test_each_action_mistake_names_its_key(
    action: dict[str, Any], key: str | None, words: str
) -> None:
    with pytest.raises(ConfigError, match=words) as caught:
        options(settings(actions={"invoice.paid": action}))
    if key is not None:
        assert caught.value.key == f'providers.tasks.actions."invoice.paid".{key}'


def test_http_is_allowed_to_loopback_only() -> None:
    table = {"queue": "orders", "url": "http://127.0.0.1:8080/t", "method": "put"}
    target = options(settings(actions={"*": table})).targets["*"]
    assert (target.url, target.method) == ("http://127.0.0.1:8080/t", "PUT")


def test_the_window_is_an_hour() -> None:
    assert timedelta(hours=1) == TASK_NAME_WINDOW
    options(settings(key_retention=timedelta(hours=1)))  # at the window: accepted


# --- the task ------------------------------------------------------------------------------------


def test_the_task_carries_the_payload_as_stored_and_the_identity_as_headers() -> None:
    provider = build(
        settings(
            actions={
                "*": {
                    "queue": "orders",
                    "url": "https://worker.example.com/tasks",
                    "headers": {"X-Source": "outbox"},
                    "oidc_service_account": "enqueuer@acme-prod.iam.gserviceaccount.com",
                    "oidc_audience": "https://worker.example.com",
                }
            }
        )
    )
    stored = "ob1_" + "a" * 64
    task = provider.task(request(payload_json='{"amount": 1000.10}'), provider.options.targets["*"])
    digest = hashlib.sha256(stored.encode()).hexdigest()
    assert task.name == f"{QUEUE}/tasks/{digest}"
    http = task.http_request
    assert http.body == b'{"amount": 1000.10}'  # as stored: the number is not re-encoded
    assert http.url == "https://worker.example.com/tasks"
    assert http.http_method == tasks_v2.HttpMethod.POST
    assert dict(http.headers) == {
        "X-Source": "outbox",
        "Content-Type": "application/json",
        "Outbox-Operation-Id": "12",
        "Outbox-Action": "invoice.paid",
        "Outbox-Attempt": "2",
        "Outbox-Tenant-Id": "acme",
        "Outbox-Correlation-Id": "corr-1",
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "Outbox-Idempotency-Key": digest,
    }
    assert http.oidc_token.service_account_email == "enqueuer@acme-prod.iam.gserviceaccount.com"
    assert http.oidc_token.audience == "https://worker.example.com"


def test_a_request_built_by_hand_has_its_payload_encoded() -> None:
    provider = build(settings())
    task = provider.task(request(payload_json=None), provider.options.targets["*"])
    assert json.loads(task.http_request.body) == {"amount": 1000}


@pytest.mark.parametrize(
    "key",
    [
        "ob1_" + "f" * 64,
        "ob1_" + "f" * 64 + ":r2",
        "x" * 255,
        "k€y with spaces/slashes?and#hashes",
        "\u0000\u202e",
    ],
)
def test_every_key_becomes_a_task_id_cloud_tasks_takes(key: str) -> None:
    wire = TASK_ID.wire(key)
    assert TASK_ID.problem(wire) is None
    assert len(wire) == 64
    assert TASK_ID.wire(key + "x") != wire  # one id per key


def test_each_generation_is_its_own_task() -> None:
    target = build(settings()).options.targets["*"]
    assert target.task_name("ob1_k") != target.task_name("ob1_k:r2")


def test_an_unknown_action_is_refused_before_sending() -> None:
    provider = build(
        settings(actions={"invoice.paid": {"queue": "o", "url": "https://w.example.com/"}})
    )
    provider.check("invoice.paid", {})
    assert provider.actions == frozenset({"invoice.paid"})
    with pytest.raises(InvalidRequest, match="no action 'refund'"):
        provider.check("refund", {})


def test_each_action_has_its_own_queue_as_its_scope() -> None:
    provider = build(
        settings(
            actions={
                "invoice.paid": {"queue": "invoices", "url": "https://w.example.com/"},
                "*": {"queue": "other", "url": "https://w.example.com/"},
            }
        )
    )
    assert provider.scope("invoice.paid", {}).endswith("/queues/invoices")
    assert provider.scope("refund", {}).endswith("/queues/other")


async def test_a_task_over_1_mb_is_refused_before_it_is_sent() -> None:
    provider = build(settings(endpoint="127.0.0.1:1"))
    result = await provider.send(request(payload_json=json.dumps({"x": "y" * 1_000_000})))
    assert isinstance(result, Failed)
    assert (result.failure, result.error_class, result.not_sent) == (
        FailureClass.PERMANENT,
        "task_too_large",
        True,
    )
    await provider.aclose()


# --- answers -------------------------------------------------------------------------------------

Kind = type[gexc.GoogleAPICallError]


def classify(kind: Kind, message: str, *, retry_unroutable: bool = False, **fields: Any) -> Failed:
    """The result of ``kind(message)`` as google.api_core raises it for a gRPC status."""
    exc = kind(message, **fields)
    return failure(exc, QUEUE, retry_unroutable=retry_unroutable)


REFUSED = (
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: "
    "Failed to connect to remote host: Connection refused"
)
T, U, P = FailureClass.TRANSIENT, FailureClass.UNKNOWN, FailureClass.PERMANENT


@pytest.mark.parametrize(
    ("kind", "message", "failure_class", "error_class"),
    [
        (gexc.ServiceUnavailable, REFUSED, T, "connect_refused"),
        (gexc.ServiceUnavailable, "DNS resolution failed for x.example", T, "connect_refused"),
        (gexc.ServiceUnavailable, "Socket closed", U, "unavailable"),
        (gexc.ServiceUnavailable, "Connection reset by peer", U, "unavailable"),
        (gexc.DeadlineExceeded, "Deadline Exceeded", U, "timeout"),
        (gexc.Cancelled, "cancelled", U, "cancelled"),
        (gexc.InternalServerError, "internal", U, "internal"),
        (gexc.Unknown, "?", U, "unknown"),
        (gexc.DataLoss, "?", U, "data_loss"),
        (gexc.NotFound, "Requested entity was not found.", P, "unroutable"),
        (gexc.FailedPrecondition, "The queue does not exist.", P, "unroutable"),
        (gexc.InvalidArgument, "Task size too large", P, "invalid_argument"),
        (gexc.OutOfRange, "?", P, "out_of_range"),
        (gexc.MethodNotImplemented, "no", P, "unimplemented"),
        (gexc.Aborted, "contention", T, "aborted"),
    ],
)
def test_each_answer_is_classified(
    kind: Kind, message: str, failure_class: FailureClass, error_class: str
) -> None:
    result = classify(kind, message)
    assert (result.failure, result.error_class) == (failure_class, error_class)
    assert not (result.pause or result.pause_action)


def test_a_missing_queue_may_be_retried_instead() -> None:
    result = classify(gexc.NotFound, "not found", retry_unroutable=True)
    assert (result.failure, result.error_class) == (T, "unroutable")
    assert QUEUE in result.message


def test_throttling_waits_without_spending_an_attempt() -> None:
    result = classify(gexc.ResourceExhausted, "Quota exceeded")
    assert (result.failure, result.retry_after) == (T, DEFAULT_THROTTLE)
    assert (result.spends_attempt, result.request_only) == (False, True)


def test_throttling_honours_the_servers_retry_info() -> None:
    delay = duration_pb2.Duration(seconds=12, nanos=5 * 10**8)
    info = error_details_pb2.RetryInfo(retry_delay=delay)
    result = classify(gexc.ResourceExhausted, "Quota exceeded", details=[info])
    assert result.retry_after == timedelta(seconds=12.5)


def test_refused_credentials_pause_the_provider_and_a_missing_permission_the_action() -> None:
    unauthenticated = classify(gexc.Unauthenticated, "Request had invalid credentials")
    assert (unauthenticated.failure, unauthenticated.pause) == (T, True)
    denied = classify(gexc.PermissionDenied, "cloudtasks.tasks.create denied")
    assert (denied.failure, denied.pause, denied.pause_action) == (T, False, True)
    plugin = classify(gexc.ServiceUnavailable, "Getting metadata from plugin failed with error")
    assert (plugin.failure, plugin.error_class, plugin.pause) == (T, "credentials", True)


def test_a_long_server_message_is_cut() -> None:
    result = classify(gexc.InvalidArgument, "x" * 5000)
    assert len(result.message) < MESSAGE_CHARS + 100

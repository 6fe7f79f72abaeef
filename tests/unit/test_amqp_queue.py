"""`type = "amqp"` without a broker: its settings, read and refused, and what each of RabbitMQ's
answers means (outbox/providers/amqp/: config, faults, provider)."""

from __future__ import annotations

import asyncio
import socket
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiormq.exceptions as amqp_errors
import pytest

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.amqp import faults
from outbox.providers.amqp.config import Route, amqp_options
from outbox.providers.amqp.provider import AmqpProvider, _message, build
from outbox.providers.base import Failed, InvalidRequest, SendRequest
from outbox.providers.registry import build_providers

ACTIONS: dict[str, Any] = {"order.placed": {"exchange": "orders", "routing_key": "placed"}}


def settings(**options: Any) -> ProviderSettings:
    base: dict[str, Any] = {"url": "amqp://127.0.0.1:5672/", "actions": ACTIONS}
    return ProviderSettings("rabbit", type="amqp", options={**base, **options})


def refused(ps: ProviderSettings, environ: dict[str, str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        amqp_options(ps, environ or {}, concurrency=64)
    return caught.value


def request(**fields: Any) -> SendRequest:
    base: dict[str, Any] = {
        "operation_id": 7,
        "tenant_id": "acme",
        "operation_type": "order",
        "operation_key": "o-1",
        "action": "order.placed",
        "payload": {"n": 1},
        "idempotency_key": "k" * 68,
        "correlation_id": None,
        "attempt": 1,
        "payload_json": '{"n": 1}',
    }
    return SendRequest(**{**base, **fields})


# --- Settings -----------------------------------------------------------------------------------


def test_the_defaults_are_guest_on_loopback_and_a_mandatory_persistent_route() -> None:
    opts = amqp_options(settings(), {}, concurrency=64)
    assert (opts.host, opts.port, opts.vhost, opts.tls) == ("127.0.0.1", 5672, "/", False)
    assert (opts.username, opts.password) == ("guest", "guest")
    assert opts.routes["order.placed"] == Route("orders", "placed", True, True, "quarantine")
    assert opts.channels == 4
    assert "guest" not in repr(opts).replace("username='guest'", "")


@pytest.mark.parametrize(
    ("url", "vhost"),
    [
        ("amqp://localhost", "/"),
        ("amqp://localhost/", "/"),
        ("amqp://localhost/%2F", "/"),
        ("amqp://localhost/prod", "prod"),
        ("amqp://localhost/a%2Fb", "a/b"),
    ],
)
def test_the_virtual_host_is_the_path_percent_decoded(url: str, vhost: str) -> None:
    assert amqp_options(settings(url=url), {}, concurrency=1).vhost == vhost


def test_amqps_takes_its_own_port_and_a_ca_file() -> None:
    opts = amqp_options(
        settings(url="amqps://[::1]/", ca_file="/etc/ssl/ca.pem"), {}, concurrency=8
    )
    assert (opts.host, opts.port, opts.tls, opts.ca_file) == ("::1", 5671, True, "/etc/ssl/ca.pem")
    assert opts.broker == "amqps://::1:5671/%2F"


def test_a_password_in_the_url_is_refused_without_being_quoted() -> None:
    error = refused(settings(url="amqp://app:hunter2@127.0.0.1/"))
    assert error.key == "providers.rabbit.url"
    assert "hunter2" not in str(error)
    assert "username" in str(error)


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://127.0.0.1/", "amqp:// or amqps://"),
        ("amqp://app@127.0.0.1/", "credentials"),
        ("amqp://127.0.0.1/?heartbeat=5", "no query"),
        ("amqp://127.0.0.1:99999/", "port"),
        ("amqp:///vhost", "no host"),
        ("amqp://127.0.0.1/a/b", "%2F"),
    ],
)
def test_a_wrong_url_is_refused_by_its_key(url: str, says: str) -> None:
    error = refused(settings(url=url))
    assert error.key == "providers.rabbit.url"
    assert says in str(error)


def test_guest_is_only_for_loopback() -> None:
    error = refused(settings(url="amqp://rabbit.internal/"))
    assert error.key == "providers.rabbit.password"
    assert "loopback" in str(error)


def test_the_password_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    env = amqp_options(
        settings(url="amqp://rabbit.internal/", username="app", password={"env": "RABBIT_PW"}),
        {"RABBIT_PW": "s3cret"},
        concurrency=1,
    )
    assert (env.username, env.password) == ("app", "s3cret")
    assert "s3cret" not in repr(env)
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    secret.chmod(0o600)
    file = amqp_options(settings(username="app", password={"file": str(secret)}), {}, concurrency=1)
    assert file.password == "from-file"  # noqa: S105 (the test's own secret file)


@pytest.mark.parametrize(
    ("options", "key", "secret"),
    [
        ({"username": "app"}, "providers.rabbit.password", None),
        ({"password": {"env": "PW"}}, "providers.rabbit.username", None),
        ({"username": "app", "password": "hunter2"}, "providers.rabbit.password", "hunter2"),
        ({"username": "app", "password": {"env": "UNSET"}}, "providers.rabbit.password", None),
    ],
)
def test_credentials_are_refused_by_their_key(
    options: dict[str, Any], key: str, secret: str | None
) -> None:
    error = refused(settings(**options), {"PW": "x"})
    assert error.key == key
    if secret is not None:
        assert secret not in str(error)


@pytest.mark.parametrize(
    ("actions", "key"),
    [
        ({}, "providers.rabbit.actions"),
        ({"a": {"exchange": "x"}}, "providers.rabbit.actions.a.routing_key"),
        ({"a": {"routing_key": "r", "queue": "q"}}, "providers.rabbit.actions.a"),
        (
            {"a": {"routing_key": "r", "unroutable": "drop"}},
            "providers.rabbit.actions.a.unroutable",
        ),
        (
            {"a": {"routing_key": "r", "mandatory": False, "unroutable": "succeed"}},
            "providers.rabbit.actions.a.unroutable",
        ),
        ({"a": {"routing_key": "r", "mandatory": "yes"}}, "providers.rabbit.actions.a.mandatory"),
        ({"a": {"routing_key": "r" * 256}}, "providers.rabbit.actions.a.routing_key"),
        ({"a": {"routing_key": "r\n"}}, "providers.rabbit.actions.a.routing_key"),
        ({"a": {"exchange": "x" * 256, "routing_key": "r"}}, "providers.rabbit.actions.a.exchange"),
        ({"a": {"exchange": "", "routing_key": ""}}, "providers.rabbit.actions.a.routing_key"),
        ({"a": {"exchange": 5, "routing_key": "r"}}, "providers.rabbit.actions.a.exchange"),
    ],
)
def test_a_wrong_action_is_refused_by_its_key(actions: dict[str, Any], key: str) -> None:
    assert refused(settings(actions=actions)).key == key


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"key_form": "base64"}, "providers.rabbit.key_form"),
        ({"channels": 0}, "providers.rabbit.channels"),
        ({"channels": True}, "providers.rabbit.channels"),
        ({"ca_file": "/ca.pem"}, "providers.rabbit.ca_file"),
    ],
)
def test_a_wrong_option_is_refused_by_its_key(options: dict[str, Any], key: str) -> None:
    assert refused(settings(**options)).key == key


def test_an_unknown_option_is_refused() -> None:
    assert "providers.rabbit.queue is not" in str(refused(settings(queue="q")))


def test_the_channels_are_at_most_the_concurrency() -> None:
    assert amqp_options(settings(channels=16), {}, concurrency=2).channels == 2


def test_the_registry_builds_it() -> None:
    provider = build_providers({"rabbit": settings()}, {}, concurrency=8)["rabbit"]
    assert isinstance(provider, AmqpProvider)
    assert provider.actions == frozenset({"order.placed"})


# --- Checks before sending ----------------------------------------------------------------------


def test_an_unknown_action_is_refused_and_any_action_takes_the_rest() -> None:
    provider = build(settings(), {}, concurrency=1)
    provider.check("order.placed", {})
    with pytest.raises(InvalidRequest, match=r"order\.placed"):
        provider.check("order.cancelled", {})
    anything = build(settings(actions={"*": {"routing_key": "q"}}), {}, concurrency=1)
    anything.check("order.cancelled", {})


def test_a_key_of_255_characters_fits_the_message_id() -> None:
    provider = build(settings(), {}, concurrency=1)
    provider.check_key("order.placed", "~" * 255)
    provider.check_key("order.placed", "k" * 256)  # no key outbox makes: send records it


def test_the_key_form_changes_the_message_id_not_the_key() -> None:
    provider = build(settings(key_form="uuid"), {}, concurrency=1)
    opts = amqp_options(settings(key_form="uuid"), {}, concurrency=1)
    wire = opts.key.wire("k" * 68)
    assert len(wire) == 36 and wire == opts.key.wire("k" * 68)
    provider.check_key("order.placed", "k" * 68)


# --- The message ------------------------------------------------------------------------------


def test_the_message_carries_the_key_the_identity_and_the_payload_as_stored() -> None:
    route = Route("orders", "placed")
    message = _message(
        request(correlation_id="c-1", traceparent="00-" + "a" * 32 + "-" + "b" * 16 + "-01"),
        "wire-key",
        route,
    )
    assert message.body == b'{"n": 1}'
    assert message.message_id == "wire-key"
    assert message.correlation_id == "c-1"
    assert message.content_type == "application/json"
    assert message.delivery_mode == 2
    assert message.app_id == "outbox"
    assert message.timestamp is not None
    assert message.headers == {
        "Outbox-Operation-Id": "7",
        "Outbox-Action": "order.placed",
        "Outbox-Attempt": "1",
        "Outbox-Tenant-Id": "acme",
        "Outbox-Correlation-Id": "c-1",
        "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01",
    }


def test_a_transient_route_and_a_long_correlation_id() -> None:
    message = _message(
        request(correlation_id="é" * 200, payload_json=None, payload={"n": 2}),
        "k",
        Route("", "q", persistent=False),
    )
    assert message.delivery_mode == 1
    assert message.correlation_id is None  # 1,200 bytes encoded: the header carries it
    assert message.headers is not None
    assert str(message.headers["Outbox-Correlation-Id"]).startswith("%C3%A9")
    assert message.body == b'{"n":2}'


async def test_what_cannot_be_built_is_not_sent() -> None:
    provider = build(settings(), {}, concurrency=1)
    bad_key = await provider.send(request(idempotency_key="k" * 256))
    unknown_action = await provider.send(request(action="nope"))
    await provider.aclose()
    for result in (bad_key, unknown_action):
        assert isinstance(result, Failed) and result.not_sent
        assert result.failure is FailureClass.PERMANENT


async def test_a_refused_connection_is_transient_and_nothing_is_sent() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed on leaving: nothing listens there
    ps = ProviderSettings(
        "rabbit",
        type="amqp",
        timeout=timedelta(seconds=2),
        options={"url": f"amqp://127.0.0.1:{port}/", "actions": ACTIONS},
    )
    provider = build(ps, {}, concurrency=4)
    results = await asyncio.gather(*(provider.send(request()) for _ in range(4)))
    await provider.aclose()
    for result in results:
        assert isinstance(result, Failed)
        assert (result.failure, result.error_class) == (FailureClass.TRANSIENT, "connect_refused")
        assert not result.may_have_reached_provider


# --- RabbitMQ's answers -----------------------------------------------------------------------

ROUTE = Route("orders", "placed")
BROKER = "amqp://127.0.0.1:5672/%2F"


def test_a_returned_message_is_permanent_unroutable_naming_the_destination() -> None:
    failed = faults.returned(ROUTE, 312, "NO_ROUTE")
    assert (failed.failure, failed.error_class, failed.reason) == (
        FailureClass.PERMANENT,
        "unroutable",
        "unroutable",
    )
    assert "'orders'" in failed.message and "'placed'" in failed.message and "312" in failed.message


def test_a_nack_is_backpressure_that_spends_nothing() -> None:
    failed = faults.after_publish(amqp_errors.DeliveryError(None, _nack()), ROUTE, BROKER)
    assert (failed.failure, failed.error_class) == (FailureClass.TRANSIENT, "nack")
    assert failed.retry_after == faults.FULL_QUEUE_RETRY
    assert not failed.spends_attempt and failed.request_only


def _nack() -> Any:
    from pamqp.commands import Basic  # noqa: PLC0415 (aiormq's frames, only here)

    return Basic.Nack(delivery_tag=3, multiple=True)


def test_a_404_naming_this_exchange_is_permanent_and_another_one_is_unknown() -> None:
    ours = amqp_errors.ChannelNotFoundEntity("NOT_FOUND - no exchange 'orders' in vhost '/'")
    theirs = amqp_errors.ChannelNotFoundEntity("NOT_FOUND - no exchange 'other' in vhost '/'")
    mine = faults.after_publish(ours, ROUTE, BROKER)
    assert (mine.failure, mine.error_class, mine.reason) == (
        FailureClass.PERMANENT,
        "exchange_not_found",
        "unroutable",
    )
    # Every publish in flight on the channel sees the close: the others may have been taken.
    other = faults.after_publish(theirs, ROUTE, BROKER)
    assert (other.failure, other.error_class) == (FailureClass.UNKNOWN, "channel_closed")


def test_a_403_on_this_exchange_pauses_the_action() -> None:
    exc = amqp_errors.ChannelAccessRefused(
        "ACCESS_REFUSED - write access to exchange 'orders' in vhost '/' refused for user 'app'"
    )
    failed = faults.after_publish(exc, ROUTE, BROKER)
    assert failed.pause_action and failed.failure is FailureClass.TRANSIENT


def test_a_message_over_the_brokers_limit_is_permanent() -> None:
    exc = amqp_errors.ChannelPreconditionFailed(
        "PRECONDITION_FAILED - message size 200000000 is larger than configured max size 134217728"
    )
    failed = faults.after_publish(exc, ROUTE, BROKER)
    assert (failed.failure, failed.error_class) == (FailureClass.PERMANENT, "message_too_large")


@pytest.mark.parametrize(
    "exc",
    [
        TimeoutError(),
        amqp_errors.ConnectionClosed(320, "CONNECTION_FORCED"),
        ConnectionResetError(104, "reset"),
        amqp_errors.ChannelClosed(None, None),
    ],
)
def test_a_publish_without_its_confirmation_is_unknown(exc: BaseException) -> None:
    failed = faults.after_publish(exc, ROUTE, BROKER)
    assert failed.failure is FailureClass.UNKNOWN
    assert failed.may_have_reached_provider


@pytest.mark.parametrize(
    ("exc", "error_class", "pause"),
    [
        (
            amqp_errors.ProbableAuthenticationError("ACCESS_REFUSED - Login was refused"),
            "credentials_refused",
            True,
        ),
        (
            amqp_errors.InvalidFrameError(
                "Expected one of ['Connection.OpenOk'], got <Connection.Close object>"
            ),
            "vhost_refused",
            True,
        ),
        (amqp_errors.AMQPConnectionError(111, "Connect call failed"), "connect_refused", False),
        (ConnectionRefusedError(111, "refused"), "connect_refused", False),
        (socket.gaierror(-2, "Name or service not known"), "dns", False),
        (TimeoutError(), "connect_timeout", False),
        (OSError(113, "No route to host"), "connect_failed", False),
    ],
)
def test_a_connection_that_fails_is_transient(
    exc: BaseException, error_class: str, pause: bool
) -> None:
    failed = faults.not_connected(exc, BROKER, "/")
    assert (failed.failure, failed.error_class, failed.pause) == (
        FailureClass.TRANSIENT,
        error_class,
        pause,
    )
    assert not failed.may_have_reached_provider


def test_a_blocked_connection_is_transient_and_spends_nothing() -> None:
    failed = faults.blocked(BROKER)
    assert failed.failure is FailureClass.TRANSIENT
    assert failed.retry_after == faults.BLOCKED_RETRY and not failed.spends_attempt

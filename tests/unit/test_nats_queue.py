"""`type = "nats"`: its settings read and checked, and each JetStream answer classified
(outbox.providers.nats.config, outbox.providers.nats.faults); no server needed."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.js.api import PubAck

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.model import FailureClass
from outbox.providers.base import InvalidRequest, Succeeded
from outbox.providers.nats import faults as nats_faults
from outbox.providers.nats.config import nats_options, subject_problem
from outbox.providers.nats.provider import build
from outbox.providers.registry import build_providers

ACTIONS = {"invoice.paid": {"subject": "orders.paid", "stream": "ORDERS"}}


def settings(**options: Any) -> ProviderSettings:
    return ProviderSettings(
        "jets",
        type="nats",
        key_retention=timedelta(minutes=2),
        options={"actions": ACTIONS, **options},
    )


def refused(**options: Any) -> str:
    with pytest.raises(ConfigError) as caught:
        nats_options(settings(**options), {"TOKEN": "t0ken", "PW": "pw"})
    return str(caught.value)


def test_the_defaults_publish_to_the_local_server_with_the_stored_key() -> None:
    options = nats_options(settings())
    assert options.servers == ("nats://127.0.0.1:4222",)
    assert options.routes["invoice.paid"].subject == "orders.paid"
    assert options.streams == ("ORDERS",)
    assert options.key.header == "Nats-Msg-Id" and options.key.form == "stored"


def test_the_registry_builds_it_for_type_nats() -> None:
    (provider,) = build_providers({"jets": settings()}).values()
    assert provider.name == "jets" and provider.key_retention == timedelta(minutes=2)


def test_servers_may_be_one_text_as_the_environment_gives_them() -> None:
    options = nats_options(settings(servers="nats://a:4222, tls://b"))
    assert options.servers == ("nats://a:4222", "tls://b:4222")


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({"servers": ["http://a"]}, "must be nats://host:port"),
        ({"servers": ["nats://u:p@a:4222"]}, "carries credentials"),
        ({"servers": []}, "must be an array"),
        ({"servers": ["nats://a/x"]}, "only scheme, host and port"),
        ({"actions": {}}, "at least one action"),
        ({"actions": {"a": {"subject": "x"}}}, "actions.a.stream is required"),
        ({"actions": {"a": {"stream": "S"}}}, "actions.a.subject is required"),
        ({"actions": {"a": {"subject": "x", "stream": "S", "q": 1}}}, "q is not known"),
        ({"actions": {"a": {"subject": "x.*", "stream": "S"}}}, "no wildcard"),
        ({"actions": {"a": {"subject": "x.>", "stream": "S"}}}, "no wildcard"),
        ({"actions": {"a": {"subject": "x y", "stream": "S"}}}, "literal subject"),
        ({"actions": {"a": {"subject": "x..y", "stream": "S"}}}, "none empty"),
        ({"actions": {"a": {"subject": "$JS.API.STREAM.DELETE.S", "stream": "S"}}}, "system"),
        ({"actions": {"a": {"subject": "x", "stream": "A.B"}}}, "must be a stream name"),
        ({"token": "t0ken"}, 'must be {env = "VARIABLE"}'),
        ({"password": {"env": "PW"}}, "go together"),
        ({"token": {"env": "TOKEN"}, "user": "u", "password": {"env": "PW"}}, "not both"),
        ({"token": {"env": "NOT_SET"}}, "NOT_SET is not set"),
        ({"token": {"env": "TOKEN"}, "servers": ["nats://10.0.0.1:4222"]}, "clear text"),
        ({"key_form": "base64"}, "key_form must be one of"),
        ({"tls": {"ca": "x"}}, "tls.ca is not known"),
        ({"tls": {"cert_file": "c"}}, "go together"),
        ({"nkey": "x"}, "nkey is not a nats provider setting"),
        ({"creds_file": "/nonexistent/outbox.creds"}, "is not a file"),
    ],
)
def test_every_mistake_names_its_key(options: dict[str, Any], said: str) -> None:
    assert said in refused(**options)


def test_a_secret_is_never_quoted_back() -> None:
    assert "t0ken" not in refused(token="t0ken")  # noqa: S106 (a test's own secret)
    assert "p4ss" not in refused(servers=["nats://u:p4ss@a"])


def test_credentials_over_tls_or_to_loopback_are_taken() -> None:
    env = {"TOKEN": "t0ken"}
    for servers in (["tls://10.0.0.1:4222"], ["nats://127.0.0.1:4222"], ["nats://localhost"]):
        assert nats_options(settings(token={"env": "TOKEN"}, servers=servers), env).token
    insecure = settings(token={"env": "TOKEN"}, servers=["nats://10.0.0.1"], allow_insecure=True)
    assert nats_options(insecure, env).token == "t0ken"  # noqa: S105 (a test's own secret)
    assert "t0ken" not in repr(nats_options(insecure, env))


def test_a_relative_creds_file_is_found_in_the_credentials_directory(tmp_path: Path) -> None:
    (tmp_path / "orders.creds").write_text("-----BEGIN NATS USER JWT-----\n")
    ps = settings(creds_file="orders.creds", key_form="SHA256")
    options = nats_options(ps, {"CREDENTIALS_DIRECTORY": str(tmp_path)})
    assert options.creds_file == str(tmp_path / "orders.creds")
    assert options.key.form == "sha256"


@pytest.mark.parametrize("subject", ["orders", "orders.paid", "a-b_c.D9", "$KV.bucket.key"])
def test_literal_subjects_are_taken(subject: str) -> None:
    assert subject_problem(subject) is None


def test_a_subject_past_ascii_is_refused_as_nats_tools_would_mangle_it() -> None:
    assert subject_problem("caf\u00e9.paid") is not None


def test_an_unknown_action_is_refused_before_anything_is_sent() -> None:
    provider = build(settings())
    provider.check("invoice.paid", {})
    with pytest.raises(InvalidRequest, match="has no action 'refund'"):
        provider.check("refund", {})
    assert provider.actions == ("invoice.paid",)


@pytest.mark.parametrize("form", ["stored", "uuid", "sha256"])
def test_every_key_outbox_stores_fits_each_form(form: str) -> None:
    provider = build(settings(key_form=form))
    provider.check_key("invoice.paid", "!" * 255)
    provider.check_key("invoice.paid", "ob1_" + "a" * 64 + ":r2")


# --- answers ---------------------------------------------------------------------------------


def test_a_puback_is_the_stream_and_sequence_and_a_duplicate_the_original() -> None:
    assert nats_faults.acknowledged(PubAck(stream="S", seq=7), "S") == Succeeded(
        "S:7", result={"stream": "S", "seq": 7, "duplicate": False}
    )
    again = nats_faults.acknowledged(PubAck(stream="S", seq=7, duplicate=True), "S")
    assert isinstance(again, Succeeded) and again.reference == "S:7"


def test_a_duplicate_without_the_original_sequence_is_unknown() -> None:
    """An interest stream without consumers answered a duplicate with seq 0 (before nats-server
    PR 5818). Which message JetStream kept under the id is then unknown, so whether it is this
    operation's, or another producer's that took the id first, cannot be checked (issue 38)."""
    zero = nats_faults.acknowledged(PubAck(stream="S", seq=0, duplicate=True), "S")
    assert not isinstance(zero, Succeeded)
    assert zero.failure is FailureClass.UNKNOWN and zero.error_class == "duplicate_unverified"
    assert zero.may_have_reached_provider


_OURS = {"Outbox-Operation-Id": "7", "Outbox-Tenant-Id": "acme", "Nats-Msg-Id": "k"}


@pytest.mark.parametrize(
    ("kept_headers", "kept_body"),
    [
        ({**_OURS, "Outbox-Operation-Id": "8"}, b"{}"),  # another database's operation 8
        ({**_OURS, "Outbox-Tenant-Id": "acme2"}, b"{}"),  # same id, another tenant
        (_OURS, b'{"n": 1}'),  # same identity headers, another body
        ({"Nats-Msg-Id": "k"}, b"{}"),  # a client that is not outbox
    ],
)
def test_a_duplicate_of_another_message_is_a_permanent_key_collision(
    kept_headers: dict[str, str], kept_body: bytes
) -> None:
    answer = nats_faults.acknowledged(PubAck(stream="S", seq=3, duplicate=True), "S")
    assert isinstance(answer, Succeeded)
    assert nats_faults.duplicate_of(answer, _OURS, b"{}", _OURS, b"{}") is answer
    verdict = nats_faults.duplicate_of(answer, kept_headers, kept_body, _OURS, b"{}")
    assert not isinstance(verdict, Succeeded)
    assert verdict.failure is FailureClass.PERMANENT and verdict.error_class == "key_collision"
    assert "S:3" in verdict.message


@given(seq=st.integers(1, 2**64), last_seq=st.integers(0, 2**64))
def test_a_vanished_duplicate_counts_only_where_the_stream_reached_its_sequence(
    seq: int, last_seq: int
) -> None:
    """Not found at the duplicate's sequence: removed since, if the stream ever got that far; a
    sequence past the stream's last is a lie, and proves nothing was published."""
    answer = nats_faults.acknowledged(PubAck(stream="S", seq=seq, duplicate=True), "S")
    assert isinstance(answer, Succeeded)
    verdict = nats_faults.vanished(answer, seq, last_seq)
    if seq <= last_seq:
        assert verdict is answer
    else:
        assert not isinstance(verdict, Succeeded)
        assert verdict.failure is FailureClass.UNKNOWN and verdict.error_class == "bad_ack"
        assert f"S:{seq}" in verdict.message and str(last_seq) in verdict.message


@pytest.mark.parametrize("ack", [PubAck(stream="OTHER", seq=1), PubAck(stream="S", seq=None)])  # type: ignore[arg-type]
def test_a_puback_that_names_no_message_of_the_stream_is_unknown(ack: PubAck) -> None:
    answer = nats_faults.acknowledged(ack, "S")
    assert not isinstance(answer, Succeeded)
    assert answer.failure is FailureClass.UNKNOWN and answer.error_class == "bad_ack"


def api(code: int, err_code: int, description: str) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, err_code=err_code, description=description)


@pytest.mark.parametrize(
    ("exc", "failure", "error_class"),
    [
        (api(400, 10060, "expected stream does not match"), "permanent", "wrong_stream"),
        (api(503, 10077, "maximum messages exceeded"), "transient", "stream_full"),
        (api(503, 10077, "maximum bytes exceeded"), "transient", "stream_full"),
        (api(503, 10077, "maximum messages per subject exceeded"), "transient", "stream_full"),
        (api(503, 10077, "store failed: disk full"), "transient", "jetstream_unavailable"),
        (api(400, 10054, "message size exceeds maximum allowed"), "permanent", "message_too_large"),
        (
            api(503, 10008, "JetStream system temporarily unavailable"),
            "transient",
            "jetstream_unavailable",
        ),
        (api(400, 10109, "invalid operation on sealed stream"), "permanent", "rejected"),
        (api(500, 10000, "internal error"), "unknown", "jetstream_error"),
        (nats.errors.TimeoutError(), "unknown", "timeout"),
        (nats.errors.AuthorizationError(), "transient", "credentials"),
        (nats.errors.Error("nats: 'Authorization Violation'"), "transient", "credentials"),
        (RuntimeError("boom"), "unknown", "publish_failed"),
    ],
)
def test_each_answer_is_classified_by_what_it_means(
    exc: BaseException, failure: str, error_class: str
) -> None:
    answer = nats_faults.publish_failed(exc, "orders.paid", "ORDERS")
    assert (answer.failure.value, answer.error_class) == (failure, error_class)
    if error_class == "stream_full":
        assert answer.retry_after == timedelta(seconds=1) and not answer.spends_attempt
    if error_class == "credentials":
        assert answer.pause
    if error_class == "wrong_stream":
        assert answer.reason == "unroutable" and "ORDERS" in answer.message


@pytest.mark.parametrize(
    "exc",
    [
        nats.errors.ConnectionClosedError(),
        nats.errors.OutboundBufferLimitError(),
        nats.errors.ConnectionDrainingError(),
    ],
)
def test_a_publish_refused_before_writing_is_transient(exc: BaseException) -> None:
    answer = nats_faults.not_sent(exc)
    assert answer.failure is FailureClass.TRANSIENT and answer.error_class == "not_connected"


def test_a_payload_over_the_servers_limit_is_permanent_and_not_sent() -> None:
    answer = nats_faults.not_sent(nats.errors.MaxPayloadError())
    assert answer.failure is FailureClass.PERMANENT and answer.not_sent


@pytest.mark.parametrize(
    ("pattern", "subject", "takes"),
    [
        ("orders.paid", "orders.paid", True),
        ("orders.*", "orders.paid", True),
        ("orders.>", "orders.paid.eu", True),
        ("orders.>", "orders", False),
        ("orders.*", "orders.paid.eu", False),
        ("*.paid", "orders.paid", True),
        ("orders.paid", "orders.paid.eu", False),
        (">", "x", True),
    ],
)
def test_a_streams_subjects_are_matched_as_nats_matches_them(
    pattern: str, subject: str, takes: bool
) -> None:
    assert nats_faults.subject_matches(pattern, subject) is takes

"""What each answer of NATS JetStream to a publish means (docs/providers.md, "NATS JetStream"):
the PubAck read into a reference, and every error the client raises into its class.

Pure: a function of the answer or the exception. The connection is outbox.providers.nats.provider's.

JetStream's answers, as nats-server 2.9 to 2.11 give them (each verified against 2.9.10 where
marked; the codes are nats-server's server/errors.json):

- a PubAck ``{"stream": S, "seq": N}``: stored as message N of S (verified);
- ``"duplicate": true``: the Nats-Msg-Id was seen inside the stream's duplicate_window; the
  message was not stored again, and ``seq`` is the original's (verified, a limits stream; an
  interest stream without consumers answered seq 0 before nats-server PR 5818: unknown, since
  whose message was kept cannot then be checked);
- no responders (a 503 status, nats-py's NoStreamResponseError): nothing subscribes to the
  subject, so no stream took it (verified); nats.go retries it briefly, as a stream may be
  recovering: the caller asks the stream whether it binds the subject before calling it
  unroutable;
- err_code 10060, expected stream does not match: the subject is another stream's (verified);
- 10077, store failed, "maximum messages/bytes exceeded": a stream with discard=new is full
  (verified, as a 503): backpressure, nothing stored;
- 10054, message size exceeds the stream's max_msg_size; other 400s: the request is refused;
- other 503s: JetStream is temporarily unavailable (no leader, insufficient resources).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import nats.errors
import nats.js.errors

from outbox.providers import queue_kit
from outbox.providers.base import Failed, SendResult, Succeeded, permanent, transient, unknown

EXPECTED_STREAM_MISMATCH: Final = 10060
STORE_FAILED: Final = 10077
MESSAGE_TOO_LARGE: Final = 10054
# How long a full stream is given before the next try: a consumer drains it at its own pace;
# the backoff grows from this while the stream stays full.
FULL_RETRY_AFTER: Final = timedelta(seconds=1)
_FULL: Final = ("maximum messages", "maximum bytes", "maximum messages per subject")
# Raised by nats-py before anything is written to the socket (its publish checks them first).
NOT_SENT: Final = (
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)
REASON_UNROUTABLE: Final = "unroutable"
_AUTH: Final = ("authorization violation", "authentication expired", "authentication revoked")


def acknowledged(ack: Any, stream: str) -> SendResult:
    """A PubAck's meaning: the reference "<stream>:<seq>", the original's on a duplicate. One
    naming another stream than the expected one, or no sequence, is no confirmation outbox can
    trust: unknown (JetStream itself refuses the first: a broker that says otherwise lies)."""
    seq = getattr(ack, "seq", None)
    stored_in = getattr(ack, "stream", None)
    duplicate = bool(getattr(ack, "duplicate", False))
    if stored_in != stream or not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        return unknown(
            "bad_ack",
            f"JetStream's acknowledgement names stream {stored_in!r} sequence {seq!r}, not a "
            f"message of stream {stream}",
        )
    if duplicate and seq == 0:
        # The server did not say which message it kept under our Nats-Msg-Id (an interest
        # stream's answer before nats-server PR 5818, or anyone answering on its behalf), so
        # nothing shows it is this operation's and not another producer's (duplicate_of):
        # unproven, as any answer outbox cannot check. Retried inside the key window, then
        # reconciliation; never a success taken on the word of an unverifiable duplicate.
        return unknown(
            "duplicate_unverified",
            f"JetStream answered a duplicate in stream {stream} without the sequence of the "
            "message it kept: whose message it is cannot be checked",
        )
    result: dict[str, Any] = {"stream": stream, "seq": seq, "duplicate": duplicate}
    domain = getattr(ack, "domain", None)
    if isinstance(domain, str):
        result["domain"] = domain
    reference = f"{stream}:{seq}" if seq > 0 else stream
    return Succeeded(reference, result=result)


def duplicate_of(
    answer: Succeeded,
    kept_headers: Mapping[str, str],
    kept_body: bytes,
    headers: Mapping[str, str],
    body: bytes,
) -> SendResult:
    """The duplicate ``answer`` if the kept message is this operation's (the same operation id,
    tenant and body); otherwise a collision: permanent, since every retry would be answered with
    the other message, and the operation is quarantined for a person, nothing recorded as sent."""
    fields = (queue_kit.OPERATION_ID, queue_kit.TENANT_ID)
    if all(kept_headers.get(f) == headers.get(f) for f in fields) and kept_body == body:
        return answer
    return permanent(
        "key_collision",
        f"JetStream already holds another message under this Nats-Msg-Id ({answer.reference}, "
        f"operation {str(kept_headers.get(queue_kit.OPERATION_ID))[:40]!r}): another producer "
        "publishes with the same ids to this stream; this operation was not published",
        reason="key_collision",
    )


def vanished(answer: Succeeded, seq: int, last_seq: int) -> SendResult:
    """A duplicate whose message JetStream no longer has at ``seq``: one removed since (acked
    from a work queue, aged out, deleted) is accepted, as nothing is left to compare; but a
    sequence past the stream's last was never stored, so the answer is a broker's lie or
    confusion and proves nothing was published: unknown, retried inside the window."""
    if seq <= last_seq:
        return answer
    return unknown(
        "bad_ack",
        f"JetStream names {answer.reference} as the duplicate, but the stream's last "
        f"sequence is {last_seq}: no such message was ever stored",
    )


def not_sent(exc: BaseException) -> Failed:
    """A publish the client refused before writing it: nothing left this host."""
    if isinstance(exc, nats.errors.MaxPayloadError):
        return too_large("the message is larger than the server's max_payload")
    return transient("not_connected", f"not connected to NATS ({type(exc).__name__})")


def too_large(message: str) -> Failed:
    return permanent(
        "message_too_large", message, not_sent=True, request_only=True, reason="message_too_large"
    )


def publish_failed(exc: BaseException, subject: str, stream: str) -> Failed:
    """The class of an error raised after the publish was written (or that JetStream answered).
    No responders is for the caller, which asks the stream first (``unroutable``)."""
    if isinstance(exc, nats.js.errors.APIError):
        return api_error(exc, subject, stream)
    if isinstance(exc, nats.errors.TimeoutError | TimeoutError):
        return unknown("timeout", f"no acknowledgement from JetStream for {subject} in time")
    if refuses_credentials(exc):
        return transient("credentials", "NATS refused the credentials", pause=True)
    return unknown(
        "publish_failed",
        f"the publish to {subject} ended without an acknowledgement ({type(exc).__name__})",
    )


def refuses_credentials(exc: BaseException) -> bool:
    """Whether the server refused our credentials: nats-py raises AuthorizationError, or (at
    connect, nats-py 2.16) a plain Error quoting the server's -ERR 'Authorization Violation';
    a revoked or expired user is told 'User Authentication Expired' or '... Revoked'."""
    if isinstance(exc, nats.errors.AuthorizationError):
        return True
    text = str(exc).lower()
    return isinstance(exc, nats.errors.Error) and any(w in text for w in _AUTH)


def api_error(exc: nats.js.errors.APIError, subject: str, stream: str) -> Failed:
    """JetStream said no: by what it means (module docstring). Its description is the
    server's own text (never the payload)."""
    code, err_code = exc.code, exc.err_code
    said = f"JetStream: {exc.description or 'no description'} (err_code {err_code}, {code})"
    if err_code == EXPECTED_STREAM_MISMATCH:
        return permanent(
            "wrong_stream",
            f"{subject} is stored by another stream than {stream}: {said}; bind the subject "
            f"to {stream} or name its stream in the action",
            reason=REASON_UNROUTABLE,
        )
    description = (exc.description or "").lower()
    if err_code == STORE_FAILED and description.startswith(_FULL):
        return transient(
            "stream_full",
            f"the stream {stream} is full and discards new messages: {said}",
            retry_after=FULL_RETRY_AFTER,
            spends_attempt=False,
        )
    if err_code == MESSAGE_TOO_LARGE:
        return too_large(f"the message is larger than the stream {stream} takes: {said}")
    if code == 503 or err_code == STORE_FAILED:
        return transient("jetstream_unavailable", said)
    if code is not None and 400 <= code < 500:
        return permanent("rejected", said, request_only=True)
    return unknown("jetstream_error", said)


def unroutable(subject: str, stream: str, why: str) -> Failed:
    return permanent(
        REASON_UNROUTABLE,
        f"no stream takes {subject}: {why}; outbox does not publish it elsewhere",
        reason=REASON_UNROUTABLE,
    )


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a stream's subject ``pattern`` (``*`` one token, ``>`` the rest) takes the
    literal ``subject``."""
    wanted = pattern.split(".")
    tokens = subject.split(".")
    for i, part in enumerate(wanted):
        if part == ">":
            return len(tokens) > i
        if i >= len(tokens) or part not in ("*", tokens[i]):
            return False
    return len(tokens) == len(wanted)

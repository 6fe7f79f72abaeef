"""What SQS's answers and botocore's exceptions mean for an operation (docs/providers.md, "Amazon
SQS", the table of answers).

SQS speaks AWS JSON with the old Query protocol's codes beside the new ones: botocore puts the
Query code (``AWS.SimpleQueueService.NonExistentQueue``) in ``Error.Code`` when the answer carries
the x-amzn-query-error header and the shape's name (``QueueDoesNotExist``) in
``Error.QueryErrorCode``, so every rule here names both spellings. A message never quotes SQS's
error text, which may echo an attribute or the body back; it gives the code and the status.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

from botocore import exceptions as boto

from outbox.providers.base import Failed, Succeeded, permanent, transient, unknown
from outbox.providers.kit import retry_after_value

# The queue is not there (or not ours to see): every attempt would answer the same.
NO_QUEUE: Final = frozenset({"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist"})
# SQS did not look at the request: it is throttled. KmsThrottled is the queue's KMS key's quota.
THROTTLED: Final = frozenset(
    {
        "RequestThrottled",
        "ThrottlingException",
        "Throttling",
        "ThrottledException",
        "OverLimit",
        "KmsThrottled",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "SlowDown",
    }
)
# The credentials themselves are refused: every operation would fail alike, so the provider
# pauses (its breaker opens with reason "credentials") and no attempt is spent.
CREDENTIALS: Final = frozenset(
    {
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "IncompleteSignature",
        "MissingAuthenticationToken",
        "InvalidAccessKeyId",
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
    }
)
# The credentials work (the request was signed and read) but this queue refuses them: its policy
# (or a policy requiring aws:SecureTransport, InvalidSecurity), or its KMS key refuses us, is
# disabled or gone. That action pauses, the actions of other queues go on, and the operation
# keeps its attempt until an operator fixes the policy or the key.
QUEUE_REFUSES: Final = frozenset(
    {
        "AccessDenied",
        "AccessDeniedException",
        "AWS.SimpleQueueService.AccessDenied",
        "InvalidSecurity",
        "AWS.SimpleQueueService.InvalidSecurity",
        "KmsAccessDenied",
        "KmsDisabled",
        "KmsInvalidKeyUsage",
        "KmsInvalidState",
        "KmsNotFound",
        "KmsOptInRequired",
        "KMS.AccessDeniedException",
        "KMS.DisabledException",
        "KMS.KMSInvalidStateException",
        "KMS.NotFoundException",
        "KMS.OptInRequired",
    }
)
# What SQS says a request it did not act on was wrong with: sent again, it would be refused again.
REFUSED: Final = frozenset(
    {
        "InvalidParameterValue",
        "InvalidParameterValueException",
        "InvalidMessageContents",
        "AWS.SimpleQueueService.InvalidMessageContents",
        "MissingParameter",
        "MissingRequiredParameterException",
        "InvalidAttributeName",
        "InvalidAttributeValue",
        "InvalidAddress",
        "UnsupportedOperation",
        "AWS.SimpleQueueService.UnsupportedOperation",
        "InvalidParameterCombination",
        "ValidationError",
        "InvalidAction",
        "InvalidQueryParameter",
    }
)
# SQS's own hint is rare: without a Retry-After, a throttled send waits this long.
THROTTLE_DELAY: Final = timedelta(seconds=1)


def codes(error: Mapping[str, Any]) -> frozenset[str]:
    """Both spellings of an answer's code (botocore's Error.Code and Error.QueryErrorCode)."""
    return frozenset(str(error[name]) for name in ("Code", "QueryErrorCode") if error.get(name))


def client_error(exc: boto.ClientError) -> Failed:  # noqa: PLR0911 (a decision table)
    """SQS answered with an error."""
    response = exc.response if isinstance(exc.response, Mapping) else {}
    error = response.get("Error") or {}
    meta = response.get("ResponseMetadata") or {}
    status = meta.get("HTTPStatusCode")
    status = status if isinstance(status, int) else None
    found = codes(error)
    code = str(error.get("Code") or error.get("QueryErrorCode") or "unknown")
    details: dict[str, Any] = {"http_status": status, "request_id": meta.get("RequestId")}
    said = f"SQS answered {code}" + (f" (HTTP {status})" if status else "")
    if found & THROTTLED or status == 429:
        headers = meta.get("HTTPHeaders") or {}
        wait = retry_after_value(headers.get("retry-after")) or THROTTLE_DELAY
        return transient(
            "throttled",
            f"{said}: throttled, nothing sent",
            retry_after=wait,
            spends_attempt=False,
            request_only=True,
            **details,
        )
    if found & NO_QUEUE:
        return permanent(
            "unroutable",
            f"{said}: unroutable, the queue does not exist (or these credentials cannot see "
            "it); create it, or correct the action's queue_url",
            reason="unroutable",
            **details,
        )
    if found & CREDENTIALS:
        return transient(
            "credentials", f"{said}: SQS refuses the credentials", pause=True, **details
        )
    if found & QUEUE_REFUSES:
        return transient(
            "queue_refuses",
            f"{said}: the queue (its policy or its KMS key) refuses these credentials; this "
            "action waits",
            pause_action=True,
            request_only=True,
            **details,
        )
    if found & REFUSED:
        return permanent(_error_class(code), f"{said}: SQS refused the message", **details)
    if status is not None and 400 <= status < 500:
        # A 4xx of a code this table does not know: SQS looked at the request and refused it.
        return permanent(_error_class(code), f"{said}: SQS refused the message", **details)
    # A 5xx (InternalError, ServiceUnavailable) or no status at all: SQS may have stored it.
    return unknown(_error_class(code), f"{said}: SQS may have stored the message", **details)


def transport_error(exc: BaseException) -> Failed:  # noqa: PLR0911 (a decision table)
    """botocore raised before an answer: what it means depends on whether the request left."""
    if isinstance(exc, boto.ConnectTimeoutError):
        return transient("connect_timeout", "no connection to SQS in time: nothing sent")
    if isinstance(exc, boto.ReadTimeoutError):
        return unknown("timeout", "SQS did not answer in time: it may have stored the message")
    if isinstance(exc, boto.EndpointConnectionError):
        # aiobotocore maps every aiohttp ClientConnectionError here: a refused or unresolvable
        # connection (nothing sent), but also a reset while the request or its answer travelled.
        cause = exc.kwargs.get("error")
        if cause is None or _never_connected(cause):
            return transient("connect_refused", "no connection to SQS: nothing sent")
        return unknown(
            "connection_lost", "the connection to SQS broke mid-request: it may have stored it"
        )
    if isinstance(exc, boto.ConnectionClosedError):
        return unknown(
            "connection_lost", "SQS closed the connection before answering: it may have stored it"
        )
    if isinstance(
        exc, boto.NoCredentialsError | boto.PartialCredentialsError | boto.ProfileNotFound
    ):
        return transient(
            "no_credentials",
            "no AWS credentials found (environment, profile, role), or the configured profile "
            "is not in the shared config files: nothing sent",
            pause=True,
            not_sent=True,
        )
    if isinstance(exc, boto.CredentialRetrievalError | boto.TokenRetrievalError):
        return transient(
            "credentials_unavailable", "the AWS credentials could not be fetched: nothing sent"
        )
    if isinstance(exc, boto.SSLError):
        return transient("tls", "the TLS handshake with SQS failed: nothing sent")
    if isinstance(exc, boto.ParamValidationError):
        return permanent("invalid_request", "botocore refused the request before sending it")
    if isinstance(exc, TimeoutError):
        return unknown("timeout", "SQS did not answer in time: it may have stored the message")
    return unknown(
        type(exc).__name__, f"sending to SQS failed ({type(exc).__name__}): it may have stored it"
    )


def answer(response: Mapping[str, Any], body: str, *, fifo: bool) -> Succeeded | Failed:
    """SQS's 200 to a SendMessage: the MessageId (a repeat of a FIFO send inside the window is
    answered with the original's, as emulators that check against AWS describe it); its
    MD5OfMessageBody must be the body's, or what SQS stored is not what was sent."""
    meta = response.get("ResponseMetadata") or {}
    request_id = meta.get("RequestId")
    message_id = response.get("MessageId")
    if not isinstance(message_id, str) or not message_id:
        return unknown("unreadable_success", "SQS's answer has no MessageId", request_id=request_id)
    md5 = response.get("MD5OfMessageBody")
    if isinstance(md5, str) and md5.lower() != hashlib.md5(body.encode()).hexdigest():  # noqa: S324 (SQS's checksum)
        return unknown(
            "md5_mismatch",
            f"SQS stored message {message_id} with a body checksum other than the body's",
            reconcile=True,
            reference=message_id,
            request_id=request_id,
        )
    result: dict[str, Any] = {"message_id": message_id}
    sequence = response.get("SequenceNumber")
    if fifo and isinstance(sequence, str):
        result["sequence_number"] = sequence
    return Succeeded(message_id, result=result, http_status=200, request_id=request_id)


def _never_connected(cause: BaseException) -> bool:
    """Whether aiohttp failed before a connection existed (so nothing of the request left)."""
    import aiohttp  # noqa: PLC0415 (aiobotocore's own transport, present where it is)

    if isinstance(cause, aiohttp.ClientConnectorError):
        return True
    return isinstance(cause, OSError) and not isinstance(cause, aiohttp.ClientOSError)


def _error_class(code: str) -> str:
    text = code.rsplit(".", 1)[-1]
    return "".join(c if c.isalnum() else "_" for c in text)[:64] or "unknown"

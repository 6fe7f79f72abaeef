"""What each answer of Cloud Tasks' CreateTask leads to (docs/providers.md, "Google Cloud Tasks",
"Answers"): gRPC status codes as google.api_core raises them, read into outbox's results.

gRPC does not say whether a failed call reached the server. Only a call that never had a
connection (``failed to connect to all addresses``) or whose credentials could not be had (the
auth plug-in runs before anything is sent) is known not to have been sent; every other failure of
a call that may have left is *unknown*, which is safe: inside the task-name window a retry with
the same name is answered ALREADY_EXISTS, never a second task.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Final

from outbox.providers.base import Failed, permanent, transient, unknown
from outbox.providers.cloudtasks.client import gexc, grpc

# When RESOURCE_EXHAUSTED carries no RetryInfo: Cloud Tasks' API quotas are counted per minute
# and its queues ramp up their enqueue rate over seconds, so a few seconds is a fair first pause.
DEFAULT_THROTTLE: Final = timedelta(seconds=5)
# The most of the server's own message kept in a result: enough for "Task size too large",
# short enough that no large echo of the request lands in the database or the logs.
MESSAGE_CHARS: Final = 300
# The channel never connected: nothing was sent. (grpc-core's words; "Connection refused" and
# the resolver's failure are the usual last errors behind them.)
_NOT_CONNECTED: Final = re.compile(
    r"failed to connect to all addresses|DNS resolution failed|Name resolution failure",
    re.IGNORECASE,
)
# google-auth's plug-in failed to produce a token: the call did not leave this host.
_NO_CREDENTIALS: Final = re.compile(r"Getting metadata from plugin failed", re.IGNORECASE)
_CODE = grpc.StatusCode


def failure(exc: gexc.GoogleAPICallError, queue: str, *, retry_unroutable: bool) -> Failed:  # noqa: PLR0911 (a decision table)
    """The result of CreateTask's error ``exc`` for a task to ``queue`` (ALREADY_EXISTS is no
    failure: the caller has answered it already)."""
    code = exc.grpc_status_code
    said = _said(exc)
    name = code.name if code is not None else f"http_{exc.code}"
    error_class = name.lower()
    if code is _CODE.UNAVAILABLE:
        if _NO_CREDENTIALS.search(said):
            return transient("credentials", f"no Google credentials: {said}", pause=True)
        if _NOT_CONNECTED.search(said):
            return transient("connect_refused", f"Cloud Tasks unreachable: {said}")
        return unknown("unavailable", f"UNAVAILABLE after the call may have left: {said}")
    if code is _CODE.DEADLINE_EXCEEDED:
        return unknown("timeout", f"no answer within the deadline: {said}")
    if code is _CODE.RESOURCE_EXHAUSTED:
        return transient(
            "throttled",
            f"Cloud Tasks quota or queue rate exceeded: {said}",
            retry_after=retry_delay(exc) or DEFAULT_THROTTLE,
            spends_attempt=False,
            request_only=True,
        )
    if code in (_CODE.NOT_FOUND, _CODE.FAILED_PRECONDITION):
        # CreateTask on a paused or disabled queue succeeds (the queue holds the task), so
        # either code means the queue, its location or its project does not exist.
        message = (
            f"unroutable: the queue {queue} does not exist ({name}: {said}); create it, or "
            "correct the action's queue"
        )
        if retry_unroutable:
            return transient("unroutable", message)
        return permanent("unroutable", message, reason="unroutable")
    if code is _CODE.UNAUTHENTICATED:
        return transient("credentials", f"Cloud Tasks refused the credentials: {said}", pause=True)
    if code is _CODE.PERMISSION_DENIED:
        # IAM is granted per queue (roles/cloudtasks.enqueuer) and per OIDC service account
        # (iam.serviceAccounts.actAs): the action waits, the provider's other queues go on.
        return transient(
            "permission_denied",
            f"the credentials may not create tasks in {queue}: {said}",
            pause_action=True,
            request_only=True,
        )
    if code in (_CODE.INVALID_ARGUMENT, _CODE.OUT_OF_RANGE, _CODE.UNIMPLEMENTED):
        return permanent(error_class, f"Cloud Tasks refused the task ({name}): {said}")
    if code is _CODE.ABORTED:
        return transient("aborted", f"Cloud Tasks aborted the call: {said}")
    # CANCELLED, INTERNAL, UNKNOWN, DATA_LOSS, and anything newer: the server may have acted.
    return unknown(error_class, f"Cloud Tasks answered {name}: {said}")


def retry_delay(exc: gexc.GoogleAPICallError) -> timedelta | None:
    """The google.rpc.RetryInfo delay an error carries, if any."""
    for detail in exc.details or ():
        delay = getattr(detail, "retry_delay", None)
        if delay is not None and (delay.seconds or delay.nanos):
            return timedelta(seconds=delay.seconds, microseconds=delay.nanos // 1000)
    return None


def _said(exc: gexc.GoogleAPICallError) -> str:
    text = " ".join(str(exc.message or type(exc).__name__).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"

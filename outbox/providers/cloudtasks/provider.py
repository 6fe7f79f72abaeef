"""`type = "cloudtasks"`: each operation becomes one Google Cloud Tasks HTTP task
(docs/providers.md, "Google Cloud Tasks").

The key is the task's name: ``<queue>/tasks/<the stored key's SHA-256>``, the same on every
attempt of a key generation. Cloud Tasks refuses a second task of a name it holds, or held within
about an hour, with ALREADY_EXISTS: that answer is the repeat recognised, a success with the same
name. The task calls the action's URL with the payload exactly as stored and the operation's
identity as headers, so that the target, which Cloud Tasks calls at least once, deduplicates by
Outbox-Operation-Id or the task name (X-CloudTasks-TaskName).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import structlog

from outbox.config.settings import ProviderSettings
from outbox.core import payloads
from outbox.providers import queue_kit
from outbox.providers.base import (
    Found,
    InvalidRequest,
    LookupRequest,
    NotFound,
    SendRequest,
    SendResult,
    Succeeded,
    permanent,
    transient,
    unknown,
)
from outbox.providers.cloudtasks.answers import failure
from outbox.providers.cloudtasks.client import (
    CloudTasksAsyncClient,
    auth_exceptions,
    build_client,
    gexc,
    tasks_v2,
)
from outbox.providers.cloudtasks.config import (
    MAX_BODY_BYTES,
    TASK_ID,
    CloudTasksOptions,
    Target,
    options,
)
from outbox.providers.kit import ANY_ACTION

log = structlog.get_logger("outbox.providers.cloudtasks")

CONTENT_TYPE: Final = "application/json"
# What a lookup that finds nothing says: a task that ran, or was deleted, is gone from GetTask,
# so its absence proves nothing once the task may have been created.
NOT_FOUND_REASON: Final = "a task that ran or was deleted is not found either"
LOOKUP_SOURCE: Final = "tasks.get"
_METHODS: Final = {
    "POST": tasks_v2.HttpMethod.POST,
    "PUT": tasks_v2.HttpMethod.PUT,
    "PATCH": tasks_v2.HttpMethod.PATCH,
}


def build(
    ps: ProviderSettings, environ: Mapping[str, str] | None = None, *, concurrency: int = 64
) -> CloudTasksProvider:
    """The provider of ``ps`` (outbox.providers.registry). Credentials are never read from the
    configuration: the real API uses Google's default credentials of the environment, which
    google-auth reads itself when the first task is sent."""
    del environ, concurrency  # one gRPC channel multiplexes every call in flight
    return CloudTasksProvider(ps.name, options(ps))


class CloudTasksProvider:
    """A Cloud Tasks client, opened on the first send and shared by every call in flight."""

    def __init__(self, name: str, opts: CloudTasksOptions) -> None:
        self._name = name
        self.options = opts
        self._client: CloudTasksAsyncClient | None = None
        self.actions = frozenset(a for a in opts.targets if a != ANY_ACTION)

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self.options.key_retention

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        if queue_kit.action_of(self.options.targets, action) is None:
            raise InvalidRequest(
                f"provider {self._name} has no action {action!r} (and no '*'): no queue to send to"
            )

    def scope(self, action: str, payload: Mapping[str, Any]) -> str:
        """The queue an operation's task goes to: a lookup reads the task where it was sent."""
        return self._target(action).queue

    async def start(self) -> None:
        """Say at startup which configured queue is missing or paused: never a refusal to start
        (a queue may be created after), only the operator's first clue."""
        try:
            client = self._connect()
        except auth_exceptions.DefaultCredentialsError as exc:
            log.warning("no Google credentials; sends pause", provider=self._name, error=str(exc))
            return
        for queue in sorted({t.queue for t in self.options.targets.values()}):
            try:
                found = await client.get_queue(
                    name=queue, retry=None, timeout=self.options.timeout.total_seconds()
                )
            except gexc.GoogleAPICallError as exc:
                log.warning(
                    "queue not readable at startup",
                    provider=self._name,
                    queue=queue,
                    status=getattr(exc.grpc_status_code, "name", str(exc.code)),
                )
                continue
            if found.state != tasks_v2.Queue.State.RUNNING:
                log.warning(
                    "queue is not running: tasks are accepted but not dispatched",
                    provider=self._name,
                    queue=queue,
                    state=tasks_v2.Queue.State(found.state).name,
                )

    async def send(self, request: SendRequest) -> SendResult:
        target = queue_kit.action_of(self.options.targets, request.action)
        if target is None:
            return permanent("invalid_request", f"no action {request.action!r}", not_sent=True)
        task = self.task(request, target)
        if len(task.http_request.body) > MAX_BODY_BYTES:
            return permanent(
                "task_too_large",
                f"the payload is {len(task.http_request.body):,} bytes; a Cloud Tasks task "
                f"takes at most {MAX_BODY_BYTES:,}",
                not_sent=True,
            )
        return await self._create(target, task)

    async def _create(self, target: Target, task: tasks_v2.Task) -> SendResult:  # noqa: PLR0911 (a decision table)
        try:
            client = self._connect()
        except auth_exceptions.DefaultCredentialsError as exc:
            return transient("credentials", f"no Google credentials: {exc}", pause=True)
        try:
            created = await client.create_task(
                parent=target.queue,
                task=task,
                retry=None,
                timeout=self.options.timeout.total_seconds(),
            )
        except gexc.AlreadyExists:
            return Succeeded(reference=task.name)  # the repeat recognised: the same task
        except gexc.GoogleAPICallError as exc:
            return failure(exc, target.queue, retry_unroutable=self.options.retry_unroutable)
        except auth_exceptions.GoogleAuthError as exc:  # a token refresh that failed
            return transient("credentials", f"Google credentials failed: {exc}", pause=True)
        except TimeoutError:
            return unknown("timeout", "no answer within the deadline")
        except Exception as exc:  # noqa: BLE001 (send never raises; the call may have left)
            return unknown("client_error", f"{type(exc).__name__} during CreateTask")
        return Succeeded(reference=created.name or task.name)

    def task(self, request: SendRequest, target: Target) -> tasks_v2.Task:
        """The task of one attempt: its name from the key, the stored payload as its body."""
        body = request.payload_json
        if body is None:
            body = payloads.encode(request.payload)
        wire_key = TASK_ID.wire(request.idempotency_key)
        headers = {**(target.headers or {}), "Content-Type": CONTENT_TYPE}
        headers.update(queue_kit.message_headers(request, wire_key=wire_key))
        http = tasks_v2.HttpRequest(
            url=target.url,
            http_method=_METHODS[target.method],
            headers=headers,
            body=body.encode(),
        )
        if target.oidc_service_account is not None:
            http.oidc_token = tasks_v2.OidcToken(
                service_account_email=target.oidc_service_account,
                audience=target.oidc_audience or "",
            )
        return tasks_v2.Task(name=target.task_name(request.idempotency_key), http_request=http)

    async def lookup(self, request: LookupRequest) -> Found | NotFound:
        """The operation's task, read by name for each key that may have reached Cloud Tasks.
        Found: the task exists, so its creation happened (DONE). Not found proves nothing: a
        task that ran or was deleted is gone too. Any other answer raises: it cannot tell."""
        queue = request.sent_scope or self._target(request.action).queue
        client = self._connect()
        found: list[tasks_v2.Task] = []
        for key in sorted(request.keys):
            if request.pace is not None:
                await request.pace()
            name = f"{queue}/tasks/{TASK_ID.wire(key)}"
            try:
                task = await client.get_task(
                    name=name, retry=None, timeout=self.options.timeout.total_seconds()
                )
            except gexc.NotFound:
                continue
            found.append(task)
        if not found:
            return NotFound(
                sources=(LOOKUP_SOURCE,),
                since=request.first_sent_at,
                until=request.search_until,
                complete=False,
                reason=NOT_FOUND_REASON,
            )
        first, *others = found
        return Found(
            reference=first.name,
            duplicates=tuple(t.name for t in others),
            state="dispatched" if first.dispatch_count else "queued",
            details={"dispatch_count": str(first.dispatch_count)},
        )

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.transport.close()  # type: ignore[no-untyped-call]

    def _connect(self) -> CloudTasksAsyncClient:
        # Built in the event loop that uses it (a gRPC aio channel belongs to one loop); gRPC
        # reconnects a broken channel by itself, so one client serves for the provider's life.
        if self._client is None:
            self._client = build_client(self.options.endpoint, emulator=self.options.emulator)
        return self._client

    def _target(self, action: str) -> Target:
        target = queue_kit.action_of(self.options.targets, action)
        if target is None:
            raise InvalidRequest(f"provider {self._name} has no action {action!r}")
        return target

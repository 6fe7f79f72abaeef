"""Amazon SQS, `type = "sqs"` (docs/providers.md, "Amazon SQS"): each operation one SendMessage,
through one aiobotocore client opened on first use and shared by every send in flight.

A FIFO queue (its URL ends in .fifo) deduplicates by MessageDeduplicationId for 5 minutes: the
stored key travels there in the configured form (SHA-256 in hex by default, so every key fits), and
a repeat inside the interval is answered with the original's MessageId. A standard queue keeps no
key: its consumers deduplicate by the Outbox-Operation-Id attribute for as long as key_retention
says. Every message carries outbox's identity as String message attributes.

botocore's own retries are off: a retry outbox cannot see could land after the key window (on a
FIFO queue) or be a second message (on a standard one); outbox retries with the window in mind.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

import structlog
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from botocore import exceptions as boto

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core import payloads
from outbox.providers import building, queue_kit
from outbox.providers.base import InvalidRequest, SendRequest, SendResult
from outbox.providers.kit import ANY_ACTION
from outbox.providers.sqs import answers as sqs_answers
from outbox.providers.sqs.config import SqsOptions, Target, read_options

log = structlog.get_logger("outbox.providers.sqs")

# What SQS takes in a body and a String attribute (the W3C XML characters): anything else is
# refused whole (InvalidMessageContents), so it is refused here, before anything is sent.
_REFUSED_CHARACTER: Final = re.compile("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# A String attribute's data type, counted in the message's size as SQS counts it.
_STRING: Final = "String"
# SQS takes at most 10 message attributes (moto takes more); outbox's come to 10 at most, with
# a correlation id, a traceparent and a contract (tests/integration/test_queue_sqs.py).
MAX_ATTRIBUTES: Final = 10
# Past the call's own timeouts (connect, then each read), the most one send may take.
_GUARD: Final = timedelta(seconds=1)


class SqsProvider:
    """Sends each operation as one message to its action's queue."""

    def __init__(self, name: str, options: SqsOptions) -> None:
        self._name = name
        self._options = options
        self._lock = asyncio.Lock()
        self._client: Any = None
        self._context: Any = None
        # A queue's own MaximumMessageSize, where start could read a lower one.
        self._limits: dict[str, int] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._options.key_retention

    @property
    def actions(self) -> frozenset[str]:
        return frozenset(a for a in self._options.targets if a != ANY_ACTION)

    def retries_unknown(self, action: str) -> bool:
        """A resend inside the window is safe: a FIFO queue drops it, a standard queue's
        consumers deduplicate by the operation id (docs/providers.md)."""
        del action
        return True

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        target = self._target(action)
        if target.group is not None:
            target.group.check(payload)
        # The body as outbox would write it without its stored text: the stored text (with
        # PostgreSQL's spaces) is checked exactly when it is sent.
        body = payloads.encode(payload)
        problem = _body_problem(body) or self._size_problem(target, body, {})
        if problem is not None:
            raise InvalidRequest(problem)

    def check_key(self, action: str, key: str) -> None:
        """Refuse a key a FIFO queue would refuse as its MessageDeduplicationId (only where
        key_form = "stored": a SHA-256 always fits)."""
        target = self._target(action)
        if not target.fifo or building.key_problem(key) is not None:
            return
        problem = self._options.key.problem(self._options.key.wire(key))
        if problem is not None:
            raise InvalidRequest(f"{problem} (SQS's MessageDeduplicationId)")

    async def start(self) -> None:
        """Read each queue's attributes where the credentials may: a FIFO queue that is not
        one, and a MaximumMessageSize lower than max_message_bytes. A queue that is down or not
        there, or credentials that may only send, are no reason to refuse to start."""
        urls = sorted({t.queue_url for t in self._options.targets.values()})
        try:
            client = await self._open()
        except Exception as exc:  # noqa: BLE001 (whatever it is, sends say it again)
            log.warning("sqs client could not open", provider=self._name, error=type(exc).__name__)
            return
        for url in urls:
            try:
                answer = await asyncio.wait_for(
                    client.get_queue_attributes(
                        QueueUrl=url, AttributeNames=["FifoQueue", "MaximumMessageSize"]
                    ),
                    self._deadline(),
                )
            except boto.ClientError as exc:
                failed = sqs_answers.client_error(exc)
                log.warning(
                    "sqs queue attributes not read; the configured limits hold",
                    provider=self._name,
                    queue_url=url,
                    error_class=failed.error_class,
                )
                continue
            except Exception as exc:  # noqa: BLE001 (down: sends fail transient meanwhile)
                log.warning(
                    "sqs did not answer at start", provider=self._name, error=type(exc).__name__
                )
                return
            self._learn(url, answer.get("Attributes") or {})

    def _learn(self, url: str, attributes: Mapping[str, Any]) -> None:
        fifo = str(attributes.get("FifoQueue", "false")).lower() == "true"
        if fifo != url.endswith(".fifo"):
            raise ConfigError(
                f"providers.{self._name}: the queue {url} says FifoQueue={str(fifo).lower()}, "
                "which its URL contradicts",
                key=f"providers.{self._name}.actions",
            )
        size = attributes.get("MaximumMessageSize")
        if isinstance(size, str) and size.isdigit() and int(size) < self._options.max_message_bytes:
            self._limits[url] = int(size)

    async def send(self, request: SendRequest) -> SendResult:
        target = self._options.targets.get(request.action, self._options.targets.get(ANY_ACTION))
        if target is None:
            return building.unsendable(f"provider {self._name} has no action {request.action!r}")
        unfit = building.key_problem(request.idempotency_key)
        if unfit is not None:
            return unfit
        try:
            params, body = self._message(target, request)
        except InvalidRequest as exc:
            return building.unsendable(str(exc))
        try:
            client = await self._open()
            async with asyncio.timeout(self._deadline()):
                response = await client.send_message(**params)
        except boto.ClientError as exc:
            return sqs_answers.client_error(exc)
        except Exception as exc:  # noqa: BLE001 (send never raises: every outcome is a result)
            return sqs_answers.transport_error(exc)
        return sqs_answers.answer(response, body, fifo=target.fifo)

    def _message(self, target: Target, request: SendRequest) -> tuple[dict[str, Any], str]:
        body = request.payload_json
        if body is None:
            body = payloads.encode(request.payload)
        wire = self._options.key.wire(request.idempotency_key)
        attributes = {
            name: value
            for name, value in queue_kit.message_headers(request, wire_key=wire).items()
            if value  # SQS refuses an empty attribute value
        }
        if len(attributes) > MAX_ATTRIBUTES:  # a header added to queue_kit without counting
            raise InvalidRequest(
                f"{len(attributes)} message attributes; SQS takes {MAX_ATTRIBUTES}"
            )
        problem = _body_problem(body) or self._size_problem(target, body, attributes)
        if problem is not None:
            raise InvalidRequest(problem)
        params: dict[str, Any] = {
            "QueueUrl": target.queue_url,
            "MessageBody": body,
            "MessageAttributes": {
                name: {"DataType": _STRING, "StringValue": value}
                for name, value in attributes.items()
            },
        }
        if target.fifo:
            key_problem = self._options.key.problem(wire)
            if key_problem is not None:
                raise InvalidRequest(f"{key_problem} (SQS's MessageDeduplicationId)")
            params["MessageDeduplicationId"] = wire
            params["MessageGroupId"] = target.group.render(request) if target.group else wire
        elif target.delay_seconds is not None:
            params["DelaySeconds"] = target.delay_seconds
        return params, body

    def _size_problem(self, target: Target, body: str, attributes: Mapping[str, str]) -> str | None:
        limit = self._limits.get(target.queue_url, self._options.max_message_bytes)
        size = len(body.encode()) + sum(
            len(name.encode()) + len(_STRING) + len(value.encode())
            for name, value in attributes.items()
        )
        if size <= limit:
            return None
        return (
            f"the message is {size:,} bytes with its attributes; the queue takes at most "
            f"{limit:,} (max_message_bytes, or the queue's MaximumMessageSize)"
        )

    def _target(self, action: str) -> Target:
        target = queue_kit.action_of(self._options.targets, action)
        if target is None:
            known = ", ".join(sorted(self._options.targets)) or "none"
            raise InvalidRequest(
                f"provider {self._name} has no action {action!r} (it has: {known})"
            )
        return target

    def _deadline(self) -> float:
        return (self._options.timeout * 2 + _GUARD).total_seconds()

    async def _open(self) -> Any:
        """The provider's one client, opened on first use; a failed opening is tried again by
        the next send."""
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is None:
                timeout = self._options.timeout.total_seconds()
                config = AioConfig(
                    retries={"total_max_attempts": 1, "mode": "standard"},
                    connect_timeout=timeout,
                    read_timeout=timeout,
                    max_pool_connections=max(1, self._options.max_connections),
                    user_agent_appid="outbox",
                )
                session = AioSession(profile=self._options.profile)
                context = session.create_client(
                    "sqs",
                    region_name=self._options.region,
                    endpoint_url=self._options.endpoint_url,
                    config=config,
                )
                self._client = await context.__aenter__()
                self._context = context
        return self._client

    async def aclose(self) -> None:
        async with self._lock:
            context, self._context, self._client = self._context, None, None
        if context is not None:
            await context.__aexit__(None, None, None)


def _body_problem(body: str) -> str | None:
    found = _REFUSED_CHARACTER.search(body)
    if found is None:
        return None
    return (
        f"the message holds U+{ord(found.group()):04X} at character {found.start():,}, which "
        "SQS refuses (it takes the XML characters only)"
    )


def build(
    ps: ProviderSettings, environ: Mapping[str, str] | None, *, concurrency: int
) -> SqsProvider:
    """The provider of ``ps``: its options checked now (ConfigError names the key); no
    connection, and no credential looked up, until start or the first send."""
    return SqsProvider(ps.name, read_options(ps, environ, concurrency=concurrency))

"""`type = "amqp"`: each operation published to RabbitMQ through aio-pika, with publisher
confirms (docs/providers.md, "RabbitMQ").

The stored key is the message's ``message_id`` property, on every attempt. RabbitMQ itself does
not deduplicate: its consumers do, by that id, for as long as they remember ids, and that is
the provider's ``key_retention``, which the user sets to what the consumers keep. Inside it, a
publish whose confirmation was lost is sent again with the same id and the consumers drop the
copy; after it, the operation goes to reconciliation (a person: RabbitMQ cannot be asked whether
a message was taken).

One connection per provider, opened when the first send needs it and again after it breaks;
publishes are spread over a few channels, each in confirm mode and carrying many publishes in
flight at once (aiormq holds a channel's lock only while it writes a publish's frames, and
matches the confirmations by delivery tag as they arrive).
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import aio_pika
import aiormq.exceptions as amqp_errors
import structlog
from aio_pika.abc import AbstractChannel, AbstractConnection, DeliveryMode

from outbox.config.settings import ProviderSettings
from outbox.core import payloads
from outbox.providers import building, queue_kit
from outbox.providers.amqp import faults
from outbox.providers.amqp.config import SHORTSTR_BYTES, AmqpOptions, Route, amqp_options
from outbox.providers.base import (
    Failed,
    InvalidRequest,
    SendRequest,
    SendResult,
    Succeeded,
    transient,
    unknown,
)

log = structlog.get_logger("outbox.providers.amqp")

APP_ID: Final = "outbox"
CONTENT_TYPE: Final = "application/json"
# What an unroutable message sent with unroutable = "succeed" records as its result.
NOT_ROUTED: Final[Mapping[str, Any]] = {"routed": False}

Connection = AbstractConnection


def build(
    ps: ProviderSettings, environ: Mapping[str, str] | None = None, *, concurrency: int
) -> AmqpProvider:
    """The provider of ``ps`` (outbox.providers.registry calls it); ConfigError names the key
    of any mistake."""
    return AmqpProvider(
        ps.name, ps.key_retention, ps.timeout, amqp_options(ps, environ, concurrency=concurrency)
    )


class AmqpProvider:
    """Publishes to RabbitMQ; ``send`` never raises."""

    def __init__(
        self, name: str, key_retention: timedelta, timeout: timedelta, options: AmqpOptions
    ) -> None:
        self._name = name
        self._key_retention = key_retention
        self._timeout = timeout.total_seconds()
        self._options = options
        self._link: _Link | None = None
        self._connecting: asyncio.Task[_Link] | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def key_retention(self) -> timedelta:
        return self._key_retention

    @property
    def actions(self) -> frozenset[str]:
        return frozenset(self._options.routes)

    def check(self, action: str, payload: Mapping[str, Any]) -> None:
        if queue_kit.action_of(self._options.routes, action) is None:
            known = ", ".join(sorted(self._options.routes)) or "none"
            raise InvalidRequest(
                f"provider {self._name} has no action {action!r} (it has: {known})"
            )

    def check_key(self, action: str, key: str) -> None:
        """Refuse a key the message_id property cannot carry (a short string: 255 bytes)."""
        if building.key_problem(key) is not None:
            return  # no key outbox makes: send records it as a message it cannot build
        problem = self._options.key.problem(self._options.key.wire(key))
        if problem is not None:
            raise InvalidRequest(problem)

    async def start(self) -> None:
        """Connect, and check that every action's exchange exists: a missing one is logged
        (an application may declare its topology after outbox starts), never a refusal to
        start; a broker that is down is retried by the first send."""
        try:
            async with asyncio.timeout(self._timeout):
                link = await self._connected()
                missing = [
                    r.exchange
                    for r in self._options.routes.values()
                    if r.exchange and not await link.exchange_exists(r.exchange)
                ]
            for exchange in missing:
                log.warning(
                    "an action's exchange does not exist: its operations are quarantined "
                    "until it is declared",
                    provider=self._name,
                    exchange=exchange,
                )
        except Exception as exc:  # noqa: BLE001 (any failure here is the first send's again)
            log.warning(
                "RabbitMQ is not reachable at start; sends fail transient until it is",
                provider=self._name,
                broker=self._options.broker,
                error_class=type(exc).__name__,
            )

    async def send(self, request: SendRequest) -> SendResult:
        try:
            return await self._send(request)
        except Exception as exc:  # noqa: BLE001 (send never raises; what left is unknown)
            return unknown("internal_error", f"publishing failed: {type(exc).__name__}")

    async def _send(self, request: SendRequest) -> SendResult:
        built = self._build(request)
        if isinstance(built, Failed):
            return built
        route, wire, message = built
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout
        ready = await self._ready(route, deadline)
        if isinstance(ready, Failed):
            return ready
        link, channel = ready
        return await self._publish(link, channel, route, wire, message=message, deadline=deadline)

    async def _publish(
        self,
        link: _Link,
        channel: AbstractChannel,
        route: Route,
        wire: str,
        *,
        message: aio_pika.Message,
        deadline: float,
    ) -> SendResult:
        """One publish and its confirmation: from here on, the message may have left."""
        loop = asyncio.get_running_loop()
        reference = f"{route.destination}/{wire}"
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                await aio_pika.Exchange(channel, route.exchange).publish(
                    message, route.routing_key, mandatory=route.mandatory
                )
        except amqp_errors.ChannelInvalidStateError:
            # aio-pika checks the channel before it writes: nothing of this message left.
            return transient("channel_closed", f"the channel to {self._options.broker} closed")
        except amqp_errors.PublishError as exc:
            if route.unroutable == "succeed":
                return Succeeded(reference, result=NOT_ROUTED)
            return faults.after_publish(exc, route, self._options.broker)
        except Exception as exc:  # noqa: BLE001 (the message may have left: unknown unless said)
            failed = faults.after_publish(exc, route, self._options.broker)
            if failed.error_class == "exchange_not_found":
                link.forget(route.exchange)  # deleted since it was checked: check it again
            return failed
        return Succeeded(reference)

    def _build(self, request: SendRequest) -> tuple[Route, str, aio_pika.Message] | Failed:
        """The action's route, the key as the message_id, and the message; or why it cannot
        be built (nothing is sent, no key window starts)."""
        route = queue_kit.action_of(self._options.routes, request.action)
        if route is None:
            return building.unsendable(f"provider {self._name} has no action {request.action!r}")
        problem = building.key_problem(request.idempotency_key)
        if problem is not None:
            return problem
        wire = self._options.key.wire(request.idempotency_key)
        try:
            return route, wire, _message(request, wire, route)
        except building.BUILD_ERRORS as exc:
            return building.unsendable(
                f"the message cannot be built: {type(exc).__name__} (the payload or a header)"
            )

    async def _ready(self, route: Route, deadline: float) -> tuple[_Link, AbstractChannel] | Failed:
        """The connection and a channel to publish on, the route's exchange checked; or why
        not, before anything of the message was written."""
        loop = asyncio.get_running_loop()
        try:
            link = await asyncio.wait_for(self._connected(), self._timeout)
        except Exception as exc:  # noqa: BLE001 (every way a connection fails: nothing sent)
            return faults.not_connected(exc, self._options.broker, self._options.vhost)
        if not await link.unblocked():
            return faults.blocked(self._options.broker)
        try:
            async with asyncio.timeout(max(0.0, deadline - loop.time())):
                channel = await link.channel()
                if route.exchange and not await link.exchange_exists(route.exchange):
                    return faults.exchange_missing(route)
        except Exception as exc:  # noqa: BLE001 (nothing of this message was written)
            return transient(
                "channel_failed", f"no channel to {self._options.broker}: {type(exc).__name__}"
            )
        return link, channel

    async def _connected(self) -> _Link:
        """The open connection, or one attempt to open it shared by every send that waits."""
        link = self._link
        if link is not None and link.open:
            return link
        if self._connecting is None or self._connecting.done():
            self._connecting = asyncio.ensure_future(self._connect())
            # Retrieved here too, so that an attempt every waiter gave up on logs nothing.
            self._connecting.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Link:
        old, self._link = self._link, None
        if old is not None:
            await old.close()
        opts = self._options
        context = None
        if opts.tls:
            context = ssl.create_default_context(cafile=opts.ca_file)
        connection = await aio_pika.connect(
            host=opts.host,
            port=opts.port,
            login=opts.username,
            password=opts.password,
            virtualhost=opts.vhost,
            ssl=opts.tls,
            ssl_context=context,
            timeout=self._timeout,
            client_properties={"connection_name": f"outbox {self._name}"},
        )
        self._link = _Link(connection, opts.channels)
        log.info("connected to RabbitMQ", provider=self._name, broker=opts.broker)
        return self._link

    async def aclose(self) -> None:
        connecting, self._connecting = self._connecting, None
        if connecting is not None and not connecting.done():
            connecting.cancel()
        link, self._link = self._link, None
        if link is not None:
            await link.close()


class _Link:
    """One connection and its channels: a few for publishing, one for checking exchanges (a
    passive declare of a missing exchange closes its channel, never a publishing one)."""

    def __init__(self, connection: Connection, channels: int) -> None:
        self._connection = connection
        self._channels: list[AbstractChannel | None] = [None] * channels
        self._opening: list[asyncio.Lock] = [asyncio.Lock() for _ in range(channels)]
        self._next = itertools.cycle(range(channels))
        self._checker: AbstractChannel | None = None
        self._checking = asyncio.Lock()
        self._exchanges: set[str] = set()

    @property
    def open(self) -> bool:
        """Whether the connection still works: aio-pika's Connection.is_closed stays false
        after the broker closed it (a broker stopped with CONNECTION_FORCED), aiormq's does
        not."""
        if self._connection.is_closed:
            return False
        underlay = getattr(getattr(self._connection, "transport", None), "connection", None)
        return underlay is not None and not underlay.is_closed

    async def unblocked(self) -> bool:
        """Whether the broker takes publishes: False while it has sent connection.blocked (a
        memory or disk alarm) and not yet connection.unblocked. aiormq's ``ready()`` waits for
        both the connection and its unblocking; given one turn of the loop, it is done at once
        unless blocked."""
        transport = getattr(self._connection, "transport", None)
        underlay = getattr(transport, "connection", None)
        if underlay is None:
            return True
        probe = asyncio.ensure_future(underlay.ready())
        await asyncio.sleep(0)
        if probe.done():
            return True
        probe.cancel()
        return False

    async def channel(self) -> AbstractChannel:
        """The next publishing channel, opened again if the broker closed it."""
        slot = next(self._next)
        channel = self._channels[slot]
        if channel is not None and not channel.is_closed:
            return channel
        async with self._opening[slot]:
            channel = self._channels[slot]
            if channel is None or channel.is_closed:
                channel = await self._connection.channel(
                    publisher_confirms=True, on_return_raises=True
                )
                self._channels[slot] = channel
            return channel

    async def exchange_exists(self, name: str) -> bool:
        """Whether ``name`` exists, by a passive declare, once per connection while it does."""
        if name in self._exchanges:
            return True
        async with self._checking:
            if name in self._exchanges:
                return True
            if self._checker is None or self._checker.is_closed:
                self._checker = await self._connection.channel(publisher_confirms=False)
            try:
                await self._checker.declare_exchange(name, passive=True)
            except amqp_errors.ChannelNotFoundEntity:
                return False
            self._exchanges.add(name)
            return True

    def forget(self, exchange: str) -> None:
        self._exchanges.discard(exchange)

    async def close(self) -> None:
        try:
            await self._connection.close()
        except Exception as exc:  # noqa: BLE001 (a broken connection is closed all the same)
            log.debug("closing the RabbitMQ connection failed", error_class=type(exc).__name__)


def _message(request: SendRequest, wire: str, route: Route) -> aio_pika.Message:
    body = request.payload_json
    if body is None:
        body = payloads.encode(request.payload)
    headers: dict[str, Any] = dict(queue_kit.message_headers(request))
    correlation = headers.get(queue_kit.CORRELATION_ID)
    if correlation is not None and len(correlation.encode()) > SHORTSTR_BYTES:
        correlation = None  # the property is a short string; the header carries it whole
    return aio_pika.Message(
        body.encode("utf-8"),
        headers=headers,
        content_type=CONTENT_TYPE,
        delivery_mode=DeliveryMode.PERSISTENT if route.persistent else DeliveryMode.NOT_PERSISTENT,
        message_id=wire,
        correlation_id=correlation,
        timestamp=datetime.now(UTC),
        app_id=APP_ID,
    )


__all__ = ["AmqpProvider", "build"]

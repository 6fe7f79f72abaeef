"""The connection of a `type = "nats"` provider (outbox.providers.nats.provider): one per provider,
opened on the first need, shared by every publish, opened again after it is lost; and before any
publish goes out on a new one, the duplicate_window of every stream the actions use read and
checked against key_retention (queue_kit.check_window).

nats-py's own reconnection is off: it would buffer publishes while disconnected and send them on
a connection whose windows nobody checked. A lost connection is a done ``Link.closed``, which
fails the publishes in flight on it at once (unknown); the next send opens a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from datetime import timedelta
from typing import Any, Final

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy

from outbox.config.settings import ConfigError, ProviderSettings
from outbox.providers import queue_kit
from outbox.providers.nats import faults as nats_faults
from outbox.providers.nats.config import NatsOptions

# nats-py pings every 2 minutes and gives up after 2 unanswered: a connection that died
# silently (a partition, no RST) would take 6 minutes to notice, every publish on it timing
# out. 10 s and 2 notice it in about 30 s, for one PING a connection each 10 s.
PING_INTERVAL: Final = 10
MAX_OUTSTANDING_PINGS: Final = 2
_PERMISSION: Final = "permissions violation for publish to "

log = structlog.get_logger("outbox.providers")


class Link:
    """One connection and its JetStream context, whose streams' windows were checked. ``closed``
    is done once it is lost; ``denied`` holds, per subject, a future done when the server
    refused a publish to it (a -ERR, while the publish waits for an acknowledgement)."""

    def __init__(self) -> None:
        self.closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.denied: dict[str, asyncio.Future[None]] = {}
        self.nc: Client | None = None
        self.js: JetStreamContext | None = None
        self.closing = False  # closed on purpose: no warning

    def refused(self, subject: str) -> asyncio.Future[None]:
        future = self.denied.get(subject)
        if future is None or future.done():
            future = self.denied[subject] = asyncio.get_running_loop().create_future()
        return future

    async def close(self, within: float = 5.0) -> None:
        self.closing = True
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), within)
        self.lost()

    def lost(self) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class Connection:
    """A provider's connection: ``get()`` the open one, or a new one whose windows were checked
    (a ConfigError when they refuse key_retention)."""

    def __init__(self, ps: ProviderSettings, options: NatsOptions) -> None:
        self._ps = ps
        self.options = options
        self._link: Link | None = None
        self._opening: asyncio.Task[Link] | None = None
        self._next_server = 0
        self._warned: set[str] = set()

    @property
    def name(self) -> str:
        return self.options.name

    async def get(self) -> Link:
        """The open connection, or a new one whose windows were checked: one attempt at a time,
        shared by every send waiting for it."""
        link = self._link
        if link is not None and not link.closed.done():
            return link
        opening = self._opening
        if opening is None or opening.done():
            opening = self._opening = asyncio.create_task(self._open())
            opening.add_done_callback(_retrieve)
        return await asyncio.shield(opening)

    async def _open(self) -> Link:
        link = Link()
        link.nc = await self._connect(link)
        try:
            link.js = link.nc.jetstream(
                timeout=self.options.timeout.total_seconds(), domain=self.options.domain
            )
            await self._check_windows(link.js)
        except BaseException as exc:
            await link.close()
            if isinstance(exc, ConfigError):
                log.error("NATS provider refused to publish", provider=self.name, error=str(exc))  # noqa: TRY400
            raise
        self._link = link
        return link

    async def _connect(self, link: Link) -> Client:
        """A connection to the first server that takes one, starting after the last one
        tried: each server twice at most (nats-py's max_reconnect_attempts=1 counts the
        connection's first attempt too), at once."""
        servers = self.options.servers
        self._next_server = (self._next_server + 1) % len(servers)
        turn = servers[self._next_server :] + servers[: self._next_server]
        nc = Client()
        try:
            await nc.connect(list(turn), **self._connect_options(link))
        except BaseException:
            # nats-py leaves the socket of a refused connection (bad credentials) open.
            link.closing = True
            with contextlib.suppress(Exception):
                await nc.close()
            raise
        return nc

    def _connect_options(self, link: Link) -> dict[str, Any]:
        o = self.options

        async def error(exc: Exception) -> None:
            text = str(exc)
            at = text.lower().find(_PERMISSION)
            if at >= 0:
                subject = text[at + len(_PERMISSION) :].strip().strip("'\"")
                future = link.denied.get(subject)
                if future is not None and not future.done():
                    future.set_result(None)

        async def closed() -> None:
            if not link.closed.done() and not link.closing:
                log.warning("the connection to NATS is lost", provider=self.name)
            link.lost()

        options: dict[str, Any] = {
            "name": f"outbox {o.name}",
            "allow_reconnect": False,
            "dont_randomize": True,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0,
            "connect_timeout": max(1, round(o.timeout.total_seconds())),
            "ping_interval": PING_INTERVAL,
            "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
            "error_cb": error,
            "disconnected_cb": closed,
            "closed_cb": closed,
        }
        if o.creds_file is not None:
            options["user_credentials"] = o.creds_file
        if o.token is not None:
            options["token"] = o.token
        if o.user is not None:
            options["user"], options["password"] = o.user, o.password
        if o.tls is not None:
            context = ssl.create_default_context(cafile=o.tls.ca_file)
            if o.tls.cert_file and o.tls.key_file:
                context.load_cert_chain(o.tls.cert_file, o.tls.key_file)
            options["tls"] = context
        return options

    async def _check_windows(self, js: JetStreamContext) -> None:
        """Refuse a key_retention longer than the shortest duplicate_window of the streams the
        actions use; a stream that does not exist is a ConfigError naming it."""
        windows: dict[str, timedelta] = {}
        for stream in self.options.streams:
            try:
                info = await js.stream_info(stream)
            except nats.js.errors.NotFoundError:
                key = f"providers.{self.name}.actions"
                raise ConfigError(
                    f"{key}: the stream {stream} does not exist; create it (its "
                    "duplicate_window at least key_retention) or name another",
                    key=key,
                ) from None
            windows[stream] = timedelta(seconds=info.config.duplicate_window or 0)
            self._warn(stream, info.config.retention, list(info.config.subjects or ()))
        stream = min(windows, key=lambda s: windows[s])
        queue_kit.check_window(self._ps, windows[stream], f"the stream {stream}'s duplicate_window")

    def _warn(self, stream: str, retention: object, subjects: list[str]) -> None:
        """Say once what the streams make of outbox's promise."""
        if retention not in (None, RetentionPolicy.LIMITS) and stream not in self._warned:
            self._warned.add(stream)
            log.warning(
                "the stream removes messages once consumed: a server restart forgets their "
                "Nats-Msg-Id, and a retry then is a second message",
                provider=self.name,
                stream=stream,
                retention=str(retention),
            )
        for action, route in self.options.routes.items():
            bound = any(nats_faults.subject_matches(p, route.subject) for p in subjects)
            if route.stream == stream and not bound and action not in self._warned:
                self._warned.add(action)
                log.warning(
                    "the action's subject is not the stream's: its operations will be "
                    "quarantined as unroutable",
                    provider=self.name,
                    action=action,
                    subject=route.subject,
                    stream=stream,
                )

    async def aclose(self) -> None:
        if self._opening is not None and not self._opening.done():
            self._opening.cancel()
        link, self._link = self._link, None
        if link is not None:
            await link.close(self.options.timeout.total_seconds())


def _retrieve(task: asyncio.Task[Link]) -> None:
    """Mark a failed attempt's exception seen: the sends that waited for it had it."""
    if not task.cancelled():
        task.exception()

"""The settings of a `type = "amqp"` provider, read and checked (docs/providers.md, "RabbitMQ").

Pure of aio-pika: what is checked here is checked when the configuration is read, so that a
provider that starts can publish every operation its actions describe.
"""

from __future__ import annotations

import ipaddress
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from outbox.config.schema import file_keys
from outbox.config.secrets import read_secret
from outbox.config.settings import ConfigError, ProviderSettings
from outbox.providers import queue_kit
from outbox.providers.amqp import options as amqp_settings
from outbox.providers.kit import KeyForm, KeySpec, reject_unknown

_KEYS: Final = tuple(file_keys(amqp_settings.OPTIONS))
_ACTION_KEYS: Final = ("exchange", "routing_key", "mandatory", "persistent", "unroutable")
UNROUTABLE_CHOICES: Final = ("quarantine", "succeed")
# AMQP 0-9-1 writes exchange names, routing keys and the message_id property as short strings:
# at most 255 bytes of UTF-8.
SHORTSTR_BYTES: Final = 255
DEFAULT_PORTS: Final = {"amqp": 5672, "amqps": 5671}
# RabbitMQ's default user, which the broker takes only from loopback (loopback_users).
GUEST: Final = "guest"


@dataclass(frozen=True, slots=True)
class Route:
    """Where one action's messages go, and what becomes of one nobody takes."""

    exchange: str
    routing_key: str
    mandatory: bool = True
    persistent: bool = True
    unroutable: str = "quarantine"

    @property
    def destination(self) -> str:
        """The exchange and routing key, as messages and references name them ("" is the
        default exchange, which RabbitMQ calls amq.default)."""
        return f"{self.exchange or 'amq.default'}/{self.routing_key}"


@dataclass(frozen=True, slots=True, repr=False)
class AmqpOptions:
    host: str
    port: int
    vhost: str
    tls: bool
    username: str
    password: str
    routes: Mapping[str, Route]
    key: KeySpec
    channels: int
    ca_file: str | None = None

    @property
    def broker(self) -> str:
        """The broker as logs and messages name it: never the credentials."""
        scheme = "amqps" if self.tls else "amqp"
        vhost = urllib.parse.quote(self.vhost, safe="")
        return f"{scheme}://{self.host}:{self.port}/{vhost}"

    def __repr__(self) -> str:
        return f"AmqpOptions(broker={self.broker!r}, username={self.username!r}, password=***)"


def amqp_options(
    ps: ProviderSettings, environ: Mapping[str, str] | None = None, *, concurrency: int
) -> AmqpOptions:
    """The settings of ``ps``, checked, the password read from its source; ConfigError names
    the key of any mistake."""
    reject_unknown(ps, _KEYS)
    where = f"providers.{ps.name}"
    scheme, host, port, vhost = _broker(ps.options.get("url"), f"{where}.url")
    username, password = _credentials(ps, host, environ)
    ca_file = queue_kit.text(ps.options, "ca_file", where)
    if ca_file is not None and scheme != "amqps":
        raise ConfigError(f"{where}.ca_file is for an amqps:// url", key=f"{where}.ca_file")
    tables = queue_kit.action_tables(ps, _ACTION_KEYS, required=("routing_key",))
    routes = {name: _route(table, _action_where(where, name)) for name, table in tables.items()}
    return AmqpOptions(
        host=host,
        port=port,
        vhost=vhost,
        tls=scheme == "amqps",
        username=username,
        password=password,
        routes=routes,
        key=_key_spec(ps, where),
        channels=max(1, min(_channels(ps, where), concurrency)),
        ca_file=ca_file,
    )


def _broker(url: object, at: str) -> tuple[str, str, int, str]:
    """The scheme, host, port and virtual host of ``url``."""
    if not isinstance(url, str) or not url.startswith(("amqp://", "amqps://")):
        raise ConfigError(f"{at} must be an amqp:// or amqps:// URL", key=at)
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        # Never quote the URL: it holds a password.
        raise ConfigError(
            f"{at} must not carry credentials: set username, and password = "
            '{env = "VAR"} or {file = "/path"}',
            key=at,
        )
    if parts.query or parts.fragment:
        raise ConfigError(
            f"{at} takes no query or fragment (options are keys of their own)", key=at
        )
    try:
        port = parts.port or DEFAULT_PORTS[parts.scheme]
    except ValueError:
        raise ConfigError(f"{at} has a port that is no number from 1 to 65535", key=at) from None
    if not parts.hostname:
        raise ConfigError(f"{at} names no host", key=at)
    path = parts.path[1:] if parts.path.startswith("/") else parts.path
    vhost = urllib.parse.unquote(path) if path else "/"
    if "/" in path:
        raise ConfigError(
            f"{at}: a virtual host with a slash in its name is written %2F ({path!r})", key=at
        )
    if len(vhost.encode()) > SHORTSTR_BYTES:
        raise ConfigError(f"{at}: the virtual host is longer than {SHORTSTR_BYTES} bytes", key=at)
    return parts.scheme, parts.hostname, port, vhost


def _credentials(
    ps: ProviderSettings, host: str, environ: Mapping[str, str] | None
) -> tuple[str, str]:
    where = f"providers.{ps.name}"
    username = queue_kit.text(ps.options, "username", where)
    spec = ps.options.get("password")
    if spec is None:
        if username is not None and username != GUEST:
            raise ConfigError(
                f'{where}.password is required with username: {{env = "VAR"}} or '
                '{file = "/path"}',
                key=f"{where}.password",
            )
        if not _loopback(host):
            raise ConfigError(
                f"{where}: RabbitMQ takes guest/guest only from loopback, and {host} is not: "
                'set username, and password = {env = "VAR"} or {file = "/path"}',
                key=f"{where}.password",
            )
        return GUEST, GUEST
    if username is None:
        raise ConfigError(f"{where}.username is required with password", key=f"{where}.username")
    if not isinstance(spec, Mapping):
        # Never quote it: it may be the password itself.
        raise ConfigError(
            f'{where}.password must be {{env = "VAR"}} or {{file = "/path"}}; passwords are '
            "never written in the config file",
            key=f"{where}.password",
        )
    env = os.environ if environ is None else environ
    return username, read_secret(spec, key=f"{where}.password", environ=env)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route(table: Mapping[str, Any], where: str) -> Route:
    exchange = table.get("exchange", "")
    if not isinstance(exchange, str):
        raise ConfigError(f"{where}.exchange must be a string", key=f"{where}.exchange")
    _shortstr(exchange, f"{where}.exchange")
    routing_key = table.get("routing_key")
    if not isinstance(routing_key, str):
        raise ConfigError(f"{where}.routing_key must be a string", key=f"{where}.routing_key")
    _shortstr(routing_key, f"{where}.routing_key")
    if not exchange and not routing_key:
        raise ConfigError(
            f"{where}.routing_key: the default exchange routes by queue name, so it names a queue",
            key=f"{where}.routing_key",
        )
    unroutable = table.get("unroutable", "quarantine")
    if unroutable not in UNROUTABLE_CHOICES:
        raise ConfigError(
            f"{where}.unroutable must be one of {', '.join(UNROUTABLE_CHOICES)}",
            key=f"{where}.unroutable",
        )
    mandatory = queue_kit.boolean(table, "mandatory", where, default=True)
    if unroutable == "succeed" and not mandatory:
        raise ConfigError(
            f'{where}.unroutable = "succeed" needs mandatory = true (without it the broker '
            "drops an unroutable message and says nothing)",
            key=f"{where}.unroutable",
        )
    return Route(
        exchange=exchange,
        routing_key=routing_key,
        mandatory=mandatory,
        persistent=queue_kit.boolean(table, "persistent", where, default=True),
        unroutable=str(unroutable),
    )


def _shortstr(value: str, at: str) -> None:
    if len(value.encode()) > SHORTSTR_BYTES:
        raise ConfigError(f"{at} is longer than AMQP's {SHORTSTR_BYTES} bytes", key=at)
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in value):
        raise ConfigError(f"{at} holds control characters", key=at)


def _key_spec(ps: ProviderSettings, where: str) -> KeySpec:
    form = ps.options.get("key_form", KeyForm.STORED)
    if form not in KeyForm.ALL:
        raise ConfigError(
            f"{where}.key_form must be one of {', '.join(KeyForm.ALL)}", key=f"{where}.key_form"
        )
    # The message_id property is a short string; outbox's keys are visible ASCII, so a
    # character is a byte.
    return KeySpec(header=None, form=str(form), max_length=SHORTSTR_BYTES)


def _channels(ps: ProviderSettings, where: str) -> int:
    value = ps.options.get("channels", amqp_settings.DEFAULT_CHANNELS)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 64:
        raise ConfigError(
            f"{where}.channels must be an integer from 1 to 64", key=f"{where}.channels"
        )
    return value


def _action_where(where: str, name: str) -> str:
    plain = name.replace("_", "").replace("-", "").isalnum()
    return f"{where}.actions.{name}" if plain else f'{where}.actions."{name}"'

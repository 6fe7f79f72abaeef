"""The settings of a `type = "nats"` provider (outbox.providers.nats.options declares them), read
and checked: every mistake is a ConfigError naming its key, before anything connects.

Pure of the client library: the connection is outbox.providers.nats.provider's.
"""

from __future__ import annotations

import ipaddress
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

from outbox.config.schema import file_keys
from outbox.config.secrets import read_secret
from outbox.config.settings import ConfigError, ProviderSettings
from outbox.providers import queue_kit
from outbox.providers.kit import KeyForm, KeySpec, reject_unknown
from outbox.providers.nats.options import DEFAULT_SERVERS, OPTIONS

# The header JetStream deduplicates by (docs.nats.io, "Message Deduplication"). A NATS header
# value is a MIME header's: visible ASCII is carried as it is (verified against nats-server
# 2.9: every character of !-~ and 255 of them come back alike, and a repeat is recognised).
MSG_ID: Final = "Nats-Msg-Id"
EXPECTED_STREAM: Final = "Nats-Expected-Stream"
ACTION_KEYS: Final = ("subject", "stream")
SCHEMES: Final = ("nats", "tls")
# Subjects outbox never publishes to: JetStream's API and the system account's, where a payload
# would be a command, and the inboxes replies travel on.
RESERVED_PREFIXES: Final = ("$JS.", "$JSC.", "$SYS.", "$NRG.", "_INBOX.")
_TOKEN: Final = re.compile(r"[!-~]+")  # visible ASCII: no space, tab, CR, LF or NUL
_STREAM_NAME: Final = re.compile(r"[!-~]{1,255}")
_TLS_KEYS: Final = ("ca_file", "cert_file", "key_file")


@dataclass(frozen=True, slots=True)
class Route:
    """Where one action's messages go: a literal subject, and the stream that must store it."""

    subject: str
    stream: str


@dataclass(frozen=True, slots=True)
class Tls:
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None


@dataclass(frozen=True, slots=True, repr=False)
class NatsOptions:
    """A nats provider's settings, secrets read from their sources (never shown)."""

    name: str
    servers: tuple[str, ...]
    routes: Mapping[str, Route]
    key: KeySpec
    timeout: timedelta
    key_retention: timedelta
    creds_file: str | None = None
    token: str | None = field(default=None)
    user: str | None = None
    password: str | None = field(default=None)
    tls: Tls | None = None
    domain: str | None = None

    @property
    def streams(self) -> tuple[str, ...]:
        """Every stream an action names, once each, in order."""
        return tuple(dict.fromkeys(route.stream for route in self.routes.values()))

    def __repr__(self) -> str:
        return (
            f"NatsOptions(name={self.name!r}, servers={self.servers!r}, streams={self.streams!r})"
        )


def nats_options(ps: ProviderSettings, environ: Mapping[str, str] | None = None) -> NatsOptions:
    """The settings of ``ps``, checked, credentials read from the environment or files."""
    reject_unknown(ps, tuple(file_keys(OPTIONS)))
    where = f"providers.{ps.name}"
    options = ps.options
    tls = _tls(options.get("tls"), f"{where}.tls")
    servers = _servers(options.get("servers", DEFAULT_SERVERS), f"{where}.servers")
    token = _secret(options, "token", where, environ)
    password = _secret(options, "password", where, environ)
    user = _user(options.get("user"), f"{where}.user", environ)
    if (user is None) != (password is None):
        raise ConfigError(f"{where}.user and {where}.password go together", key=f"{where}.user")
    if token is not None and user is not None:
        raise ConfigError(
            f"{where}: a token or a user and password, not both", key=f"{where}.token"
        )
    allow_insecure = queue_kit.boolean(options, "allow_insecure", where, default=False)
    if (token or password) and tls is None and not allow_insecure:
        plain = [url for url in servers if not _secure_or_local(url)]
        if plain:
            raise ConfigError(
                f"{where}.servers: {plain[0]} would carry the token or password in clear text; "
                f"use tls:// (or a {where}.tls table), or set {where}.allow_insecure = true",
                key=f"{where}.servers",
            )
    creds = _creds_file(options.get("creds_file"), f"{where}.creds_file", environ)
    return NatsOptions(
        name=ps.name,
        servers=servers,
        routes=_routes(ps),
        key=_key(options.get("key_form", KeyForm.STORED), f"{where}.key_form"),
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        creds_file=creds,
        token=token,
        user=user,
        password=password,
        tls=tls,
        domain=queue_kit.text(options, "domain", where, check=_name_problem),
    )


def subject_problem(subject: str) -> str | None:
    """Why ``subject`` is no literal subject outbox publishes to, or None."""
    tokens = subject.split(".")
    if not all(_TOKEN.fullmatch(token) for token in tokens):
        return "must be a literal subject: dot-separated tokens of visible ASCII, none empty"
    if "*" in subject or ">" in subject:
        return "must be a literal subject: no wildcard (* or >)"
    if subject.startswith(RESERVED_PREFIXES):
        return f"must not be a system subject ({', '.join(RESERVED_PREFIXES)})"
    return None


def _name_problem(name: str) -> str | None:
    if not _STREAM_NAME.fullmatch(name) or any(c in name for c in ".*>/\\"):
        return "must be a stream name: visible ASCII without . * > / or \\"
    return None


def _routes(ps: ProviderSettings) -> dict[str, Route]:
    tables = queue_kit.action_tables(ps, ACTION_KEYS, required=ACTION_KEYS)
    routes = {}
    for action, table in tables.items():
        at = f"providers.{ps.name}.actions.{action}"
        subject = queue_kit.required_text(table, "subject", at, check=subject_problem)
        stream = queue_kit.required_text(table, "stream", at, check=_name_problem)
        routes[action] = Route(subject, stream)
    return routes


def _creds_file(value: object, where: str, environ: Mapping[str, str] | None) -> str | None:
    """The credentials file, a relative name found in $CREDENTIALS_DIRECTORY (systemd's
    LoadCredential=), which must exist now: nats-py would only fail at each connection."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where} must be a file name", key=where)
    env = os.environ if environ is None else environ
    path = Path(value)
    directory = env.get("CREDENTIALS_DIRECTORY")
    if directory and not path.is_absolute():
        path = Path(directory) / path
    if not path.is_file():
        raise ConfigError(f"{where}: {path} is not a file", key=where)
    return str(path)


def _key(form: object, where: str) -> KeySpec:
    form = form.strip().lower() if isinstance(form, str) else form
    if form not in KeyForm.ALL:
        raise ConfigError(f"{where} must be one of {', '.join(KeyForm.ALL)}", key=where)
    # Every form fits a header: stored keys are 1 to 255 visible ASCII characters.
    return KeySpec(header=MSG_ID, form=str(form), max_length=255, characters="!-~")


def _servers(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",")]
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{where} must be an array of nats:// URLs", key=where)
    servers = []
    for url in value:
        if not isinstance(url, str):
            raise ConfigError(f"{where} must be an array of nats:// URLs", key=where)
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError:
            raise ConfigError(f"{where}: {url!r} is no URL", key=where) from None
        if parts.scheme not in SCHEMES or not parts.hostname:
            raise ConfigError(f"{where}: {url!r} must be nats://host:port or tls://host:port")
        if parts.username or parts.password:  # never quoted: the URL carries a secret
            raise ConfigError(
                f"{where}: a URL carries credentials; name them with token, user and password "
                "(read from the environment or a file) or creds_file",
                key=where,
            )
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ConfigError(f"{where}: {url!r} must be only scheme, host and port", key=where)
        servers.append(f"{parts.scheme}://{parts.hostname}:{port or 4222}")
    return tuple(servers)


def _secure_or_local(url: str) -> bool:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "tls" or parts.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parts.hostname or "").is_loopback
    except ValueError:
        return False


def _secret(
    options: Mapping[str, Any], key: str, where: str, environ: Mapping[str, str] | None
) -> str | None:
    spec = options.get(key)
    if spec is None:
        return None
    return read_secret(spec, key=f"{where}.{key}", environ=environ)


def _user(value: object, where: str, environ: Mapping[str, str] | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, Mapping):
        return read_secret(value, key=where, environ=environ)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f'{where} must be a user name or {{env = "VAR"}}', key=where)
    return value


def _tls(value: object, where: str) -> Tls | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table ({', '.join(_TLS_KEYS)})", key=where)
    for key, item in value.items():
        if key not in _TLS_KEYS:
            raise ConfigError(f"{where}.{key} is not known; valid: {', '.join(_TLS_KEYS)}")
        if not isinstance(item, str) or not item.strip():
            raise ConfigError(f"{where}.{key} must be a file name", key=f"{where}.{key}")
    if ("cert_file" in value) != ("key_file" in value):
        raise ConfigError(f"{where}.cert_file and {where}.key_file go together", key=where)
    return Tls(value.get("ca_file"), value.get("cert_file"), value.get("key_file"))

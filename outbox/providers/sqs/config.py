"""Reads a `type = "sqs"` provider's table into SqsOptions, checking every key, so that a provider
that starts can build each message its configuration describes (docs/providers.md, "Amazon SQS").

Pure of the client library: the provider (outbox.providers.sqs.provider) brings aiobotocore.
"""

from __future__ import annotations

import hashlib
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from outbox.config.schema import file_keys
from outbox.config.settings import ConfigError, ProviderSettings
from outbox.core.json_pointer import MISSING, Pointer, PointerError
from outbox.providers import queue_kit
from outbox.providers.base import InvalidRequest, SendRequest
from outbox.providers.kit import KeyForm, KeySpec, reject_unknown
from outbox.providers.sqs.options import MAX_MESSAGE_BYTES, OPTIONS

SQS_KEYS: Final = tuple(file_keys(OPTIONS))
ACTION_KEYS: Final = ("queue_url", "message_group", "delay_seconds")
# A FIFO queue forgets a MessageDeduplicationId 5 minutes after the send that carried it (the SQS
# Developer Guide, "Exactly-once processing"); nothing reads or changes that interval.
FIFO_WINDOW: Final = timedelta(minutes=5)
# MessageDeduplicationId and MessageGroupId: at most 128 alphanumerics and punctuation.
MAX_ID_CHARS: Final = 128
_ID: Final = re.compile(r"[!-~]{1,128}")
# DelaySeconds: 0 to 900 (15 minutes).
MAX_DELAY_SECONDS: Final = 900
# A queue's name (the URL's last segment): 1 to 80 of these, ".fifo" included.
_QUEUE_NAME: Final = re.compile(r"[A-Za-z0-9_-]{1,75}(\.fifo)?|[A-Za-z0-9_-]{1,80}")
# The region a public endpoint's host names: sqs.<region>.amazonaws.com(.cn) and the legacy
# <region>.queue.amazonaws.com.
_PUBLIC_HOST: Final = re.compile(
    r"sqs\.([a-z0-9-]+)\.amazonaws\.com(?:\.cn)?|([a-z0-9-]+)\.queue\.amazonaws\.com(?:\.cn)?"
)
_REGION: Final = re.compile(r"[a-z]{2}(-[a-z0-9]+)+-[0-9]+")
_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1"})
# What id_safe leaves as it is: visible ASCII but "%".
_ID_SAFE_CHARS: Final = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
_ID_SAFE: Final = re.compile(r"[!-$&-~]*")
_PLACEHOLDER: Final = re.compile(r"\{([^{}]*)\}")
# The operation's own identity a group may name: each is the same on every attempt, so every
# retry of an operation lands in the group of its first send (and its deduplication scope).
_FIELDS: Final = ("tenant_id", "operation_type", "operation_key")
# The longest payload value a group takes before hashing: far past any identifier.
_MAX_PART: Final = 1024


@dataclass(frozen=True, slots=True)
class Group:
    """A FIFO queue's MessageGroupId: literal text and placeholders, each ``("", text)``,
    ``("field", name)`` (an operation's tenant_id, operation_type or operation_key) or
    ``("payload", pointer)``."""

    text: str
    parts: tuple[tuple[str, str], ...]

    def render(self, request: SendRequest) -> str:
        """The group of this operation: the same on every attempt. Values travel
        percent-encoded where they hold what an id cannot (id_safe); a group
        longer than SQS takes travels as its SHA-256 in hex."""
        out = []
        for kind, name in self.parts:
            if not kind:
                out.append(name)
            elif kind == "field":
                out.append(id_safe(str(getattr(request, name))))
            else:
                out.append(id_safe(payload_text(request.payload, name)))
        group = "".join(out)
        if _ID.fullmatch(group):
            return group
        return hashlib.sha256(group.encode()).hexdigest()

    def check(self, payload: Mapping[str, Any]) -> None:
        """Raise InvalidRequest unless the payload has every value the group names."""
        for kind, name in self.parts:
            if kind == "payload":
                payload_text(payload, name)


@dataclass(frozen=True, slots=True)
class Target:
    """Where one action's messages go."""

    queue_url: str
    fifo: bool
    group: Group | None = None
    delay_seconds: int | None = None


@dataclass(frozen=True, slots=True)
class SqsOptions:
    region: str
    endpoint_url: str | None
    profile: str | None
    timeout: timedelta
    key_retention: timedelta
    key: KeySpec
    targets: Mapping[str, Target]
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_connections: int = 10


def read_options(
    ps: ProviderSettings, environ: Mapping[str, str] | None, *, concurrency: int
) -> SqsOptions:
    """The checked options of ``ps``; ConfigError names the key of any mistake. ``environ`` is
    not read: the AWS chain reads the process's own environment when the client opens."""
    del environ
    reject_unknown(ps, SQS_KEYS)
    where = f"providers.{ps.name}"
    options = ps.options
    region = queue_kit.required_text(options, "region", where, check=_region_problem)
    insecure = queue_kit.boolean(options, "allow_insecure", where, default=False)
    endpoint = queue_kit.text(
        options, "endpoint_url", where, check=lambda url: _url_problem(url, insecure)
    )
    profile = queue_kit.text(options, "profile", where)
    form = str(options.get("key_form", KeyForm.SHA256)).strip().lower()
    if form not in (KeyForm.SHA256, KeyForm.STORED):
        raise ConfigError(f'{where}.key_form must be "sha256" or "stored"', key=f"{where}.key_form")
    tables = queue_kit.action_tables(ps, ACTION_KEYS, required=("queue_url",))
    targets = {
        name: _target(table, f"{where}.actions.{name}", region, endpoint, insecure)
        for name, table in tables.items()
    }
    if any(t.fifo for t in targets.values()):
        # The queue's window is a constant: checked here, not read at start.
        queue_kit.check_window(ps, FIFO_WINDOW, "an SQS FIFO queue's deduplication interval")
    return SqsOptions(
        region=region,
        endpoint_url=endpoint,
        profile=profile,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        key=KeySpec(header=None, form=form, max_length=MAX_ID_CHARS, characters="!-~"),
        targets=targets,
        max_message_bytes=_max_bytes(options, where),
        max_connections=min(concurrency, ps.max_in_flight or concurrency),
    )


def _target(
    table: Mapping[str, Any], where: str, region: str, endpoint: str | None, insecure: bool
) -> Target:
    url = queue_kit.required_text(
        table, "queue_url", where, check=lambda u: _queue_url_problem(u, insecure)
    )
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    public = _PUBLIC_HOST.fullmatch(host)
    if public and endpoint is None and (public.group(1) or public.group(2)) != region:
        raise ConfigError(
            f"{where}.queue_url names a queue of another region than {region!r}: set the "
            "provider's region to the queue's (one provider per region)",
            key=f"{where}.queue_url",
        )
    fifo = url.endswith(".fifo")
    group = None
    if "message_group" in table:
        if not fifo:
            raise ConfigError(
                f"{where}.message_group applies only to a FIFO queue (a URL ending in .fifo)",
                key=f"{where}.message_group",
            )
        group = _group(table["message_group"], f"{where}.message_group")
    elif fifo:
        raise ConfigError(
            f"{where}.message_group is required for a FIFO queue: a literal group (one ordered "
            'stream) or placeholders such as "{tenant_id}" (ordered per tenant)',
            key=f"{where}.message_group",
        )
    delay = table.get("delay_seconds")
    if delay is not None:
        at = f"{where}.delay_seconds"
        if fifo:
            raise ConfigError(
                f"{at}: a FIFO queue takes no delay per message (set the queue's DelaySeconds)",
                key=at,
            )
        if isinstance(delay, bool) or not isinstance(delay, int) or not 0 <= delay <= 900:
            raise ConfigError(f"{at} must be an integer from 0 to {MAX_DELAY_SECONDS}", key=at)
    return Target(url, fifo, group, delay)


def _group(value: object, where: str) -> Group:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string", key=where)
    parts: list[tuple[str, str]] = []
    at = 0
    for match in _PLACEHOLDER.finditer(value):
        parts.append(("", value[at : match.start()]))
        name = match.group(1)
        if name in _FIELDS:
            parts.append(("field", name))
        elif name.startswith("/"):
            try:
                Pointer.parse(name)
            except PointerError as exc:
                raise ConfigError(
                    f"{where}: {{{name}}} is no JSON pointer: {exc}", key=where
                ) from None
            parts.append(("payload", name))
        else:
            raise ConfigError(
                f"{where}: {{{name}}} is no placeholder; use {{tenant_id}}, {{operation_type}}, "
                "{operation_key} or a JSON pointer into the payload such as {/customer_id}",
                key=where,
            )
        at = match.end()
    parts.append(("", value[at:]))
    kept = tuple(p for p in parts if p != ("", ""))
    literal = "".join(text for kind, text in kept if not kind)
    if literal and (not _ID.fullmatch(literal) or "{" in literal or "}" in literal):
        raise ConfigError(
            f"{where}: its literal text must be visible ASCII (SQS takes alphanumerics and "
            "punctuation), with braces only around placeholders",
            key=where,
        )
    if len(literal) > MAX_ID_CHARS:
        raise ConfigError(f"{where} is longer than SQS's {MAX_ID_CHARS} characters", key=where)
    return Group(value, kept)


def id_safe(value: str) -> str:
    """``value`` as an id's part: as it is where it is visible ASCII without "%", else
    percent-encoded as UTF-8 (a space as %20, "caf\u00e9" as caf%C3%A9), so that no two values
    meet."""
    if _ID_SAFE.fullmatch(value):
        return value
    return urllib.parse.quote(value, safe=_ID_SAFE_CHARS)


def payload_text(payload: Mapping[str, Any], pointer: str) -> str:
    """The payload's string or integer at ``pointer``, for a message group; InvalidRequest if
    it has none (the operation can never be sent as configured)."""
    value = Pointer.parse(pointer).read(payload)
    if value is MISSING:
        raise InvalidRequest(f"the payload has no {pointer}, which the message group needs")
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise InvalidRequest(f"the payload's {pointer} is no string or integer, for the group")
    text = str(value)
    if len(text) > _MAX_PART:
        raise InvalidRequest(f"the payload's {pointer} is too long for a message group")
    return text


def _region_problem(value: str) -> str | None:
    return None if _REGION.fullmatch(value) else 'must be an AWS region name such as "eu-west-1"'


def _url_problem(url: str, insecure: bool) -> str | None:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an https:// URL naming a host"
    if parts.username is not None or parts.password is not None:
        return "holds credentials (user:password@): they come from the AWS chain, never a URL"
    if parts.query or parts.fragment:
        return "must have no query or fragment"
    host = parts.hostname.lower()
    if parts.scheme == "http" and host not in _LOOPBACK and not insecure:
        return (
            f"is http:// to {host}: the messages would travel in clear text; use https://, "
            "or set allow_insecure = true"
        )
    return None


def _queue_url_problem(url: str, insecure: bool) -> str | None:
    problem = _url_problem(url, insecure)
    if problem is not None:
        return problem
    path = urllib.parse.urlsplit(url).path.rstrip("/")
    name = path.rsplit("/", 1)[-1]
    if path.count("/") < 2 or not _QUEUE_NAME.fullmatch(name):
        return (
            "must be a queue URL such as https://sqs.eu-west-1.amazonaws.com/123456789012/orders"
            " (an account and a queue name of letters, digits, - and _, .fifo for FIFO)"
        )
    return None


def _max_bytes(options: Mapping[str, Any], where: str) -> int:
    value = options.get("max_message_bytes", MAX_MESSAGE_BYTES)
    at = f"{where}.max_message_bytes"
    if isinstance(value, bool) or not isinstance(value, int) or not 1024 <= value <= (1 << 20):
        raise ConfigError(f"{at} must be an integer from 1024 to {MAX_MESSAGE_BYTES}", key=at)
    return value

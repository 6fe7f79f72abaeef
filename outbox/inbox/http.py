"""What the inbox reads from a delivery and answers to it: the identity from its headers (or a
key from its body), the headers a recorded response may keep, and the answer for each decision
(docs/design.md, "The inbox": in progress is 409 with Retry-After, a conflict 422, a malformed
delivery 400)."""

from __future__ import annotations

import base64
import binascii
import json
import re
import unicodedata
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from outbox.contracts.files import MAX_TYPE_LENGTH
from outbox.core.json_pointer import MISSING, Pointer
from outbox.inbox.core import Fingerprint, Identity, Outcome

Headers = Mapping[str, str]  # lower-case names
# Where a key or a tenant is found: the value, or None where the delivery has none. A source
# that can say more about why raises MissingIdentity with the reason.
KeySource = Callable[[Headers, bytes], str | None]
TenantSource = Callable[[Headers], str | None]

# Headers a recorded response keeps: what describes the representation and where it lives.
# Never a cookie, a credential, a hop-by-hop field or the date of the first answer.
STORED_HEADERS: Final = frozenset(
    {
        "content-type",
        "content-encoding",
        "content-language",
        "content-location",
        "location",
        "etag",
        "last-modified",
        "link",
        "cache-control",
        "expires",
        "vary",
    }
)
NEVER_STORED: Final = frozenset(
    {
        "set-cookie",
        "set-cookie2",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "cookie",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "content-length",
        "date",
        "server",
    }
)
# A foreign sender's key: an RFC 8941 string (as outbox's webhook sends it) or a bare token.
_SF_STRING: Final = re.compile(r'"((?:[^"\\]|\\["\\])*)"')
_DIGITS: Final = re.compile(r"[0-9]{1,19}")
_UUID: Final = re.compile(r"[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}")
# What the inbox stores for a sender that names no origin (outbox.unnamed_origin(), sql/0048):
# never a sender's own.
_UNNAMED: Final = "00000000-0000-0000-0000-000000000000"
# Outbox-Fingerprint (outbox.providers.kit.intent_headers): ":<base64>:" then parameters.
_PARAM_TEXT: Final = r';([a-z*][a-z0-9_.*-]*)="((?:[^"\\]|\\["\\])*)"'
_PARAM: Final = re.compile(_PARAM_TEXT)
_FINGERPRINT: Final = re.compile(r":([A-Za-z0-9+/=]{1,88}):((?:" + _PARAM_TEXT + ")*)")
# Outbox-Contract, percent-decoded: "<type>/v<N>", a type of 1 to 128 characters
# (outbox.contracts.files), a version of 1 to 2^31-1.
_CONTRACT: Final = re.compile(rf"(.{{1,{MAX_TYPE_LENGTH}}})/v([1-9][0-9]{{0,9}})", re.DOTALL)
_MAX_VERSION: Final = 2**31 - 1
_SF_ESCAPE: Final = re.compile(r"\\([\\\"])")
_SHA256_BYTES: Final = 32
# outbox.inbox_admit's bound on a key (sql/0042). A key read from a body is held to it here, so
# that an over-long value is refused with its reason rather than by the database.
MAX_KEY: Final = 512
POINTER_PREFIX: Final = "ptr:"
# The prefixes of the sources outbox knows, which say where a key came from.
KEY_SOURCES: Final = frozenset({"op", "key", "task", "msg", "ptr"})
# What the database refuses in a key (outbox.check_text: Cc, Cf, Zl, Zp), and lone surrogates,
# which a JSON string may spell (\ud800) but no UTF-8 can carry to PostgreSQL.
_UNSAFE: Final = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


class MissingIdentity(ValueError):
    """The delivery names no key or no tenant where one is required (HTTP 400)."""


def stored_headers(
    headers: tuple[tuple[str, str], ...], extra: frozenset[str] = frozenset()
) -> tuple[tuple[str, str], ...]:
    """The response headers a record keeps, in their order: the allowed ones, never a refused
    one even when ``extra`` names it."""
    keep = (STORED_HEADERS | extra) - NEVER_STORED
    return tuple((name, value) for name, value in headers if name.lower() in keep)


@dataclass(frozen=True)
class KeyFrom:
    """Where a delivery's key comes from. ``auto`` (the default) takes outbox's own identity,
    the operation (``Outbox-Operation-Id``; the database that sent it, ``Outbox-Origin``, is a
    part of the identity too: identity_of), so that every key generation of one operation,
    ``reconcile retry`` included, finds one record; else the ``Idempotency-Key`` header; else
    the task name Cloud Tasks sends (``X-CloudTasks-TaskName``), the same on every retry.
    ``header`` reads another header, ``json_pointer`` a member of the JSON body. Each source's
    prefix (``op:``, ``key:``, ``task:``, ``ptr:``, ``msg:``) keeps keys of different sources
    apart."""

    source: KeySource

    def read(self, headers: Headers, body: bytes) -> str:
        """The delivery's key; MissingIdentity, saying why, when it has none."""
        key = self.source(headers, body)
        if key is None:
            raise MissingIdentity("the delivery names no idempotency key")
        return key

    @staticmethod
    def auto() -> KeyFrom:
        def read(headers: Headers, body: bytes) -> str | None:
            operation = headers.get("outbox-operation-id")
            if operation is not None and _DIGITS.fullmatch(operation):
                return f"op:{int(operation)}"
            found = _header_key(headers, "idempotency-key")
            if found is None and (task := headers.get("x-cloudtasks-taskname")):
                return f"task:{task}"
            return found

        return KeyFrom(read)

    @staticmethod
    def header(name: str) -> KeyFrom:
        lower = name.lower()
        return KeyFrom(lambda headers, body: _header_key(headers, lower))

    @staticmethod
    def json_pointer(pointer: str) -> KeyFrom:
        """The string at ``pointer`` (RFC 6901, ``"/event/id"``) in the JSON body, as
        ``ptr:<value>``, for senders whose messages carry their own id. Nothing there, a value
        that is not a non-empty string, one too long for a key or holding a control character,
        or a body that is not UTF-8 JSON: MissingIdentity, with the reason and never the value.
        A number is refused rather than spelled: ``100``, ``1e2`` and ``100.0`` are one number
        to the conflict digest but would be three keys. Raises PointerError (a ValueError) for
        text that is no pointer, when the worker starts rather than at its first delivery."""
        parsed = Pointer.parse(pointer)
        return KeyFrom(lambda headers, body: _pointed_key(parsed, body))


@dataclass(frozen=True)
class TenantFrom:
    """Where a delivery's tenant comes from: a header, percent-decoded as outbox's providers
    encode it (``Outbox-Tenant-Id``), or one tenant for every delivery."""

    source: TenantSource

    def read(self, headers: Headers) -> str:
        """The delivery's tenant; MissingIdentity, saying why, when it has none."""
        tenant = self.source(headers)
        if tenant is None:
            raise MissingIdentity("the delivery names no tenant")
        return tenant

    @staticmethod
    def header(name: str = "Outbox-Tenant-Id") -> TenantFrom:
        lower = name.lower()

        def read(headers: Headers) -> str | None:
            value = headers.get(lower)
            if value is None:
                return None
            try:
                return urllib.parse.unquote(value, errors="strict")
            except UnicodeDecodeError:
                # "%ff": no tenant can be read, so the delivery has none; not a crash.
                raise MissingIdentity(f"{name} is not percent-encoded UTF-8") from None

        return TenantFrom(read)

    @staticmethod
    def constant(tenant_id: str) -> TenantFrom:
        return TenantFrom(lambda headers: tenant_id)


def identity_of(tenant_id: str, handler: str, key: str, headers: Headers) -> Identity:
    """The identity of a delivery: for an operation's key (``op:``), the database that sent it
    (``Outbox-Origin``), and what its sender says the body is (``Outbox-Fingerprint``) and
    which contract it was written to (``Outbox-Contract``)."""
    origin = origin_of(headers) if key.startswith("op:") else None
    return Identity(tenant_id, handler, key, origin, fingerprint_of(headers), contract_of(headers))


def contract_of(headers: Headers) -> tuple[str, int] | None:
    """The contract a delivery's body was written to (``Outbox-Contract: <type>/v<N>``,
    percent-encoded where a header cannot carry the type as it is), or None. MissingIdentity
    for one that cannot be read: a body its sender meant to be checked is not taken unchecked."""
    value = headers.get("outbox-contract")
    if value is None:
        return None
    try:
        text = urllib.parse.unquote(value.strip(), errors="strict")
    except UnicodeDecodeError:
        raise MissingIdentity("Outbox-Contract is not percent-encoded UTF-8") from None
    found = _CONTRACT.fullmatch(text)
    if found is None or int(found.group(2)) > _MAX_VERSION or not found.group(1).strip():
        raise MissingIdentity("Outbox-Contract is not <operation type>/v<version>")
    if any(ord(c) < 32 or ord(c) == 127 for c in found.group(1)):
        raise MissingIdentity("Outbox-Contract names a type with control characters")
    return found.group(1), int(found.group(2))


def origin_of(headers: Headers) -> str | None:
    """The database a delivery's sender names (``Outbox-Origin``, a UUID), lower-case, or None.
    MissingIdentity for one it names unreadably: which operation it is would be a guess."""
    origin = headers.get("outbox-origin")
    if origin is None:
        return None
    normal = origin.strip().lower()
    if not _UUID.fullmatch(normal) or normal == _UNNAMED:
        raise MissingIdentity("Outbox-Origin is not a UUID")
    return normal


def fingerprint_of(headers: Headers) -> Fingerprint | None:
    """What the sender says the body is (``Outbox-Fingerprint``: an RFC 8941 byte sequence of
    SHA-256 with the provider and the ordering key as string parameters, and the action from
    ``Outbox-Action``), or None when it says nothing. MissingIdentity for one that cannot be
    read: a body that cannot be checked is not taken on trust when its sender meant it to be."""
    value = headers.get("outbox-fingerprint")
    if value is None:
        return None
    item = _FINGERPRINT.fullmatch(value.strip())
    digest = _base64(item.group(1)) if item else None
    if item is None or digest is None or len(digest) != _SHA256_BYTES:
        raise MissingIdentity("Outbox-Fingerprint is not a SHA-256 byte sequence")
    params = dict(_PARAM.findall(item.group(2)))
    action = headers.get("outbox-action")
    if "provider" not in params or action is None:
        raise MissingIdentity("Outbox-Fingerprint comes without its provider or Outbox-Action")
    try:
        ordering = params.get("ordering-key")
        return Fingerprint(
            digest,
            _unescaped(params["provider"]),
            urllib.parse.unquote(action, errors="strict"),
            None if ordering is None else _unescaped(ordering),
        )
    except UnicodeDecodeError:
        raise MissingIdentity("Outbox-Fingerprint is not percent-encoded UTF-8") from None


def _base64(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        return None


def _unescaped(sf_string: str) -> str:
    """An RFC 8941 string's content, unescaped, then percent-decoded (strict UTF-8)."""
    return urllib.parse.unquote(_SF_ESCAPE.sub(r"\1", sf_string), errors="strict")


def _header_key(headers: Headers, name: str) -> str | None:
    value = headers.get(name)
    if value is None:
        return None
    quoted = _SF_STRING.fullmatch(value.strip())
    text = quoted.group(1).replace('\\"', '"').replace("\\\\", "\\") if quoted else value.strip()
    return f"key:{text}" if text else None


def traced(identity: Identity) -> dict[str, str | int]:
    """What a delivery's span shows of its identity: the tenant, where the key came from, and
    the operation when the key is outbox's (its dispatch span carries the same id). Never
    another key's value: an Idempotency-Key is the caller's, and whoever holds it with the
    tenant is answered the recorded response; a pointer's value is the payload's."""
    source, _, value = identity.key.partition(":")
    shown: dict[str, str | int] = {
        "outbox.tenant_id": identity.tenant_id,
        # A source of the caller's own (KeyFrom(...)) may spell its keys any way: not shown.
        "outbox.inbox.key_source": source if source in KEY_SOURCES else "other",
    }
    operation = value.rpartition(":")[2]
    if source == "op" and _DIGITS.fullmatch(operation):
        shown["outbox.operation_id"] = int(operation)
    return shown


def _pointed_key(pointer: Pointer, body: bytes) -> str:
    """``ptr:`` and the string at ``pointer`` in ``body``. The reasons name the pointer and the
    kind of value, never the value: it is the payload's."""
    try:
        # Strict UTF-8, as the inbox reads a JSON body; no NaN or Infinity, which are not JSON.
        document = json.loads(body.decode("utf-8"), parse_constant=_not_json)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError among them
        raise MissingIdentity(f"the body is not JSON, so it has nothing at {pointer}") from None
    value = pointer.read(document)
    if value is MISSING:
        raise MissingIdentity(f"the body has nothing at {pointer}")
    if not isinstance(value, str):
        raise MissingIdentity(f"the body's {pointer} is {_json_kind(value)}, not a string")
    if not value.strip():
        raise MissingIdentity(f"the body's {pointer} is empty")
    longest = MAX_KEY - len(POINTER_PREFIX)
    if len(value) > longest:
        raise MissingIdentity(f"the body's {pointer} is longer than {longest} characters")
    if not value.isprintable() and any(unicodedata.category(c) in _UNSAFE for c in value):
        raise MissingIdentity(f"the body's {pointer} holds a control or format character")
    return POINTER_PREFIX + value


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def _json_kind(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "a number"
    return "an array" if isinstance(value, list) else "an object"


def replay(outcome: Outcome) -> Outcome:
    """The recorded outcome, marked as a replay (Stripe's convention)."""
    marks = (("Idempotent-Replayed", "true"), ("Outbox-Inbox-Decision", "replayed"))
    return Outcome(outcome.status, outcome.headers + marks, outcome.body)


def problem(
    status: int, title: str, detail: str, decision: str, retry_after: int | None = None
) -> Outcome:
    """An RFC 9457 problem answer."""
    body = json.dumps({"title": title, "status": status, "detail": detail}).encode()
    headers: tuple[tuple[str, str], ...] = (
        ("Content-Type", "application/problem+json"),
        ("Outbox-Inbox-Decision", decision),
    )
    if retry_after is not None:
        headers += (("Retry-After", str(retry_after)),)
    return Outcome(status, headers, body)

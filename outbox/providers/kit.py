"""What every provider family shares, so that none imports another: the action wildcard and
the form a stored idempotency key travels in (KeySpec: a header or a body field, its form, the
length and characters the provider takes), the checks of a provider's option keys and of a
configured header, header values made safe to send, and the reading of Retry-After. Taken out
of the http family, where they were born, so the queue families and stripe stand beside it
(pyproject.toml, "Provider families stand apart").

Pure: no I/O.
"""

from __future__ import annotations

import base64
import email.utils
import functools
import hashlib
import re
import urllib.parse
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Final

from outbox.config.schema import Boolean, ConfigError, Count, Setting
from outbox.config.settings import DEFAULT_MAX_RESPONSE_BYTES, PROVIDER_KEYS, ProviderSettings
from outbox.core.json_pointer import Pointer
from outbox.providers.base import Intent

# In a provider's per-action tables: every action not named.
ANY_ACTION: Final = "*"

# --- the idempotency key on the wire -------------------------------------------------------------


class KeyForm:
    """How the stored idempotency key is written on the wire."""

    STORED: Final = "stored"  # as outbox holds it (derived keys are 68 characters)
    UUID: Final = "uuid"  # an RFC 9562 version 8 UUID of its SHA-256: 36 characters
    SHA256: Final = "sha256"  # its SHA-256 in hex: 64 characters
    ALL: Final = (STORED, UUID, SHA256)


@dataclass(frozen=True, slots=True)
class KeySpec:
    """Where the key travels and what the provider takes. ``header`` or ``field`` (a JSON
    pointer into the body), never both; ``characters`` is a regular-expression class body."""

    header: str | None = "Idempotency-Key"
    field: Pointer | None = None
    quoting: str = "none"  # "none" or "sf-string" (RFC 8941, as the IETF draft wants)
    form: str = KeyForm.STORED
    max_length: int = 255
    characters: str = "!-~"

    def wire(self, stored: str) -> str:
        """The key as the provider receives it: a pure function of the stored key, so every
        attempt of a generation carries the same one and each generation its own."""
        if self.form == KeyForm.STORED:
            return stored
        digest = hashlib.sha256(stored.encode()).digest()
        if self.form == KeyForm.SHA256:
            return digest.hex()
        raw = bytearray(digest[:16])
        raw[6] = (raw[6] & 0x0F) | 0x80  # version 8: custom (RFC 9562 section 5.8)
        raw[8] = (raw[8] & 0x3F) | 0x80  # the RFC's variant
        text = raw.hex()
        return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"

    def problem(self, wire: str) -> str | None:
        """Why the provider would refuse this key, or None."""
        if len(wire) > self.max_length:
            return (
                f"the idempotency key is {len(wire)} characters; "
                f"the provider takes at most {self.max_length}"
            )
        if not _characters(self.characters).fullmatch(wire):
            return (
                "the idempotency key holds characters the provider does not take "
                f"(it takes [{self.characters}])"
            )
        return None

    def header_value(self, wire: str) -> str:
        if self.quoting == "sf-string":
            return '"' + wire.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return wire


@functools.lru_cache(maxsize=64)
def _characters(allowed: str) -> re.Pattern[str]:
    """The key's pattern, compiled once per configured class (it is checked on every send)."""
    return re.compile(f"[{allowed}]+")


# --- a provider's settings and headers -----------------------------------------------------------

# A header field name (RFC 9110 token), and a value without CR, LF, NUL or other controls: a
# CR/LF in a secret started the daemon fine, then every request failed to be built.
HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HEADER_VALUE_BAD: Final = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
SECRET_HEADER: Final = re.compile(
    r"auth|cookie|api[-_]?key|access[-_]?key|token|secret|password|signature|credential",
    re.IGNORECASE,
)
# Headers the HTTP client writes from the request itself: one configured would contradict it.
FRAMING: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "te", "trailer", "upgrade"}
)


def reject_unknown(ps: ProviderSettings, valid: tuple[str, ...]) -> None:
    for key in ps.options:
        if key not in valid:
            allowed = ", ".join((*PROVIDER_KEYS, *valid))
            raise ConfigError(
                f"providers.{ps.name}.{key} is not a {ps.type} provider setting; valid: {allowed}"
            )


def check_header(name: str, value: str, key: str) -> None:
    if not HEADER_NAME.fullmatch(name):
        raise ConfigError(f"{key}: {name!r} is not an HTTP header name", key=key)
    if name.lower() in FRAMING:
        raise ConfigError(f"{key}: {name} frames the request: the HTTP client writes it", key=key)
    if _HEADER_VALUE_BAD.search(value) or not value.isascii():  # never quoted: it may be secret
        raise ConfigError(
            f"{key}: the value holds a line break, a control character or "
            "non-ASCII text, which no HTTP header may carry",
            key=key,
        )


# --- the options every HTTP-speaking type declares (http, webhook, stripe) ------------------------

ALLOW_INSECURE: Final = Setting(
    "allow_insecure",
    Boolean(),
    "Send secrets (secret headers, the API key) over http:// to a host other than loopback, "
    "which is refused otherwise.",
    default=False,
)
MAX_RESPONSE_BYTES: Final = Setting(
    "max_response_bytes",
    Count(unit="bytes"),
    "The most of one answer read, counted as decoded, so a compressed answer cannot expand past "
    "it: an answer is held in memory whole while its reference is read, and 1 MiB is hundreds "
    "of times a webhook's or a Stripe object's answer, yet the 64 calls in flight of the "
    "default concurrency hold at most 64 MiB of answers. A longer answer is *unknown*.",
    default=DEFAULT_MAX_RESPONSE_BYTES,
)

# --- header values -------------------------------------------------------------------------------

# Longest Retry-After we honour: a misconfigured receiver must not park operations for days.
MAX_RETRY_AFTER = timedelta(hours=1)
# What header_safe leaves as it is when it percent-encodes: visible ASCII but "%".
_HEADER_SAFE: Final = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
# Retry-After in seconds, in ASCII digits only (str.isdigit also takes "²", which int refuses).
_SECONDS = re.compile(r"[0-9]+")


def header_safe(value: str) -> str:
    """An identity as a header value. A header carries visible ASCII with spaces only between
    (RFC 9110), and a tenant id, an action or a correlation id may be any text but control
    characters (sql/0028). One a header cannot carry as it is (a character past ASCII, a control
    in a row older than that check, a space at either end), or one that holds a "%", travels
    percent-encoded as UTF-8 (RFC 3986, the value-chars of RFC 8187 without their charset
    prefix), spaces as %20: "café" as caf%C3%A9, " acme" as %20acme, "50%" as 50%25. A receiver
    can always percent-decode a value and get the text back, and no two identities arrive the
    same."""
    if value.isascii() and value.isprintable() and "%" not in value and value.strip(" ") == value:
        return value
    return urllib.parse.quote(value, safe=_HEADER_SAFE)


# What a delivery carries for its receiver to check (providers.base.Intent; sql/0045).
ORIGIN: Final = "Outbox-Origin"
FINGERPRINT: Final = "Outbox-Fingerprint"
CONTRACT: Final = "Outbox-Contract"


def intent_headers(intent: Intent | None, *, body_is_payload: bool) -> dict[str, str]:
    """The origin of a delivery, and, where the body is the payload as stored, enqueue's
    fingerprint (a receiver recomputes it from the body; a body built from a part of the payload
    would never match) and the contract the payload was enqueued under (``charge/v1``, which a
    receiver checks the body against). The fingerprint is an RFC 8941 item, a byte sequence with
    the provider and the ordering key as string parameters, header-safe and escaped:
    ``:<base64>:;provider="billing";ordering-key="acct%201"``."""
    if intent is None:
        return {}
    headers = {ORIGIN: intent.origin}
    if body_is_payload:
        item = f":{base64.b64encode(intent.fingerprint).decode()}:;provider={_sf(intent.provider)}"
        if intent.ordering_key is not None:
            item += f";ordering-key={_sf(intent.ordering_key)}"
        headers[FINGERPRINT] = item
        if intent.contract is not None:
            headers[CONTRACT] = header_safe(intent.contract)
    return headers


def _sf(value: str) -> str:
    """An RFC 8941 string of any text: header-safe first (printable ASCII), then escaped."""
    return '"' + header_safe(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def retry_after_value(value: str | None) -> timedelta | None:
    """A Retry-After header's delay, at most MAX_RETRY_AFTER; None when absent or unreadable."""
    if not value:
        return None
    if _SECONDS.fullmatch(value.strip()):
        cap = int(MAX_RETRY_AFTER.total_seconds())
        # Digits past the cap's own are past the cap: never int() thousands of them (it raises).
        digits = value.strip().lstrip("0")
        seconds = cap if len(digits) > len(str(cap)) else min(int(digits or "0"), cap)
        delay = timedelta(seconds=seconds)
    else:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):
            return None
        if when.tzinfo is None:  # "-0000": UTC with no claim about the local zone
            when = when.replace(tzinfo=UTC)
        # An HTTP date is relative to our clock, not the database's: the best we have.
        delay = when - datetime.now(UTC)
    return max(timedelta(0), min(delay, MAX_RETRY_AFTER))

"""Who is signed in to the console, what they may do, and the proof that a form came from it.

Two ways in (docs/console.md, "Signing in"): HTTP basic credentials checked against a
credentials file (`name role hash` per line, scrypt hashes from `outbox web --hash-password`),
or a trusted reverse proxy's headers. Without either, everyone is a viewer named ``anonymous``:
the console then shows and never changes.

Every form that changes something carries a token bound to the person's name (an HMAC under a
key of the process, or of ``$OUTBOX_WEB_SECRET`` where several replicas serve one console), and
a request a browser marks as cross-site is refused before the token is read.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Final

from outbox.core.safe_text import printable
from outbox.errors import OutboxError

# scrypt's cost: about 50 ms and 16 MiB per check here, so a stolen file is slow to guess from;
# a check that passed is remembered (VerifiedCache), so pages and their refreshes pay it once.
SCRYPT_N: Final = 2**14
SCRYPT_R: Final = 8
SCRYPT_P: Final = 1
_SCHEME: Final = "scrypt"
SECRET_ENV: Final = "OUTBOX_WEB_SECRET"  # noqa: S105 (the variable's name)
ANONYMOUS: Final = "anonymous"
# The longest name the audit takes from a header or a file: longer is a mistake or an attack.
MAX_NAME: Final = 128


class Role(Enum):
    VIEWER = "viewer"
    OPERATOR = "operator"


@dataclass(frozen=True)
class User:
    name: str
    role: Role

    @property
    def may_act(self) -> bool:
        return self.role is Role.OPERATOR


class CredentialsError(OutboxError):
    """The credentials file cannot be read as one: the message names the line, never a hash."""


def hash_password(password: str, *, salt: bytes | None = None) -> str:
    """``scrypt$<salt>$<hash>``, base64: what a credentials file's third field holds."""
    salt = salt if salt is not None else secrets.token_bytes(16)
    digest = _scrypt(password, salt)
    return f"{_SCHEME}${_b64(salt)}${_b64(digest)}"


def _scrypt(password: str, salt: bytes) -> bytes:
    return hashlib.scrypt(
        password.encode(), salt=salt, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P, maxmem=64 << 20
    )


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


@dataclass(frozen=True)
class _Entry:
    role: Role
    salt: bytes
    digest: bytes


def read_credentials(path: Path) -> dict[str, _Entry]:
    """The people of a credentials file; blank lines and ``#`` comments are skipped."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CredentialsError(f"cannot read the credentials file {path}: {exc}") from None
    people: dict[str, _Entry] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        people_line = _parse_line(line, f"{path}:{number}")
        name, entry = people_line
        if name in people:
            raise CredentialsError(f"{path}:{number}: {printable(name)!r} is named twice")
        people[name] = entry
    return people


def _parse_line(line: str, where: str) -> tuple[str, _Entry]:
    fields = line.split()
    if len(fields) != 3:
        raise CredentialsError(f"{where}: expected `name role hash`, found {len(fields)} fields")
    name, role_text, hashed = fields
    if len(name) > MAX_NAME or not name.isprintable():
        raise CredentialsError(f"{where}: a name is printable and at most {MAX_NAME} characters")
    try:
        role = Role(role_text)
    except ValueError:
        raise CredentialsError(
            f"{where}: the role is viewer or operator, not {printable(role_text)!r}"
        ) from None
    scheme, _, rest = hashed.partition("$")
    salt_text, _, digest_text = rest.partition("$")
    try:
        salt, digest = (
            base64.b64decode(salt_text, validate=True),
            base64.b64decode(digest_text, validate=True),
        )
    except (binascii.Error, ValueError):
        salt = digest = b""
    if scheme != _SCHEME or not salt or len(digest) != 64:
        # Never quoted: it is the hash, or a password pasted in its place.
        raise CredentialsError(
            f"{where}: the third field is not a hash from `outbox web --hash-password`"
        )
    return name, _Entry(role, salt, digest)


class Credentials:
    """A credentials file's people, with the checks that passed remembered by a digest of
    what was sent (never the password itself), so that a page's refreshes cost no scrypt."""

    def __init__(self, people: Mapping[str, _Entry]) -> None:
        self._people = dict(people)
        self._passed: dict[bytes, User] = {}

    @classmethod
    def load(cls, path: Path) -> Credentials:
        return cls(read_credentials(path))

    def __len__(self) -> int:
        return len(self._people)

    def remembered(self, name: str, password: str) -> User | None:
        """The person, if this name and password passed a check before; else None."""
        return self._passed.get(_seen(name, password))

    def check(self, name: str, password: str) -> User | None:
        """The person, if ``password`` is theirs; else None (a wrong name costs as much time)."""
        seen = _seen(name, password)
        if (user := self._passed.get(seen)) is not None:
            return user
        entry = self._people.get(name)
        # An unknown name still pays for one scrypt, so timing does not tell names apart.
        salt = entry.salt if entry is not None else b"outbox-no-such-person"
        digest = _scrypt(password, salt)
        if entry is None or not hmac.compare_digest(digest, entry.digest):
            return None
        user = User(name, entry.role)
        if len(self._passed) > 10_000:  # a bound, for a file of many people over a long run
            self._passed.clear()
        self._passed[seen] = user
        return user


def _seen(name: str, password: str) -> bytes:
    return hashlib.sha256(f"{name}\0{password}".encode()).digest()


def basic_credentials(header: str | None) -> tuple[str, str] | None:
    """The name and password of an ``Authorization: Basic`` header, or None."""
    if not header:
        return None
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    name, colon, password = decoded.partition(":")
    return (name, password) if colon else None


def proxy_user(name: str | None, role: str | None) -> User | None:
    """The person a trusted proxy's headers name: a viewer unless it says operator."""
    if not name or len(name) > MAX_NAME or not name.isprintable():
        return None
    return User(name, Role.OPERATOR if role == Role.OPERATOR.value else Role.VIEWER)


class FormTokens:
    """The token each form that changes something carries: an HMAC of the person's name."""

    def __init__(self, key: bytes | None = None) -> None:
        configured = os.environ.get(SECRET_ENV)
        self._key = key or (configured.encode() if configured else secrets.token_bytes(32))

    def issue(self, user: User) -> str:
        mac = hmac.new(self._key, f"form\0{user.name}".encode(), hashlib.sha256)
        return mac.hexdigest()

    def valid(self, user: User, token: str | None) -> bool:
        return token is not None and hmac.compare_digest(self.issue(user), token)

"""Secrets named by the config (``{env = ...}``, ``{file = ...}``), read where they are: never
written in the file, never quoted in a message. Providers read theirs with :func:`read_secret`
(outbox.config re-exports it for plug-ins)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import structlog

from outbox.config.schema import (
    ConfigError,
)

# --- Secrets ---------------------------------------------------------------------------------


def read_secret(
    spec: Mapping[str, str] | str, *, key: str, environ: Mapping[str, str] | None = None
) -> str:
    """The secret that ``spec`` points at: ``{"env": "NAME"}`` or ``{"file": "/path"}``.

    A relative file name is looked up in ``$CREDENTIALS_DIRECTORY`` when that is set (systemd's
    LoadCredential=); one trailing newline is dropped. ``key`` is the dotted key of ``spec``, for
    messages. Raises ConfigError, whose message never contains the secret, when the secret is
    missing or empty, or when ``spec`` is anything else, such as the secret itself.
    """
    env = os.environ if environ is None else environ
    kind, name = _secret_reference(spec, key)
    if kind == "env":
        value = env.get(name)
        if not value:
            state = "is not set" if value is None else "is not set (it is empty)"
            raise ConfigError(f"{key}: environment variable {name} {state}", key=key)
        return value
    return _read_secret_file(name, key, env.get("CREDENTIALS_DIRECTORY"))


def _secret_reference(spec: object, key: str) -> tuple[str, str]:
    if isinstance(spec, Mapping) and len(spec) == 1:
        ((kind, name),) = spec.items()
        if kind in ("env", "file") and isinstance(name, str) and name:
            return kind, name
    # Never quote spec: it may well be the secret itself.
    raise ConfigError(
        f'{key} must be {{env = "VARIABLE"}} or {{file = "/path"}}; '
        "secrets are never written in the config file",
        key=key,
    )


def _read_secret_file(name: str, key: str, credentials_directory: str | None) -> str:
    path = Path(name)
    if credentials_directory and not path.is_absolute():
        path = Path(credentials_directory) / path
    try:
        # Bytes, then text: read_text's universal newlines would turn a "\r" inside the secret
        # into "\n", and hand back something other than what the file holds.
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{key}: secret file {path} does not exist", key=key) from None
    except OSError as exc:
        raise ConfigError(
            f"{key}: cannot read secret file {path}: {exc.strerror}", key=key
        ) from None
    except UnicodeDecodeError:  # from None: the exception holds the file's bytes
        raise ConfigError(f"{key}: secret file {path} is not UTF-8 text", key=key) from None
    # Editors and `echo` end files with a newline that is no part of the secret.
    text = text.removesuffix("\n").removesuffix("\r") if text.endswith("\n") else text
    if not text:
        raise ConfigError(f"{key}: secret file {path} is empty", key=key)
    _warn_if_readable(path, key)
    return text


def _warn_if_readable(path: Path, key: str) -> None:
    """A secret file others on the host may read is worth a word (systemd's credentials are
    0400 of their own accord)."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if mode & 0o077:
        structlog.get_logger("outbox.config").warning(
            "a secret file is readable by its group or by everyone: chmod 600 it",
            key=key,
            file=str(path),
            mode=oct(mode & 0o777),
        )

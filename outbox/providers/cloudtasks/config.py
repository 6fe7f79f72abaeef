"""The options of a `cloudtasks` provider, read and checked (docs/providers.md, "Google Cloud
Tasks"): where each action's tasks go, what they call, and the task name each key becomes.

Pure: no client library, no I/O. Everything is checked when the configuration is read, so that a
provider that starts can build every task its configuration describes.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

from outbox.config.schema import file_keys
from outbox.config.settings import ConfigError, ProviderSettings
from outbox.providers import queue_kit
from outbox.providers.cloudtasks.options import OPTIONS
from outbox.providers.kit import SECRET_HEADER, KeyForm, KeySpec, check_header, reject_unknown

# Cloud Tasks keeps a task's name while the task exists and for about an hour after it ran or
# was deleted (about 9 days for a queue.yaml queue): a repeat inside that answers ALREADY_EXISTS.
# The task exists from its creation on, so an hour from the first send is always covered.
TASK_NAME_WINDOW: Final = timedelta(hours=1)
# A TASK_ID takes letters, digits, hyphens and underscores, at most 500 characters: the stored
# key's SHA-256 in hex (64 characters) fits any key, one id per key. Hashed ids are also what
# Google recommends, since sequential ids slow task creation down.
TASK_ID: Final = KeySpec(header=None, form=KeyForm.SHA256, max_length=500, characters="A-Za-z0-9_-")
# The most of a task Cloud Tasks takes: 1 MB by its quotas page ("Maximum task size"; the API
# reference's CreateTask still says 100KB, an older limit), counted on the body alone, which is
# most of it: a larger one is refused before it is sent; one just under it that the headers push
# past is refused by Cloud Tasks (INVALID_ARGUMENT, permanent).
MAX_BODY_BYTES: Final = 1_000_000
UNROUTABLE: Final = ("quarantine", "retry")
# HttpRequest carries a body only with POST, PUT or PATCH; a task always carries the payload.
METHODS: Final = ("POST", "PUT", "PATCH")
ACTION_KEYS: Final = ("queue", "url", "method", "headers", "oidc_service_account", "oidc_audience")

_PROJECT: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:-]{0,99}")
_LOCATION: Final = re.compile(r"[a-z][a-z0-9-]{0,62}")
_QUEUE: Final = re.compile(r"[A-Za-z0-9-]{1,100}")
_EMAIL: Final = re.compile(r"[^@\s]+@[^@\s]+\.[^@\s]+")
_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1"})
# Headers outbox or Cloud Tasks writes on every task: one configured would contradict them.
_OWN_HEADERS: Final = frozenset(
    {h.lower() for h in (queue_kit.OPERATION_ID, queue_kit.ACTION, queue_kit.ATTEMPT)}
    | {h.lower() for h in (queue_kit.TENANT_ID, queue_kit.CORRELATION_ID)}
    | {queue_kit.IDEMPOTENCY_KEY.lower(), queue_kit.TRACEPARENT, "content-type", "user-agent"}
)


@dataclass(frozen=True, slots=True)
class Target:
    """One action's tasks: the queue they go to and the HTTP request each makes."""

    queue: str  # the queue's full name, projects/P/locations/L/queues/Q
    url: str
    method: str = "POST"
    headers: Mapping[str, str] | None = None
    oidc_service_account: str | None = None
    oidc_audience: str | None = None

    def task_name(self, idempotency_key: str) -> str:
        """The task's name for a stored key: the same on every attempt of a generation."""
        return f"{self.queue}/tasks/{TASK_ID.wire(idempotency_key)}"


@dataclass(frozen=True, slots=True)
class CloudTasksOptions:
    project: str
    location: str
    endpoint: str | None  # None: the real API at its default address
    emulator: bool  # a loopback endpoint: plain gRPC, anonymous
    targets: Mapping[str, Target]  # per action name, "*" for any other
    timeout: timedelta
    key_retention: timedelta
    retry_unroutable: bool = False


def options(ps: ProviderSettings) -> CloudTasksOptions:
    """The settings of ``ps``, checked; ConfigError names the key of any mistake."""
    reject_unknown(ps, tuple(file_keys(OPTIONS)))
    where = f"providers.{ps.name}"
    queue_kit.check_window(ps, TASK_NAME_WINDOW, "Cloud Tasks' task-name window")
    project = queue_kit.required_text(ps.options, "project", where, check=_matches(_PROJECT))
    location = queue_kit.required_text(ps.options, "location", where, check=_matches(_LOCATION))
    endpoint = queue_kit.text(ps.options, "endpoint", where, check=_endpoint_problem)
    unroutable = queue_kit.text(ps.options, "unroutable", where, default="quarantine")
    if unroutable not in UNROUTABLE:
        raise ConfigError(
            f'{where}.unroutable must be "quarantine" or "retry"', key=f"{where}.unroutable"
        )
    tables = queue_kit.action_tables(ps, ACTION_KEYS, required=("queue", "url"))
    parent = f"projects/{project}/locations/{location}/queues"
    targets = {
        name: _target(table, parent, f"{where}.actions.{_dotted(name)}")
        for name, table in tables.items()
    }
    return CloudTasksOptions(
        project=project,
        location=location,
        endpoint=endpoint,
        emulator=endpoint is not None and _host(endpoint) in _LOOPBACK,
        targets=targets,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        retry_unroutable=unroutable == "retry",
    )


def _target(table: Mapping[str, Any], parent: str, where: str) -> Target:
    queue = queue_kit.required_text(table, "queue", where, check=_matches(_QUEUE))
    url = queue_kit.required_text(table, "url", where, check=_url_problem)
    method = queue_kit.text(table, "method", where, default="POST") or "POST"
    if method.upper() not in METHODS:
        raise ConfigError(
            f"{where}.method must be POST, PUT or PATCH: a task's request carries the payload, "
            "and Cloud Tasks takes a body with those only",
            key=f"{where}.method",
        )
    account = queue_kit.text(table, "oidc_service_account", where, check=_matches(_EMAIL))
    audience = queue_kit.text(table, "oidc_audience", where)
    if audience is not None and account is None:
        raise ConfigError(
            f"{where}.oidc_audience needs oidc_service_account", key=f"{where}.oidc_audience"
        )
    return Target(
        queue=f"{parent}/{queue}",
        url=url,
        method=method.upper(),
        headers=_headers(table.get("headers"), f"{where}.headers"),
        oidc_service_account=account,
        oidc_audience=audience,
    )


def _headers(value: object, where: str) -> Mapping[str, str] | None:
    """Plain headers of every task: never a secret (a task's headers are readable by anyone who
    may view the queue's tasks); authenticate the target with oidc_service_account."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ConfigError(f"{where} must be a table of strings", key=where)
    for name, text in value.items():
        at = f"{where}.{name}"
        check_header(name, text, at)
        lowered = name.lower()
        # The `http` providers' reading of a secret-looking name (the kit's): one definition.
        if SECRET_HEADER.search(name):
            raise ConfigError(
                f"{at} looks like a secret, and a task's headers are readable by whoever may "
                "view the queue's tasks: authenticate the target with oidc_service_account",
                key=at,
            )
        if lowered in _OWN_HEADERS or lowered.startswith(("x-cloudtasks-", "x-appengine-")):
            raise ConfigError(f"{at}: outbox or Cloud Tasks writes {name} itself", key=at)
    return dict(value)


def _dotted(name: str) -> str:
    """An action's name in a dotted key, quoted as queue_kit.action_tables quotes it."""
    return name if name.replace("_", "").replace("-", "").isalnum() else f'"{name}"'


def _matches(pattern: re.Pattern[str]) -> Any:
    def problem(value: str) -> str | None:
        return None if pattern.fullmatch(value) else f"must match {pattern.pattern}"

    return problem


def _host(endpoint: str) -> str:
    host = endpoint.rpartition(":")[0] if ":" in endpoint else endpoint
    return host.strip("[]").lower()


def _endpoint_problem(value: str) -> str | None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return "must be host:port (127.0.0.1:8123 for an emulator)"
    if "/" in value or "@" in value:
        return "must be host:port, no scheme, path or credentials"
    return None


def _url_problem(value: str) -> str | None:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL"
    if parts.username is not None or parts.password is not None:
        return "holds credentials (user:password@): authenticate with oidc_service_account"
    if parts.fragment:
        return "must not hold a fragment (#...)"
    if parts.scheme == "http" and parts.hostname.lower() not in _LOOPBACK:
        return "must be https:// (http:// only to a loopback host, for an emulator)"
    if len(value) > 2083:  # HttpRequest.url: at most 2083 characters
        return "is longer than the 2083 characters Cloud Tasks takes"
    return None

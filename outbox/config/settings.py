"""Settings for ``outbox run``: a TOML file, then environment overrides, as frozen dataclasses.

The file has an optional top-level ``log_level``, a ``[dispatcher]`` table, an optional
``[database]`` table and one ``[providers.<name>]`` table per provider. The environment is applied
on top of it:

* ``OUTBOX_LOG_LEVEL``
* ``OUTBOX_DISPATCHER__<KEY>``, e.g. ``OUTBOX_DISPATCHER__LEASE=45s``
* ``OUTBOX_DATABASE__<KEY>``, e.g. ``OUTBOX_DATABASE__POOL_MODE=transaction``
* ``OUTBOX_PROVIDERS__<NAME>__<KEY>``: NAME matches a provider case-insensitively, with "-"
  written as "_"; a provider that is not in the file is created when its TYPE is set.

Other ``OUTBOX_*`` variables (``OUTBOX_DATABASE_URL``, ``OUTBOX_CONFIG``) belong to the CLI and are
ignored here, except ``OUTBOX_LISTEN_DATABASE_URL``, the default place of the direct connection for
LISTEN (see :class:`DatabaseSettings`). Secrets are never written in the file: it names where they
are (``{env = ...}``, ``{file = ...}``, ``*_env``, ``*_file``); providers read theirs with
:func:`read_secret`, and the LISTEN URL, read while loading, never appears in a repr.

**Every key is declared once, here**: a field of DispatcherSettings, DatabaseSettings,
ProviderSettings or Settings whose metadata is ``setting(kind, doc)``, or an entry of
PROVIDER_OPTIONS for the options a provider type reads. The valid keys, the parsing, the checks
of settings built in Python, the error messages, the reprs and docs/config-reference.md all come
from those declarations (outbox.config.schema). Rules between keys (``backoff_base`` at most
``backoff_max``...) are the ``__post_init__`` code below them.

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Final

from outbox.config.schema import (
    Boolean,
    Choice,
    ConfigError,
    Count,
    Duration,
    FileName,
    HeaderName,
    ProviderType,
    Rate,
    Secret,
    Share,
    Where,
    check_fields,
    default_of,
    format_rate,
    setting,
    settings_of,
    shown_fields,
)
from outbox.core.durations import format_duration
from outbox.observability import redaction
from outbox.runtime.event_loop import EVENT_LOOPS, uvloop_available

# What other modules import, ConfigError and format_rate among it (from outbox.config.schema).
__all__ = [
    "BREAKER_OPEN_MAX",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_KEY_RETENTION",
    "DEFAULT_LISTEN_URL_ENV",
    "DEFAULT_MAX_RESPONSE_BYTES",
    "DEFAULT_SHUTDOWN_GRACE",
    "DEFAULT_TIMEOUT",
    "HEARTBEATS_PER_LEASE",
    "LIMIT_KEYS",
    "LOG_LEVELS",
    "MAX_CONCURRENCY",
    "POOL_MODES",
    "PROVIDER_KEYS",
    "PROVIDER_NAME",
    "REDACTED",
    "TABLES",
    "ConfigError",
    "DatabaseSettings",
    "DispatcherSettings",
    "ProviderLimits",
    "ProviderSettings",
    "Settings",
    "WebSettings",
    "default_burst",
    "format_rate",
]

# --- Bounds and names that are no key's default ----------------------------------------------

# The most calls one process may have in flight: past this a typo, not a setting (each call is a
# task, a pool slot and a socket; PostgreSQL's default max_connections is 100).
MAX_CONCURRENCY: Final = 10_000
# Without a heartbeat setting, leases are renewed three times per lease: one late renewal still
# leaves the lease held.
HEARTBEATS_PER_LEASE: Final = 3
# An open breaker's probes, doubling while they fail, come at least this often (or every
# breaker_open_for, if longer).
BREAKER_OPEN_MAX: Final = timedelta(minutes=5)
LOG_LEVELS: Final = ("debug", "info", "warning", "error")
POOL_MODES: Final = ("session", "transaction")
PROVIDER_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
# Where the URL of a direct connection for LISTEN is found unless the file names another place:
# beside OUTBOX_DATABASE_URL, in the environment, and like it without a password (libpq's pgpass).
DEFAULT_LISTEN_URL_ENV: Final = "OUTBOX_LISTEN_DATABASE_URL"
# What repr() shows instead of anything that might be a secret.
REDACTED: Final = redaction.REDACTED


def _uvloop_missing(loop: str) -> str | None:
    if loop == "uvloop" and not uvloop_available():
        return 'is "uvloop", which is not installed here; use "auto" or "asyncio"'
    return None


_POOL_MODE: Final = Choice(
    POOL_MODES,
    refused={
        "statement": 'cannot be "statement": statement pooling forbids the multi-statement '
        "transactions that outbox's producers and operator commands rely on; use "
        'pool_mode = "transaction" in the pooler and here'
    },
)


# --- The declarations: every key, once -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DispatcherSettings:
    """``[dispatcher]``: how the dispatcher claims, calls, retries and gives up."""

    concurrency: int = field(
        default=64,
        metadata=setting(
            Count(most=MAX_CONCURRENCY),
            "Provider calls in flight, per process: enough to hide provider latency (at ~100 ms a "
            "call, over 600 calls a second) while staying far below providers' rate limits and a "
            "database pool's size. A process leases at most twice as many operations: those "
            "whose outcome is being written hold no call slot.",
        ),
    )
    batch_size: int = field(
        default=100,
        metadata=setting(
            Count(),
            "Rows claimed per claim query: one query per 100 rows amortises its round trip without "
            "leasing rows that the workers will not reach before their lease runs out.",
        ),
    )
    lease: timedelta = field(
        default=timedelta(seconds=30),
        metadata=setting(
            # The database's bound too (sql/0040): a lease of years would hide a row for years.
            Duration(most=timedelta(days=1)),
            "How long a claim holds an operation, renewed by a heartbeat while its call runs: "
            "outlives a provider call at its timeout (10-20 s) plus recording the result, yet a "
            "crashed process's operations are claimed again within half a minute.",
        ),
    )
    poll_interval: timedelta = field(
        default=timedelta(seconds=1),
        metadata=setting(
            Duration(),
            "How often to look for due work when no NOTIFY arrives: NOTIFY wakes the dispatcher at "
            "once, so polling only covers lost notifications and retries coming due, and once a "
            "second bounds their delay at a negligible cost to the database.",
        ),
    )
    shutdown_grace: timedelta = field(
        default=timedelta(seconds=25),
        metadata=setting(
            Duration(zero=True),
            "How long in-flight calls get after SIGTERM: they finish within Kubernetes' default "
            "30 s termination grace period, with 5 s left to release leases and exit before "
            "SIGKILL.",
        ),
    )
    max_attempts: int = field(
        default=10,
        metadata=setting(
            # As enqueue bounds an operation's own (sql/0004), and the rescuer's (sql/0040).
            Count(most=1000),
            "Attempts before an operation needs a human: with doubling backoff from 1 s, ten ride "
            "out a provider outage of several minutes.",
        ),
    )
    backoff_base: timedelta = field(
        default=timedelta(seconds=1),
        metadata=setting(
            Duration(),
            "The first retry's delay (capped exponential backoff with full jitter), at most "
            "backoff_max: most transient failures (a reset connection, a 502 during a deploy) "
            "clear "
            "within a second.",
        ),
    )
    backoff_max: timedelta = field(
        default=timedelta(minutes=10),
        metadata=setting(
            # The database's bound on a retry's delay (sql/0040).
            Duration(most=timedelta(days=366)),
            "The longest delay between retries: a recovered provider is tried again within ten "
            "minutes, and a long outage costs each operation no more than six calls an hour.",
        ),
    )
    retention_margin: timedelta = field(
        default=timedelta(hours=1),
        metadata=setting(
            Duration(zero=True),
            "Retries stop this long before the provider forgets an idempotency key (the operation "
            "goes to reconciliation), since a retry after that could repeat the effect; shorter "
            "than every provider's key_retention. An hour absorbs clock skew and a slow last "
            "attempt with room to spare.",
        ),
    )
    heartbeat: timedelta | None = field(
        default=None,
        metadata=setting(
            Duration(),
            "How often a worker renews its leases; shorter than lease. Three renewals per lease "
            "leave the lease held after one late renewal.",
            default_doc="a third of `lease`",
        ),
    )
    auto_reconcile: bool = field(
        default=True,
        metadata=setting(
            Boolean(),
            "Whether the reconciler asks providers about reconciling operations on its own; only "
            "a person's decision is then needed for what it cannot find.",
        ),
    )
    reconcile_interval: timedelta = field(
        default=timedelta(minutes=5),
        metadata=setting(
            Duration(),
            "How often the reconciler looks: a lookup lists a page or two of objects per "
            "operation, so every few minutes finds an effect soon after it appears (Stripe may "
            "roll a 500 forward) without loading the provider's API.",
        ),
    )
    gauge_interval: timedelta = field(
        default=timedelta(seconds=15),
        metadata=setting(
            Duration(),
            "How often the database-wide gauges are measured: a scrape interval's worth of "
            "staleness, one cheap query per period.",
        ),
    )
    event_loop: str = field(
        default="auto",
        metadata=setting(
            Choice(EVENT_LOOPS, unavailable=_uvloop_missing),
            'The dispatcher\'s event loop: "auto" is uvloop where it is installed (a dependency, '
            "with less CPU per task and socket callback), else asyncio's own.",
        ),
    )

    def __post_init__(self) -> None:
        # The loader checked each value already, naming its source; this keeps settings built in
        # Python code to the same rules.
        check_fields(self, "dispatcher")
        if self.backoff_base > self.backoff_max:
            raise ConfigError(
                f"dispatcher.backoff_base ({format_duration(self.backoff_base)}) must not be "
                f"longer than dispatcher.backoff_max ({format_duration(self.backoff_max)})",
                key="dispatcher.backoff_base",
            )
        if self.heartbeat is not None and self.heartbeat >= self.lease:
            raise ConfigError(
                f"dispatcher.heartbeat ({format_duration(self.heartbeat)}) must be shorter than "
                f"dispatcher.lease ({format_duration(self.lease)}): a lease renewed less often "
                "than it lasts runs out while its worker is still busy",
                key="dispatcher.heartbeat",
            )

    @property
    def heartbeat_interval(self) -> timedelta:
        """How often a worker renews its leases: ``heartbeat`` if set, else a third of ``lease``."""
        return self.heartbeat if self.heartbeat is not None else self.lease / HEARTBEATS_PER_LEASE


@dataclass(frozen=True, slots=True, repr=False)
class DatabaseSettings:
    """``[database]``: how ``outbox run`` reaches PostgreSQL, beyond the database URL itself."""

    pool_mode: str = field(
        default="session",
        metadata=setting(
            _POOL_MODE,
            'How the database URL reaches PostgreSQL. "session": a session of outbox\'s own per '
            "connection (a direct connection, or a pooler in session mode), so prepared "
            "statements, "
            "session settings and LISTEN all work; the default, as a plain PostgreSQL URL gives "
            "it. "
            '"transaction": a pooler (PgBouncer\'s pool_mode = transaction) that lends a server '
            "session per transaction only: no prepared statements, no session settings (the DBA "
            "sets them on the role), no LISTEN through it (docs/pgbouncer.md).",
        ),
    )
    listen_url: str | None = field(
        default=None,
        metadata=setting(
            Secret(
                "the LISTEN URL",
                carries="a password",
                kind_of_value="a connection URL",
                default_env=DEFAULT_LISTEN_URL_ENV,
            ),
            "A direct connection (bypassing the pooler) for LISTEN. It may carry a password, so "
            "the "
            "file names only where it is, and it is never shown. Without one, a transaction-pooled "
            "daemon polls only.",
            default_doc=f"`${DEFAULT_LISTEN_URL_ENV}`, else none",
        ),
    )
    listen: bool = field(
        default=True,
        metadata=setting(
            Boolean(),
            "Whether the daemon LISTENs for enqueue notifications: an idle dispatcher then claims "
            "a "
            "committed row within milliseconds instead of at its next poll. Off, it polls only "
            "(every poll_interval), producers never notify, and any listen_url goes unused.",
        ),
    )
    startup_wait: timedelta = field(
        default=timedelta(seconds=60),
        metadata=setting(
            Duration(),
            "How long `outbox run` gives the database to answer at start-up before it exits (code "
            "2) saying so; the first failed try is logged at once with its reason, and a refusal "
            "that waiting will not change (no such database or role, a failed login) exits at "
            "once. Once it has started, an unreachable database is waited out for ever.",
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self, "database")

    @property
    def transaction_pooling(self) -> bool:
        """True when server sessions are lent per transaction, not held per connection."""
        return self.pool_mode == "transaction"

    def __repr__(self) -> str:
        return f"DatabaseSettings({shown_fields(self)})"


@dataclass(frozen=True, slots=True, repr=False)
class WebSettings:
    """``[web]``: who may use ``outbox web``, the operator console, and how they sign in."""

    credentials_file: str | None = field(
        default=None,
        metadata=setting(
            FileName(),
            "The console's sign-in: one line per person, `name role hash` (role viewer or "
            "operator; the hash from `outbox web --hash-password`), read with HTTP basic "
            "credentials. Without it and without proxy_user_header, everyone is a viewer.",
            default_doc="none",
        ),
    )
    proxy_user_header: str | None = field(
        default=None,
        metadata=setting(
            HeaderName(),
            "Sign-in by a trusted reverse proxy instead: the header that names the person. Only "
            "behind a proxy that sets it on every request and strips it from the client's; the "
            "console listens on loopback unless told otherwise.",
            default_doc="none",
        ),
    )
    proxy_role_header: str | None = field(
        default=None,
        metadata=setting(
            HeaderName(),
            "With proxy_user_header: the header the proxy puts the person's role in (viewer or "
            "operator); without it, or without a role, the person is a viewer.",
            default_doc="none",
        ),
    )
    read_only: bool = field(
        default=False,
        metadata=setting(
            Boolean(),
            "The console changes nothing, whoever signs in: every action is refused and none is "
            "offered.",
        ),
    )

    def __post_init__(self) -> None:
        check_fields(self, "web")
        if self.proxy_role_header is not None and self.proxy_user_header is None:
            raise ConfigError(
                "web.proxy_role_header needs web.proxy_user_header: a role without a name "
                "signs no one in",
                key="web.proxy_role_header",
            )

    def __repr__(self) -> str:
        return f"WebSettings({shown_fields(self)})"


def _no_options() -> Mapping[str, Any]:
    return MappingProxyType({})


_LIMITS: Final = "limits"


@dataclass(frozen=True, slots=True, repr=False)
class ProviderSettings:
    """One ``[providers.<name>]`` table. ``options`` holds its other keys, read-only and as
    written (tables as read-only mappings, arrays as tuples); the provider's factory checks them
    (PROVIDER_OPTIONS declares those of the built-in types). The keys every provider has are
    fields; ``rate_limit`` is in calls per second.
    """

    name: str
    type: str = field(
        metadata=setting(
            ProviderType(),
            'The provider\'s type: "http", "webhook", "stripe", "noop", the queues "nats", '
            '"amqp", "sqs" and "cloudtasks", or the name a plug-in registers in the entry point '
            "group outbox.providers.",
        )
    )
    key_retention: timedelta = field(
        default=timedelta(hours=24),
        metadata=setting(
            Duration(),
            "How long the provider remembers an idempotency key; longer than "
            "dispatcher.retention_margin. Stripe keeps them for at least 24 hours; other providers "
            "must say otherwise.",
        ),
    )
    timeout: timedelta = field(
        default=timedelta(seconds=10),
        metadata=setting(
            Duration(),
            "How long one call may take: a provider that has not answered in 10 s is probably "
            "stuck, and that is well under the lease, so the lease outlives the call.",
        ),
    )
    options: Mapping[str, Any] = field(default_factory=_no_options)
    retention_margin: timedelta | None = field(
        default=None,
        metadata=setting(
            Duration(zero=True),
            "This provider's own dispatcher.retention_margin: a queue that keeps keys for minutes "
            "(JetStream's duplicate_window, 2 minutes by default) needs a margin of seconds, "
            "which would be too thin for a provider that keeps them for a day.",
            default_doc="`dispatcher.retention_margin`",
        ),
    )
    max_in_flight: int | None = field(
        default=None,
        metadata=setting(
            Count(),
            "Its calls in flight at once, per process: a slow provider keeps to its own slots.",
            default_doc="up to `dispatcher.concurrency`",
            group=_LIMITS,
        ),
    )
    rate_limit: float | None = field(
        default=None,
        metadata=setting(
            Rate(),
            "Its calls per second across every replica: a token bucket in PostgreSQL, emptied for "
            "the Retry-After of a 429.",
            default_doc="none",
            group=_LIMITS,
        ),
    )
    rate_burst: int | None = field(
        default=None,
        metadata=setting(
            Count(),
            "Calls that may go at once after a quiet spell.",
            default_doc="one second's worth (at least 1)",
            requires="rate_limit",
            group=_LIMITS,
        ),
    )
    breaker_failures: int = field(
        default=5,
        metadata=setting(
            Count(),
            "Failures (transient or unknown) among its last calls that open its circuit "
            "breaker, when they are also breaker_failure_rate of them: a provider that fails "
            "a few calls at random never opens it, one that is down opens it within a few calls.",
            group=_LIMITS,
        ),
    )
    breaker_failure_rate: float = field(
        default=0.8,
        metadata=setting(
            Share(),
            "The share of failures among the last breaker_window calls that opens its breaker: "
            "high, so that operations the provider refuses alone (one payload, one tenant) never "
            "stop the others; they spend their own attempts instead.",
            group=_LIMITS,
        ),
    )
    breaker_window: int = field(
        default=20,
        metadata=setting(
            Count(most=1000),
            "How many of its last calls the breaker weighs: a few seconds of traffic at a "
            "modest rate, so that it opens soon after a provider goes down.",
            group=_LIMITS,
        ),
    )
    breaker_open_for: timedelta = field(
        default=timedelta(seconds=30),
        metadata=setting(
            Duration(),
            "How long its breaker stays open before one probe, doubling while probes of fresh "
            "operations fail (up to 5 minutes, or this if longer): a provider back after a blip "
            "resumes within half a minute, and one still down costs one request per probe.",
            group=_LIMITS,
        ),
    )

    def __post_init__(self) -> None:
        table = _dotted("providers", self.name)
        _provider_name(self.name, Where(table))
        check_fields(self, table)
        if self.retention_margin is not None and self.retention_margin < self.timeout:
            key = f"{table}.retention_margin"
            raise ConfigError(
                f"{key} ({format_duration(self.retention_margin)}) must be at least "
                f"{table}.timeout ({format_duration(self.timeout)}): a retry that starts just "
                "inside the key window may reach the provider that long after, when it has "
                "forgotten the key",
                key=key,
            )
        # Frozen all the way down: a provider cannot change the settings another one sees.
        object.__setattr__(self, "options", _freeze(self.options))

    @property
    def limits(self) -> ProviderLimits:
        """The dispatcher's share for this provider, defaults filled in."""
        burst = self.rate_burst
        if burst is None:
            burst = 1 if self.rate_limit is None else default_burst(self.rate_limit)
        return ProviderLimits(
            max_in_flight=self.max_in_flight,
            rate=self.rate_limit,
            burst=burst,
            breaker_failures=self.breaker_failures,
            breaker_open_for=self.breaker_open_for,
            breaker_failure_rate=self.breaker_failure_rate,
            breaker_window=self.breaker_window,
        )

    def __repr__(self) -> str:
        options = redaction.redact(self.options, marker=REDACTED)
        return f"ProviderSettings(name={self.name!r}, {shown_fields(self)}, options={options!r})"


_BREAKER_FAILURES: Final[int] = default_of(ProviderSettings, "breaker_failures")
_BREAKER_OPEN_FOR: Final[timedelta] = default_of(ProviderSettings, "breaker_open_for")
DEFAULT_FAILURE_RATE: Final[float] = default_of(ProviderSettings, "breaker_failure_rate")
DEFAULT_WINDOW: Final[int] = default_of(ProviderSettings, "breaker_window")


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """How much of the dispatcher one provider may have (see ``outbox.dispatch.limits``).

    ``max_in_flight``: calls in flight per process (None: up to ``dispatcher.concurrency``).
    ``rate``: calls per second across every replica (None: no limit), with ``burst`` calls at
    once after a quiet spell. ``breaker_failures`` failures that are ``breaker_failure_rate`` of
    the last ``breaker_window`` calls open the breaker for ``breaker_open_for`` before a probe.
    """

    max_in_flight: int | None = None
    rate: float | None = None
    burst: int = 1
    breaker_failures: int = _BREAKER_FAILURES
    breaker_open_for: timedelta = _BREAKER_OPEN_FOR
    breaker_failure_rate: float = DEFAULT_FAILURE_RATE
    breaker_window: int = DEFAULT_WINDOW


def default_burst(rate: float) -> int:
    """One second's worth of calls, and at least one."""
    return max(1, math.ceil(rate))


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``outbox run`` is configured with, apart from the database URL."""

    dispatcher: DispatcherSettings
    providers: Mapping[str, ProviderSettings]
    log_level: str = field(
        default="info",
        metadata=setting(Choice(LOG_LEVELS), "How much the daemon logs (a top-level key)."),
    )
    database: DatabaseSettings = field(default_factory=DatabaseSettings)
    web: WebSettings = field(default_factory=WebSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", MappingProxyType(dict(self.providers)))
        check_fields(self, "")
        for name, provider in self.providers.items():
            margin = self.margin_of(provider)
            setting_name = (
                "dispatcher.retention_margin"
                if provider.retention_margin is None
                else f"providers.{name}.retention_margin"
            )
            if name != provider.name:
                raise ConfigError(
                    f"providers.{name} holds the settings of provider {provider.name!r}",
                    key=f"providers.{name}",
                )
            if margin >= provider.key_retention:
                raise ConfigError(
                    f"providers.{name}.key_retention ({format_duration(provider.key_retention)}) "
                    f"must be longer than {setting_name} ({format_duration(margin)}): "
                    "operations go to reconciliation that long before the provider forgets a key",
                    key=f"providers.{name}.key_retention",
                )

    def margin_of(self, provider: ProviderSettings) -> timedelta:
        """How long before ``provider`` forgets a key its retries stop: its own
        retention_margin, else the dispatcher's."""
        own = provider.retention_margin
        return self.dispatcher.retention_margin if own is None else own

    @property
    def margins(self) -> dict[str, timedelta]:
        """The providers with a retention margin of their own, and that margin (the others
        take the dispatcher's)."""
        return {
            name: ps.retention_margin
            for name, ps in self.providers.items()
            if ps.retention_margin is not None
        }


# The tables of the file, and the dataclass each is read into.
TABLES: Final[Mapping[str, type]] = MappingProxyType(
    {"dispatcher": DispatcherSettings, "database": DatabaseSettings, "web": WebSettings}
)
# The keys every [providers.<name>] table may have, and among them those of its share of the
# dispatcher; a provider's other keys are its options.
PROVIDER_KEYS: Final = tuple(s.name for s in settings_of(ProviderSettings))
LIMIT_KEYS: Final = tuple(s.name for s in settings_of(ProviderSettings) if s.group == _LIMITS)

# The defaults other modules use.
DEFAULT_CONCURRENCY: Final[int] = default_of(DispatcherSettings, "concurrency")
DEFAULT_SHUTDOWN_GRACE: Final[timedelta] = default_of(DispatcherSettings, "shutdown_grace")
DEFAULT_KEY_RETENTION: Final[timedelta] = default_of(ProviderSettings, "key_retention")
DEFAULT_TIMEOUT: Final[timedelta] = default_of(ProviderSettings, "timeout")
DEFAULT_MAX_RESPONSE_BYTES: Final[int] = 1 << 20  # the max_response_bytes option's default


def _dotted(*parts: str) -> str:
    """A dotted key as TOML writes it, quoting the parts that are not bare keys."""
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in parts)


def _provider_name(value: object, where: Where) -> str:
    if isinstance(value, str) and PROVIDER_NAME.fullmatch(value):
        return value
    raise where.error(
        f"is not a valid provider name: names must match ^{PROVIDER_NAME.pattern}$ (lower-case "
        'letters, digits, "_" and "-", at most 64 characters)'
    )


def _freeze(value: Any) -> Any:
    """A read-only deep copy: tables as MappingProxyType, arrays as tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value

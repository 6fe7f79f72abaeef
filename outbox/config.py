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
from those declarations (outbox.settings_schema). Rules between keys (``backoff_base`` at most
``backoff_max``...) are the ``__post_init__`` code below them.

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import structlog

from outbox.core.durations import format_duration
from outbox.observability import redaction
from outbox.providers.amqp import options as amqp_options
from outbox.providers.cloudtasks import options as cloudtasks_options
from outbox.providers.nats import options as nats_options
from outbox.providers.sqs import options as sqs_options
from outbox.runtime.event_loop import EVENT_LOOPS, uvloop_available
from outbox.settings_schema import (
    Boolean,
    Choice,
    ConfigError,
    Count,
    Duration,
    Kind,
    Opaque,
    ProviderType,
    Rate,
    Secret,
    Setting,
    Share,
    Where,
    check_fields,
    default_of,
    file_keys,
    format_rate,
    setting,
    settings_of,
    show,
    shown_fields,
)

# What other modules import, ConfigError and format_rate among it (from outbox.settings_schema).
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
    "PROVIDER_OPTIONS",
    "REDACTED",
    "TABLES",
    "ConfigError",
    "DatabaseSettings",
    "DispatcherSettings",
    "ProviderLimits",
    "ProviderSettings",
    "Settings",
    "default_burst",
    "format_rate",
    "load_settings",
    "read_secret",
    "settings_from_mapping",
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

_ENV: Final = "OUTBOX_"
_ENV_PROVIDERS: Final = "OUTBOX_PROVIDERS__"


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
            "database pool's size.",
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


# The options of both HTTP providers.
_ALLOW_INSECURE: Final = Setting(
    "allow_insecure",
    Boolean(),
    "Send secrets (secret headers, the API key) over http:// to a host other than loopback, "
    "which is refused otherwise.",
    default=False,
)
_MAX_RESPONSE_BYTES: Final = Setting(
    "max_response_bytes",
    Count(unit="bytes"),
    "The most of one answer read, counted as decoded, so a compressed answer cannot expand past "
    "it: an answer is held in memory whole while its reference is read, and 1 MiB is hundreds "
    "of times a webhook's or a Stripe object's answer, yet the 64 calls in flight of the "
    "default concurrency hold at most 64 MiB of answers. A longer answer is *unknown*.",
    default=1 << 20,
)

_HEADERS: Final = Setting(
    "headers",
    Opaque("table of strings"),
    "Headers sent with every request, in plain sight: a secret-looking one "
    "(Authorization, *token*, Cookie...) is refused here.",
    default=None,
    default_doc="none",
    env=False,
)
_SECRET_HEADERS: Final = Setting(
    "secret_headers",
    Opaque('table of `{env = "VAR"}` or `{file = "/path"}`'),
    "Headers whose values are secrets, read from the environment or a file (under "
    "systemd, relative to $CREDENTIALS_DIRECTORY) and never logged.",
    default=None,
    default_doc="none",
    env=False,
)

# The options each built-in provider type reads (besides the keys of ProviderSettings), which
# its factory (outbox.providers.registry) checks and reads; a plug-in's type takes any options.
# On loading, only the values that are not text are read (so that the environment's text reads
# as the file would give it); the rest stay as written.
PROVIDER_OPTIONS: Final[Mapping[str, tuple[Setting, ...]]] = MappingProxyType(
    {
        "webhook": (
            Setting(
                "url",
                Opaque("`http://` or `https://` URL, no credentials"),
                "Where each operation is POSTed.",
            ),
            _HEADERS,
            _SECRET_HEADERS,
            Setting(
                "reference_field",
                Opaque("text"),
                "The JSON field of a 2xx answer that identifies the effect (the operation's "
                "provider_ref); without it, the idempotency key.",
                default="id",
            ),
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
            Setting(
                "lookup",
                Opaque('table (docs/providers.md, "Lookups")'),
                "How reconciliation asks the receiver whether an in-doubt operation's effect "
                "exists (a path below the URL's origin, such as `/effects?key={key}`): without "
                "one, a person decides.",
                default=None,
                default_doc="none",
                env=False,
            ),
        ),
        "http": (
            Setting(
                "base_url",
                Opaque("`http://` or `https://` URL, no credentials, no query"),
                "The API's scheme, host and optional path prefix; each action's path is below "
                "it, and no payload value can change the host.",
            ),
            _HEADERS,
            _SECRET_HEADERS,
            Setting(
                "key",
                Opaque('table (docs/providers.md, "Keys")'),
                "Where the idempotency key travels (a header, quoted or not, or a body field), "
                "in which form, and the length and characters the provider takes; each action "
                "may change it.",
                default=None,
                default_doc="the `Idempotency-Key` header, unquoted, as stored",
                env=False,
            ),
            Setting(
                "actions",
                Opaque('table of actions (docs/providers.md, "Actions")'),
                "Per action: method, path template, body, reference, key_retention, key, "
                'status overrides and lookup. `"*"` takes any other action.',
                env=False,
            ),
            Setting(
                "outbox_headers",
                Boolean(),
                "Send the Outbox-Operation-Id, -Action, -Attempt, -Tenant-Id and "
                "-Correlation-Id headers, as the webhook type does (a third party learns the "
                "tenant ids from them).",
                default=False,
            ),
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
        ),
        "stripe": (
            Setting(
                "api_key",
                Secret(
                    "the API key",
                    carries="the key itself",
                    kind_of_value="an API key",
                    example_env="STRIPE_API_KEY",
                ),
                "The secret or restricted key; under systemd, LoadCredential=<provider name>:... "
                "needs neither key.",
                default_doc="the file `<provider name>` in `$CREDENTIALS_DIRECTORY`",
            ),
            Setting(
                "api_base",
                Opaque("`http://` or `https://` URL"),
                "Stripe's API, or a test double of it.",
                default="https://api.stripe.com",
            ),
            Setting(
                "stripe_account",
                Opaque("text (`acct_...`)"),
                "The Connect account every operation of the provider acts for (Stripe-Account).",
                default=None,
                default_doc="none: the platform's own",
            ),
            _ALLOW_INSECURE,
            _MAX_RESPONSE_BYTES,
            Setting(
                "redact_fields",
                Opaque("array of field names"),
                "Fields never kept in an operation's result, at any depth: client_secret "
                "confirms a payment from any browser.",
                default=("client_secret",),
                env=False,
            ),
            Setting(
                "stripe_version",
                Opaque("Stripe API version, a date and a name"),
                "The API version requests are sent in (Stripe-Version): the one stripe-python "
                "16.1 was built for, never the SDK's default, which moves with each release. "
                "An operation keeps the version of its first send.",
                default="2026-10-28.endive",
            ),
            Setting(
                "operation_accounts",
                Boolean(),
                "Whether an operation may name its own Connect account (the payload's top-level "
                "stripe_account): any producer of the provider can then act for any account "
                "the platform's key reaches.",
                default=False,
            ),
        ),
        "noop": (),
        "nats": nats_options.OPTIONS,
        "amqp": amqp_options.OPTIONS,
        "sqs": sqs_options.OPTIONS,
        "cloudtasks": cloudtasks_options.OPTIONS,
    }
)


_BREAKER_FAILURES: Final[int] = default_of(ProviderSettings, "breaker_failures")
_BREAKER_OPEN_FOR: Final[timedelta] = default_of(ProviderSettings, "breaker_open_for")
DEFAULT_FAILURE_RATE: Final[float] = default_of(ProviderSettings, "breaker_failure_rate")
DEFAULT_WINDOW: Final[int] = default_of(ProviderSettings, "breaker_window")


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """How much of the dispatcher one provider may have (see ``outbox.provider_limits``).

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
    {"dispatcher": DispatcherSettings, "database": DatabaseSettings}
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
DEFAULT_MAX_RESPONSE_BYTES: Final[int] = _MAX_RESPONSE_BYTES.default


def _provider_name(value: object, where: Where) -> str:
    if isinstance(value, str) and PROVIDER_NAME.fullmatch(value):
        return value
    raise where.error(
        f"is not a valid provider name: names must match ^{PROVIDER_NAME.pattern}$ (lower-case "
        'letters, digits, "_" and "-", at most 64 characters)'
    )


# --- Loading ---------------------------------------------------------------------------------

_Values = dict[str, tuple[Any, Where]]


@dataclass(slots=True)
class _RawProvider:
    where: Where
    values: _Values


@dataclass(slots=True)
class _Raw:
    """The values read so far, each with where it came from: the file's, then the environment's."""

    top: _Values
    tables: dict[str, _Values]
    providers: dict[str, _RawProvider]


def load_settings(path: Path | None, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings in the TOML file at ``path`` (None: the defaults), with environment overrides.

    ``environ`` defaults to ``os.environ``. Raises ConfigError naming the file when it cannot be
    read or is not valid TOML, and naming the key or variable when a value is wrong.
    """
    if path is None:
        return settings_from_mapping({}, environ, source="<defaults>")
    path = Path(path)
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as exc:  # its message ends "(at line L, column C)"
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return settings_from_mapping(data, environ, source=str(path))


def settings_from_mapping(
    data: Mapping[str, Any], environ: Mapping[str, str] | None = None, *, source: str = "<config>"
) -> Settings:
    """The settings in ``data`` (a parsed TOML document), with environment overrides.

    ``source`` names ``data`` in error messages; ``environ`` defaults to ``os.environ``.
    """
    env = os.environ if environ is None else environ
    raw = _read_document(data, source)
    _apply_environment(raw, env)
    return Settings(
        dispatcher=DispatcherSettings(**_read_table(DispatcherSettings, raw.tables["dispatcher"])),
        providers={name: _provider_settings(name, table) for name, table in raw.providers.items()},
        **_read_table(Settings, raw.top),
        database=DatabaseSettings(**_read_table(DatabaseSettings, raw.tables["database"], env)),
    )


def _dotted(*parts: str) -> str:
    """A dotted key as TOML writes it, quoting the parts that are not bare keys."""
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in parts)


def _table(value: object, where: Where, valid: tuple[str, ...] | None = None) -> _Values:
    """The table ``value``, each value paired with where it is; its keys must be in ``valid``."""
    if not isinstance(value, Mapping):
        raise where.error(f"must be a table, not {show(value)}")
    values: _Values = {}
    for key, item in value.items():
        at = Where(
            f"{where.key}.{_dotted(str(key))}" if where.key else _dotted(str(key)), where.source
        )
        if valid is not None and key not in valid:
            raise ConfigError(
                f"unknown key {at}; the valid keys are {', '.join(valid)}", key=at.key
            )
        values[str(key)] = (item, at)
    return values


def _read_document(data: Mapping[str, Any], source: str) -> _Raw:
    top_keys = (*TABLES, "providers", *file_keys(settings_of(Settings)))
    top = _table(data, Where("", source), tuple(sorted(top_keys)))
    tables = {name: top.pop(name, ({}, Where(name, source))) for name in TABLES}
    for name, (table, where) in tables.items():
        _refuse_written_secrets(TABLES[name], table, where)
    raw = _Raw(top, {}, {})
    for name, (table, where) in tables.items():
        raw.tables[name] = _table(table, where, tuple(file_keys(settings_of(TABLES[name]))))
    providers, at_providers = top.pop("providers", ({}, Where("providers", source)))
    for name, (table, where) in _table(providers, at_providers).items():
        raw.providers[name] = _RawProvider(where, _table(table, where))
    return raw


def _refuse_written_secrets(cls: type, table: object, where: Where) -> None:
    """A secret written in the file itself is refused before anything else is said of it."""
    if isinstance(table, Mapping):
        for declared in settings_of(cls):
            if isinstance(declared.kind, Secret) and declared.name in table:
                declared.kind.read(
                    table[declared.name], Where(f"{where.key}.{declared.name}", where.source)
                )


def _read_table(
    cls: type, values: _Values, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The values of one table read as their declarations say, as keyword arguments of ``cls``;
    a secret read from where the table says it is."""
    keys = file_keys(settings_of(cls))
    read = {key: keys[key][1].read(value, where) for key, (value, where) in values.items()}
    fields = {key: value for key, value in read.items() if keys[key][0].name == key}
    for declared in settings_of(cls):
        if isinstance(declared.kind, Secret):
            fields[declared.name] = _secret(declared.name, declared.kind, values, environ or {})
    return fields


def _secret(name: str, secret: Secret, values: _Values, environ: Mapping[str, str]) -> str | None:
    """The secret ``name`` from where the table says it is; None when it is nowhere."""
    if f"{name}_env" in values and f"{name}_file" in values:
        other, where = values[f"{name}_env"][1].key, values[f"{name}_file"][1]
        raise where.error(f"and {other} both say where {secret.label} is; keep one")
    for suffix, kind in (("_file", "file"), ("_env", "env")):
        if name + suffix in values:
            reference, where = values[name + suffix]
            return read_secret({kind: reference}, key=where.key, environ=environ)
    # Unset or empty (an env file's placeholder): none.
    return (environ.get(secret.default_env) or None) if secret.default_env else None


def _provider_settings(name: str, raw: _RawProvider) -> ProviderSettings:
    _provider_name(name, raw.where)
    values = dict(raw.values)
    if "type" not in values:
        if raw.where.env is not None:  # only the environment mentions this provider
            env_name = raw.where.env.removeprefix(_ENV_PROVIDERS).split("__")[0]
            raise raw.where.error(
                f"is not in the config file; set {_ENV_PROVIDERS}{env_name}__TYPE to add it"
            )
        where = Where(f"{raw.where.key}.type", raw.where.source)
        raise where.error(
            'is required: the provider\'s type, such as "webhook", "stripe" or "noop"'
        )
    # Every provider has these keys; what each must be names the key (and its source).
    common = {
        key: kind.read(*values.pop(key))
        for key, (_, kind) in file_keys(settings_of(ProviderSettings)).items()
        if key in values
    }
    options = file_keys(PROVIDER_OPTIONS.get(common["type"], ()))
    return ProviderSettings(
        name=name,
        options={k: _option(options.get(k), value, where) for k, (value, where) in values.items()},
        **common,
    )


def _option(declared: tuple[Setting, Kind[Any]] | None, value: object, where: Where) -> object:
    """An option of a built-in provider type as written, or read when it is not text."""
    return declared[1].read(value, where) if declared and declared[1].not_text else value


# --- Environment overrides -------------------------------------------------------------------


def _apply_environment(raw: _Raw, environ: Mapping[str, str]) -> None:
    """Lay the OUTBOX_* overrides over ``raw``, in a fixed order so errors are reproducible."""
    top = {f"{_ENV}{s.name.upper()}": s.name for s in settings_of(Settings) if s.env}
    for var in sorted(environ):
        value = environ[var]
        if var in top:
            raw.top[top[var]] = (value, Where(top[var], env=var))
        elif var.startswith(_ENV_PROVIDERS):
            _override_provider(raw, var, value)
        else:
            for table in TABLES:
                if var.startswith(f"{_ENV}{table.upper()}__"):
                    _override_table(raw, table, var, value)


def _override_table(raw: _Raw, table: str, var: str, value: str) -> None:
    key = var.removeprefix(f"{_ENV}{table.upper()}__").lower()
    where = Where(f"{table}.{key}", env=var)
    for declared in settings_of(TABLES[table]):
        if declared.name == key and isinstance(declared.kind, Secret) and declared.kind.default_env:
            raise where.error(f"is read from {declared.kind.default_env}, not from {var}")
    valid = file_keys(settings_of(TABLES[table]))
    if key not in valid:
        raise ConfigError(
            f"{var}: the {table} has no setting {key!r}; the valid keys are {', '.join(valid)}",
            key=var,
        )
    raw.tables[table][key] = (value, where)


def _override_provider(raw: _Raw, var: str, value: str) -> None:
    parts = var.removeprefix(_ENV_PROVIDERS).split("__")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"{var}: write provider overrides as {_ENV_PROVIDERS}<NAME>__<KEY> "
            "(keys inside a provider's tables cannot be set from the environment)",
            key=var,
        )
    name = _provider_named(raw.providers, parts[0], var)
    provider = raw.providers.setdefault(
        name, _RawProvider(Where(_dotted("providers", name), env=var), {})
    )
    # Match an existing option whatever its case, so REFERENCE_FIELD overrides reference_field.
    key = next((k for k in provider.values if k.lower() == parts[1].lower()), parts[1].lower())
    where = Where(_dotted("providers", name, key), env=var)
    if isinstance(provider.values.get(key, (None,))[0], Mapping):
        raise where.error("is a table; it cannot be replaced from the environment")
    provider.values[key] = (value, where)


def _provider_named(providers: Mapping[str, _RawProvider], env_name: str, var: str) -> str:
    """The provider that NAME in ``var`` means: matched ignoring case, with "-" written "_"."""
    matches = [n for n in providers if n.upper().replace("-", "_") == env_name.upper()]
    if len(matches) > 1:
        raise ConfigError(
            f"{var} could mean provider {' or '.join(matches)}: rename one of them", key=var
        )
    return matches[0] if matches else env_name.lower()


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


def _freeze(value: Any) -> Any:
    """A read-only deep copy: tables as MappingProxyType, arrays as tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value

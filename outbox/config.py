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

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import decimal
import json
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

import structlog

from outbox.durations import format_duration, parse_duration
from outbox.errors import OutboxError
from outbox.event_loop import EVENT_LOOPS, uvloop_available

# --- Defaults, and why -----------------------------------------------------------------------

# Enough calls in flight to hide provider latency (at ~100 ms a call, over 600 calls a second)
# while staying far below providers' rate limits and a database pool's size.
DEFAULT_CONCURRENCY: Final = 64
# One claim query per 100 rows amortises its round trip without leasing rows that the workers
# will not reach before their lease runs out.
DEFAULT_BATCH_SIZE: Final = 100
# Outlives a provider call at its timeout (10-20 s) plus recording the result, yet a crashed
# process's operations are claimed again within half a minute.
DEFAULT_LEASE: Final = timedelta(seconds=30)
# NOTIFY wakes the dispatcher at once; polling only covers lost notifications and retries coming
# due, so once a second bounds their delay at a negligible cost to the database.
DEFAULT_POLL_INTERVAL: Final = timedelta(seconds=1)
# Lets in-flight calls finish within Kubernetes' default 30 s termination grace period, with 5 s
# left to release leases and exit before SIGKILL.
DEFAULT_SHUTDOWN_GRACE: Final = timedelta(seconds=25)
# With doubling backoff from 1 s, ten attempts ride out a provider outage of several minutes
# before the operation needs a human.
DEFAULT_MAX_ATTEMPTS: Final = 10
# Most transient failures (a reset connection, a 502 during a deploy) clear within a second.
DEFAULT_BACKOFF_BASE: Final = timedelta(seconds=1)
# A recovered provider is tried again within ten minutes, and a long outage costs each
# operation no more than six calls an hour.
DEFAULT_BACKOFF_MAX: Final = timedelta(minutes=10)
# A retry after the provider forgot the idempotency key could repeat the effect, so retries stop
# this long before that; an hour absorbs clock skew and a slow last attempt with room to spare.
DEFAULT_RETENTION_MARGIN: Final = timedelta(hours=1)
# The reconciler asks providers about reconciling operations on its own; only a person's
# decision is needed for what it cannot find.
DEFAULT_AUTO_RECONCILE: Final = True
# A lookup lists a page or two of objects per operation: every few minutes finds an effect soon
# after it appears (Stripe may roll a 500 forward) without loading the provider's API.
DEFAULT_RECONCILE_INTERVAL: Final = timedelta(minutes=5)
# The database-wide gauges: a scrape interval's worth of staleness, one cheap query per period.
DEFAULT_GAUGE_INTERVAL: Final = timedelta(seconds=15)
# Without a heartbeat setting, leases are renewed three times per lease: one late renewal still
# leaves the lease held.
HEARTBEATS_PER_LEASE: Final = 3
# Stripe keeps idempotency keys for at least 24 hours; other providers must say otherwise.
DEFAULT_KEY_RETENTION: Final = timedelta(hours=24)
# A provider that has not answered in 10 s is probably stuck; well under the lease, so the
# lease outlives the call.
DEFAULT_TIMEOUT: Final = timedelta(seconds=10)
# The most bytes of one answer an HTTP provider reads (``max_response_bytes``), counted as
# decoded, so a compressed answer cannot expand past it: an answer is held in memory whole while
# its reference is read, and 1 MiB is hundreds of times a webhook's or a Stripe object's
# answer, yet the 64 calls in flight of the default concurrency hold at most 64 MiB of answers.
DEFAULT_MAX_RESPONSE_BYTES: Final = 1 << 20
# Five failures in a row (transient or unknown) are an outage, not bad luck: at a few percent of
# random errors, five in a row happen about once in ten million calls.
DEFAULT_BREAKER_FAILURES: Final = 5
# An open provider is probed again after this long: a provider back after a blip resumes within
# half a minute, and one still down costs one request per probe. Doubles while probes fail, up
# to BREAKER_OPEN_MAX (or breaker_open_for, if longer).
DEFAULT_BREAKER_OPEN_FOR: Final = timedelta(seconds=30)
BREAKER_OPEN_MAX: Final = timedelta(minutes=5)
DEFAULT_LOG_LEVEL: Final = "info"
# How the database URL reaches PostgreSQL. "session": a session of our own per connection (a
# direct connection, or a pooler in session mode), so prepared statements, session settings and
# LISTEN all work; the default, because it is what a plain PostgreSQL URL gives. "transaction": a
# pooler (PgBouncer's pool_mode = transaction) that lends a server session per transaction only.
POOL_MODES: Final = ("session", "transaction")
DEFAULT_POOL_MODE: Final = "session"
# `outbox run` gives the database this long to answer at start-up, then exits saying so.
DEFAULT_STARTUP_WAIT: Final = timedelta(seconds=60)
# Where the URL of a direct connection for LISTEN is found unless the file names another place:
# beside OUTBOX_DATABASE_URL, in the environment, and like it without a password (libpq's pgpass).
DEFAULT_LISTEN_URL_ENV: Final = "OUTBOX_LISTEN_DATABASE_URL"
# Whether the daemon LISTENs for enqueue notifications at all. On by default: an idle dispatcher
# then claims a committed row within milliseconds instead of at its next poll. Off, it polls only
# (every poll_interval), and producers never notify, since no dispatcher registers as waiting.
DEFAULT_LISTEN: Final = True

LOG_LEVELS: Final = ("debug", "info", "warning", "error")
PROVIDER_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
# What repr() shows instead of anything that might be a secret.
REDACTED: Final = "***"

_TOP_KEYS: Final = ("database", "dispatcher", "log_level", "providers")
# Option names that might hold a secret, matched case-insensitively anywhere in the name.
_SECRET_WORDS: Final = ("key", "secret", "token", "password", "authorization")
_ENV_LOG_LEVEL: Final = "OUTBOX_LOG_LEVEL"
_ENV_DISPATCHER: Final = "OUTBOX_DISPATCHER__"
_ENV_DATABASE: Final = "OUTBOX_DATABASE__"
_ENV_PROVIDERS: Final = "OUTBOX_PROVIDERS__"
_DURATION_FORMS: Final = "like 500ms, 30s, 10m, 24h, 1h30m or a number of seconds"
# A provider's rate limit: a number of calls per second or per minute.
_RATE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m)\s*")
_RATE_UNITS: Final = {"s": 1.0, "m": 60.0}


class ConfigError(OutboxError):
    """The settings are invalid; the message names the offending key or environment variable.

    ``key`` is the dotted key (``dispatcher.lease``), or the variable's name when no key applies.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class _Where:
    """Where a value came from, as error messages name it."""

    key: str
    source: str | None = None
    env: str | None = None

    def __str__(self) -> str:
        if self.env is not None:
            return f"{self.key} (from {self.env})"
        return self.key if self.source is None else f"{self.key} (in {self.source})"

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self} {message}", key=self.key)


# --- Single values ---------------------------------------------------------------------------


def _show(value: object) -> str:
    """``value`` as a message quotes it: in TOML's spelling, tables and arrays by kind only."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, timedelta):
        return format_duration(value) if value >= timedelta(0) else f"-{format_duration(-value)}"
    return str(value)


def _positive_int(value: object, where: _Where) -> int:
    """``value`` as an integer of at least 1; from the environment, its decimal text."""
    number = value
    # Only the environment gives integers as text: "64" in the file is a mistake worth naming.
    if where.env is not None and isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
        number = int(value)
    if isinstance(number, bool) or not isinstance(number, int) or number < 1:
        raise where.error(f"must be a positive integer, not {_show(value)}")
    return number


# The most calls one process may have in flight: past this a typo, not a setting (each call is a
# task, a pool slot and a socket; PostgreSQL's default max_connections is 100).
MAX_CONCURRENCY: Final = 10_000


def _bounded_int(value: object, where: _Where, most: int) -> int:
    number = _positive_int(value, where)
    if number > most:
        raise where.error(f"must be at most {most:,}, not {_show(value)}")
    return number


def _boolean(value: object, where: _Where) -> bool:
    """``value`` as a boolean; from the environment, true/false/1/0/yes/no."""
    if where.env is not None and isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
    if not isinstance(value, bool):
        raise where.error(f"must be true or false, not {_show(value)}")
    return value


def _as_timedelta(value: object) -> timedelta | None:
    """``value`` (a duration string, seconds or a timedelta) as a timedelta, else None."""
    if isinstance(value, timedelta):
        return value
    try:
        if isinstance(value, str):
            return parse_duration(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return timedelta(seconds=value)
    except (ValueError, OverflowError):  # not a duration, NaN, or beyond timedelta's range
        return None
    return None


def _duration(value: object, where: _Where, *, allow_zero: bool) -> timedelta:
    duration = _as_timedelta(value)
    if duration is None or duration < timedelta(0) or (not duration and not allow_zero):
        bound = "zero or more" if allow_zero else "greater than zero"
        raise where.error(f"must be a duration {bound} ({_DURATION_FORMS}), not {_show(value)}")
    return duration


def _positive_duration(value: object, where: _Where) -> timedelta:
    """``value`` as a duration greater than zero."""
    return _duration(value, where, allow_zero=False)


def _nonnegative_duration(value: object, where: _Where) -> timedelta:
    """``value`` as a duration of zero or more."""
    return _duration(value, where, allow_zero=True)


def _optional_positive_duration(value: object, where: _Where) -> timedelta | None:
    """``value`` as a duration greater than zero, or None (only possible from Python code)."""
    return None if value is None else _positive_duration(value, where)


def _rate(value: object, where: _Where) -> float:
    """``value``, such as "100/s" or "600/m", as calls per second (greater than zero)."""
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    per_second = float(match.group(1)) / _RATE_UNITS[match.group(2)] if match else 0.0
    if not per_second > 0:
        raise where.error(
            f'must be a rate such as "100/s" or "600/m" (calls per second or per minute), '
            f"not {_show(value)}"
        )
    return per_second


def format_rate(per_second: float) -> str:
    """Calls per second as a config value the rate parser reads back: "100/s", or "30/m" for a
    whole number of calls a minute under one a second."""
    per_minute = per_second * 60
    if per_second < 1 and math.isclose(per_minute, round(per_minute)) and round(per_minute):
        return f"{round(per_minute)}/m"
    # The shortest text that reads back as the same float, in fixed point: never an exponent
    # ("1e+06/s" is no config value).
    fixed = format(decimal.Decimal(repr(per_second)), "f")
    return (fixed.rstrip("0").rstrip(".") if "." in fixed else fixed) + "/s"


def _log_level(value: object, where: _Where) -> str:
    """``value`` as one of LOG_LEVELS, in lower case."""
    if isinstance(value, str) and value.strip().lower() in LOG_LEVELS:
        return value.strip().lower()
    raise where.error(f"must be one of {', '.join(LOG_LEVELS)}, not {_show(value)}")


def _provider_type(value: object, where: _Where) -> str:
    """``value`` as a provider type: a built-in type or a third-party entry-point name."""
    if isinstance(value, str) and value.strip():
        return value
    raise where.error(
        f'must name a provider type such as "webhook", "stripe" or "noop", not {_show(value)}'
    )


def _provider_name(value: object, where: _Where) -> str:
    if isinstance(value, str) and PROVIDER_NAME.fullmatch(value):
        return value
    raise where.error(
        f"is not a valid provider name: names must match ^{PROVIDER_NAME.pattern}$ (lower-case "
        'letters, digits, "_" and "-", at most 64 characters)'
    )


def _pool_mode(value: object, where: _Where) -> str:
    """``value`` as one of POOL_MODES, in lower case."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text in POOL_MODES:
        return text
    if text == "statement":
        raise where.error(
            'cannot be "statement": statement pooling forbids the multi-statement transactions '
            "that outbox's producers and operator commands rely on; use "
            'pool_mode = "transaction" in the pooler and here'
        )
    raise where.error(f"must be one of {', '.join(POOL_MODES)}, not {_show(value)}")


def _event_loop(value: object, where: _Where) -> str:
    """``value`` as one of EVENT_LOOPS, in lower case; "uvloop" only where it is installed."""
    text = value.strip().lower() if isinstance(value, str) else None
    if text not in EVENT_LOOPS:
        raise where.error(f"must be one of {', '.join(EVENT_LOOPS)}, not {_show(value)}")
    if text == "uvloop" and not uvloop_available():
        raise where.error('is "uvloop", which is not installed here; use "auto" or "asyncio"')
    return text


def _env_name(value: object, where: _Where) -> str:
    """``value`` as the name of an environment variable."""
    if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        return value
    # Never quote it: someone may have written the URL itself here.
    raise where.error("must name an environment variable, such as OUTBOX_LISTEN_DATABASE_URL")


def _file_name(value: object, where: _Where) -> str:
    """``value`` as a file name (a relative one is looked up in $CREDENTIALS_DIRECTORY)."""
    if isinstance(value, str) and value.strip():
        return value
    raise where.error(f"must be a file name, not {_show(value)}")


# Every key of [dispatcher] and what its value must be: this table is the list of valid keys.
_DISPATCHER_CHECKS: Final[Mapping[str, Callable[[Any, _Where], Any]]] = MappingProxyType(
    {
        "concurrency": lambda value, where: _bounded_int(value, where, MAX_CONCURRENCY),
        "batch_size": _positive_int,
        "lease": _positive_duration,
        "poll_interval": _positive_duration,
        "shutdown_grace": _nonnegative_duration,
        "max_attempts": _positive_int,
        "backoff_base": _positive_duration,
        "backoff_max": _positive_duration,
        "retention_margin": _nonnegative_duration,
        "heartbeat": _optional_positive_duration,
        "auto_reconcile": _boolean,
        "reconcile_interval": _positive_duration,
        "gauge_interval": _positive_duration,
        "event_loop": _event_loop,
    }
)


# The keys of [providers.<name>] that set the provider's share of the dispatcher (every type has
# them), and what each value must be.
_LIMIT_CHECKS: Final[Mapping[str, Callable[[Any, _Where], Any]]] = MappingProxyType(
    {
        "max_in_flight": _positive_int,
        "rate_limit": _rate,
        "rate_burst": _positive_int,
        "breaker_failures": _positive_int,
        "breaker_open_for": _positive_duration,
    }
)
LIMIT_KEYS: Final = tuple(_LIMIT_CHECKS)

# Keys that some provider types take (the provider's factory says which, and rejects the rest)
# and whose values are not text: checked here, where a value's source is still known, so that an
# override from the environment (always text) is read as the file would give it.
_OPTION_CHECKS: Final[Mapping[str, Callable[[Any, _Where], Any]]] = MappingProxyType(
    {"max_response_bytes": _positive_int}
)


# Every key of [database] and what its value must be. The LISTEN URL may carry a password, so the
# file says only where it is: in an environment variable or a (credentials) file.
_DATABASE_CHECKS: Final[Mapping[str, Callable[[Any, _Where], Any]]] = MappingProxyType(
    {
        "pool_mode": _pool_mode,
        "listen_url_env": _env_name,
        "listen_url_file": _file_name,
        "listen": _boolean,
        "startup_wait": _positive_duration,
    }
)


# --- The settings ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DispatcherSettings:
    """How the dispatcher claims, calls, retries and gives up; the DEFAULT_* constants say why."""

    concurrency: int = DEFAULT_CONCURRENCY
    batch_size: int = DEFAULT_BATCH_SIZE
    lease: timedelta = DEFAULT_LEASE
    poll_interval: timedelta = DEFAULT_POLL_INTERVAL
    shutdown_grace: timedelta = DEFAULT_SHUTDOWN_GRACE
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    backoff_base: timedelta = DEFAULT_BACKOFF_BASE
    backoff_max: timedelta = DEFAULT_BACKOFF_MAX
    retention_margin: timedelta = DEFAULT_RETENTION_MARGIN
    heartbeat: timedelta | None = None
    auto_reconcile: bool = DEFAULT_AUTO_RECONCILE
    reconcile_interval: timedelta = DEFAULT_RECONCILE_INTERVAL
    gauge_interval: timedelta = DEFAULT_GAUGE_INTERVAL
    event_loop: str = "auto"

    def __post_init__(self) -> None:
        # The loader checked each value already, naming its source; this keeps settings built in
        # Python code to the same rules.
        for name, check in _DISPATCHER_CHECKS.items():
            check(getattr(self, name), _Where(f"dispatcher.{name}"))
        object.__setattr__(
            self, "event_loop", _event_loop(self.event_loop, _Where("dispatcher.event_loop"))
        )
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
    """How ``outbox run`` reaches PostgreSQL, beyond the database URL itself.

    ``pool_mode`` "transaction" means the URL leads to a transaction-mode pooler: no prepared
    statements, no session settings (the DBA sets them on the role), no LISTEN through it.
    ``listen_url`` is a direct connection (bypassing the pooler) for LISTEN; it may carry a
    password, so it is never shown. Without one, a transaction-pooled daemon polls only.
    ``listen`` false turns LISTEN off whatever the connection: the daemon polls only, and any
    ``listen_url`` goes unused.
    """

    pool_mode: str = DEFAULT_POOL_MODE
    listen_url: str | None = None
    listen: bool = DEFAULT_LISTEN
    # How long `outbox run` waits for the database at start-up before it exits (code 2) saying
    # so; once it has started, an unreachable database is waited out for ever.
    startup_wait: timedelta = DEFAULT_STARTUP_WAIT

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "pool_mode", _pool_mode(self.pool_mode, _Where("database.pool_mode"))
        )
        if self.listen_url is not None and (
            not isinstance(self.listen_url, str) or not self.listen_url.strip()
        ):
            raise ConfigError(
                "database.listen_url must be a connection URL", key="database.listen_url"
            )
        _boolean(self.listen, _Where("database.listen"))

    @property
    def transaction_pooling(self) -> bool:
        """True when server sessions are lent per transaction, not held per connection."""
        return self.pool_mode == "transaction"

    def __repr__(self) -> str:
        shown = None if self.listen_url is None else REDACTED
        return (
            f"DatabaseSettings(pool_mode={self.pool_mode!r}, listen_url={shown!r}, "
            f"listen={self.listen!r})"
        )


def _no_options() -> Mapping[str, Any]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class ProviderLimits:
    """How much of the dispatcher one provider may have (see ``outbox.provider_limits``).

    ``max_in_flight``: calls in flight per process (None: up to ``dispatcher.concurrency``).
    ``rate``: calls per second across every replica (None: no limit), with ``burst`` calls at
    once after a quiet spell. ``breaker_failures`` failures in a row open the breaker for
    ``breaker_open_for`` before a probe.
    """

    max_in_flight: int | None = None
    rate: float | None = None
    burst: int = 1
    breaker_failures: int = DEFAULT_BREAKER_FAILURES
    breaker_open_for: timedelta = DEFAULT_BREAKER_OPEN_FOR


def default_burst(rate: float) -> int:
    """One second's worth of calls, and at least one."""
    return max(1, math.ceil(rate))


@dataclass(frozen=True, slots=True, repr=False)
class ProviderSettings:
    """One ``[providers.<name>]`` table. ``options`` holds its other keys, read-only and as
    written (tables as read-only mappings, arrays as tuples); the provider's factory checks them.
    The keys every provider has are fields; ``rate_limit`` is in calls per second.
    """

    name: str
    type: str
    key_retention: timedelta = DEFAULT_KEY_RETENTION
    timeout: timedelta = DEFAULT_TIMEOUT
    options: Mapping[str, Any] = field(default_factory=_no_options)
    max_in_flight: int | None = None
    rate_limit: float | None = None
    rate_burst: int | None = None
    breaker_failures: int = DEFAULT_BREAKER_FAILURES
    breaker_open_for: timedelta = DEFAULT_BREAKER_OPEN_FOR

    def __post_init__(self) -> None:
        where = _Where(_dotted("providers", self.name))
        _provider_name(self.name, where)
        _provider_type(self.type, _Where(f"{where.key}.type"))
        _positive_duration(self.key_retention, _Where(f"{where.key}.key_retention"))
        _positive_duration(self.timeout, _Where(f"{where.key}.timeout"))
        self._check_limits(where.key)
        # Frozen all the way down: a provider cannot change the settings another one sees.
        object.__setattr__(self, "options", _freeze(self.options))

    def _check_limits(self, key: str) -> None:
        if self.max_in_flight is not None:
            _positive_int(self.max_in_flight, _Where(f"{key}.max_in_flight"))
        rate = self.rate_limit
        if rate is not None and (
            isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf
        ):
            raise _Where(f"{key}.rate_limit").error(
                f"must be a number of calls per second greater than zero, not {_show(rate)}"
            )
        if self.rate_burst is not None:
            _positive_int(self.rate_burst, _Where(f"{key}.rate_burst"))
            if rate is None:
                raise _Where(f"{key}.rate_burst").error(
                    f"applies only with {key}.rate_limit, which is not set"
                )
        _positive_int(self.breaker_failures, _Where(f"{key}.breaker_failures"))
        _positive_duration(self.breaker_open_for, _Where(f"{key}.breaker_open_for"))

    @property
    def limits(self) -> ProviderLimits:
        """The dispatcher's share for this provider, defaults filled in."""
        burst = self.rate_burst
        if burst is None:
            burst = 1 if self.rate_limit is None else default_burst(self.rate_limit)
        return ProviderLimits(
            max_in_flight=self.max_in_flight, rate=self.rate_limit, burst=burst,
            breaker_failures=self.breaker_failures, breaker_open_for=self.breaker_open_for,
        )  # fmt: skip

    def __repr__(self) -> str:
        rate = None if self.rate_limit is None else format_rate(self.rate_limit)
        return (
            f"ProviderSettings(name={self.name!r}, type={self.type!r}, "
            f"key_retention={format_duration(self.key_retention)!r}, "
            f"timeout={format_duration(self.timeout)!r}, max_in_flight={self.max_in_flight!r}, "
            f"rate_limit={rate!r}, rate_burst={self.rate_burst!r}, "
            f"breaker_failures={self.breaker_failures!r}, "
            f"breaker_open_for={format_duration(self.breaker_open_for)!r}, "
            f"options={_redact(self.options)!r})"
        )


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``outbox run`` is configured with, apart from the database URL."""

    dispatcher: DispatcherSettings
    providers: Mapping[str, ProviderSettings]
    log_level: str = DEFAULT_LOG_LEVEL
    database: DatabaseSettings = field(default_factory=DatabaseSettings)

    def __post_init__(self) -> None:
        object.__setattr__(self, "providers", MappingProxyType(dict(self.providers)))
        object.__setattr__(self, "log_level", _log_level(self.log_level, _Where("log_level")))
        margin = self.dispatcher.retention_margin
        for name, provider in self.providers.items():
            if name != provider.name:
                raise ConfigError(
                    f"providers.{name} holds the settings of provider {provider.name!r}",
                    key=f"providers.{name}",
                )
            if margin >= provider.key_retention:
                raise ConfigError(
                    f"providers.{name}.key_retention ({format_duration(provider.key_retention)}) "
                    f"must be longer than dispatcher.retention_margin ({format_duration(margin)}): "
                    "operations go to reconciliation that long before the provider forgets a key",
                    key=f"providers.{name}.key_retention",
                )


# --- Loading ---------------------------------------------------------------------------------

_Values = dict[str, tuple[Any, _Where]]


@dataclass(slots=True)
class _RawProvider:
    where: _Where
    values: _Values


@dataclass(slots=True)
class _Raw:
    """The values read so far, each with where it came from: the file's, then the environment's."""

    top: _Values
    dispatcher: _Values
    providers: dict[str, _RawProvider]
    database: _Values = field(default_factory=dict)


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
    log_level = raw.top.get("log_level")
    return Settings(
        dispatcher=_dispatcher_settings(raw.dispatcher),
        providers={name: _provider_settings(name, table) for name, table in raw.providers.items()},
        log_level=DEFAULT_LOG_LEVEL if log_level is None else _log_level(*log_level),
        database=_database_settings(raw.database, env),
    )


def _dotted(*parts: str) -> str:
    """A dotted key as TOML writes it, quoting the parts that are not bare keys."""
    return ".".join(p if re.fullmatch(r"[A-Za-z0-9_-]+", p) else json.dumps(p) for p in parts)


def _table(value: object, where: _Where, valid: tuple[str, ...] | None = None) -> _Values:
    """The table ``value``, each value paired with where it is; its keys must be in ``valid``."""
    if not isinstance(value, Mapping):
        raise where.error(f"must be a table, not {_show(value)}")
    values: _Values = {}
    for key, item in value.items():
        at = _Where(
            f"{where.key}.{_dotted(str(key))}" if where.key else _dotted(str(key)), where.source
        )
        if valid is not None and key not in valid:
            raise ConfigError(
                f"unknown key {at}; the valid keys are {', '.join(valid)}", key=at.key
            )
        values[str(key)] = (item, at)
    return values


def _read_document(data: Mapping[str, Any], source: str) -> _Raw:
    top = _table(data, _Where("", source), _TOP_KEYS)
    dispatcher, at = top.pop("dispatcher", ({}, _Where("dispatcher", source)))
    providers, at_providers = top.pop("providers", ({}, _Where("providers", source)))
    database, at_database = top.pop("database", ({}, _Where("database", source)))
    if isinstance(database, Mapping) and "listen_url" in database:
        raise _listen_url_written(_Where("database.listen_url", source))
    raw = _Raw(top, _table(dispatcher, at, tuple(_DISPATCHER_CHECKS)), {})
    raw.database = _table(database, at_database, tuple(_DATABASE_CHECKS))
    for name, (table, where) in _table(providers, at_providers).items():
        raw.providers[name] = _RawProvider(where, _table(table, where))
    return raw


def _dispatcher_settings(values: _Values) -> DispatcherSettings:
    checked = {key: _DISPATCHER_CHECKS[key](value, where) for key, (value, where) in values.items()}
    return DispatcherSettings(**checked)


def _database_settings(values: _Values, environ: Mapping[str, str]) -> DatabaseSettings:
    checked = {key: _DATABASE_CHECKS[key](value, where) for key, (value, where) in values.items()}
    return DatabaseSettings(
        pool_mode=checked.get("pool_mode", DEFAULT_POOL_MODE),
        listen_url=_listen_url(values, environ),
        listen=checked.get("listen", DEFAULT_LISTEN),
        startup_wait=checked.get("startup_wait", DEFAULT_STARTUP_WAIT),
    )


def _listen_url(values: _Values, environ: Mapping[str, str]) -> str | None:
    """The direct URL for LISTEN from where the settings say it is; None when there is none."""
    if "listen_url_env" in values and "listen_url_file" in values:
        where = values["listen_url_file"][1]
        raise where.error("and database.listen_url_env both say where the LISTEN URL is; keep one")
    if "listen_url_file" in values:
        name, where = values["listen_url_file"]
        return read_secret({"file": name}, key=where.key, environ=environ)
    if "listen_url_env" in values:
        name, where = values["listen_url_env"]
        return read_secret({"env": name}, key=where.key, environ=environ)
    # Unset or empty (an env file's placeholder): no direct connection, so polling only.
    return environ.get(DEFAULT_LISTEN_URL_ENV) or None


def _listen_url_written(where: _Where) -> ConfigError:
    # Never quote the value: a URL may carry a password.
    return where.error(
        f"is never written in the config file, as it may carry a password: set "
        f"{DEFAULT_LISTEN_URL_ENV}, or name where it is with database.listen_url_env or "
        "database.listen_url_file"
    )


def _provider_settings(name: str, raw: _RawProvider) -> ProviderSettings:
    _provider_name(name, raw.where)
    values = dict(raw.values)
    if "type" not in values:
        if raw.where.env is not None:  # only the environment mentions this provider
            env_name = raw.where.env.removeprefix(_ENV_PROVIDERS).split("__")[0]
            raise raw.where.error(
                f"is not in the config file; set {_ENV_PROVIDERS}{env_name}__TYPE to add it"
            )
        where = _Where(f"{raw.where.key}.type", raw.where.source)
        raise where.error(
            'is required: the provider\'s type, such as "webhook", "stripe" or "noop"'
        )
    retention = values.pop("key_retention", (DEFAULT_KEY_RETENTION, raw.where))
    timeout = values.pop("timeout", (DEFAULT_TIMEOUT, raw.where))
    # Every provider has these keys; what each must be names the key (and its source).
    limits = {key: check(*values.pop(key)) for key, check in _LIMIT_CHECKS.items() if key in values}
    return ProviderSettings(
        name=name,
        type=_provider_type(*values.pop("type")),
        key_retention=_positive_duration(*retention),
        timeout=_positive_duration(*timeout),
        options={
            key: _OPTION_CHECKS[key](value, where) if key in _OPTION_CHECKS else value
            for key, (value, where) in values.items()
        },
        **limits,
    )


# --- Environment overrides -------------------------------------------------------------------


def _apply_environment(raw: _Raw, environ: Mapping[str, str]) -> None:
    """Lay the OUTBOX_* overrides over ``raw``, in a fixed order so errors are reproducible."""
    for var in sorted(environ):
        value = environ[var]
        if var == _ENV_LOG_LEVEL:
            raw.top["log_level"] = (value, _Where("log_level", env=var))
        elif var.startswith(_ENV_DISPATCHER):
            key = var.removeprefix(_ENV_DISPATCHER).lower()
            if key not in _DISPATCHER_CHECKS:
                raise ConfigError(
                    f"{var}: the dispatcher has no setting {key!r}; "
                    f"the valid keys are {', '.join(_DISPATCHER_CHECKS)}",
                    key=var,
                )
            raw.dispatcher[key] = (value, _Where(f"dispatcher.{key}", env=var))
        elif var.startswith(_ENV_DATABASE):
            _override_database(raw, var, value)
        elif var.startswith(_ENV_PROVIDERS):
            _override_provider(raw, var, value)


def _override_database(raw: _Raw, var: str, value: str) -> None:
    key = var.removeprefix(_ENV_DATABASE).lower()
    where = _Where(f"database.{key}", env=var)
    if key == "listen_url":
        raise where.error(f"is read from {DEFAULT_LISTEN_URL_ENV}, not from {var}")
    if key not in _DATABASE_CHECKS:
        raise ConfigError(
            f"{var}: the database has no setting {key!r}; "
            f"the valid keys are {', '.join(_DATABASE_CHECKS)}",
            key=var,
        )
    raw.database[key] = (value, where)


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
        name, _RawProvider(_Where(_dotted("providers", name), env=var), {})
    )
    # Match an existing option whatever its case, so REFERENCE_FIELD overrides reference_field.
    key = next((k for k in provider.values if k.lower() == parts[1].lower()), parts[1].lower())
    where = _Where(_dotted("providers", name, key), env=var)
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
            "a secret file is readable by its group or by everyone: chmod 600 it", key=key,
            file=str(path), mode=oct(mode & 0o777))  # fmt: skip


# --- Freezing and redaction ------------------------------------------------------------------


def _freeze(value: Any) -> Any:
    """A read-only deep copy: tables as MappingProxyType, arrays as tuples."""
    if isinstance(value, Mapping):
        return MappingProxyType({key: _freeze(item) for key, item in value.items()})
    if isinstance(value, list | tuple):
        return tuple(_freeze(item) for item in value)
    return value


def _redact(options: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``options`` fit to print: anything that might be a secret is REDACTED."""
    shown: dict[str, Any] = {}
    for key, value in options.items():
        if str(key).lower() == "secret_headers" and isinstance(value, Mapping):
            shown[key] = dict.fromkeys(value, REDACTED)  # header names help; values never
        elif any(word in str(key).lower() for word in _SECRET_WORDS):
            shown[key] = REDACTED
        else:
            shown[key] = _redact_value(value)
    return shown


def _redact_value(value: Any) -> Any:
    if isinstance(value, Mapping):
        return _redact(value)
    if isinstance(value, list | tuple):
        return [_redact_value(item) for item in value]
    if isinstance(value, str):  # a password in a URL: https://user:secret@host/
        return re.sub(r"(://[^/@:\s]*:)[^/@\s]*@", rf"\1{REDACTED}@", value)
    return value

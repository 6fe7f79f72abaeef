"""How a key of ``outbox run``'s config is declared once, and what is derived from the declaration.

outbox.config declares every key as a :class:`Setting`: a field of a settings dataclass made with
:func:`setting` (its name is the field's), or an entry of a provider type's table of options. A
setting has a :class:`Kind` (how a value is read from the file or the environment, how one built
in Python is checked, and what a wrong one is told), a default, one line of documentation (what
it does and why the default), and whether the environment may set it. From those declarations
come the valid keys of each table, the loader's parsing, the checks of settings built in Python,
the error messages, the reprs and docs/config-reference.md (outbox.config.reference).

Pure: imports nothing from the database or provider layers.
"""

from __future__ import annotations

import dataclasses
import decimal
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, Final, Generic, TypeVar

from outbox.core.durations import format_duration, parse_duration
from outbox.errors import OutboxError
from outbox.observability import redaction

T = TypeVar("T")

_DURATION_FORMS: Final = "like 500ms, 30s, 10m, 24h, 1h30m or a number of seconds"
# A provider's rate limit: a number of calls per second or per minute.
_RATE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*/\s*(s|m)\s*")
_RATE_UNITS: Final = {"s": 1.0, "m": 60.0}
# A share, as a percentage.
_SHARE: Final = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*%\s*")


class ConfigError(OutboxError):
    """The settings are invalid; the message names the offending key or environment variable.

    ``key`` is the dotted key (``dispatcher.lease``), or the variable's name when no key applies.
    """

    def __init__(self, message: str, *, key: str | None = None) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True, slots=True)
class Where:
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


def show(value: object) -> str:
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


# --- Kinds: how a value is read, checked and shown -------------------------------------------


class Kind(Generic[T]):
    """What the values of a key are. ``read`` takes a value from the file or the environment
    (``where.env`` set: always text) and raises ``where.error(...)`` for a wrong one; ``check``
    does the same for a value built in Python, and returns it normalised."""

    # What the reference says a value is.
    describe: ClassVar[str] = ""
    # A value of this kind is not text, so an option of a provider's type (which the provider's
    # factory checks) is read on loading all the same: an override from the environment then
    # reads as the file would give it.
    not_text: ClassVar[bool] = False

    def read(self, value: object, where: Where) -> T:
        raise NotImplementedError

    def check(self, value: object, where: Where) -> T:
        return self.read(value, where)

    def shown(self, value: T) -> object:
        """The value as a repr shows it."""
        return value

    def toml(self, value: T) -> str:
        """The value as a config file would write it."""
        return show(value)

    def text(self) -> str:
        return self.describe


@dataclass(frozen=True, slots=True)
class Count(Kind[int]):
    """An integer of at least 1, and at most ``most``; from the environment, its decimal text."""

    most: int | None = None
    unit: str = ""
    not_text: ClassVar[bool] = True

    def read(self, value: object, where: Where) -> int:
        number = value
        # Only the environment gives integers as text: "64" in the file is a mistake worth naming.
        from_env = where.env is not None and isinstance(value, str)
        if from_env and re.fullmatch(r"[0-9]+", str(value).strip()):
            number = int(str(value))
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise where.error(f"must be a positive integer, not {show(value)}")
        if self.most is not None and number > self.most:
            raise where.error(f"must be at most {self.most:,}, not {show(value)}")
        return number

    def text(self) -> str:
        bound = "at least 1" if self.most is None else f"1 to {self.most:,}"
        return f"integer, {bound}" + (f" ({self.unit})" if self.unit else "")


def as_timedelta(value: object) -> timedelta | None:
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


@dataclass(frozen=True, slots=True)
class Duration(Kind[timedelta]):
    """A duration greater than zero (or, with ``zero``, of zero or more), and at most ``most``."""

    zero: bool = False
    most: timedelta | None = None

    def read(self, value: object, where: Where) -> timedelta:
        duration = as_timedelta(value)
        if duration is None or duration < timedelta(0) or (not duration and not self.zero):
            bound = "zero or more" if self.zero else "greater than zero"
            raise where.error(f"must be a duration {bound} ({_DURATION_FORMS}), not {show(value)}")
        if self.most is not None and duration > self.most:
            raise where.error(f"must be at most {format_duration(self.most)}, not {show(value)}")
        return duration

    def shown(self, value: timedelta) -> object:
        return format_duration(value)

    def toml(self, value: timedelta) -> str:
        return f'"{format_duration(value)}"'

    def text(self) -> str:
        low = "0 or more" if self.zero else "more than 0"
        if self.most is None:
            return f"duration, {low}"
        return f"duration, {low}, at most {format_duration(self.most)}"


@dataclass(frozen=True, slots=True)
class Boolean(Kind[bool]):
    """true or false; from the environment, also 1/0, yes/no and on/off."""

    describe: ClassVar[str] = "true or false"
    not_text: ClassVar[bool] = True

    def read(self, value: object, where: Where) -> bool:
        if where.env is not None and isinstance(value, str):
            text = value.strip().lower()
            if text in ("true", "1", "yes", "on"):
                return True
            if text in ("false", "0", "no", "off"):
                return False
        if not isinstance(value, bool):
            raise where.error(f"must be true or false, not {show(value)}")
        return value


@dataclass(frozen=True, slots=True)
class Choice(Kind[str]):
    """One of ``values``, whatever its case. ``refused`` explains a value that is not one of them;
    ``unavailable`` says why one of them cannot be had here (None: it can)."""

    values: tuple[str, ...]
    refused: Mapping[str, str] = field(default_factory=dict)
    unavailable: Callable[[str], str | None] | None = None

    def read(self, value: object, where: Where) -> str:
        text = value.strip().lower() if isinstance(value, str) else None
        if text is not None and text in self.refused:
            raise where.error(self.refused[text])
        if text is None or text not in self.values:
            raise where.error(f"must be one of {', '.join(self.values)}, not {show(value)}")
        why = None if self.unavailable is None else self.unavailable(text)
        if why is not None:
            raise where.error(why)
        return text

    def text(self) -> str:
        return "one of " + ", ".join(f"`{value}`" for value in self.values)


@dataclass(frozen=True, slots=True)
class Rate(Kind[float]):
    """Calls per second: "100/s" or "600/m" in the file, a number built in Python."""

    describe: ClassVar[str] = '`"N/s"` or `"N/m"`'

    def read(self, value: object, where: Where) -> float:
        match = _RATE.fullmatch(value) if isinstance(value, str) else None
        per_second = float(match.group(1)) / _RATE_UNITS[match.group(2)] if match else 0.0
        if not per_second > 0:
            raise where.error(
                f'must be a rate such as "100/s" or "600/m" (calls per second or per minute), '
                f"not {show(value)}"
            )
        return per_second

    def check(self, value: object, where: Where) -> float:
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or not 0 < number < math.inf:
            raise where.error(
                f"must be a number of calls per second greater than zero, not {show(value)}"
            )
        return number

    def shown(self, value: float) -> object:
        return format_rate(value)

    def toml(self, value: float) -> str:
        return f'"{format_rate(value)}"'


class Share(Kind[float]):
    """A share of a whole: "80%" in the file (or the environment), a number above 0 and at most 1
    built in Python."""

    describe: ClassVar[str] = '`"N%"`, above 0 and at most 100'

    def read(self, value: object, where: Where) -> float:
        match = _SHARE.fullmatch(value) if isinstance(value, str) else None
        share = float(match.group(1)) / 100 if match else 0.0
        if not 0 < share <= 1:
            raise where.error(
                f'must be a percentage such as "80%" (above 0, at most 100), not {show(value)}'
            )
        return share

    def check(self, value: object, where: Where) -> float:
        number = value if isinstance(value, int | float) and not isinstance(value, bool) else None
        if number is None or not 0 < number <= 1:
            raise where.error(f"must be a share above 0 and at most 1, not {show(value)}")
        return float(number)

    def shown(self, value: float) -> object:
        return format_share(value)

    def toml(self, value: float) -> str:
        return f'"{format_share(value)}"'


def format_share(share: float) -> str:
    return f"{share * 100:g}%"


@dataclass(frozen=True, slots=True)
class EnvName(Kind[str]):
    """The name of an environment variable (never quoted back: it may be the secret itself)."""

    example: str
    describe: ClassVar[str] = "environment variable name"

    def read(self, value: object, where: Where) -> str:
        if isinstance(value, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            return value
        raise where.error(f"must name an environment variable, such as {self.example}")


@dataclass(frozen=True, slots=True)
class FileName(Kind[str]):
    """A file name; a relative one is looked up in $CREDENTIALS_DIRECTORY."""

    describe: ClassVar[str] = "file name (relative: in `$CREDENTIALS_DIRECTORY`)"

    def read(self, value: object, where: Where) -> str:
        if isinstance(value, str) and value.strip():
            return value
        raise where.error(f"must be a file name, not {show(value)}")


@dataclass(frozen=True, slots=True)
class HeaderName(Kind[str]):
    """An HTTP header's name (a token of RFC 9110: letters, digits and a few marks)."""

    describe: ClassVar[str] = "HTTP header name"

    def read(self, value: object, where: Where) -> str:
        if isinstance(value, str) and re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", value):
            return value
        raise where.error(
            f"must be an HTTP header's name, such as X-Forwarded-User, not {show(value)}"
        )


@dataclass(frozen=True, slots=True)
class ProviderType(Kind[str]):
    """A provider type: a built-in one or the name of a third-party entry point."""

    describe: ClassVar[str] = "text"

    def read(self, value: object, where: Where) -> str:
        if isinstance(value, str) and value.strip():
            return value
        raise where.error(
            'must name a provider type such as "http", "webhook", "stripe" or "noop", '
            f"not {show(value)}"
        )


@dataclass(frozen=True, slots=True)
class Secret(Kind[str]):
    """A secret, such as a URL carrying a password: never written in the file, which names where
    it is instead, with ``<key>_env`` (a variable) or ``<key>_file`` (a file); without either it
    is read from the variable ``default_env``. Never shown."""

    label: str  # what it is, as messages name it: "the LISTEN URL"
    carries: str  # why it is a secret: "a password"
    kind_of_value: str  # what a value built in Python must be: "a connection URL"
    default_env: str | None = None
    example_env: str = ""  # a variable's name, as messages suggest one (default_env if unset)

    def read(self, value: object, where: Where) -> str:
        """Refuses the secret itself in the file (never quoting it)."""
        instead = f"set {self.default_env}, or " if self.default_env else ""
        raise where.error(
            f"is never written in the config file, as it may carry {self.carries}: {instead}"
            f"name where it is with {where.key}_env or {where.key}_file"
        )

    def check(self, value: object, where: Where) -> str:
        if not isinstance(value, str) or not value.strip():
            raise where.error(f"must be {self.kind_of_value}")
        return value

    def shown(self, value: str) -> object:
        return redaction.REDACTED

    def sources(self) -> dict[str, Kind[str]]:
        """The keys that say where it is, by suffix, and what each holds."""
        return {"_env": EnvName(self.example_env or self.default_env or ""), "_file": FileName()}


@dataclass(frozen=True, slots=True)
class Opaque(Kind[Any]):
    """A value outbox.config leaves as written: the provider's factory checks it (``describe``
    is what the reference says it must be)."""

    what: str

    def read(self, value: object, where: Where) -> Any:
        return value

    def toml(self, value: Any) -> str:
        if isinstance(value, list | tuple):
            return "[" + ", ".join(show(item) for item in value) + "]"
        return show(value)

    def text(self) -> str:
        return self.what


# --- Settings: one declaration per key -------------------------------------------------------

# The default of a key that has none: the file must write it.
REQUIRED: Final[Any] = type("Required", (), {"__repr__": lambda _: "REQUIRED"})()


@dataclass(frozen=True, slots=True)
class Setting:
    """One key of the config, declared once.

    ``default`` is REQUIRED for a key the file must write. ``default_doc`` says what an absent
    key means when that is no value (``a third of lease``). ``env`` is false for a key the
    environment cannot set (a table, a secret). ``requires`` names a key of the same table
    without which this one is refused. ``group`` gathers keys under a heading of the reference.
    """

    name: str
    kind: Kind[Any]
    doc: str
    default: Any = REQUIRED
    default_doc: str | None = None
    env: bool = True
    requires: str | None = None
    group: str = ""

    def file_keys(self) -> dict[str, Kind[Any]]:
        """The keys a file writes for this setting, and what each holds: the setting itself, or
        for a secret the keys that say where it is."""
        if isinstance(self.kind, Secret):
            return {self.name + suffix: kind for suffix, kind in self.kind.sources().items()}
        return {self.name: self.kind}


_SETTING: Final = "outbox.setting"


def setting(
    kind: Kind[Any],
    doc: str,
    *,
    default_doc: str | None = None,
    env: bool = True,
    requires: str | None = None,
    group: str = "",
) -> Mapping[str, Setting]:
    """The metadata that makes a dataclass field a key of the config, named by the field and with
    the field's default: ``field(default=64, metadata=setting(Count(), "..."))``. A field without
    a default is a required key. See :class:`Setting` for the rest."""
    return {_SETTING: Setting("", kind, doc, REQUIRED, default_doc, env, requires, group)}


_DECLARED: Final[dict[type, tuple[Setting, ...]]] = {}


def settings_of(cls: type) -> tuple[Setting, ...]:
    """The settings that are fields of the dataclass ``cls``, in field order, each named by its
    field and with its field's default."""
    declared = _DECLARED.get(cls)
    if declared is None:
        declared = _DECLARED[cls] = tuple(
            dataclasses.replace(
                f.metadata[_SETTING],
                name=f.name,
                default=REQUIRED if f.default is dataclasses.MISSING else f.default,
            )
            for f in dataclasses.fields(cls)
            if _SETTING in f.metadata
        )
    return declared


def default_of(cls: type, name: str) -> Any:
    """The default of the setting ``name`` of ``cls``."""
    (declared,) = (s for s in settings_of(cls) if s.name == name)
    return declared.default


def file_keys(settings: tuple[Setting, ...]) -> dict[str, tuple[Setting, Kind[Any]]]:
    """Every key a file may write for ``settings``, in order, with its setting and kind."""
    return {
        key: (declared, kind) for declared in settings for key, kind in declared.file_keys().items()
    }


def check_fields(settings: object, table: str) -> None:
    """Check each setting of the dataclass instance ``settings`` (of the table ``table``) by its
    kind, storing the normalised value: settings built in Python follow the loader's rules."""
    for declared in settings_of(type(settings)):
        value = getattr(settings, declared.name)
        if value is None and declared.default is None:
            continue  # None is how Python spells an absent optional key
        where = Where(f"{table}.{declared.name}" if table else declared.name)
        checked = declared.kind.check(value, where)
        if checked is not value:
            object.__setattr__(settings, declared.name, checked)
        if declared.requires is not None and getattr(settings, declared.requires) is None:
            raise where.error(f"applies only with {table}.{declared.requires}, which is not set")


def shown_fields(settings: object) -> str:
    """The settings of the dataclass instance ``settings`` as a repr lists them, secrets never."""
    shown = []
    for declared in settings_of(type(settings)):
        value = getattr(settings, declared.name)
        shown.append(f"{declared.name}={None if value is None else declared.kind.shown(value)!r}")
    return ", ".join(shown)

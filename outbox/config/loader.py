"""Loading the settings: the TOML file's tables read as their declarations say
(outbox.config.settings, outbox.config.options), then the environment's OUTBOX_* overrides laid
over them (the order, and each variable's form, are outbox.config.settings' docstring's)."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from outbox.config.options import PROVIDER_OPTIONS
from outbox.config.schema import (
    ConfigError,
    Kind,
    Secret,
    Setting,
    Where,
    file_keys,
    settings_of,
    show,
)
from outbox.config.secrets import read_secret
from outbox.config.settings import (
    TABLES,
    DatabaseSettings,
    DispatcherSettings,
    ProviderSettings,
    Settings,
    WebSettings,
    _dotted,
    _provider_name,
)

_ENV: Final = "OUTBOX_"
_ENV_PROVIDERS: Final = "OUTBOX_PROVIDERS__"


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
        web=WebSettings(**_read_table(WebSettings, raw.tables["web"], env)),
    )


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

"""Reads an `http` provider's table (and the webhook preset's) into HttpOptions, checking every
key so that a provider that starts can build each request it describes (docs/providers.md).

Secrets come from the environment or files only: ``secret_headers`` are read here, and a plain
header that looks like one is refused.
"""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, Final

from outbox.config.schema import Count, Duration, Where, file_keys
from outbox.config.secrets import read_secret
from outbox.config.settings import (
    DEFAULT_MAX_RESPONSE_BYTES,
    ConfigError,
    ProviderSettings,
)
from outbox.core.json_pointer import Pointer, PointerError
from outbox.providers.http.options import OPTIONS
from outbox.providers.http.provider import HttpOptions
from outbox.providers.http.spec import CLASSES, ActionSpec, LookupSpec, StatusRule, Template
from outbox.providers.kit import (
    FRAMING,
    HEADER_NAME,
    SECRET_HEADER,
    KeyForm,
    KeySpec,
    check_header,
    reject_unknown,
)
from outbox.providers.shards import connection_cap

_HTTP_KEYS: Final = tuple(file_keys(OPTIONS))
_METHODS: Final = ("GET", "POST", "PUT", "PATCH", "DELETE")
_KEY_KEYS: Final = ("header", "field", "quoting", "form", "max_length", "characters")
_ACTION_KEYS: Final = ("method", "path", "body", "reference", "key_retention", "key", "status",
                       "lookup", "retry_unknown")  # fmt: skip
_LOOKUP_KEYS: Final = ("method", "path", "found", "not_found", "items", "more", "total",
                       "state", "done", "refused", "absent", "reference", "retention",
                       "match")  # fmt: skip
# Statuses that prove nothing absent: a gateway's, a rate limit's, a refusal of credentials.
_NOT_ABSENCE: Final = frozenset({401, 403, 407, 408, 409, 425, 429})
_STATE_LISTS: Final = ("done", "refused", "absent")
_RULE_KEYS: Final = ("status", "at", "is")
# The keys outbox derives (68 characters) and a later generation of one: a stored key form
# must let them through, or every operation without a key of its own would be refused.
_DERIVED_SAMPLES: Final = (
    "ob1_" + "0123456789abcdef" * 4,
    "ob1_" + "0123456789abcdef" * 4 + ":r999999",  # a millionth generation: 76 characters
)
# Classes that say the provider did not act: never of a 2xx (it did) nor of a 5xx (a gateway
# may answer one after the provider acted), whose retry could then outlive the key window.
_NOT_ACTED: Final = frozenset({"transient", "in_use"})
# Classes that end the operation without a retry: never of a 5xx, which may have acted (a
# person replaying it from quarantine would act twice).
_FINAL: Final = frozenset({"permanent", "refused"})


def http_options(
    ps: ProviderSettings, environ: Mapping[str, str] | None, *, concurrency: int
) -> HttpOptions:
    reject_unknown(ps, _HTTP_KEYS)
    where = f"providers.{ps.name}"
    base_url = _base_url(ps.options.get("base_url"), f"{where}.base_url")
    headers, secrets = read_headers(ps, environ)
    check_endpoint(
        base_url,
        where,
        carries_secrets=bool(secrets),
        allow_insecure=allow_insecure(ps),
        setting="base_url",
    )
    key = key_spec(ps.options.get("key", {}), KeySpec(), f"{where}.key")
    actions = _table(ps.options.get("actions"), f"{where}.actions")
    if not actions:
        raise ConfigError(
            f"{where}.actions must describe at least one action", key=f"{where}.actions"
        )
    specs = {
        name: action_spec(
            _table(table, f"{where}.actions.{name}"),
            key,
            ps.key_retention,
            f"{where}.actions.{name}",
        )
        for name, table in actions.items()
    }
    _check_key_headers(specs, {**headers, **secrets}, where)
    return HttpOptions(
        base_url=base_url,
        timeout=ps.timeout,
        key_retention=ps.key_retention,
        actions=specs,
        headers=headers,
        secret_headers=secrets,
        outbox_headers=_boolean(ps.options.get("outbox_headers", False), f"{where}.outbox_headers"),
        max_connections=connection_cap(concurrency, ps.max_in_flight),
        max_response_bytes=max_response_bytes(ps),
    )


def _base_url(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ConfigError(f"{where} must be an http:// or https:// URL", key=where)
    if "?" in value or "#" in value or not urllib.parse.urlsplit(value).hostname:
        raise ConfigError(f"{where} must name a host, with no query or fragment", key=where)
    return value


def _check_key_headers(
    specs: Mapping[str, ActionSpec], configured: Mapping[str, str], where: str
) -> None:
    """No configured header stands for the key: it would travel the same on every operation,
    or be overwritten by the key, or overwrite a secret."""
    names = {spec.key.header.lower() for spec in specs.values() if spec.key.header}
    for name in configured:
        if name.lower() in names or "idempotency" in name.lower():
            raise ConfigError(
                f"{where}: the header {name} is configured, and it carries (or looks like) the "
                "idempotency key, which outbox writes for each operation (key.header)",
                key=f"{where}.headers",
            )


def action_spec(
    table: Mapping[str, Any], provider_key: KeySpec, retention: timedelta, where: str
) -> ActionSpec:
    _known(table, _ACTION_KEYS, where)
    method = _method(table.get("method", "POST"), f"{where}.method")
    target = _template(table.get("path"), f"{where}.path")
    body_default: object = "" if method in ("POST", "PUT", "PATCH") else False
    body_value = table.get("body", body_default)
    body = None if body_value is False else _pointer(body_value, f"{where}.body")
    if body is not None and method in ("GET", "DELETE"):
        raise ConfigError(
            f"{where}.body: a {method} request carries no body (body = false)", key=f"{where}.body"
        )
    key = key_spec(table.get("key", {}), provider_key, f"{where}.key")
    if key.field is not None and body is None:
        raise ConfigError(
            f"{where}.key.field: the request has no body to carry the key", key=f"{where}.key.field"
        )
    keeps = retention
    if "key_retention" in table:
        keeps = Duration().read(table["key_retention"], Where(f"{where}.key_retention"))
    spec = ActionSpec(
        method=method,
        target=target,
        key=key,
        key_retention=keeps,
        body=body,
        reference=_pointer(table.get("reference", "/id"), f"{where}.reference"),
        rules=_rules(table.get("status", {}), f"{where}.status"),
        retry_unknown=_boolean(table.get("retry_unknown", True), f"{where}.retry_unknown"),
    )
    if "lookup" not in table:
        return spec
    lookup = lookup_spec(_table(table["lookup"], f"{where}.lookup"), spec, f"{where}.lookup")
    return dataclasses.replace(spec, lookup=lookup)


def lookup_spec(table: Mapping[str, Any], action: ActionSpec, where: str) -> LookupSpec:
    _known(table, _LOOKUP_KEYS, where)
    target = _template(table.get("path"), f"{where}.path")
    found, not_found = _lookup_statuses(table, where)
    match_at, match = _match(table.get("match"), f"{where}.match")
    if not (target.parts_vary or match is not None):
        raise ConfigError(
            f"{where}.path names no value of the operation ({{key}}, {{operation_id}} or a "
            "payload pointer) and there is no match: every operation would find the same object",
            key=f"{where}.path",
        )
    # By key, the lookup finds only what the provider still keeps by key; otherwise as long as
    # it keeps its objects, unless the table says.
    retention: timedelta | None = action.key_retention if target.uses_key else None
    if "retention" in table:
        retention = Duration().read(table["retention"], Where(f"{where}.retention"))
    return LookupSpec(
        match_at=match_at,
        match=match,
        method=_choice(table.get("method", "GET"), ("GET",), f"{where}.method"),
        target=target,
        found=found,
        not_found=not_found,
        items=_optional_pointer(table, "items", where),
        more=_optional_pointer(table, "more", where),
        total=_optional_pointer(table, "total", where),
        reference=_optional_pointer(table, "reference", where),
        retention=retention,
        **_states(table, where),
    )


def _lookup_statuses(table: Mapping[str, Any], where: str) -> tuple[frozenset[int], ...]:
    found = _statuses(table.get("found", [200]), f"{where}.found")
    not_found = _statuses(table.get("not_found", [404]), f"{where}.not_found")
    if found & not_found:
        raise ConfigError(f"{where}: a status cannot mean both found and not found", key=where)
    unproven = sorted(s for s in not_found if s in _NOT_ABSENCE or s < 200 or s >= 500)
    if unproven or any(300 <= s < 400 for s in not_found):
        raise ConfigError(
            f"{where}.not_found: {unproven or 'a 3xx'} can come from a gateway, a rate limit or "
            "refused credentials, and proves nothing absent",
            key=f"{where}.not_found",
        )
    return found, not_found


def _states(table: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The state pointer and what its words mean, each word in one list only."""
    words = {name: _words(table.get(name, []), f"{where}.{name}") for name in _STATE_LISTS}
    if "state" not in table:
        if any(words.values()):
            raise ConfigError(f"{where}: done, refused and absent need a state", key=where)
        return {"state": None, **words}
    if not words["done"]:
        raise ConfigError(
            f"{where}.done must name the states that mean the effect happened", key=f"{where}.done"
        )
    for a, b in (("done", "refused"), ("done", "absent"), ("refused", "absent")):
        if words[a] & words[b]:
            shared = sorted(words[a] & words[b])
            raise ConfigError(f"{where}: {shared} are both {a} and {b}", key=f"{where}.{b}")
    return {"state": _pointer(table["state"], f"{where}.state"), **words}


def _optional_pointer(table: Mapping[str, Any], name: str, where: str) -> Pointer | None:
    return None if name not in table else _pointer(table[name], f"{where}.{name}")


def _match(value: object, where: str) -> tuple[Pointer | None, Template | None]:
    """``match = { at = "/reference", is = "{/reference}" }``: the candidate's value that must
    equal the payload's (or the key's, ``{key}``)."""
    if value is None:
        return None, None
    table = _table(value, where)
    _known(table, ("at", "is"), where)
    if not isinstance(table.get("is"), str) or "at" not in table:
        raise ConfigError(f"{where} names at (a JSON pointer) and is (a text)", key=where)
    try:
        expected = Template.parse(table["is"], target=False)
    except (ValueError, PointerError) as exc:
        raise ConfigError(f"{where}.is: {exc}", key=f"{where}.is") from None
    return _pointer(table["at"], f"{where}.at"), expected


def key_spec(value: object, base: KeySpec, where: str) -> KeySpec:
    """``base`` with the table's keys changed, checked: a key form whose keys the provider would
    refuse is refused here, not at the provider."""
    table = _table(value, where)
    _known(table, _KEY_KEYS, where)
    if "header" in table and "field" in table:
        raise ConfigError(
            f"{where}: the key travels in a header or a body field, not both", key=where
        )
    header, field = base.header, base.field
    if "header" in table:
        header, field = _header_name(table["header"], f"{where}.header"), None
    if "field" in table:
        header, field = None, _pointer(table["field"], f"{where}.field")
        if not field.tokens:
            raise ConfigError(
                f"{where}.field must point into the body, not be it", key=f"{where}.field"
            )
    spec = KeySpec(
        header=header,
        field=field,
        quoting=_choice(
            table.get("quoting", base.quoting), ("none", "sf-string"), f"{where}.quoting"
        ),
        form=_choice(table.get("form", base.form), KeyForm.ALL, f"{where}.form"),
        max_length=Count(most=4096).read(
            table.get("max_length", base.max_length), Where(f"{where}.max_length")
        ),
        characters=_characters(table.get("characters", base.characters), f"{where}.characters"),
    )
    for sample in _DERIVED_SAMPLES:
        problem = spec.problem(spec.wire(sample))
        if problem is not None:
            hint = ' (form = "uuid" writes each key as 36 characters of 0-9, a-f and "-")'
            raise ConfigError(
                f"{where}: outbox's derived keys would be refused: {problem}{hint}", key=where
            )
    return spec


def _rules(value: object, where: str) -> dict[str, tuple[StatusRule, ...]]:
    table = _table(value, where)
    _known(table, CLASSES, where)
    rules = {name: tuple(_rule(item, f"{where}.{name}") for item in _list(items, f"{where}.{name}"))
             for name, items in table.items()}  # fmt: skip
    seen: dict[StatusRule, str] = {}
    for name, listed in rules.items():
        for rule in listed:
            _check_class(name, rule.status, where)
            if rule in seen:
                raise ConfigError(
                    f"{where}: the same answer is both {seen[rule]} and {name}", key=where
                )
            seen[rule] = name
    return rules


def _check_class(name: str, status: int, where: str) -> None:
    if name in _NOT_ACTED and (200 <= status < 300 or status >= 500):
        raise ConfigError(
            f"{where}.{name}: a {status} may come after the provider acted, so it cannot say "
            "the provider did not (use unknown)",
            key=f"{where}.{name}",
        )
    if name in _FINAL and status >= 500:
        raise ConfigError(
            f"{where}.{name}: a {status} may come after the provider acted (a gateway's): it "
            "cannot end the operation (use unknown, or done)",
            key=f"{where}.{name}",
        )


def _rule(value: object, where: str) -> StatusRule:
    if not isinstance(value, Mapping):
        return StatusRule(_status(value, where))
    _known(value, _RULE_KEYS, where)
    if ("at" in value) != ("is" in value):
        raise ConfigError(
            f"{where}: a rule must name both at (a JSON pointer) and is (the values there)",
            key=where,
        )
    status = _status(value.get("status"), f"{where}.status")
    if "at" not in value:
        return StatusRule(status)
    values = _words(value["is"], f"{where}.is")
    if not values:
        raise ConfigError(f"{where}.is names no value: the rule would never match", key=where)
    return StatusRule(status, _pointer(value["at"], f"{where}.at"), values)


# --- what the webhook preset shares ------------------------------------------------------------

_LOOPBACK: Final = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})


def read_headers(
    ps: ProviderSettings, environ: Mapping[str, str] | None
) -> tuple[dict[str, str], dict[str, str]]:
    """The plain headers and the secret ones, read from their sources, all checked."""
    where = f"providers.{ps.name}"
    secrets = _string_map(
        ps.options.get("secret_headers", {}), f"{where}.secret_headers", allow_tables=True
    )
    headers = _string_map(ps.options.get("headers", {}), f"{where}.headers")
    for name, value in headers.items():
        check_header(name, value, f"{where}.headers.{name}")
        if SECRET_HEADER.search(name):  # secrets come from the environment or files only
            raise ConfigError(
                f"{where}.headers.{name} looks like a secret: move it to "
                "secret_headers (read from the environment or a file)"
            )
    values = {
        name: read_secret(spec, key=f"{where}.secret_headers.{name}", environ=environ)
        for name, spec in secrets.items()
    }
    for name, value in values.items():
        check_header(name, value, f"{where}.secret_headers.{name}")
    return headers, values


def check_endpoint(
    url: str, where: str, *, carries_secrets: bool, allow_insecure: bool, setting: str = "url"
) -> None:
    """No credentials in the URL; no secret over clear text to another host."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            f"{where}.{setting} holds credentials (user:password@): put them in "
            "secret_headers instead, where they are never logged",
            key=f"{where}.{setting}",
        )
    host = (parts.hostname or "").lower()
    if carries_secrets and parts.scheme == "http" and host not in _LOOPBACK and not allow_insecure:
        raise ConfigError(
            f"{where}: http:// to {host}, and the requests carry secrets in "
            "clear text: use https://, or set allow_insecure = true"
        )


def allow_insecure(ps: ProviderSettings) -> bool:
    return _boolean(ps.options.get("allow_insecure", False), f"providers.{ps.name}.allow_insecure")


def max_response_bytes(ps: ProviderSettings) -> int:
    """The provider's cap on one answer's bytes. A config file's value was checked on loading
    (outbox.config); this checks settings built in Python."""
    value = ps.options.get("max_response_bytes", DEFAULT_MAX_RESPONSE_BYTES)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"providers.{ps.name}.max_response_bytes must be a positive integer (bytes), "
            f"not {value!r}",
            key=f"providers.{ps.name}.max_response_bytes",
        )
    return value


# --- values ------------------------------------------------------------------------------------


def _string_map(value: object, where: str, *, allow_tables: bool = False) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table")
    for key, item in value.items():
        if not (isinstance(item, str) or (allow_tables and isinstance(item, Mapping))):
            raise ConfigError(f"{where}.{key} must be a string")
    return dict(value)


def _table(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table", key=where)
    return value


def _list(value: object, where: str) -> list[Any]:
    if not isinstance(value, list | tuple):
        raise ConfigError(f"{where} must be an array", key=where)
    return list(value)


def _known(table: Mapping[str, Any], valid: tuple[str, ...], where: str) -> None:
    for key in table:
        if key not in valid:
            raise ConfigError(
                f"{where}.{key} is no setting here; valid: {', '.join(valid)}", key=f"{where}.{key}"
            )


def _boolean(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false", key=where)
    return value


def _method(value: object, where: str) -> str:
    return _choice(value, _METHODS, where)


def _choice(value: object, valid: tuple[str, ...], where: str) -> str:
    if value not in valid:
        raise ConfigError(f"{where} must be one of {', '.join(valid)}, not {value!r}", key=where)
    return str(value)


def _template(value: object, where: str) -> Template:
    if not isinstance(value, str):
        raise ConfigError(f"{where} is required: the request's path below base_url", key=where)
    try:
        return Template.parse(value)
    except (ValueError, PointerError) as exc:
        raise ConfigError(f"{where}: {exc}", key=where) from None


def _pointer(value: object, where: str) -> Pointer:
    if not isinstance(value, str):
        raise ConfigError(f'{where} must be a JSON pointer such as "/id"', key=where)
    try:
        return Pointer.parse(value)
    except PointerError as exc:
        raise ConfigError(f"{where}: {exc}", key=where) from None


def _header_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not HEADER_NAME.fullmatch(value):
        raise ConfigError(f"{where} must be an HTTP header name", key=where)
    if value.lower() in FRAMING or SECRET_HEADER.search(value):
        raise ConfigError(f"{where}: {value} cannot carry the idempotency key", key=where)
    return value


def _characters(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f'{where} must be a character class such as "A-Za-z0-9_-"', key=where)
    try:
        re.compile(f"[{value}]+")
    except re.error as exc:
        raise ConfigError(f"{where}: not a character class ({exc})", key=where) from None
    return value


def _status(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 100 <= value <= 599:
        raise ConfigError(f"{where} must hold HTTP statuses (100 to 599), not {value!r}", key=where)
    return value


def _statuses(value: object, where: str) -> frozenset[int]:
    return frozenset(_status(item, where) for item in _list(value, where))


def _words(value: object, where: str) -> frozenset[str]:
    items = _list(value, where)
    if not all(isinstance(item, str | int) and not isinstance(item, bool) for item in items):
        raise ConfigError(f"{where} must be an array of strings", key=where)
    return frozenset(str(item) for item in items)

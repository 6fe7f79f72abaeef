"""The provider recipes of docs/providers.md, as a test reads and runs them: each config block
is marked ``<!-- recipe: <name> -->``, and a test points its base_url at a loopback fake."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

from outbox.config.loader import settings_from_mapping
from outbox.providers.http.provider import HttpProvider
from outbox.providers.registry import build_providers
from outbox.testing.apis import FakeAdyen, FakeCheckoutCom, FakeEffectsService
from outbox.testing.harnesses import HttpApiHarness
from outbox.testing.http_api import FakeHttpApi

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"
_BLOCK = re.compile(r"<!-- recipe: ([a-z]+) -->\s*```toml\n(.*?)```", re.DOTALL)


def recipes() -> dict[str, dict[str, Any]]:
    """Every recipe's parsed TOML: ``{"providers": {name: table}}``, by recipe name."""
    return {name: tomllib.loads(text) for name, text in _BLOCK.findall(DOC.read_text())}


def provider_table(recipe: str) -> tuple[str, dict[str, Any]]:
    """The recipe's one provider: its name and table (a copy the test may change)."""
    providers = recipes()[recipe]["providers"]
    assert len(providers) == 1, f"recipe {recipe} configures {len(providers)} providers"
    name, table = next(iter(providers.items()))
    return name, json.loads(json.dumps(table))


def secret_variables(table: Mapping[str, Any]) -> dict[str, str]:
    """A value for each environment variable the recipe's secret headers read."""
    specs = table.get("secret_headers", {}).values()
    return {spec["env"]: f"Bearer test-{spec['env'].lower()}" for spec in specs if "env" in spec}


def shortened(table: dict[str, Any], key_retention: timedelta) -> dict[str, Any]:
    """The table with every key retention (the provider's and each action's) set to
    ``key_retention``: a test of the key window cannot wait 6 hours."""
    text = f"{int(key_retention.total_seconds())}s"
    table["key_retention"] = text
    for action in table.get("actions", {}).values():
        if "key_retention" in action:
            action["key_retention"] = text
    return table


def built(
    name: str,
    table: Mapping[str, Any],
    environ: Mapping[str, str],
    dispatcher: Mapping[str, Any] | None = None,
) -> HttpProvider:
    """The provider the table makes, as `outbox run` would build it."""
    document = {"dispatcher": dict(dispatcher or {}), "providers": {name: dict(table)}}
    settings = settings_from_mapping(document, environ=environ)
    provider = build_providers(settings.providers, environ)[name]
    assert isinstance(provider, HttpProvider)
    return provider


def toml_document(tables: Mapping[str, Any]) -> str:
    """``tables`` as TOML: one [section] per top-level key, nested values inline."""
    lines: list[str] = []
    for section, table in tables.items():
        lines.append(f"[{section}]")
        lines += [f"{_key(k)} = {_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def _key(key: str) -> str:
    return json.dumps(key)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items()) + "}"
    return "[" + ", ".join(_value(v) for v in value) + "]"


# The payload of one operation of each recipe's first action, for the conformance suite.
_PAYLOADS: dict[str, Callable[[int], dict[str, Any]]] = {
    "internal": lambda n: {"reference": f"ref-{n}", "amount": Decimal("19.99")},
    "checkout": lambda n: {
        "amount": 1999,
        "currency": "GBP",
        "reference": f"conformance-{n}",
        "source": {"type": "token"},
    },
    "adyen": lambda n: {
        "merchantAccount": "AcmeECOM",
        "reference": f"conformance-{n}",
        "amount": {"value": 1999, "currency": "EUR"},
        "paymentMethod": {"type": "scheme"},
    },
}
_FAKES: dict[str, Callable[[], FakeHttpApi]] = {
    "internal": FakeEffectsService,
    "checkout": FakeCheckoutCom,
    "adyen": FakeAdyen,
}


@contextmanager
def http_recipe_harness(recipe: str) -> Iterator[HttpApiHarness]:
    """An HttpApiHarness of the recipe's provider table and first action, on its fake."""
    _, table = provider_table(recipe)
    action = next(iter(table["actions"]))
    with _FAKES[recipe]() as fake:
        yield HttpApiHarness(fake, table, action=action, payload=_PAYLOADS[recipe])

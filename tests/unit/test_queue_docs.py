"""docs/providers.md's queue examples, as written: each TOML block of its "Queues" section loads,
passes the configuration checks and builds its providers, as `outbox run` would before the first
claim (nothing connects: a queue provider opens its client on the first send). An example that
drifts from the options the code accepts fails here, not in a reader's deployment."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Collection
from pathlib import Path
from typing import Any, Protocol, cast

import pytest

from outbox.config.loader import settings_from_mapping
from outbox.providers.registry import QUEUE_TYPES, build_providers

DOC = Path(__file__).resolve().parents[2] / "docs" / "providers.md"


class _Routed(Protocol):
    """What each queue provider has beside the Provider interface: the actions it routes."""

    @property
    def actions(self) -> Collection[str]: ...


_BLOCK = re.compile(r"```toml\n(.*?)```", re.DOTALL)


def queue_section() -> str:
    text = DOC.read_text()
    start = text.index("\n## Queues\n")
    return text[start : text.index("\n## ", start + 1)]


def examples() -> list[dict[str, Any]]:
    return [tomllib.loads(block) for block in _BLOCK.findall(queue_section())]


def test_the_section_has_an_example_of_every_queue_type() -> None:
    shown = {t["type"] for doc in examples() for t in doc["providers"].values()}
    assert shown == set(QUEUE_TYPES), f"types without an example: {set(QUEUE_TYPES) - shown}"


@pytest.mark.parametrize("number", range(len(examples())))
def test_the_example_builds(number: int, tmp_path: Path) -> None:
    # The secrets the examples read, where the examples say they are.
    (tmp_path / "orders.creds").write_text(
        "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.e30.sig\n------END NATS USER JWT------\n"
        "-----BEGIN USER NKEY SEED-----\nSUAFAKEFAKEFAKEFAKE\n------END USER NKEY SEED------\n"
    )
    environ = {"CREDENTIALS_DIRECTORY": str(tmp_path), "RABBITMQ_PASSWORD": "not-a-real-one"}
    document = examples()[number]
    settings = settings_from_mapping(document, environ=environ)
    providers = build_providers(settings.providers, environ)
    assert set(providers) == set(document["providers"])
    for name, table in document["providers"].items():
        configured = {a for a in table.get("actions", {}) if a != "*"}
        assert set(cast(_Routed, providers[name]).actions) == configured, name

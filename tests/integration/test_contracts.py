"""Publishing contracts (issue 42, sql/0052): `outbox contracts push|diff|list|show|deprecate|
retire|activate`, the real command run as a member of outbox_operator, and what the database
itself refuses whoever asks. Each test counts rows of outbox.contracts and of the audit."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox.contracts import checker_for, parse_contract
from tests.integration.test_roles import APP, OPERATOR, apply_roles, as_role, sqlstate_of
from tests.support.cli import outbox_cli
from tests.support.dispatch import rows

CHARGE: dict[str, Any] = {
    "type": "object",
    "properties": {"amount": {"type": "integer", "minimum": 1}, "currency": {"type": "string"}},
    "required": ["amount", "currency"],
    "additionalProperties": False,
}


@pytest.fixture
def operator_env(db_url: str, pg_server: str, cli_env: dict[str, str]) -> dict[str, str]:
    apply_roles(pg_server, db_url)
    return {**cli_env, "OUTBOX_DATABASE_URL": as_role(db_url, OPERATOR)}


def write(root: Path, operation_type: str, version: int, schema: dict[str, Any]) -> None:
    folder = root / operation_type
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"v{version}.json").write_text(json.dumps(schema, indent=2))


def published(db_url: str) -> list[tuple[Any, ...]]:
    return rows(db_url, "SELECT operation_type, version, state FROM outbox.contracts ORDER BY 1, 2")


def audited(db_url: str) -> list[tuple[Any, ...]]:
    return rows(
        db_url,
        "SELECT action, actor, details->>'operation_type', (details->>'version')::int "
        "FROM outbox.audit WHERE action LIKE 'contract%' ORDER BY id",
    )


def test_push_publishes_every_version_once_and_again_changes_nothing(
    db_url: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    write(tmp_path, "payments/charge", 1, CHARGE)
    write(tmp_path, "payments/charge", 2, {**CHARGE, "required": ["amount"]})
    write(tmp_path, "refund", 1, {"type": "object"})
    first = outbox_cli(operator_env, "contracts", "push", str(tmp_path), "--actor", "ana", "--json")
    assert first.returncode == 0, first.stderr
    assert [r["result"] for r in json.loads(first.stdout)] == ["published"] * 3
    again = outbox_cli(operator_env, "contracts", "push", str(tmp_path), "--json")
    assert [r["result"] for r in json.loads(again.stdout)] == ["unchanged"] * 3
    assert published(db_url) == [
        ("payments/charge", 1, "active"),
        ("payments/charge", 2, "active"),
        ("refund", 1, "active"),
    ]
    assert audited(db_url) == [
        ("contract_publish", "ana", "payments/charge", 1),
        ("contract_publish", "ana", "payments/charge", 2),
        ("contract_publish", "ana", "refund", 1),
    ]
    shown = outbox_cli(operator_env, "contracts", "show", "payments/charge", "1", "--json")
    assert json.loads(shown.stdout)["schema"] == CHARGE
    listed = outbox_cli(operator_env, "contracts", "list", "--type", "refund")
    assert "refund" in listed.stdout and "payments" not in listed.stdout


def test_other_content_under_a_published_version_is_refused_with_the_difference(
    db_url: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    write(tmp_path, "charge", 1, CHARGE)
    assert outbox_cli(operator_env, "contracts", "push", str(tmp_path)).returncode == 0
    changed = {**CHARGE, "properties": {**CHARGE["properties"], "note": {"type": "string"}}}
    write(tmp_path, "charge", 1, changed)
    write(tmp_path, "charge", 2, changed)  # in the same push: not published either
    refused = outbox_cli(operator_env, "contracts", "push", str(tmp_path))
    assert refused.returncode == 3
    assert "charge/v1 is published with other content; nothing was published" in refused.stderr
    assert '+    "note": {' in refused.stderr
    assert published(db_url) == [("charge", 1, "active")]
    assert len(audited(db_url)) == 1
    diffed = outbox_cli(operator_env, "contracts", "diff", str(tmp_path))
    assert diffed.returncode == 3
    assert "CHANGED    charge/v1" in diffed.stdout and "new        charge/v2" in diffed.stdout


def test_states_move_audited_and_a_published_row_never_changes(
    db_url: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    write(tmp_path, "charge", 1, CHARGE)
    assert outbox_cli(operator_env, "contracts", "push", str(tmp_path)).returncode == 0
    for command, state in (
        ("deprecate", "deprecated"),
        ("retire", "retired"),
        ("activate", "active"),
    ):
        done = outbox_cli(
            operator_env, "contracts", command, "charge", "1", "--reason", "test", "--actor", "bo"
        )
        assert done.returncode == 0, done.stderr
        assert published(db_url) == [("charge", 1, state)]
    assert [a[0] for a in audited(db_url)] == [
        "contract_publish", "contract_deprecated", "contract_retired", "contract_active",
    ]  # fmt: skip
    missing = outbox_cli(operator_env, "contracts", "retire", "charge", "9", "--reason", "x")
    assert missing.returncode != 0 and "no contract charge/v9 is published" in missing.stderr
    # Not even the owner changes a published version, deletes or truncates it.
    for statement in (
        "UPDATE outbox.contracts SET canonical = '{}'",
        "DELETE FROM outbox.contracts",
        "TRUNCATE outbox.contracts",
    ):
        assert sqlstate_of(db_url, statement) == "OB005", statement
    # A digest that is not the content's.
    forged = (
        "INSERT INTO outbox.contracts (operation_type, version, canonical, digest, published_by)"
        " VALUES ('x', 1, '{}', repeat('0', 64), 'me')"
    )
    assert sqlstate_of(db_url, forged) == "23514"
    assert published(db_url) == [("charge", 1, "active")]


def test_a_producer_reads_contracts_and_cannot_publish(db_url: str, pg_server: str) -> None:
    apply_roles(pg_server, db_url)
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(
            "SELECT outbox.publish_contract('charge', 1, %s, 'ana', 'test')",
            (json.dumps(CHARGE, sort_keys=True, separators=(",", ":")),),
        )
    app = as_role(db_url, APP)
    held = rows(app, "SELECT state, length(digest) FROM outbox.get_contract('charge', 1)")
    assert held == [("active", 64)]
    publish = "SELECT outbox.publish_contract('charge', 2, '{}', 'app', 'sneaky')"
    assert sqlstate_of(app, publish) == "42501"
    assert sqlstate_of(app, "SELECT * FROM outbox.contracts") == "42501"
    assert published(db_url) == [("charge", 1, "active")]


def test_a_file_that_is_not_a_contract_is_refused_before_anything_is_published(
    db_url: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    write(tmp_path, "charge", 1, CHARGE)
    write(tmp_path, "charge", 2, {"$ref": "https://example.com/charge.json"})
    refused = outbox_cli(operator_env, "contracts", "push", str(tmp_path))
    assert refused.returncode == 2
    assert "leaves the document" in refused.stderr
    assert published(db_url) == []


ORDER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "amount": {"type": "integer", "minimum": 1},
        "currency": {"enum": ["eur", "usd"]},
        "first-name": {"type": "string"},
        "class": {"type": ["string", "null"]},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}},
        "note": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    },
    "required": ["amount", "currency", "lines"],
    "additionalProperties": False,
    "$defs": {
        "line": {
            "type": "object",
            "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
            "required": ["sku"],
        }
    },
}

USES = """
from contracts_gen import ShopOrderV1, ShopOrderV1Line, ShopRefundV1

order = ShopOrderV1(
    amount=5, currency="eur", lines=[ShopOrderV1Line(sku="a", qty=2)], first_name="Ana",
    class_=None,
)
payload: dict[str, object] = order.to_payload()
kind, version = ShopOrderV1.CONTRACT
refund = ShopRefundV1()
"""


def mypy_strict(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "--cache-dir", os.devnull,
         "contracts_gen.py", "uses.py"],
        cwd=folder, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_codegen_writes_classes_a_type_checker_holds_producers_to(
    db_url: str, operator_env: dict[str, str], tmp_path: Path
) -> None:
    """The generated module passes mypy --strict, so does code that uses it right; a misspelt
    member, a missing one and a value outside an enum fail it; and what to_payload gives is a
    payload the contract accepts, with members' JSON names."""
    write(tmp_path / "c", "shop/order", 1, ORDER)
    write(tmp_path / "c", "shop/refund", 1, {"type": "object"})
    write(tmp_path / "c", "shop/old", 1, {"type": "object"})
    assert outbox_cli(operator_env, "contracts", "push", str(tmp_path / "c")).returncode == 0
    retire = ("contracts", "retire", "shop/old", "1", "--reason", "gone")
    assert outbox_cli(operator_env, *retire).returncode == 0
    project = tmp_path / "project"
    project.mkdir()
    module = project / "contracts_gen.py"
    done = outbox_cli(operator_env, "contracts", "codegen", "--output", str(module))
    assert done.returncode == 0, done.stderr
    source = module.read_text()
    assert "class ShopOrderV1:" in source and "class ShopRefundV1:" in source
    assert "ShopOld" not in source  # retired: no class
    (project / "uses.py").write_text(USES)
    checked = mypy_strict(project)
    assert checked.returncode == 0, checked.stdout
    wrong = {
        "ammount=5": 'Unexpected keyword argument "ammount"',
        "currency='gbp'": 'Argument "currency" to "ShopOrderV1" has incompatible type',
        "lines=None": 'Argument "lines" to "ShopOrderV1" has incompatible type "None"',
    }
    for typo, error in wrong.items():
        (project / "uses.py").write_text(
            f"from contracts_gen import ShopOrderV1\n"
            f"ShopOrderV1(amount=5, currency='eur', lines=[], {typo})\n"
            if "ammount" in typo
            else f"from contracts_gen import ShopOrderV1\n"
            f"ShopOrderV1(amount=5, {'currency' if 'lines' in typo else 'lines'}="
            f"{'[]' if 'currency' in typo else repr('eur')}, {typo})\n"
        )
        refused = mypy_strict(project)
        assert refused.returncode == 1 and error in refused.stdout, (typo, refused.stdout)
    sys.path.insert(0, str(project))
    try:
        generated = importlib.import_module("contracts_gen")
    finally:
        sys.path.remove(str(project))
    order = generated.ShopOrderV1(
        amount=5, currency="usd", lines=[generated.ShopOrderV1Line(sku="a")], first_name="Bo"
    )
    payload = order.to_payload()
    assert payload == {"amount": 5, "currency": "usd", "first-name": "Bo", "lines": [{"sku": "a"}]}
    contract = parse_contract("shop/order", 1, json.dumps(ORDER))
    assert (
        checker_for(contract.label, contract.digest, contract.canonical).violation(payload) is None
    )

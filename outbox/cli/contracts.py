"""`outbox contracts`: publish the application's contract files (DIR/<type>/v<N>.json) and look
after the published versions. A published version never changes: pushing other content under
it is refused, with the difference, and nothing of that push is published."""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import click

from outbox.cli.common import (
    TEXT,
    BadInput,
    Conflict,
    actor_option,
    connect,
    dsn_option,
    json_option,
)
from outbox.contracts import ContractFile, InvalidContract, load_dir
from outbox.contracts.codegen import Generator
from outbox.core.safe_text import printable
from outbox.db import contracts as store
from outbox.oncall.text_tables import render_table

STATES = {"deprecate": "deprecated", "retire": "retired", "activate": "active"}


@click.group(help="Operation contracts: a JSON Schema per operation type and version.")
def contracts() -> None:
    pass


def _read(directory: Path) -> list[ContractFile]:
    try:
        return load_dir(directory)
    except InvalidContract as exc:
        raise BadInput(str(exc)) from None


@contracts.command("push")
@dsn_option
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--reason",
    type=TEXT,
    default="published by outbox contracts push",
    show_default=True,
    help="Recorded in the audit with each version published.",
)
@click.option(
    "--allow-unversioned", is_flag=True,
    help="A type published for the first time does not require producers to name a version "
    "yet (for a type producers already enqueue; `outbox contracts require` later).",
)  # fmt: skip
@actor_option
@json_option
def push(
    dsn: str, directory: Path, reason: str, allow_unversioned: bool, actor: str, as_json: bool
) -> None:
    """Publish every contract under DIRECTORY, all or none. A type's first publish makes
    enqueue require producers to name a version, unless --allow-unversioned."""
    found = _read(directory)
    with connect(dsn) as conn:
        try:
            results = store.publish(
                conn, found, actor=actor, reason=reason, require_version=not allow_unversioned
            )
        except store.ContractChanged as exc:
            click.echo(_difference(exc.published, exc.contract), err=True)
            raise Conflict(
                f"{exc.contract.label} is published with other content; nothing was published. "
                f"A published version never changes: publish the change as v"
                f"{_next_version(found, exc.contract)}"
            ) from None
    rows = [
        (c.operation_type, c.version, result, c.digest[:12])
        for c, result in zip(found, results, strict=True)
    ]
    if as_json:
        click.echo(
            json.dumps(
                [
                    dict(zip(("operation_type", "version", "result", "digest"), r, strict=True))
                    for r in rows
                ]
            )
        )
        return
    click.echo(
        render_table(("type", "version", "result", "digest"), [tuple(map(str, r)) for r in rows])
    )


@contracts.command("diff")
@dsn_option
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def diff(dsn: str, directory: Path) -> None:
    """What a push of DIRECTORY would do: new versions, unchanged ones, and the difference of
    each that is published with other content (exit status 3 if any)."""
    found = _read(directory)
    changed = 0
    with connect(dsn) as conn:
        for contract in found:
            held = store.get(conn, contract.operation_type, contract.version)
            if held is None:
                click.echo(f"new        {printable(contract.label)}")
            elif held.digest == contract.digest:
                click.echo(f"unchanged  {printable(contract.label)} ({held.state})")
            else:
                changed += 1
                click.echo(f"CHANGED    {printable(contract.label)}: a push would be refused")
                click.echo(_difference(held.canonical, contract))
    if changed:
        raise Conflict(f"{changed} published version(s) differ from the files")


@contracts.command("list")
@dsn_option
@click.option("--type", "operation_type", type=TEXT, help="Only this operation type's versions.")
@json_option
def list_(dsn: str, operation_type: str | None, as_json: bool) -> None:
    """Published versions, by type and version."""
    with connect(dsn) as conn:
        rows = store.list_published(conn, operation_type)
        named = store.aliases(conn, operation_type)
    if as_json:
        click.echo(json.dumps([_jsonable(r) for r in rows]))
        return
    lines = [
        (printable(r.operation_type), str(r.version), r.state,
         "yes" if r.versions_required else "no", r.digest[:12],
         f"{r.published_at:%Y-%m-%d %H:%M}", printable(r.published_by))
        for r in rows
    ]  # fmt: skip
    headers = ("type", "version", "state", "version required", "digest", "published", "by")
    click.echo(render_table(headers, lines))
    for alias, target, _at, _by in named:
        click.echo(f"alias {printable(alias)} reads the contracts of {printable(target)}")


@contracts.command("show")
@dsn_option
@click.argument("operation_type", type=TEXT)
@click.argument("version", type=click.IntRange(1))
@json_option
def show(dsn: str, operation_type: str, version: int, as_json: bool) -> None:
    """One published version's schema and state."""
    with connect(dsn) as conn:
        held = store.get(conn, operation_type, version)
    if held is None:
        raise BadInput(f"no contract {operation_type}/v{version} is published")
    schema = json.loads(held.canonical)
    if as_json:
        click.echo(json.dumps({"state": held.state, "digest": held.digest, "schema": schema}))
        return
    click.echo(f"{printable(operation_type)}/v{version}: {held.state}, sha256 {held.digest}")
    click.echo(json.dumps(schema, indent=2, ensure_ascii=False))


@contracts.command("codegen")
@dsn_option
@click.option("--type", "operation_type", type=TEXT, help="Only this operation type's versions.")
@click.option(
    "--output", type=click.Path(dir_okay=False, path_type=Path),
    help="Write the module here (default: stdout).",
)  # fmt: skip
def codegen(dsn: str, operation_type: str | None, output: Path | None) -> None:
    """Typed Python classes (dataclasses) of every published version not retired, so that
    a type checker finds a misspelt field before enqueue does."""
    with connect(dsn) as conn:
        found = store.schemas(conn, operation_type)
    if not found:
        raise BadInput("no published contract to write classes for")
    generator = Generator()
    for kind, version, canonical in found:
        generator.add(kind, version, json.loads(canonical))
    source = generator.source()
    if output is None:
        click.echo(source, nl=False)
    else:
        output.write_text(source, encoding="utf-8")
        click.echo(f"wrote {len(found)} contract class(es) to {output}", err=True)


def _requirement_command(name: str, required: bool, what: str) -> None:
    @contracts.command(name, help=what)
    @dsn_option
    @click.argument("operation_type", type=TEXT)
    @click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")
    @actor_option
    def command(dsn: str, operation_type: str, reason: str, actor: str) -> None:
        with connect(dsn) as conn:
            result = store.set_requirement(
                conn, operation_type, required, actor=actor, reason=reason
            )
        click.echo(f"{printable(operation_type)}: a contract version is {result}")


_requirement_command(
    "require", True, "Enqueue refuses the type's operations that name no contract version."
)
_requirement_command(
    "allow-unversioned", False, "Enqueue takes the type's operations that name no version."
)


@contracts.command("alias")
@dsn_option
@click.argument("alias", type=TEXT)
@click.argument("operation_type", type=TEXT)
@click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")
@actor_option
def alias(dsn: str, alias: str, operation_type: str, reason: str, actor: str) -> None:
    """Make ALIAS, a renamed type's old name, read OPERATION_TYPE's contracts, for ever: push
    ALIAS's versions under OPERATION_TYPE with the same content first. Audited."""
    with connect(dsn) as conn:
        result = store.set_alias(conn, alias, operation_type, actor=actor, reason=reason)
    click.echo(f"{printable(alias)} -> {printable(operation_type)}: {result}")


def _state_command(name: str, state: str) -> None:
    @contracts.command(name, help=f"Mark one published version {state}, audited.")
    @dsn_option
    @click.argument("operation_type", type=TEXT)
    @click.argument("version", type=click.IntRange(1))
    @click.option("--reason", type=TEXT, required=True, help="Why; recorded in the audit.")
    @actor_option
    def command(dsn: str, operation_type: str, version: int, reason: str, actor: str) -> None:
        with connect(dsn) as conn:
            result = store.set_state(
                conn, operation_type, version, state, actor=actor, reason=reason
            )
        click.echo(f"{printable(operation_type)}/v{version}: {result}")


for _name, _state in STATES.items():
    _state_command(_name, _state)


def _difference(published: str, pushed: ContractFile) -> str:
    def lines(canonical: str) -> list[str]:
        text = json.dumps(json.loads(canonical), indent=2, sort_keys=True, ensure_ascii=False)
        return text.splitlines(keepends=True)

    label = printable(pushed.label)
    return "".join(
        difflib.unified_diff(
            lines(published) if published else [], lines(pushed.canonical),
            fromfile=f"{label} (published)", tofile=f"{label} (files)",
        )
    )  # fmt: skip


def _next_version(found: list[ContractFile], contract: ContractFile) -> int:
    return 1 + max(c.version for c in found if c.operation_type == contract.operation_type)


def _jsonable(row: store.Published) -> dict[str, Any]:
    return {
        "operation_type": row.operation_type,
        "version": row.version,
        "state": row.state,
        "digest": row.digest,
        "published_at": row.published_at.isoformat(),
        "published_by": row.published_by,
        "state_changed_at": row.state_changed_at.isoformat(),
        "versions_required": row.versions_required,
    }

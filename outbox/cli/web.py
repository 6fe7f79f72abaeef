"""`outbox web`: the operator console (outbox/web/), served by uvicorn."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Final

import click

from outbox.cli.common import TEXT, BadInput, config_option, dsn_option
from outbox.config.loader import load_settings
from outbox.config.settings import ConfigError, Settings
from outbox.daemon import service as daemon
from outbox.web import auth

DEFAULT_LISTEN: Final = "127.0.0.1:8086"
_EXTRA: Final = "outbox web needs its extra: pip install 'outbox[web]'"


@click.command()
@dsn_option
@config_option("The settings file `outbox run` takes: its [web] table and its providers.")
@click.option(
    "--listen",
    type=TEXT,
    default=DEFAULT_LISTEN,
    show_default=True,
    help="HOST:PORT to serve on; loopback unless a proxy in front needs otherwise.",
)
@click.option("--read-only", is_flag=True, help="Change nothing, whoever signs in.")
@click.option(
    "--hash-password",
    is_flag=True,
    help="Read a password from stdin and print its hash for the credentials file; serve nothing.",
)
def web(
    dsn: str, config_path: Path | None, listen: str, read_only: bool, hash_password: bool
) -> None:
    """Serve the operator console: the overview, operations, failures by cause, reconciliation,
    and the actions of `outbox quarantine` and `outbox reconcile`, one at a time or by filter."""
    if hash_password:
        click.echo(auth.hash_password(_password()))
        return
    try:
        from outbox.web import serve  # noqa: PLC0415 (only with the extra)
    except ImportError:
        raise click.ClickException(_EXTRA) from None
    settings = _settings(config_path)
    try:
        chosen = serve.options(settings, read_only=read_only)
    except auth.CredentialsError as exc:
        raise BadInput(str(exc)) from None
    host, port = _address(listen)
    click.echo(f"outbox web: http://{host}:{port}/ (signs in: {serve.describe(chosen)})", err=True)
    serve.serve(dsn, settings, chosen, host, port)


def _password() -> str:
    if sys.stdin.isatty():
        return str(click.prompt("password", hide_input=True, confirmation_prompt=True, type=str))
    password = sys.stdin.readline().removesuffix("\n")
    if not password:
        raise BadInput("no password on stdin")
    return password


def _settings(config_path: Path | None) -> Settings:
    try:
        return load_settings(config_path)
    except ConfigError as exc:
        raise BadInput(str(exc)) from None


def _address(listen: str) -> tuple[str, int]:
    try:
        found = daemon.parse_addr(listen)  # HOST:PORT as `run --metrics-addr` reads it
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--listen") from None
    if found is None:  # "off": a console must listen somewhere
        raise click.BadParameter("the console needs an address: HOST:PORT", param_hint="--listen")
    return found

"""What every `outbox` command shares: the --dsn and --json options, a connection that turns
database errors into clean messages, parameter types and exit codes.

Exit codes: 0 success; 1 failure (database unreachable, migration failed, an action refused);
2 bad input (usage, an invalid operation, a config error); 3 conflict (the identity exists with
other content).
"""

from __future__ import annotations

import contextlib
import getpass
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

import click
import psycopg
from click.core import ParameterSource
from psycopg.conninfo import conninfo_to_dict

from outbox.core.durations import parse_duration
from outbox.db import dsn as dsn_util
from outbox.db.connect import pin_search_path

F = TypeVar("F", bound=Callable[..., Any])

EXIT_CONFLICT = 3
CONNECT_TIMEOUT_SECONDS = 10  # a CLI that hangs on a dead host is worse than one that says so


# click 8.5 made ParamType generic; the older releases we also support cannot be subscripted.
class Duration(click.ParamType):  # type: ignore[type-arg]
    """A click parameter for durations such as 500ms, 30s or 10m."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


class Text(click.ParamType):  # type: ignore[type-arg]
    """A text option or argument: refuses what no database text can hold, at parse time, with
    exit 2 (before: a traceback from the driver). Bytes that are not UTF-8 on a command line
    reach Python as lone surrogates; a NUL can come from a file or the environment."""

    name = "text"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if "\x00" in text:
            self.fail("must not contain a NUL character", param, ctx)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            self.fail(f"is not UTF-8 text (character {exc.start + 1})", param, ctx)
        return text


TEXT: Final = Text()


class JsonErrors(click.Group):
    """The `outbox` group: a command given --json reports its failure as JSON too, one object
    on stderr (``{"error": ..., "exit_code": ...}``), so that a script never parses prose."""

    def main(self, args: Sequence[str] | None = None, *rest: Any, **options: Any) -> Any:
        argv = list(sys.argv[1:] if args is None else args)
        if "--json" not in argv or options.get("standalone_mode") is False:
            return super().main(argv, *rest, **options)
        options["standalone_mode"] = False
        try:
            result = super().main(argv, *rest, **options)
        except click.ClickException as exc:
            error = {"error": exc.format_message(), "exit_code": exc.exit_code}
            click.echo(json.dumps(error), err=True)
            sys.exit(exc.exit_code)
        except click.Abort:
            click.echo(json.dumps({"error": "aborted", "exit_code": 1}), err=True)
            sys.exit(1)
        sys.exit(result if isinstance(result, int) else 0)


class BadInput(click.ClickException):
    exit_code = 2


class Conflict(click.ClickException):
    exit_code = EXIT_CONFLICT


def _check_dsn(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        with_password = dsn_util.has_password(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if (
        with_password
        and ctx.get_parameter_source(param.name or "dsn") is ParameterSource.COMMANDLINE
    ):
        raise click.BadParameter(
            "a password on the command line is visible to every user of this machine; "
            "set OUTBOX_DATABASE_URL, PGPASSWORD or a ~/.pgpass file instead"
        )
    return value


def dsn_option(command: F) -> F:
    """``--dsn``, defaulting to $OUTBOX_DATABASE_URL; passwords only from the environment."""
    return click.option(
        "--dsn",
        type=TEXT,
        envvar="OUTBOX_DATABASE_URL",
        show_envvar=True,
        required=True,
        callback=_check_dsn,
        help="PostgreSQL connection string (URL or key=value); no password on the command line.",
    )(command)


def actor_option(command: F) -> F:
    """--actor: who is acting, recorded with what they do (the audit, an ordering mode)."""
    option = click.option(
        "--actor",
        type=TEXT,
        default=getpass.getuser,
        show_default="the login user",
        help="Who is acting; recorded with the change.",
    )
    return option(command)


def config_option(help_text: str) -> Callable[[F], F]:
    """--config (or $OUTBOX_CONFIG): the settings file, as `outbox run` takes it."""
    return click.option(
        "--config",
        "config_path",
        envvar="OUTBOX_CONFIG",
        show_envvar=True,
        type=click.Path(dir_okay=False, path_type=Path),
        help=help_text,
    )


def json_option(command: F) -> F:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(command)


UNPINNED_SEARCH_PATH: Final = (
    "outbox: through a transaction pooler this command's search_path is your login role's, and "
    "it is not pinned: ALTER ROLE <you> SET search_path = pg_catalog, pg_temp (docs/operations.md)"
)


@contextlib.contextmanager
def connect(dsn: str, *, autocommit: bool = False) -> Iterator[psycopg.Connection[Any]]:
    """A connection for one command, with database errors turned into clean messages."""
    # Nothing is prepared: a one-shot command gains nothing by it, and a transaction pooler
    # between us and the server would lose the prepared statements (docs/pgbouncer.md).
    options: dict[str, Any] = {
        "application_name": "outbox-cli",
        "autocommit": autocommit,
        "prepare_threshold": None,
    }
    if "connect_timeout" not in conninfo_to_dict(dsn):
        options["connect_timeout"] = CONNECT_TIMEOUT_SECONDS
    try:
        with psycopg.connect(dsn, **options) as conn:
            # Operator functions read after taking an ordering key's lock, which only READ
            # COMMITTED's fresh snapshot per statement makes right, whatever the database's
            # default_transaction_isolation (sql/0019).
            conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
            if not pin_search_path(conn):
                click.echo(UNPINNED_SEARCH_PATH, err=True)
            yield conn
    except (
        psycopg.errors.UndefinedTable,
        psycopg.errors.UndefinedFunction,
        psycopg.errors.InvalidSchemaName,
    ):
        raise click.ClickException(
            "the outbox schema is missing or out of date: run `outbox migrate` first"
        ) from None
    except psycopg.Error as exc:
        raise click.ClickException(dsn_util.scrub(str(exc).strip(), dsn)) from None

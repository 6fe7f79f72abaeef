"""`outbox web`'s ASGI application: server-rendered pages (Starlette and Jinja2, no build step)
over a small pool of connections, each action through the same SQL function as the CLI's.

Every request is signed in first (outbox/web/auth.py); every POST also proves that it came from
one of the console's own forms and that its sender may act. Database work runs on a worker
thread, with a statement timeout, so a slow query never stalls the event loop nor holds a
connection for long.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final, TypeVar

import psycopg
from psycopg_pool import ConnectionPool
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.templating import Jinja2Templates

from outbox.config.settings import Settings
from outbox.core.durations import format_duration
from outbox.core.model import Status
from outbox.db.connect import connection_options, pin_search_path
from outbox.db.dsn import scrub
from outbox.web import bulk, reads
from outbox.web.auth import ANONYMOUS, Credentials, FormTokens, Role, User, basic_credentials
from outbox.web.auth import proxy_user as user_from_proxy
from outbox.web.statements import SESSION_SETTINGS, TOO_PRIVILEGED

T = TypeVar("T")
HERE: Final = Path(__file__).parent
REFRESH_SECONDS: Final = 2  # how often a page's live parts are read again
READ_SHARE: Final = 10  # the overview is read again after ten times what its last read took
REALM: Final = 'Basic realm="outbox", charset="UTF-8"'

# The actions of one operation, by its status: the name a form posts and what it calls.
ACTIONS: Final[Mapping[Status, tuple[str, ...]]] = {
    Status.QUARANTINED: ("replay", "reconcile", "cancel"),
    Status.RECONCILING: ("check", "retry", "no-effect", "resolve", "cancel"),
    Status.PENDING: ("request-cancel",),
    Status.IN_FLIGHT: ("request-cancel",),
}
# What each action's button says: what it does, in the words of the CLI's help.
LABELS: Final[Mapping[str, str]] = {
    "replay": "replay (same key)",
    "reconcile": "send to reconciliation",
    "cancel": "cancel",
    "request-cancel": "cancel",
    "retry": "retry under a new key",
    "no-effect": "found no effect: retry",
    "resolve": "resolve with the reference",
}
# Bulk actions by status, as `outbox quarantine|reconcile ACTION --all` offers them.
BULK_ACTIONS: Final[Mapping[Status, tuple[str, ...]]] = {
    Status.QUARANTINED: ("replay", "reconcile", "cancel"),
    Status.RECONCILING: ("retry", "cancel"),
}


@dataclass(frozen=True)
class Options:
    """How this console runs: what its settings and command line said."""

    read_only: bool = False
    credentials: Credentials | None = None
    proxy_user_header: str | None = None
    proxy_role_header: str | None = None

    @property
    def anonymous(self) -> bool:
        return self.credentials is None and self.proxy_user_header is None


def key_windows(settings: Settings) -> dict[str, timedelta]:
    """Per configured provider, how long after its first send its key window closes."""
    return {
        name: ps.key_retention - settings.margin_of(ps) for name, ps in settings.providers.items()
    }


def open_pool(
    dsn: str, *, size: int = 4, timeout: float = 10.0, session_settings: bool = True
) -> ConnectionPool[Any]:
    """The console's connections: read committed (as the CLI's, sql/0019), pinned search_path,
    a statement timeout; opened lazily, so the console starts while the database is down."""

    def configure(conn: psycopg.Connection[Any]) -> None:
        # Autocommit: a page's reads hold no transaction open between its statements nor hand
        # the pool a connection mid-transaction; each action opens its own (operators._act).
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
        conn.autocommit = True
        if pin_search_path(conn) and session_settings:
            conn.execute(SESSION_SETTINGS)

    # The network defaults of every outbox connection; what the DSN sets itself wins.
    kwargs = {**connection_options(dsn, "outbox-web"), "prepare_threshold": None}
    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=size,
        kwargs=kwargs,
        configure=configure,
        open=False,
        timeout=timeout,
    )


class Console:
    """The pages and actions, around one pool, the settings and the sign-in."""

    def __init__(
        self, pool: ConnectionPool[Any], settings: Settings, options: Options, dsn: str = ""
    ) -> None:
        self.pool = pool
        self.settings = settings
        self.windows = key_windows(settings)
        self.options = options
        self.tokens = FormTokens()
        self.jobs = bulk.Jobs(pool)
        self.dsn = dsn
        # The role the console connects as, when it can do more than outbox_operator: every page
        # says so (docs/console.md). Learned at the first answer of the database.
        self.overprivileged_role: str | None = None
        self._role_known = False
        self._scrypt_slots = asyncio.Semaphore(2)
        self._overview: tuple[float, dict[str, Any]] | None = None
        self._overview_lock = asyncio.Lock()
        self.templates = Jinja2Templates(directory=str(HERE / "templates"))
        # Said, not assumed: a provider's error text or a producer's id is never markup here.
        self.templates.env.autoescape = True
        self.templates.env.filters["age"] = _age
        self.templates.env.globals["refresh_seconds"] = REFRESH_SECONDS
        self.templates.env.globals["labels"] = LABELS

    # --- plumbing -------------------------------------------------------------------------

    async def user(self, request: Request) -> User:
        """The person signed in, or a 401 asking for credentials (403 for a bad proxy header)."""
        options = self.options
        if options.proxy_user_header is not None:
            role_header = options.proxy_role_header
            role = request.headers.get(role_header) if role_header else None
            found = user_from_proxy(request.headers.get(options.proxy_user_header), role)
            if found is None:
                raise HTTPException(403, "the proxy named no one")
            return found
        if options.credentials is not None:
            sent = basic_credentials(request.headers.get("authorization"))
            found = await self._check(options.credentials, *sent) if sent else None
            if found is None:
                raise HTTPException(401, "sign in", headers={"WWW-Authenticate": REALM})
            return found
        return User(ANONYMOUS, Role.VIEWER)

    async def _check(self, credentials: Credentials, name: str, password: str) -> User | None:
        """A password check: remembered ones at once; a new one (scrypt: 50 ms of CPU and 16 MiB)
        on a worker thread, at most two at a time, so that a flood of wrong passwords slows
        sign-ins, never the pages of people already signed in."""
        known = credentials.remembered(name, password)
        if known is not None:
            return known
        async with self._scrypt_slots:
            return await run_in_threadpool(credentials.check, name, password)

    async def overview(self) -> dict[str, Any]:
        """The overview's figures, read at most once per refresh however many tabs show them,
        and never more than a tenth of the time: a dozen people watching an incident must not
        multiply its load, and a read that takes a second (a backlog of a million) is kept ten."""
        async with self._overview_lock:
            kept = self._overview
            if kept is None or time.monotonic() >= kept[0]:
                began = time.monotonic()
                data = await self.db(lambda c: reads.overview(c, self.windows))
                took = time.monotonic() - began
                kept = self._overview = (began + max(REFRESH_SECONDS, READ_SHARE * took), data)
            return kept[1]

    async def db(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``work`` on a pooled connection, on a worker thread."""

        def run() -> T:
            if not self._role_known:
                self.learn_role()
            with self.pool.connection() as conn:
                return work(conn)

        try:
            return await run_in_threadpool(run)
        except psycopg.errors.QueryCanceled:
            raise HTTPException(
                503, "the database took too long: narrow the filters and ask again"
            ) from None
        except (psycopg.OperationalError, psycopg.errors.AdminShutdown) as exc:
            raise HTTPException(503, "the database does not answer: " + self._scrub(exc)) from None
        except (psycopg.errors.UndefinedFunction, psycopg.errors.UndefinedTable):
            raise HTTPException(
                503, "the outbox schema is missing or out of date: run `outbox migrate`"
            ) from None

    def _scrub(self, exc: BaseException) -> str:
        return scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else "", self.dsn)

    def learn_role(self) -> None:
        """Read once whether the role can change outbox's tables directly; a database that
        does not answer yet is asked again at the next page."""
        try:
            with self.pool.connection(timeout=2) as conn:
                row = conn.execute(TOO_PRIVILEGED).fetchone()
        except psycopg.Error:
            return
        self._role_known = True
        if row is not None and row[1]:
            self.overprivileged_role = str(row[0])

    def page(self, request: Request, name: str, user: User, **context: Any) -> HTMLResponse:
        context.update(
            overprivileged_role=self.overprivileged_role,
            user=user,
            may_act=user.may_act and not self.options.read_only,
            read_only=self.options.read_only,
            anonymous=self.options.anonymous,
            csrf=self.tokens.issue(user),
        )
        return self.templates.TemplateResponse(request, name, context)

    async def acting(self, request: Request) -> tuple[User, FormData]:
        """The person behind a POST and its form, once it is shown to come from the console's
        own form and its sender may act: else 403, before anything is read or changed."""
        user = await self.user(request)
        # A browser says where a request came from; a cross-site one is never ours.
        if request.headers.get("sec-fetch-site", "same-origin") not in ("same-origin", "none"):
            raise HTTPException(403, "a request from another site is refused")
        form = await request.form(max_files=0, max_fields=16)
        token = form.get("csrf")
        if not self.tokens.valid(user, token if isinstance(token, str) else None):
            raise HTTPException(403, "the form's token is missing or not yours: reload the page")
        if self.options.read_only:
            raise HTTPException(403, "this console is read-only")
        if not user.may_act:
            raise HTTPException(403, f"{user.name} is a viewer: viewers change nothing")
        return user, form


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return format_duration(timedelta(seconds=max(0, round(seconds))))


def redirect(url: str) -> Response:
    return RedirectResponse(url, status_code=303)

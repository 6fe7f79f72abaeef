"""The console's pages and actions: one handler each, reading through outbox/web/reads.py and
acting through outbox.oncall.operators, the CLI's own functions."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any, Final
from urllib.parse import urlencode

import psycopg
from starlette.applications import Starlette
from starlette.datastructures import FormData, QueryParams
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from outbox.config.settings import ConfigError
from outbox.core.durations import DurationTooLong, parse_duration
from outbox.core.model import Status
from outbox.core.safe_text import printable
from outbox.oncall import operators, reconciler
from outbox.web import bulk, reads
from outbox.web.app import ACTIONS, BULK_ACTIONS, HERE, Console, redirect
from outbox.web.auth import User

MAX_REASON: Final = 500  # the audit's why: a sentence, not a document
MAX_FIELD: Final = 200  # a filter's or a reference's length
# What a bulk action selects by: `outbox quarantine|reconcile ACTION`'s filters.
_BULK_FILTERS: Final = frozenset(
    {"status", "provider", "status_reason", "error", "tenant", "since"}
)


def create_app(console: Console) -> Starlette:
    """The ASGI application: pages, actions and the static files."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        console.pool.open(wait=False)
        try:
            yield
        finally:
            console.pool.close()

    served: list[BaseRoute] = [
        *routes(console),
        Mount("/static", StaticFiles(directory=str(HERE / "static")), name="static"),
    ]
    app = Starlette(
        routes=served,
        lifespan=lifespan,
        exception_handlers=errors(console),
        middleware=[Middleware(SecurityHeaders)],
    )
    app.state.console = console
    return app


# Every answer: scripts, styles and forms of the console's own origin only, never in a frame of
# another site's (clickjacking an operator into an action), never cached (a payload shown once
# stays on no disk), no address of a page sent elsewhere.
_HEADERS: Final = [
    (
        b"content-security-policy",
        b"default-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cache-control", b"no-store"),
]


class SecurityHeaders:
    """Adds _HEADERS to every HTTP answer (pure ASGI: no buffering of the body)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, with_headers)


def routes(console: Console) -> list[Route]:
    def bound(handler: Callable[[Console, Request], Any]) -> Callable[[Request], Any]:
        return partial(handler, console)

    return [
        Route("/", bound(overview), name="overview"),
        Route("/live/overview", bound(overview_live), name="overview_live"),
        Route("/operations", bound(operations), name="operations"),
        Route("/operations/{id:int}", bound(operation), name="operation"),
        Route("/operations/{id:int}/act", bound(act), methods=["POST"], name="act"),
        Route("/failures", bound(failures), name="failures"),
        Route("/reconcile", bound(reconcile), name="reconcile"),
        Route("/bulk", bound(bulk_preview), name="bulk"),
        Route("/bulk", bound(bulk_start), methods=["POST"], name="bulk_start"),
        Route("/jobs/{token}", bound(job_page), name="job"),
        Route("/jobs/{token}/stop", bound(job_stop), methods=["POST"], name="job_stop"),
    ]


def errors(console: Console) -> Mapping[Any, Callable[..., Any]]:
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)  # noqa: S101 (registered for it alone)
        body = console.templates.get_template("error.html").render(
            status=exc.status_code, detail=exc.detail
        )
        return HTMLResponse(body, status_code=exc.status_code, headers=exc.headers)

    return {HTTPException: http_error}


# --- pages ----------------------------------------------------------------------------------


async def overview(console: Console, request: Request) -> Response:
    user = await console.user(request)
    return console.page(request, "overview.html", user, o=await console.overview())


async def overview_live(console: Console, request: Request) -> Response:
    """The overview's live part alone: what the page's script swaps in every few seconds."""
    user = await console.user(request)
    return console.page(request, "overview_live.html", user, o=await console.overview())


async def operations(console: Console, request: Request) -> Response:
    user = await console.user(request)
    query = request.query_params
    text = _text(query, "q")
    if text:
        ids = await console.db(lambda c: reads.search(c, text))
        if len(ids) == 1:
            return redirect(str(request.url_for("operation", id=ids[0])))
        rows = await console.db(lambda c: operators.list_ids(c, ids)) if ids else []
        return console.page(
            request, "operations.html", user, rows=rows, q=text, f=reads.ListFilters(), next=None
        )
    filters = _list_filters(query)
    before = _int(query, "before")
    rows = await console.db(lambda c: reads.list_operations(c, filters, before=before))
    next_page = None
    if len(rows) == reads.PAGE:
        kept = {k: v for k, v in query.items() if k != "before" and v}
        next_page = "?" + urlencode({**kept, "before": rows[-1]["id"]})
    return console.page(
        request, "operations.html", user, rows=rows, q="", f=filters, next=next_page
    )


async def operation(console: Console, request: Request) -> Response:
    user = await console.user(request)
    operation_id = int(request.path_params["id"])
    with_payload = request.query_params.get("payload") == "1"

    def read(conn: psycopg.Connection[Any]) -> dict[str, Any]:
        op = operators.show(conn, operation_id, with_payload=with_payload)
        op["key_window"] = reads.key_window(conn, op, console.windows)
        return op

    try:
        op = await console.db(read)
    except operators.ActionRefused as exc:
        raise HTTPException(404, str(exc)) from None
    status = Status.parse(op["status"])
    return console.page(
        request,
        "operation.html",
        user,
        op=op,
        payload=reads.shown_payload(op.get("payload")),
        actions=ACTIONS.get(status, ()),
        done=request.query_params.get("done"),
    )


async def failures(console: Console, request: Request) -> Response:
    user = await console.user(request)
    groups, waiting = await console.db(reads.failure_groups)
    return console.page(
        request, "failures.html", user, groups=groups, waiting=waiting, grouped=reads.GROUPED
    )


async def reconcile(console: Console, request: Request) -> Response:
    user = await console.user(request)
    filters = _cli_filters(request.query_params)

    def read(conn: psycopg.Connection[Any]) -> list[dict[str, Any]]:
        return operators.list_attention(conn, Status.RECONCILING, filters, limit=reads.PAGE)

    rows = await console.db(read)
    return console.page(request, "reconcile.html", user, rows=rows)


# --- actions --------------------------------------------------------------------------------


async def act(console: Console, request: Request) -> Response:
    user, form = await console.acting(request)
    operation_id = int(request.path_params["id"])
    name = _form_text(form, "action")
    if name == "check":
        return await _check(console, request, operation_id, user)
    call = _single_action(name, form, user)
    try:
        status = await console.db(lambda c: call(c, operation_id))
    except operators.ActionRefused as exc:
        raise HTTPException(409, str(exc)) from None
    url = request.url_for("operation", id=operation_id)
    return redirect(f"{url}?" + urlencode({"done": f"{name}: now {status.value}"}))


async def _check(console: Console, request: Request, operation_id: int, user: User) -> Response:
    """Ask the provider, as `outbox reconcile check ID` does: found makes it succeeded, not found
    is recorded; nothing changes at the provider, so no reason is asked for. The audit names the
    person."""

    def providers(conn: psycopg.Connection[Any]) -> set[str]:
        return operators.reconciling_providers(conn, operation_id, None)

    wanted = await console.db(providers)
    if not wanted:
        raise HTTPException(409, f"operation {operation_id} is not reconciling: nothing to check")
    configured = console.settings.providers
    try:
        built, without_lookup = reconciler.providers_to_ask(configured, wanted)
    except ConfigError as exc:
        raise HTTPException(409, f"cannot ask the provider: {exc}") from None
    (result,) = await reconciler.run_checks(
        console.dsn,
        built,
        operation_id,
        dry_run=False,
        on_total=lambda _: None,
        on_result=lambda _: None,
        limits={name: ps.limits for name, ps in configured.items()},
        without_lookup=without_lookup,
        actor=user.name,
    )
    said = f"check: {result.finding}" + (f", state {result.state}" if result.state else "")
    url = request.url_for("operation", id=operation_id)
    return redirect(f"{url}?" + urlencode({"done": said}))


def _single_action(
    name: str, form: FormData, user: User
) -> Callable[[psycopg.Connection[Any], int], Status]:
    """The operators function ``name`` calls, with the form's reason and the person's name."""
    said: dict[str, Any] = {"reason": _reason(form), "actor": user.name}
    if name == "retry":
        said["force"] = form.get("force") == "1"
    elif name == "resolve":
        said["provider_ref"] = _form_text(form, "provider_ref")
        if not said["provider_ref"]:
            raise HTTPException(400, "resolve needs the provider's reference of the effect")
    function = _FUNCTIONS.get(name)
    if function is None:
        raise HTTPException(400, f"no action {printable(name)!r}")
    return partial(_call, function, **said)


# What each action calls: the CLI's functions, so the same SQL functions, fences and audit.
_FUNCTIONS: Final[Mapping[str, Callable[..., Status]]] = {
    "replay": operators.replay,
    "reconcile": operators.request_reconciliation,
    "cancel": operators.cancel,  # reconciling or quarantined, as `outbox quarantine cancel`
    "request-cancel": operators.request_cancel,  # any unfinished one, as `outbox cancel`
    "retry": operators.retry,
    "no-effect": operators.retry_with_no_effect,
    "resolve": operators.resolve,
}


def _call(function: Callable[..., Status], conn: Any, operation_id: int, **kw: Any) -> Status:
    return function(conn, operation_id, **kw)


async def bulk_preview(console: Console, request: Request) -> Response:
    """The dry run: the ids the filters select now, counted, the first shown; nothing changes."""
    user = await console.user(request)
    query = request.query_params
    # A filter the bulk action would not apply must not be silently dropped: the person would
    # act on more than the list they looked at showed.
    unknown = sorted(k for k, v in query.items() if v and k not in _BULK_FILTERS)
    if unknown:
        raise HTTPException(
            400, "a bulk action does not filter by " + ", ".join(printable(k) for k in unknown)
        )
    status = _bulk_status(_text(query, "status"))
    filters = _cli_filters(query)

    def select(conn: psycopg.Connection[Any]) -> tuple[list[int], list[dict[str, Any]], int]:
        ids = operators.select_ids(conn, status, filters)
        # A retry without force takes only those a check (or a person) found no effect for.
        retryable = len(operators.retryable_ids(conn, ids)) if status is Status.RECONCILING else 0
        return ids, operators.list_ids(conn, ids[:20]), retryable

    ids, preview, retryable = await console.db(select)
    selection = console.jobs.keep(bulk.Selection(status, filters, ids, made_by=user.name))
    return console.page(
        request,
        "bulk.html",
        user,
        selection=selection,
        preview=preview,
        actions=BULK_ACTIONS[status],
        described=filters.describe(),
        retryable=retryable,
    )


async def bulk_start(console: Console, request: Request) -> Response:
    user, form = await console.acting(request)
    selection = console.jobs.selection(_form_text(form, "selection"), user.name)
    if selection is None:
        raise HTTPException(409, "that count is gone or stale: count again before acting")
    name = _form_text(form, "action")
    if name not in BULK_ACTIONS[selection.status]:
        raise HTTPException(400, f"no bulk action {printable(name)!r} for {selection.status}")
    action = _single_action(name, form, user)
    job = console.jobs.start(name, selection.ids, action, started_by=user.name)
    return redirect(str(request.url_for("job", token=job.token)))


async def job_page(console: Console, request: Request) -> Response:
    user = await console.user(request)
    job = console.jobs.job(request.path_params["token"])
    if job is None:
        raise HTTPException(404, "no such job in this console (it may have restarted)")
    name = "job_live.html" if request.query_params.get("live") == "1" else "job.html"
    return console.page(request, name, user, job=job)


async def job_stop(console: Console, request: Request) -> Response:
    await console.acting(request)
    job = console.jobs.job(request.path_params["token"])
    if job is None:
        raise HTTPException(404, "no such job in this console")
    job.stop.set()
    return redirect(str(request.url_for("job", token=job.token)))


# --- input ----------------------------------------------------------------------------------


def _text(query: QueryParams, name: str) -> str:
    return _held(name, query.get(name, "").strip(), MAX_FIELD)


def _form_text(form: FormData, name: str) -> str:
    value = form.get(name)
    return _held(name, value.strip() if isinstance(value, str) else "", MAX_FIELD)


def _reason(form: FormData) -> str:
    value = form.get("reason")
    reason = _held("reason", value.strip() if isinstance(value, str) else "", MAX_REASON)
    if not reason:
        raise HTTPException(400, "say why: every action is audited with its reason")
    return reason


def _held(name: str, text: str, most: int) -> str:
    """``text``, if a database text can hold it and it is not too long: else 400, naming it."""
    if len(text) > most:
        raise HTTPException(400, f"{name} is longer than {most} characters")
    if "\x00" in text:  # PostgreSQL's text holds no NUL: refused here, not as a 500 later
        raise HTTPException(400, f"{name} holds a NUL character")
    return text


def _int(query: QueryParams, name: str) -> int | None:
    text = _text(query, name)
    if not text:
        return None
    if not text.isdigit() or len(text) > 18:
        raise HTTPException(400, f"{name} is an operation id")
    return int(text)


def _since(query: QueryParams) -> Any:
    text = _text(query, "since")
    if not text:
        return None
    try:
        return parse_duration(text)
    except (DurationTooLong, ValueError) as exc:
        raise HTTPException(400, f"since: {exc}") from None


def _list_filters(query: QueryParams) -> reads.ListFilters:
    status = _text(query, "status") or None
    if status is not None and status not in {s.value for s in Status}:
        raise HTTPException(400, f"no status {printable(status)!r}")
    return reads.ListFilters(
        status=status,
        provider=_text(query, "provider") or None,
        reason=_text(query, "status_reason") or None,
        error=_text(query, "error") or None,
        tenant=_text(query, "tenant") or None,
        operation_type=_text(query, "operation_type") or None,
        since=_since(query),
    )


def _cli_filters(query: QueryParams) -> operators.Filters:
    """The filters of `outbox quarantine|reconcile list`, as the query string gives them."""
    return operators.Filters(
        provider=_text(query, "provider") or None,
        reason=_text(query, "status_reason") or None,
        error=_text(query, "error") or None,
        tenant=_text(query, "tenant") or None,
        since=_since(query),
    )


def _bulk_status(text: str) -> Status:
    for status in BULK_ACTIONS:
        if status.value == text:
            return status
    raise HTTPException(400, "a bulk action takes quarantined or reconciling operations")

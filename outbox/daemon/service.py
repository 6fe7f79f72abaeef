"""`outbox run`: wires the dispatcher, the LISTEN wake-ups, signals and the HTTP listener."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Final, Literal

import prometheus_client
import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict

import outbox
from outbox.config.settings import DEFAULT_LISTEN_URL_ENV, Settings
from outbox.core.durations import format_duration
from outbox.daemon import gauges, sdnotify, startup, wakeup
from outbox.db.connect import dispatcher_pool, shares_server_sessions
from outbox.db.probe import DatabaseProbe
from outbox.db.store import Store
from outbox.dispatch.dispatcher import UNKNOWN_PROVIDER_GRACE, Dispatcher
from outbox.observability import metrics
from outbox.oncall.reconciler import Reconciler
from outbox.providers import lifecycle
from outbox.providers.base import Provider
from outbox.runtime import loops

# Enough connections for claims, heartbeats, rescues and bursts of records; more would only
# queue inside PostgreSQL. Each replica holds at most this many plus one for LISTEN.
POOL_MAX_SIZE: Final = 10
# /healthz fails when the event loop has not ticked for this long (a hung process).
LOOP_STALL_LIMIT: Final = 10.0
TICK: Final = 0.5
# The CLI's exit code for settings that cannot work (outbox.cli.common's BadInput).
EXIT_MISCONFIGURED: Final = 2
# The pool-mode check at startup (two connections, a few queries) takes milliseconds; a database
# that does not answer within this is checked in the background instead, every RETRY seconds.
POOL_MODE_CHECK_TIMEOUT: Final = 2.0
POOL_MODE_CHECK_RETRY: Final = 5.0

log = structlog.get_logger("outbox.daemon")


class Health:
    """What /healthz and /readyz report; read from the HTTP thread, written by the loop."""

    def __init__(self, dispatcher: Dispatcher, probe: DatabaseProbe | None = None) -> None:
        self.dispatcher = dispatcher
        self.probe = probe
        self.draining = False
        self.last_tick = time.monotonic()

    def alive(self) -> bool:
        return time.monotonic() - self.last_tick < LOOP_STALL_LIMIT

    def ready(self) -> bool:
        # A writable primary answers the probe now: not the last claim, which waits up to 30 s
        # for a pool connection and saw nothing of a failover (outbox/db/probe.py).
        database_ok = self.probe.ok if self.probe is not None else self.dispatcher.database_ok
        return self.alive() and not self.draining and database_ok


def worker_id() -> str:
    """Unique per process run, readable in lease_owner: host, pid and a random suffix."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _tune_gc() -> None:
    """Every operation allocates a few hundred short-lived objects (rows, records, tasks, log
    contexts) that die young without cycles; with the default thresholds the collector ran so
    often that it took a sixth of the process's time at full speed (py-spy --native). Collect
    the young generation ten times less often, and freeze what start-up built (modules,
    settings, providers) out of the older generations' scans."""
    gc.freeze()
    threshold0, threshold1, threshold2 = gc.get_threshold()
    gc.set_threshold(threshold0 * 10, threshold1, threshold2)


async def serve(
    dsn: str,
    settings: Settings,
    providers: Mapping[str, Provider],
    *,
    metrics_addr: tuple[str, int] | None,
) -> int:
    """Run until SIGTERM or SIGINT, then drain; returns the exit code."""
    metrics.BUILD_INFO.info({"version": outbox.__version__})
    _tune_gc()
    if not providers:  # no --config, or a file without a provider: a trap, said at once
        log.warning(
            "outbox run has no providers (its config, --config or OUTBOX_CONFIG, names no "
            "[providers.<name>]): it sends nothing, and quarantines each operation it claims "
            f"{format_duration(UNKNOWN_PROVIDER_GRACE)} after its enqueue (unknown_provider)"
        )
    database = settings.database
    refusal, checked = await _preflight(dsn, settings, providers)
    if refusal:
        await _close(providers)
        return EXIT_MISCONFIGURED
    pool = dispatcher_pool(
        dsn, max_size=POOL_MAX_SIZE, transaction_pooling=database.transaction_pooling
    )
    timeouts = {name: ps.timeout for name, ps in settings.providers.items()}
    limits = {name: ps.limits for name, ps in settings.providers.items()}
    dispatcher = Dispatcher(
        Store(pool),
        providers,
        settings.dispatcher,
        worker_id=worker_id(),
        call_timeouts=timeouts,
        limits=limits,
        margins=settings.margins,
    )
    probe = DatabaseProbe(dsn, on_new_server=dispatcher.server_changed)
    health = Health(dispatcher, probe)
    # Before the pool opens: a port in use must end the run, not leave it half started.
    http = _listen(metrics_addr, health) if metrics_addr else None
    if http is False:
        await _close(providers)
        return EXIT_MISCONFIGURED
    await pool.open(wait=False)  # once started, an unreachable database is retried, not fatal
    helpers = [
        asyncio.create_task(_tick(health), name="outbox-tick"),
        asyncio.create_task(probe.run_forever(), name="outbox-readiness"),
    ]
    listen_url = _wakeup_url(dsn, settings)
    if listen_url is not None:
        listen = wakeup.listen_forever(
            listen_url,
            dispatcher.wake,
            expect_direct=database.transaction_pooling,
            on_listening=_listening_flag(dispatcher),
        )
        helpers.append(asyncio.create_task(listen, name="outbox-listen"))
    refused = asyncio.Event()
    if checked is None and not database.transaction_pooling:
        guard = _check_pool_mode_later(dsn, dispatcher, refused)
        helpers.append(asyncio.create_task(guard, name="outbox-pool-mode"))
    # When each provider's key window closes after the first send: the dispatcher's own rules,
    # so the gauges and the dispatch agree for a plug-in with a key_retention of its own.
    windows = dispatcher.rules.closes_after()
    refresh = gauges.refresh_forever(pool, windows, settings.dispatcher.gauge_interval)
    helpers.append(asyncio.create_task(refresh, name="outbox-gauges"))
    if settings.dispatcher.auto_reconcile:
        checker = Reconciler(pool, providers, limits=limits)
        interval = settings.dispatcher.reconcile_interval
        helpers.append(asyncio.create_task(checker.run_forever(interval), name="outbox-reconcile"))
    _install_signal_handlers(dispatcher, health)
    log.info(
        "outbox run started",
        providers=sorted(providers),
        concurrency=settings.dispatcher.concurrency,
        pool_mode=database.pool_mode,
        wakeups="polling" if listen_url is None else "listen",
        # What actually runs, whatever was asked: a tool that imports serve() brings its own loop.
        event_loop=type(asyncio.get_running_loop()).__module__.split(".")[0],
    )
    try:
        await dispatcher.run()
    finally:
        await loops.stop_tasks(helpers)
        for provider in providers.values():
            await provider.aclose()
        await pool.close()
        if http is not None:
            http.shutdown()
            http.server_close()
    log.info("outbox run stopped")
    return EXIT_MISCONFIGURED if refused.is_set() else 0


async def _preflight(
    dsn: str, settings: Settings, providers: Mapping[str, Provider]
) -> tuple[bool, bool | None]:
    """Whether `outbox run` must not start (each reason logged, with its fix), and the result
    of the pool-mode check (None: postponed)."""
    database = settings.database
    # First: a database that never answers, or a schema that is not this outbox's, ends the
    # run now with the fix, not an error loop (outbox/daemon/startup.py). Then a provider whose live
    # system contradicts its settings (outbox/providers/lifecycle.py).
    problem = await startup.check_database(dsn, database.startup_wait)
    problem = problem or await lifecycle.start_all(providers)
    if problem is not None:
        log.error(f"outbox run cannot start: {problem}")
        return True, None
    unparsable = database.listen_url is not None and not _parses(database.listen_url)
    # Only a URL the daemon would use stops it: with listen off it is never opened.
    bad_listen_url = unparsable and database.listen
    if unparsable:  # never quoted: it may carry a password
        (log.error if bad_listen_url else log.warning)(
            "the LISTEN URL (database.listen_url) is not a valid connection string",
            used=database.listen,
        )
    # Checked before our own pool adds traffic that could hide the pooler from the check.
    checked = None
    if not (bad_listen_url or database.transaction_pooling):
        checked = await _check_pool_mode(dsn)
    return bool(bad_listen_url or checked), checked


def _listen(addr: tuple[str, int], health: Health) -> ThreadingHTTPServer | Literal[False]:
    """The HTTP listener, or False (logged with the fix) when the address is taken."""
    try:
        return start_http(addr, health)
    except OSError as exc:
        log.error(  # noqa: TRY400 (one line with the fix: the traceback would say less)
            f"outbox run cannot start: it cannot listen on {addr[0]}:{addr[1]} for /metrics "
            f"({exc.strerror or exc}): another outbox run on this host? give each its own "
            "--metrics-addr, or --metrics-addr off"
        )
        return False


async def _close(providers: Mapping[str, Provider]) -> None:
    for provider in providers.values():
        await provider.aclose()


def _listening_flag(dispatcher: Dispatcher) -> Callable[[bool], None]:
    """Keeps ``dispatcher.listening`` true exactly while notifications can reach it: only then
    does it ask producers to notify (sql/0012)."""

    def changed(listening: bool) -> None:
        dispatcher.listening = listening

    return changed


def _parses(url: str) -> bool:
    try:
        conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return False
    return True


def _wakeup_url(dsn: str, settings: Settings) -> str | None:
    """The URL to LISTEN on, or None to poll only; says at startup which it is."""
    database = settings.database
    poll_interval = format_duration(settings.dispatcher.poll_interval)
    if not database.listen:
        log.info(
            "wake-ups: polling only, since database.listen is false",
            wakeups="polling",
            poll_interval=poll_interval,
            listen_url_unused=database.listen_url is not None,
        )
        return None
    if database.listen_url is not None:
        log.info(
            "wake-ups: LISTEN on the direct listen URL, polling as a fallback",
            wakeups="listen",
            listen_connection="listen_url",
            poll_interval=poll_interval,
        )
        return database.listen_url
    if database.transaction_pooling:
        log.info(
            "wake-ups: polling only, since LISTEN cannot work through a transaction-mode "
            f"pooler; set {DEFAULT_LISTEN_URL_ENV} to a direct URL for immediate wake-ups",
            wakeups="polling",
            poll_interval=poll_interval,
        )
        return None
    log.info(
        "wake-ups: LISTEN on the database URL, polling as a fallback",
        wakeups="listen",
        listen_connection="database_url",
        poll_interval=poll_interval,
    )
    return dsn


async def _check_pool_mode(dsn: str) -> bool | None:
    """Whether the database URL leads to a transaction-mode pooler although the settings say
    session (logged as an error); None when the database did not answer in time.

    In session mode psycopg prepares statements; in server sessions shared with other clients
    those fail, or run one client's prepared statement with another's parameters.
    """
    try:
        shared = await asyncio.wait_for(shares_server_sessions(dsn), POOL_MODE_CHECK_TIMEOUT)
    except (psycopg.Error, TimeoutError) as exc:
        log.debug("pool-mode check postponed", error_class=type(exc).__name__)
        return None
    if shared:
        log.error(
            "the database URL leads to a transaction-mode pooler (two connections ran in one "
            'server session) but database.pool_mode is "session": set '
            "OUTBOX_DATABASE__POOL_MODE=transaction (see docs/pgbouncer.md); stopping"
        )
    return shared


async def _check_pool_mode_later(dsn: str, dispatcher: Dispatcher, refused: asyncio.Event) -> None:
    """The startup check, retried until the database answers; stops the daemon on a pooler."""
    while True:
        shared = await _check_pool_mode(dsn)
        if shared is not None:
            break
        await asyncio.sleep(POOL_MODE_CHECK_RETRY)
    if shared:
        refused.set()
        dispatcher.request_stop()


def _install_signal_handlers(dispatcher: Dispatcher, health: Health) -> None:
    loop = asyncio.get_running_loop()
    signals_seen = 0

    def on_signal(signum: int) -> None:
        nonlocal signals_seen
        signals_seen += 1
        if signals_seen > 1:
            # Leases of unfinished calls expire and are rescued; nothing is marked succeeded.
            log.warning("second signal: exiting now", signal=signal.Signals(signum).name)
            os._exit(1)
        log.info("draining", signal=signal.Signals(signum).name)
        sdnotify.notify(sdnotify.STOPPING)
        health.draining = True
        dispatcher.request_stop()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)


async def _tick(health: Health) -> None:
    """The event loop's heartbeat: /healthz, systemd's READY once the database answered, and
    WATCHDOG=1 from this loop, so a stalled loop is restarted."""
    watchdog = sdnotify.watchdog_interval()
    last_watchdog = 0.0
    ready_sent = False
    while True:
        health.last_tick = now = time.monotonic()
        if not ready_sent and health.dispatcher.database_ok:
            sdnotify.notify(sdnotify.READY)
            ready_sent = True
        if watchdog is not None and now - last_watchdog >= watchdog:
            sdnotify.notify(sdnotify.WATCHDOG)
            last_watchdog = now
        await asyncio.sleep(TICK)


def start_http(addr: tuple[str, int], health: Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                self._answer(
                    200, prometheus_client.generate_latest(), prometheus_client.CONTENT_TYPE_LATEST
                )
            elif self.path == "/healthz":
                self._answer(
                    200 if health.alive() else 503, b"ok\n" if health.alive() else b"stalled\n"
                )
            elif self.path == "/readyz":
                self._answer(
                    200 if health.ready() else 503, b"ready\n" if health.ready() else b"not ready\n"
                )
            else:
                self._answer(404, b"not found\n")

        def _answer(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            """Scrapes are not worth a log line each."""

    server_class = _V6Server if ":" in addr[0] else ThreadingHTTPServer
    server = server_class(addr, Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="outbox-http", daemon=True).start()
    host, port = server.server_address[:2]
    log.info("HTTP listener started", metrics_addr=f"{host!s}:{port}")
    return server


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def parse_addr(text: str) -> tuple[str, int] | None:
    """HOST:PORT or [V6]:PORT; "off" disables the listener."""
    if text.strip().lower() == "off":
        return None
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"invalid address {text!r}: write HOST:PORT, e.g. 127.0.0.1:9464")
    return host.strip("[]") or "127.0.0.1", int(port)

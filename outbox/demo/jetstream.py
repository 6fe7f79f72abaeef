"""`outbox demo --queue nats://HOST:PORT`: the outbox in front of a real NATS JetStream.

A stream of the demo's own is made with a two-minute duplicate_window; a few operations are
dispatched to it by a real dispatcher with the `nats` provider; then one operation's message is
published again with its stored key, as a dispatcher killed before its record would, and the
stream answers that it is a duplicate, with the original's sequence. The stream is deleted at the
end. Needs the nats extra (nats-py) and a NATS server with JetStream: :func:`check` says, before
the demo starts anything, which of them is missing (issue 38: with nothing listening the demo
ran its whole first part, then retried the connection for ever).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import DispatcherSettings, ProviderSettings
from outbox.daemon import service as daemon
from outbox.db import statements
from outbox.db.store import Store
from outbox.dispatch.dispatcher import Dispatcher
from outbox.observability import redaction
from outbox.oncall.text_tables import render_table
from outbox.providers.base import Provider, SendRequest, Succeeded
from outbox.providers.lifecycle import start_all
from outbox.providers.registry import build_providers

Say = Callable[[str], None]

PROVIDER: Final = "orders"
ACTION: Final = "order.placed"
WINDOW: Final = timedelta(minutes=2)
DEADLINE: Final = 30.0
ORDERS: Final = 5
# How long the check before the demo gives the server to answer, JetStream included.
CHECK_WITHIN: Final = 5.0


def _provider_settings(url: str, stream: str, subject: str) -> ProviderSettings:
    return ProviderSettings(
        PROVIDER,
        "nats",
        key_retention=WINDOW,
        retention_margin=timedelta(seconds=30),
        timeout=timedelta(seconds=5),
        options={"servers": [url], "actions": {ACTION: {"subject": subject, "stream": stream}}},
    )


async def check(url: str) -> str | None:
    """None when the NATS client is installed and a NATS server with JetStream answers at
    ``url`` within :data:`CHECK_WITHIN` seconds; otherwise why not, in one line with the fix."""
    shown = redaction.scrub(url)
    try:
        nats = _client_library()
    except RuntimeError as exc:
        return str(exc)
    try:
        client = await asyncio.wait_for(_connect(nats, url), CHECK_WITHIN)
    except Exception as exc:  # noqa: BLE001 (whatever stops the connection is the answer)
        return (
            f"outbox demo --queue: no NATS server answers at {shown} ({_why(exc)}): start one "
            "with JetStream (nats-server -js), or leave out --queue"
        )
    try:
        await asyncio.wait_for(client.jetstream(timeout=CHECK_WITHIN).account_info(), CHECK_WITHIN)
    except Exception as exc:  # noqa: BLE001 (no JetStream answers, whatever the error)
        return (
            f"outbox demo --queue: the NATS server at {shown} answers, but not its JetStream "
            f"({_why(exc, detail=False)}): start it with -js, or leave out --queue"
        )
    finally:
        with contextlib.suppress(Exception):
            await client.close()
    return None


async def _connect(nats: Any, url: str) -> Any:
    """A connection tried twice at once at most, never again (nats-py's max_reconnect_attempts=0
    means for ever, and its reconnect_time_wait 2 s between tries), its errors this module's to
    say, not tracebacks in nats-py's log. A failure raises the first error a try met: nats-py's
    own is only "no servers available"."""
    met: list[Exception] = []

    async def keep(exc: Exception) -> None:
        met.append(exc)

    client = nats.NATS()
    try:
        await client.connect(
            url,
            connect_timeout=3,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            error_cb=keep,
        )
    except Exception as exc:  # noqa: BLE001 (raised again, as the first error met)
        with contextlib.suppress(Exception):  # a refused connection's socket may stay open
            await client.close()
        raise (met[0] if met else exc) from None
    return client


def _why(exc: BaseException, *, detail: bool = True) -> str:
    """The error in a few words: its type, and its message's first line unless nats-py's
    JetStream errors would only repeat the type."""
    if isinstance(exc, TimeoutError):
        return f"no answer within {CHECK_WITHIN:g} s"
    if not detail:
        return type(exc).__name__
    text = redaction.scrub(str(exc).strip().splitlines()[0]) if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def run(dsn: str, url: str, settings: DispatcherSettings, say: Say) -> None:
    """Dispatch the demo's orders to a stream of its own at ``url``, show the repeat recognised,
    and delete the stream."""
    nats = _client_library()
    suffix = uuid.uuid4().hex[:8]
    stream, subject = f"OUTBOX_DEMO_{suffix.upper()}", f"outbox.demo.{suffix}.orders"
    try:
        client = await asyncio.wait_for(_connect(nats, url), CHECK_WITHIN)
    except Exception as exc:  # noqa: BLE001 (any failure to connect ends this part alone)
        say(f"queue: no NATS server answers at {redaction.scrub(url)} ({_why(exc)}): skipped")
        return
    try:
        js = client.jetstream()
        await js.add_stream(name=stream, subjects=[subject], duplicate_window=WINDOW.seconds)
        say(f"queue: stream {stream} on {url}, duplicate_window {WINDOW.seconds // 60} minutes")
        await _dispatch(dsn, _provider_settings(url, stream, subject), settings, say)
        info = await js.stream_info(stream)
        say(f"queue: the stream holds {info.state.messages} messages for {ORDERS} orders")
        await js.delete_stream(stream)
    finally:
        await client.close()


async def _dispatch(
    dsn: str, target: ProviderSettings, settings: DispatcherSettings, say: Say
) -> None:
    tenant = f"demo-queue-{uuid.uuid4().hex[:6]}"
    keys = _enqueue(dsn, tenant)
    providers = build_providers({PROVIDER: target})
    problem = await start_all(providers)
    if problem is not None:
        say(f"queue: the provider refused to start: {problem}")
        return
    async with AsyncConnectionPool(dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as p:
        dispatcher = Dispatcher(
            Store(p),
            providers,
            settings,
            worker_id=daemon.worker_id(),
            margins={PROVIDER: timedelta(seconds=30)},
        )
        running = asyncio.create_task(dispatcher.run())
        try:
            await _until_settled(dsn, tenant)
        finally:
            dispatcher.request_stop()
            await running
    rows = _report(dsn, tenant)
    say(render_table(["id", "order", "status", "attempts", "reference"], rows))
    await _repeat(dsn, providers[PROVIDER], tenant=tenant, keys=keys, rows=rows, say=say)
    for provider in providers.values():
        await provider.aclose()


def _enqueue(dsn: str, tenant: str) -> dict[int, str]:
    keys: dict[int, str] = {}
    with psycopg.connect(dsn) as conn:
        for n in range(1, ORDERS + 1):
            result = outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="demo.order",
                operation_key=f"order-{n}",
                provider=PROVIDER,
                action=ACTION,
                payload={"order": n, "amount": 1250 * n, "currency": "eur"},
            )
            op = outbox.get_operation(conn, tenant, "demo.order", f"order-{n}")
            assert op is not None  # noqa: S101 (just enqueued)
            keys[result.operation_id] = op.idempotency_key
    return keys


async def _until_settled(dsn: str, tenant: str) -> None:
    deadline = time.monotonic() + DEADLINE
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            cur = await conn.execute(statements.DEMO_COUNTS, {"tenant": tenant})
            counts: dict[str, int] = dict(await cur.fetchall())
            if not counts.get("pending") and not counts.get("in_flight"):
                return
            await asyncio.sleep(0.2)


def _report(dsn: str, tenant: str) -> list[tuple[Any, ...]]:
    """Per order: id, key, status, attempts, and the reference or the reason."""
    with psycopg.connect(dsn) as conn:
        found = conn.execute(statements.DEMO_REPORT, {"tenant": tenant}).fetchall()
    return [(r[0], r[1], r[3], r[4], r[5] or r[6]) for r in found]


async def _repeat(
    dsn: str,
    provider: Provider,
    *,
    tenant: str,
    keys: dict[int, str],
    rows: list[tuple[Any, ...]],
    say: Say,
) -> None:
    """Publish the first order's message again with its stored key, as a dispatcher killed
    between the publish and its record would after its lease: the stream recognises it."""
    op_id, key, _, _, reference = rows[0]
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        cur = await conn.execute(statements.DEMO_PAYLOAD, {"id": op_id})
        (stored,) = await cur.fetchone() or (None,)
    again = await provider.send(
        SendRequest(
            operation_id=op_id,
            tenant_id=tenant,
            operation_type="demo.order",
            operation_key=key,
            action=ACTION,
            payload={"order": 1, "amount": 1250, "currency": "eur"},
            payload_json=stored,
            idempotency_key=keys[op_id],
            correlation_id=None,
            attempt=2,
        )
    )
    if isinstance(again, Succeeded):
        said = "the same message" if again.reference == reference else "a new message"
        say(
            f"queue: {key} published again with its key, as after a crash: the stream answered "
            f"{again.reference} ({said})"
        )
    else:
        say(f"queue: {key} published again: {again.error_class}: {again.message}")


def _client_library() -> Any:
    try:
        import nats  # noqa: PLC0415 (the nats extra)
    except ImportError:
        raise RuntimeError(
            "outbox demo --queue needs the NATS client (nats-py, the nats extra), which is not "
            "installed: pip install 'outbox[nats]'"
        ) from None
    return nats

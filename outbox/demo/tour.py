"""`outbox demo`: the whole product in under a minute, on loopback.

It starts an embedded PostgreSQL (unless given --dsn), migrates it, starts the fake Stripe and the
fake webhook receiver, enqueues a realistic mix of operations with faults planted in some of
them, runs a real dispatcher with its metrics endpoint, lets the reconciler resolve what it can,
and prints what happened to each operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.config.settings import DispatcherSettings, ProviderSettings
from outbox.daemon import service as daemon
from outbox.db import migrations, statements
from outbox.db.store import Store
from outbox.demo import jetstream as demo_queue
from outbox.dispatch.dispatcher import Dispatcher
from outbox.oncall import operators
from outbox.oncall.reconciler import Reconciler
from outbox.oncall.text_tables import render_table
from outbox.providers.registry import build_providers
from outbox.testing import FakeStripe, FakeWebhookReceiver, StripeFault, WebhookFault

DEMO_STRIPE_KEY: Final = "sk_test_outbox_demo"
DEMO_PREFIX: Final = "outbox-demo-"  # the embedded database's directory; `--stop` wants it
_KEY_VARIABLE: Final = "OUTBOX_DEMO_STRIPE_KEY"
# Short enough to watch: retries in a fraction of a second, and a Stripe key window that closes
# two seconds after a send (real Stripe: 24 hours), so the timeout below goes to reconciliation.
_SETTINGS: Final = DispatcherSettings(
    concurrency=16,
    batch_size=20,
    lease=timedelta(seconds=10),
    poll_interval=timedelta(milliseconds=200),
    backoff_base=timedelta(milliseconds=200),
    backoff_max=timedelta(seconds=1),
    retention_margin=timedelta(seconds=1),
    max_attempts=5,
    shutdown_grace=timedelta(seconds=5),
    auto_reconcile=False,
)
DEADLINE: Final = 45.0

Say = Callable[[str], None]


@dataclass(frozen=True)
class Planned:
    """One operation of the demo and what should become of it."""

    key: str
    provider: str
    action: str
    payload: dict[str, Any]
    story: str


def _charge(n: int, amount: int) -> dict[str, Any]:
    """A PaymentIntent confirmed at its create with Stripe's test card: a charge, ``succeeded``
    when it went through (one never confirmed would only await a payment method)."""
    return {
        "amount": amount,
        "currency": "usd",
        "customer": f"cus_{n:03d}",
        "payment_method": "pm_card_visa",
        "payment_method_types": ["card"],
        "confirm": True,
    }


def plan() -> list[Planned]:
    charges = [
        Planned(
            f"invoice-{n}-charge",
            "stripe",
            "payment_intents.create",
            _charge(n, 1000 * n),
            "charged once",
        )
        for n in range(1, 5)
    ]
    events = [
        Planned(f"invoice-{n}-paid", "billing", "invoice.paid", {"invoice": n}, "delivered")
        for n in range(1, 5)
    ]
    return [
        *charges,
        *events,
        Planned(
            "invoice-5-paid",
            "billing",
            "invoice.paid",
            {"invoice": 5},
            "rate limited twice (429), then delivered",
        ),
        Planned(
            "invoice-6-charge",
            "stripe",
            "payment_intents.create",
            _charge(6, 600),
            "card declined (402): quarantined for a person",
        ),
        Planned(
            "invoice-7-charge",
            "stripe",
            "payment_intents.create",
            _charge(7, 700),
            "timed out after Stripe acted: reconciled, not resent",
        ),
    ]


async def run(dsn: str | None, *, keep: bool, say: Say, queue: str | None = None) -> int:
    """The demo; returns the exit code. ``queue``: a NATS server's URL, to show the outbox in
    front of a real JetStream too (outbox.demo.jetstream)."""
    with contextlib.ExitStack() as stack:
        kept: str | None = None
        if dsn is None:
            dsn, directory = stack.enter_context(_embedded_postgres(keep, say))
            kept = directory if keep else None
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrations.migrate(conn)
        stripe_fake = stack.enter_context(FakeStripe(api_key=DEMO_STRIPE_KEY))
        receiver = stack.enter_context(FakeWebhookReceiver())
        tenant = f"demo-{uuid.uuid4().hex[:6]}"
        ids = _enqueue(dsn, tenant, plan(), stripe_fake, receiver)
        say(
            f"enqueued {len(ids)} operations for tenant {tenant} "
            f"(fake Stripe at {stripe_fake.url}, fake webhook at {receiver.url})"
        )
        await _dispatch_and_reconcile(dsn, stripe_fake, receiver, tenant, say)
        _report(dsn, tenant, stripe_fake=stripe_fake, receiver=receiver, say=say)
        if queue is not None:
            say("")
            await demo_queue.run(dsn, queue, _SETTINGS, say)
        _next_steps(dsn, kept, say)
    return 0


def _enqueue(
    dsn: str,
    tenant: str,
    planned: list[Planned],
    stripe_fake: FakeStripe,
    receiver: FakeWebhookReceiver,
) -> dict[str, int]:
    ids: dict[str, int] = {}
    with psycopg.connect(dsn) as conn:
        for p in planned:
            result = outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="demo",
                operation_key=p.key,
                provider=p.provider,
                action=p.action,
                payload=p.payload,
                correlation_id=f"req-{p.key}",
            )
            ids[p.key] = result.operation_id
        conn.commit()
        keys = {p.key: _key(conn, tenant, p.key) for p in planned}
    receiver.inject(WebhookFault.status(429, retry_after=0), key=keys["invoice-5-paid"], times=2)
    stripe_fake.inject(
        StripeFault.status(402, error_type="card_error", code_str="card_declined"),
        key=keys["invoice-6-charge"],
    )
    stripe_fake.inject(StripeFault.delay_after_apply(1.5), key=keys["invoice-7-charge"])
    return ids


def _key(conn: psycopg.Connection[Any], tenant: str, key: str) -> str:
    op = outbox.get_operation(conn, tenant, "demo", key)
    assert op is not None  # noqa: S101 (just enqueued)
    return op.idempotency_key


async def _dispatch_and_reconcile(
    dsn: str, stripe_fake: FakeStripe, receiver: FakeWebhookReceiver, tenant: str, say: Say
) -> None:
    providers = build_providers(
        {
            "stripe": ProviderSettings(
                "stripe",
                "stripe",
                key_retention=timedelta(seconds=2),
                timeout=timedelta(seconds=1),
                options={"api_key_env": _KEY_VARIABLE, "api_base": stripe_fake.url},
            ),
            "billing": ProviderSettings("billing", "webhook", options={"url": receiver.url}),
        },
        environ={_KEY_VARIABLE: DEMO_STRIPE_KEY},
    )
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=4, kwargs={"autocommit": True}
    ) as pool:
        dispatcher = Dispatcher(Store(pool), providers, _SETTINGS, worker_id=daemon.worker_id())
        http = daemon.start_http(("127.0.0.1", 0), daemon.Health(dispatcher))
        host, port = http.server_address[:2]
        say(f"dispatching; metrics at http://{host!s}:{port}/metrics")
        running = asyncio.create_task(dispatcher.run())
        try:
            await _watch(dsn, tenant, say)
        finally:
            dispatcher.request_stop()
            await running
            http.shutdown()
            http.server_close()
        found = await Reconciler(pool, providers, actor="outbox demo").run_once(
            recheck_after=timedelta(0)
        )
        say(f"reconciler: checked {found} operation(s) at Stripe")
    for provider in providers.values():
        await provider.aclose()


async def _watch(dsn: str, tenant: str, say: Say) -> None:
    """Print the counts per status until nothing is pending or in flight."""
    deadline = time.monotonic() + DEADLINE
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            cur = await conn.execute(statements.DEMO_COUNTS, {"tenant": tenant})
            counts: dict[str, int] = dict(await cur.fetchall())
            say("  " + "  ".join(f"{s} {n}" for s, n in counts.items()))
            if not counts.get("pending") and not counts.get("in_flight"):
                return
            await asyncio.sleep(0.5)


def _report(
    dsn: str, tenant: str, *, stripe_fake: FakeStripe, receiver: FakeWebhookReceiver, say: Say
) -> None:
    stories = {p.key: p.story for p in plan()}
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(statements.DEMO_REPORT, {"tenant": tenant}).fetchall()
        checked = [op for op in (operators.show(conn, r[0]) for r in rows) if op["check_finding"]]
    headers = ["id", "operation", "provider", "status", "attempts", "reference", "story"]
    say("")
    say(render_table(headers, [(*r[:5], r[5] or r[6], stories[r[1]]) for r in rows]))
    charges = sum(p.provider == "stripe" for p in plan())
    events = sum(p.provider == "billing" for p in plan())
    say("")
    say(
        f"effects at the providers: {stripe_fake.object_count()} Stripe objects for {charges} "
        f"charges, {receiver.effect_count()} webhook deliveries for {events} events"
    )
    for op in checked:  # what the reconciler judged by the object's state (docs/runbook.md)
        say(
            f"reconciled {op['operation_key']}: the check {op['check_finding']} its object at "
            f"{op['provider']} in state {op['check_state']}, so the operation is {op['status']} "
            f"after {op['attempts']} attempt(s), never sent again"
        )


def _next_steps(dsn: str, kept: str | None, say: Say) -> None:
    say("")
    if kept is not None:
        say("the database is still running; look deeper with:")
        say(f"  export OUTBOX_DATABASE_URL='{dsn}'")
        say("  outbox status; outbox quarantine list; outbox reconcile show <id>")
        say(f"  outbox web --config {_console_config(kept)}   # the console, in a browser")
        say("then stop it and delete its directory with:")
        say(f"  outbox demo --stop {kept}")
    else:
        say(
            "look deeper next time with `outbox demo --keep`, then `outbox quarantine list`, "
            "`outbox quarantine show <id>`, `outbox status`"
        )


def _console_config(kept: str) -> Path:
    """A config file for `outbox web` beside the kept database: the demo's providers were test
    servers of this process, gone with it, so it configures none (no key window to show)."""
    path = Path(kept) / "outbox.toml"
    path.write_text(
        "# Written by `outbox demo --keep` for `outbox web --config` (docs/console.md).\n"
        "# The demo's providers ended with it: none is configured here.\n"
        "[web]\nread_only = false\n"
    )
    return path


def stop(directory: Path) -> None:
    """Stop an embedded PostgreSQL that `demo --keep` left running, and delete its directory.

    Only a directory the demo made (its name, a PostgreSQL data directory inside): a mistyped
    path must never delete someone's real database."""
    if not (directory.name.startswith(DEMO_PREFIX) and (directory / "PG_VERSION").is_file()):
        raise ValueError(
            f"{directory} is not a directory `outbox demo --keep` left (those "
            f"are named {DEMO_PREFIX}... and hold a PostgreSQL data "
            "directory)"
        )
    pgserver = _pgserver()
    pgserver.get_server(directory, cleanup_mode="delete").cleanup()


def _pgserver() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # platformdirs' note about XDG_RUNTIME_DIR
            import pgserver  # noqa: PLC0415 (the demo extra)
    except ImportError:
        raise RuntimeError(
            "outbox demo needs an embedded PostgreSQL: pip install 'outbox[demo]', or pass --dsn"
        ) from None
    return pgserver


@contextlib.contextmanager
def _embedded_postgres(keep: bool, say: Say) -> Iterator[tuple[str, str]]:
    pgserver = _pgserver()
    directory = tempfile.mkdtemp(prefix=DEMO_PREFIX)
    say(f"starting an embedded PostgreSQL in {directory}")
    server = pgserver.get_server(directory, cleanup_mode=None if keep else "delete")
    try:
        yield str(server.get_uri()), directory
    finally:
        if not keep:
            server.cleanup()

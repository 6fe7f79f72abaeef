"""The whole chain, with kills (issue 40): an application enqueues ``invoice.generate`` with its
business write, a real `outbox run` sends it with the http provider (or its webhook preset), and
examples/invoice-worker records it through the inbox. The dispatcher and the worker are
SIGKILLed at seeded moments and started again. The end state is counted in rows: every
operation succeeded, exactly one invoice and one inbox record per operation, none lost, none
doubled. The seed is printed on failure.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import psycopg
import pytest

import outbox
from tests.support import tasks_emulator
from tests.support.daemon import OutboxProcess, wait_until, write_config
from tests.support.invoice_worker import InvoiceWorker, count
from tests.support.queues import FAST_RUN, wait_settled

OPERATIONS = 200
TENANTS = ("acme", "globex", "initech")


def enqueue_with_orders(db_url: str, rng: random.Random, operations: int = OPERATIONS) -> None:
    """Each operation in the transaction of its order, as an application records both."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, tenant_id text, amount bigint)")
    with psycopg.connect(db_url) as conn:
        for i in range(operations):
            tenant, amount = rng.choice(TENANTS), rng.randrange(1, 10**9)
            conn.execute("INSERT INTO orders VALUES (%s, %s, %s)", (i, tenant, amount))
            outbox.enqueue(
                conn,
                tenant_id=tenant,
                operation_type="invoice.generate",
                operation_key=f"order-{i}",
                provider="invoices",
                action="invoice.generate",
                payload={"account_id": f"acct-{i}", "amount": amount, "currency": "EUR"},
            )
            conn.commit()


@pytest.mark.slow
def test_a_seeded_chain_with_kills_loses_and_doubles_no_invoice(
    db_url: str, tmp_path: Path
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    said = f"seed {seed}"
    enqueue_with_orders(db_url, rng)
    delay = rng.choice([20, 60, 150])
    worker = InvoiceWorker(db_url, tmp_path / "worker.log", workers=2, delay_ms=delay).start()
    # The README's `http` provider with outbox's headers, or the webhook preset: both send the
    # operation's identity, so either chain needs no configuration at the worker.
    hook: dict[str, object] = {"timeout": "2s", "breaker_open_for": "500ms"}
    if rng.random() < 0.5:
        hook.update(type="webhook", url=f"{worker.url}/invoices")
    else:
        hook.update(type="http", base_url=worker.url, outbox_headers=True)
        hook["actions"] = {"invoice.generate": {"path": "/invoices"}}
    said += f", {hook['type']} provider"
    config = write_config(tmp_path / "outbox.toml", providers={"invoices": hook}, **FAST_RUN)
    run = OutboxProcess(db_url, config, tmp_path / "run.log")
    try:
        for _ in range(4):
            time.sleep(rng.uniform(0.15, 0.6))
            if rng.random() < 0.5:
                worker.kill()
                time.sleep(rng.uniform(0, 0.5))
                worker = InvoiceWorker(
                    db_url, tmp_path / "worker.log", workers=2, delay_ms=delay, port=worker.port
                ).start()
            else:
                run.stop()
                time.sleep(rng.uniform(0, 0.5))
                run = OutboxProcess(db_url, config, tmp_path / "run.log")
        settled = wait_settled(db_url, OPERATIONS, timeout=120, process=run)
    finally:
        run.stop()
        worker.kill()
    assert settled.get("succeeded") == OPERATIONS, (said, settled)
    assert count(db_url, "SELECT count(*) FROM invoices") == OPERATIONS, said
    # Known by the sending database and the operation, each record keeps the fingerprint that
    # enqueue stored: the worker checked the body it got against it.
    per_operation = count(
        db_url,
        "SELECT count(*) FROM outbox.operations o JOIN outbox.inbox i"
        " ON i.key = 'op:' || o.id AND i.origin = outbox.origin() AND i.tenant_id = o.tenant_id"
        " AND i.state = 'completed' AND i.fingerprint = o.fingerprint",
    )
    assert per_operation == OPERATIONS, said
    # Each invoice is its order's: same tenant, same amount, one each.
    matched = count(
        db_url,
        "SELECT count(DISTINCT o.id) FROM orders o JOIN invoices v"
        " ON v.account_id = 'acct-' || o.id AND v.tenant_id = o.tenant_id"
        " AND v.amount = o.amount",
    )
    assert matched == OPERATIONS, said


@pytest.mark.slow
def test_the_chain_through_cloud_tasks_makes_one_invoice_per_operation(
    db_url: str, tmp_path: Path
) -> None:
    """outbox run → the Cloud Tasks emulator → the worker as an HTTP target (its Cloud Tasks
    answers), the worker SIGKILLed once while the emulator dispatches: one invoice each."""
    if not tasks_emulator.available():
        pytest.skip("gcloud-tasks-emulator is not installed")
    count_ops = 20
    enqueue_with_orders(db_url, random.Random(7), count_ops)
    worker = InvoiceWorker(
        db_url, tmp_path / "worker.log", delay_ms=300, transport="cloudtasks"
    ).start()
    emulator = tasks_emulator.TasksEmulator(["invoices"], tmp_path / "emulator.log").start()
    provider = {
        "type": "cloudtasks",
        "project": tasks_emulator.PROJECT,
        "location": tasks_emulator.LOCATION,
        "endpoint": emulator.endpoint,
        "key_retention": "1h",
        "retention_margin": "10m",
        "timeout": "5s",
        "actions": {"*": {"queue": "invoices", "url": f"{worker.url}/invoices"}},
    }
    config = write_config(tmp_path / "outbox.toml", providers={"invoices": provider}, **FAST_RUN)
    run = OutboxProcess(db_url, config, tmp_path / "run.log")
    try:
        wait_settled(db_url, count_ops, timeout=60, process=run)
        time.sleep(0.3)
        worker.kill()
        time.sleep(0.5)
        worker = InvoiceWorker(
            db_url, tmp_path / "worker.log", delay_ms=300, transport="cloudtasks", port=worker.port
        ).start()

        def invoiced() -> bool:
            return count(db_url, "SELECT count(*) FROM invoices") >= count_ops

        wait_until(invoiced, timeout=90, what=f"{count_ops} invoices")
        time.sleep(1.0)  # a duplicate dispatch would have arrived by now
    finally:
        run.stop()
        worker.kill()
        emulator.kill()
    assert count(db_url, "SELECT count(*) FROM invoices") == count_ops
    assert count(db_url, "SELECT count(*) FROM outbox.inbox WHERE state = 'completed'") == count_ops

"""Traces, with the OpenTelemetry SDK's in-memory exporter: the dispatch span is linked to the
trace that enqueued the operation. Without the extra, nothing breaks and nothing is imported."""

from __future__ import annotations

import subprocess
import sys
from datetime import timedelta
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg_pool import AsyncConnectionPool

import outbox
from outbox.providers.noop import NoopProvider
from tests.support.dispatch import dispatcher, rows
from tests.support.spans import spans

__all__ = ["spans"]  # the fixture, used by name


async def test_the_dispatch_span_links_to_the_enqueue_trace(
    db_url: str, pool: AsyncConnectionPool[Any], spans: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("the-application")
    with (
        tracer.start_as_current_span("POST /invoices/42/charge") as request_span,
        psycopg.connect(db_url) as conn,
    ):
        result = outbox.enqueue(
            conn,
            tenant_id="acme",
            operation_type="invoice.charge",
            operation_key="inv-42",
            provider="fast",
            action="charge",
            payload={"amount": 1},
        )
    origin = request_span.get_span_context()
    ((stored,),) = rows(db_url, "SELECT traceparent FROM outbox.operations")
    assert stored.startswith(f"00-{origin.trace_id:032x}-{origin.span_id:016x}-")

    fast = NoopProvider("fast", timedelta(hours=24))
    assert await dispatcher(pool, {"fast": fast}).run_once() == 1
    (span,) = [s for s in spans.get_finished_spans() if s.name == "outbox.dispatch"]
    assert [link.context.span_id for link in span.links] == [origin.span_id]
    assert span.context.trace_id != origin.trace_id  # linked, not parented
    assert dict(span.attributes or {}) == {
        "outbox.operation_id": result.operation_id,
        "outbox.attempt": 1,
        "outbox.provider": "fast",
        "outbox.action": "charge",
        "outbox.tenant_id": "acme",
        "outbox.outcome": "succeeded",
    }


def test_without_the_extra_nothing_breaks_and_nothing_is_imported() -> None:
    script = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "opentelemetry":
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, Hide())
import outbox, outbox.dispatch.dispatcher, outbox.daemon.service
from outbox.observability import tracing
assert not tracing.AVAILABLE
assert tracing.current_traceparent() is None
with tracing.attempt_span("00-" + "1" * 32 + "-" + "2" * 16 + "-01", {}) as span:
    assert span is None
assert not [m for m in sys.modules if m.startswith("opentelemetry")]
print("ok")
"""
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"

"""OpenTelemetry, when the `otel` extra is installed: enqueue stores the caller's traceparent,
and the dispatcher starts a span per attempt linked to it. Without the extra, every function
here does nothing and OpenTelemetry is never imported."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any, Final

TRACER_NAME: Final = "outbox"


def _available() -> bool:
    try:
        return importlib.util.find_spec("opentelemetry.trace") is not None
    except (ImportError, ValueError):
        return False


AVAILABLE: Final = _available()


def current_traceparent() -> str | None:
    """The W3C traceparent of the caller's current span, if there is one."""
    if not AVAILABLE:
        return None
    from opentelemetry import propagate  # noqa: PLC0415 (only with the extra)

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


@contextlib.contextmanager
def attempt_span(traceparent: str | None, attributes: dict[str, Any]) -> Iterator[Any]:
    """A span for one attempt, linked to the enqueue's trace; yields it (None without the
    extra) so the caller can add the outcome."""
    if not AVAILABLE:
        yield None
        return
    from opentelemetry import propagate, trace  # noqa: PLC0415

    if isinstance(
        trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider
    ):
        # No SDK configured: every span would be a no-op, and building one per attempt costs
        # more than the rest of a no-op dispatch.
        yield None
        return
    links = []
    if traceparent:
        parent = trace.get_current_span(propagate.extract({"traceparent": traceparent}))
        if parent.get_span_context().is_valid:
            links.append(trace.Link(parent.get_span_context()))
    tracer = trace.get_tracer(TRACER_NAME)
    # A new trace per attempt, linked rather than parented: attempts happen long after the
    # request that enqueued, and a retry storm must not grow one trace without bound.
    with tracer.start_as_current_span("outbox.dispatch", links=links, attributes=attributes,
                                      kind=trace.SpanKind.CLIENT) as span:  # fmt: skip
        yield span

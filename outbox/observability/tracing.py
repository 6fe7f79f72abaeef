"""OpenTelemetry, when the `otel` extra is installed: enqueue stores the caller's traceparent,
and the dispatcher starts a span per attempt linked to it. Without the extra, every function
here does nothing and OpenTelemetry is never imported."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator
from typing import Any, Final

TRACER_NAME: Final = "outbox"
# While no SDK is configured, ask OpenTelemetry again this often (seconds): the question reads
# the environment each time, which costs more than the rest of a no-op dispatch.
RECHECK_INTERVAL: Final = 1.0


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
    from opentelemetry import propagate, trace  # noqa: PLC0415 (only with the extra)

    if not trace.get_current_span().get_span_context().is_valid:
        # No trace to continue: the propagators would find nothing, at ~14 us an enqueue.
        return None
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def _sdk_configured() -> bool:
    from opentelemetry import trace  # noqa: PLC0415 (only with the extra)

    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


class Spans:
    """Whether an attempt is worth a span: only with an SDK configured. Once one is, it stays
    (OpenTelemetry sets the global provider once); until then the answer is reused for
    RECHECK_INTERVAL, so an SDK configured later is picked up within that."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._on = False
        self._off_until = float("-inf")

    def active(self) -> bool:
        if self._on or not AVAILABLE:
            return self._on
        now = self._clock()
        if now < self._off_until:
            return False
        self._on = _sdk_configured()
        if not self._on:
            self._off_until = now + RECHECK_INTERVAL
        return self._on


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
    with tracer.start_as_current_span(
        "outbox.dispatch", links=links, attributes=attributes, kind=trace.SpanKind.CLIENT
    ) as span:
        yield span

"""OpenTelemetry, when the `otel` extra is installed: enqueue stores the caller's traceparent,
and the dispatcher starts a span per attempt linked to it; the inbox starts a span per delivery
linked to the traceparent the delivery carries. Without the extra, every function here does
nothing and OpenTelemetry is never imported."""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

TRACER_NAME: Final = "outbox"
# What a delivery's span may carry of it: OpenTelemetry's attribute values.
Attributes = Mapping[str, str | int]
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


class DeliverySpans:
    """The spans of one inbox adapter (a middleware, a queue consumer): one per delivery, named
    ``inbox <handler>``, made only while an SDK is configured (Spans). The tracer is fetched
    once, here: until an SDK is configured it is OpenTelemetry's proxy, which then hands over to
    the SDK's, so an SDK configured after the worker started is still used."""

    def __init__(self) -> None:
        self._spans = Spans()
        self._tracer: Any = None
        if AVAILABLE:
            from opentelemetry import trace  # noqa: PLC0415 (only with the extra)

            self._tracer = trace.get_tracer(TRACER_NAME)

    @contextlib.contextmanager
    def delivery(self, handler: str, headers: Mapping[str, str]) -> Iterator[Any]:
        """The current span while a delivery is decided and handled (the handler's own spans
        are its children); yields it, or None without the extra or an SDK.

        Linked to the sender's span, never its child: the sender's trace is another unit of
        work (OpenTelemetry's messaging conventions for consumers), and every redelivery would
        grow it. Its parent is whatever span is current (an HTTP server's), often none.
        Exceptions are not recorded, since their text may quote the payload: a raise marks
        the span failed with its class (``error.type``) and nothing else."""
        if self._tracer is None or not self._spans.active():
            yield None
            return
        from opentelemetry import trace  # noqa: PLC0415 (only with the extra)

        with self._tracer.start_as_current_span(
            f"inbox {handler}",
            kind=trace.SpanKind.CONSUMER,
            links=sender_links(headers),
            attributes={"outbox.inbox.handler": handler},
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except BaseException as exc:
                failed(span, type(exc).__name__)
                raise


def sender_links(headers: Mapping[str, str]) -> list[Any]:
    """A link to the sender's span, read from the W3C ``traceparent`` (and ``tracestate``) of a
    delivery's headers (lower-case names); none when it has none or a malformed one. W3C's
    propagator, not the configured one: outbox's queue providers send ``traceparent``
    whatever propagators the worker itself configured."""
    traceparent = headers.get("traceparent")
    if not AVAILABLE or not traceparent:
        return []
    from opentelemetry import trace  # noqa: PLC0415 (only with the extra)
    from opentelemetry.trace.propagation.tracecontext import (  # noqa: PLC0415
        TraceContextTextMapPropagator,
    )

    carrier = {"traceparent": traceparent}
    if (tracestate := headers.get("tracestate")) is not None:
        carrier["tracestate"] = tracestate
    context = TraceContextTextMapPropagator().extract(carrier)
    sender = trace.get_current_span(context).get_span_context()
    return [trace.Link(sender)] if sender.is_valid else []


def annotate(span: Any, attributes: Attributes) -> None:
    """Add ``attributes`` to ``span`` (None: nothing to do)."""
    if span is not None:
        span.set_attributes(attributes)


def failed(span: Any, error_type: str) -> None:
    """Mark ``span`` failed: ``error.type`` (a class name, a status: few distinct values) and
    the status ERROR with no description, which could quote the payload."""
    if span is None:
        return
    from opentelemetry.trace import StatusCode  # noqa: PLC0415 (only with the extra)

    span.set_attribute("error.type", error_type)
    span.set_status(StatusCode.ERROR)

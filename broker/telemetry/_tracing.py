"""Tracing, metrics and log correlation (docs/design.md section 9).

Tracing: one span per room per broker (``kvbroker.room``) with child spans
for the handshake, the waits, each posted transfer, staging gather and
scatter, aux, each state component, completion, abort and cleanup. The gRPC
instrumentation makes the RPC spans and carries the W3C trace context from
engines into their broker and from broker to peer broker, so both sides of a
room land in one trace: the receiver's room span is a child of the engine's
ExpectRoom call, the sender's room span a child of the receiver broker's
RegisterRoom call (or of the engine's BeginSend, when the engine passed its
own trace context).

Configuration follows the standard OpenTelemetry variables, read once when
``kvbroker serve`` starts: ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``,
``none``; default ``none``: nothing is exported unless asked),
``OTEL_EXPORTER_OTLP_ENDPOINT``/``_PROTOCOL``/``_HEADERS`` (read by the OTLP
exporter), ``OTEL_SERVICE_NAME`` (default ``kvbroker``),
``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``/``_ARG`` (read by the
SDK). Spans are made (and trace ids logged and propagated) even when nothing
is exported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

__all__ = [
    "TRACER_NAME",
    "add_trace_ids",
    "configure_metrics",
    "configure_tracing",
    "records_children",
    "span_ids",
    "tracer",
]

TRACER_NAME = "kvbroker"

log = structlog.get_logger(__name__)


def configure_tracing(env: Mapping[str, str] = os.environ) -> TracerProvider:
    """Install this process's tracer provider from the OTEL_* variables.

    With no exporter (the default) and no ``OTEL_TRACES_SAMPLER``, spans are
    recorded only where they continue a sampled trace (an engine's, or a
    peer's): a room's spans cost ~3 KiB and some CPU, for nothing when
    nothing leaves the process. The trace context still propagates.
    """
    resource = Resource.create({"service.name": env.get("OTEL_SERVICE_NAME", "kvbroker")})
    names = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", "none").split(",") if n.strip() not in ("", "none")]
    sampler = ParentBased(ALWAYS_OFF) if not names and "OTEL_TRACES_SAMPLER" not in env else None
    provider = TracerProvider(resource=resource, sampler=sampler)
    for name in names:
        if name == "otlp":
            protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"))
            if protocol != "grpc":
                raise ValueError(f"OTLP protocol {protocol!r} is not supported here; use grpc")
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        elif name == "console":
            provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        else:
            raise ValueError(f"OTEL_TRACES_EXPORTER {name!r} is not one of otlp, console, none")
    trace.set_tracer_provider(provider)
    return provider


def configure_metrics(prometheus_port: int | None, prometheus_host: str = "127.0.0.1") -> MeterProvider:
    """Install this process's meter provider; with a port, serve a Prometheus scrape endpoint."""
    readers: list[MetricReader] = []
    if prometheus_port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        start_http_server(prometheus_port, addr=prometheus_host)
        readers.append(PrometheusMetricReader())
    provider = MeterProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvbroker")}),
        metric_readers=readers,
    )
    metrics.set_meter_provider(provider)
    return provider


_tracer: trace.Tracer | None = None


def tracer() -> trace.Tracer:
    """kvbroker's tracer (made once: ``get_tracer`` builds a new one per call; the
    one it returns before a provider is installed forwards to it later)."""
    global _tracer
    if _tracer is None:
        _tracer = trace.get_tracer(TRACER_NAME)
    return _tracer


def span_ids(span: Span | None) -> dict[str, str]:
    """``trace_id``/``span_id`` of ``span`` as hex, for log lines (empty if invalid)."""
    if span is None:
        return {}
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return {}
    return {"trace_id": format(ctx.trace_id, "032x"), "span_id": format(ctx.span_id, "016x")}


def add_trace_ids(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: the current span's ids, unless the line names its own."""
    if "trace_id" not in event:
        event.update(span_ids(trace.get_current_span()))
    return event


def current_span() -> Span:
    """The current span, to parent spans made later. (A record keeps the span,
    not the whole context: one less object per room.)"""
    return trace.get_current_span()


def records_children(parent: Span | None) -> bool:
    """Whether a child span of ``parent`` would be recorded (callers skip
    building its attributes otherwise: per packed part, that was a few
    percent of the control loop)."""
    return parent is None or not _unrecorded_child(parent)


def _unrecorded_child(parent: Span) -> bool:
    """Whether a child of ``parent`` would be a non-recording span anyway: the
    parent is valid, unsampled and not recording, and the sampler is parent
    based (the SDK's default, and ours: its children of unsampled parents are
    never sampled). Such a child only carries its parent's trace id with a
    new span id; ``start_span`` hands back the parent instead, so an
    untraced room holds no span objects of its own (scale_rooms: ~0.5 KiB
    per room and side)."""
    if parent.is_recording():
        return False
    ctx = parent.get_span_context()
    if not ctx.is_valid or ctx.trace_flags.sampled:
        return False
    return isinstance(getattr(trace.get_tracer_provider(), "sampler", None), ParentBased)


def start_span(
    name: str,
    *,
    parent: Span | otel_context.Context | None = None,
    start_ns: int | None = None,
    attributes: Mapping[str, Any] | None = None,
    links: Iterable[Link] = (),
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span:
    """A span under ``parent`` (a span, a context, or the current context).

    Under an unsampled, non-recording parent this is the parent itself (see
    ``_unrecorded_child``): ending it or setting attributes does nothing."""
    parent_span = parent if isinstance(parent, Span) else trace.get_current_span(parent)
    if _unrecorded_child(parent_span):
        return parent_span
    if isinstance(parent, Span):
        ctx: otel_context.Context | None = trace.set_span_in_context(parent)
    else:
        ctx = parent
    return tracer().start_span(
        name, context=ctx, kind=kind, attributes=dict(attributes or {}), links=list(links), start_time=start_ns
    )


def child_done(parent: Span | None, name: str, attributes: Mapping[str, Any] | None = None, start_ns: int | None = None) -> None:
    """A child span of ``parent`` that starts at ``start_ns`` (default now) and ends now."""
    if parent is None:
        return
    span = start_span(name, parent=parent, start_ns=start_ns, attributes=attributes)
    span.end()


def end_with_status(span: Span, ok: bool, message: str = "") -> None:
    span.set_status(Status(StatusCode.OK) if ok else Status(StatusCode.ERROR, message))
    span.end()


def has_remote_parent(span: Span) -> bool:
    """Whether ``span`` continues a trace its caller sent: an RPC server span
    whose parent came with the call, or the caller's own span context as a
    session command carried it (``SessionCommand.trace_context``)."""
    if not isinstance(span, ReadableSpan):
        context = span.get_span_context()
        return bool(context.is_valid and context.is_remote)
    return bool(span.parent is not None and span.parent.is_remote)


def open_room_span(progress: Any, side: str, parent: Span | otel_context.Context | None, start_ns: int | None = None) -> Span:
    """The ``kvbroker.room`` span of one side of a room (stored on ``progress.span``)."""
    key = progress.key
    progress.span = start_span(
        "kvbroker.room",
        parent=parent,
        start_ns=start_ns,
        attributes={
            "kvbroker.room": progress.room,
            "kvbroker.side": side,
            "kvbroker.engine.group": key.group,
            "kvbroker.engine.tp_rank": key.tp_rank,
            "kvbroker.engine.pp_rank": key.pp_rank,
        },
    )
    span: Span = progress.span
    return span


def close_room_span(progress: Any, attributes: Mapping[str, Any]) -> None:
    """End a room span with its outcome (state, bytes, chunks, cause)."""
    from kvbroker.v1 import common_pb2

    span = progress.span
    if progress.wait_span is not None:
        progress.wait_span.end()
        progress.wait_span = None
    if span is None:
        return
    span.set_attributes(dict(attributes))
    span.set_attribute("kvbroker.state", common_pb2.RoomState.Name(progress.state))
    span.set_attribute("kvbroker.bytes", progress.bytes)
    span.set_attribute("kvbroker.chunks", progress.chunks)
    if progress.cause is not None:
        span.set_attribute("kvbroker.failure.kind", common_pb2.FailureKind.Name(progress.cause.kind))
        span.set_attribute("kvbroker.failure.message", progress.cause.message)
        span.set_attribute("kvbroker.failure.origin", progress.cause.origin_broker)
    end_with_status(span, progress.cause is None, progress.cause.message if progress.cause else "")

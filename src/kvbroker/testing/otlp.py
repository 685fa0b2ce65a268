"""A minimal OTLP/gRPC trace receiver for tests: what a collector would get.

``OtlpReceiver`` serves ``opentelemetry.proto.collector.trace.v1.TraceService``
on 127.0.0.1 and keeps every span it is sent, flattened to :class:`SpanRecord`.
Point brokers at it with ``OTEL_TRACES_EXPORTER=otlp`` and
``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:<port>`` (insecure).
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

__all__ = ["OtlpReceiver", "SpanRecord"]


@dataclass(frozen=True)
class SpanRecord:
    """One exported span."""

    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    attributes: dict[str, Any]
    ok: bool
    status_message: str
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: list[SpanRecord], lock: threading.Lock) -> None:
        self._sink = sink
        self._lock = lock

    def Export(self, request: Any, context: Any) -> Any:
        records = []
        for resource_spans in request.resource_spans:
            service = next(
                (_value(a.value) for a in resource_spans.resource.attributes if a.key == "service.name"), ""
            )
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    records.append(
                        SpanRecord(
                            service=str(service),
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            name=span.name,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            ok=span.status.code != 2,  # STATUS_CODE_ERROR
                            status_message=span.status.message,
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self._sink.extend(records)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """Start with ``OtlpReceiver()``; ``endpoint`` for the exporters; ``spans()``; ``stop()``."""

    def __init__(self) -> None:
        self._spans: list[SpanRecord] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self._spans, self._lock), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return list(self._spans)

    def stop(self) -> None:
        self._server.stop(0)

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

__all__ = ["PART_HOPS", "OtlpReceiver", "SpanRecord", "part_times"]

#: A packed part's hops, between its times (``s.``: on the sender's part span, ``r.``: on the receiver's scatter span).
PART_HOPS = (
    ("wait for a slot", "s.handed_on", "s.slot"),
    ("wait for a credit", "s.slot", "s.credit"),
    ("credit -> gather launched", "s.credit", "s.gather_start"),
    ("gather", "s.gather_start", "s.gathered"),
    ("gather done -> posted", "s.gathered", "s.posted"),
    ("write", "s.posted", "s.done"),
    ("DONE -> notice seen", "s.done", "r.notice"),
    ("notice -> scatter start", "r.notice", "r.scatter_start"),
    ("scatter", "r.scatter_start", "r.scatter_end"),
    ("scatter done -> credit seen by the sender", "r.scatter_end", "s.credit_back"),
)


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


def part_times(spans: list[SpanRecord]) -> dict[int, list[dict[str, float]]]:
    """Each packed part's times (``kvbroker.t.<hop>`` as ``s.<hop>`` and ``r.<hop>``), by its bytes: the
    sender's part span and the receiver's scatter span, matched by trace and credit (a traced part's span
    ends when its credit comes back, so a part whose credit did not is left out)."""

    def times(span: SpanRecord, side: str) -> dict[str, float]:
        return {f"{side}.{k[len('kvbroker.t.'):]}": float(v) for k, v in span.attributes.items() if k.startswith("kvbroker.t.")}

    sent = {(s.trace_id, s.attributes.get("kvbroker.credit_id")): s for s in spans if s.name == "kvbroker.transfer"}
    out: dict[int, list[dict[str, float]]] = {}
    for span in spans:
        mine = sent.get((span.trace_id, span.attributes.get("kvbroker.credit_id"))) if span.name == "kvbroker.staging.scatter" else None
        if mine is not None and "kvbroker.t.credit_back" in mine.attributes:
            out.setdefault(int(mine.attributes["kvbroker.bytes"]), []).append(times(mine, "s") | times(span, "r"))
    return out


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

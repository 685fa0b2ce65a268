"""Traces, metrics and counters."""

from kvbroker.broker.telemetry._counters import Counters
from kvbroker.broker.telemetry._metrics import BrokerMetrics, GaugeSnapshot
from kvbroker.broker.telemetry._queues import QueueObserver, QueueRow, QueueStats
from kvbroker.broker.telemetry._tracing import (
    add_trace_ids,
    child_done,
    close_room_span,
    configure_metrics,
    configure_tracing,
    current_span,
    end_with_status,
    has_remote_parent,
    open_room_span,
    records_children,
    span_ids,
    start_span,
    tracer,
)

__all__ = [
    "BrokerMetrics",
    "Counters",
    "GaugeSnapshot",
    "QueueObserver",
    "QueueRow",
    "QueueStats",
    "add_trace_ids",
    "child_done",
    "close_room_span",
    "configure_metrics",
    "configure_tracing",
    "current_span",
    "end_with_status",
    "has_remote_parent",
    "open_room_span",
    "records_children",
    "span_ids",
    "start_span",
    "tracer",
]

"""Carry the caller's OpenTelemetry trace context into broker calls.

A small gRPC client interceptor: it injects the current context (W3C
``traceparent``/``tracestate``) into the call's metadata, so the broker's
spans for an engine's ExpectRoom or BeginSend join the engine's request trace.
It makes no client spans of its own: an engine that wants them instruments
gRPC itself. With no active trace it adds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import grpc
from opentelemetry import propagate

__all__ = ["TraceContextInterceptor", "current_trace_context"]


def current_trace_context() -> dict[str, str]:
    """The caller's current trace context as a W3C carrier (empty with no active trace)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: Any
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class TraceContextInterceptor(grpc.UnaryUnaryClientInterceptor):
    """Adds the current trace context to unary calls' metadata."""

    def intercept_unary_unary(
        self, continuation: Callable[[Any, Any], Any], client_call_details: Any, request: Any
    ) -> Any:
        carrier = current_trace_context()
        if carrier:
            metadata = list(client_call_details.metadata or ()) + list(carrier.items())
            client_call_details = _CallDetails(
                client_call_details.method,
                client_call_details.timeout,
                metadata,
                client_call_details.credentials,
                client_call_details.wait_for_ready,
                client_call_details.compression,
            )
        return continuation(client_call_details, request)

"""What the call routes share in reading a request: the protocol version
check, a request's state indices decoded, and the trace context of one that
carries none."""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry import context as otel_context

from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.plan import IndexArray, decode_indices
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2

__all__ = ["NO_TRACE", "check_version", "decode_state"]

#: The context of a command or registration that carries none: no parent span.
NO_TRACE = otel_context.Context()


def decode_state(entries: Iterable[common_pb2.StateIndices]) -> dict[str, IndexArray]:
    """A request's state indices, by component (each listed once)."""
    out: dict[str, IndexArray] = {}
    for entry in entries:
        if entry.component in out:
            raise InvalidArgument(f"state component {entry.component!r} listed twice")
        out[entry.component] = decode_indices(entry.indices, what=f"state {entry.component!r}")
    return out


def check_version(version: int, call: str) -> None:
    """Refuse a message of another protocol version (FAILED_PRECONDITION)."""
    if version != PROTOCOL_VERSION:
        raise FailedPrecondition(f"{call} speaks protocol version {version}; this broker speaks {PROTOCOL_VERSION}")

"""Span helpers: what a room holds when nothing is recorded."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from kvbroker.broker import telemetry


def _remote(flags: int) -> NonRecordingSpan:
    return NonRecordingSpan(SpanContext(trace_id=0xABC, span_id=0xDEF, is_remote=True, trace_flags=TraceFlags(flags)))


def test_a_child_of_an_unsampled_parent_is_the_parent_itself() -> None:
    """Under a parent-based sampler (the tests' provider, and the broker's), a child of an
    unsampled, non-recording parent would be non-recording with the same trace id: the
    parent is handed back instead, so an untraced room holds no span objects of its own."""
    parent = _remote(TraceFlags.DEFAULT)
    assert telemetry.start_span("kvbroker.wait", parent=parent) is parent
    assert telemetry.start_span("kvbroker.wait", parent=trace.set_span_in_context(parent)) is parent
    parent.end()  # ending it, as the room's end does, is a no-op


def test_a_child_of_a_sampled_or_recording_parent_is_a_new_span() -> None:
    """A span started under a sampled remote parent, or under a recording span, is a new recording span of the same
    trace."""
    sampled = _remote(TraceFlags.SAMPLED)
    child = telemetry.start_span("kvbroker.room", parent=sampled)
    try:
        assert child is not sampled and child.is_recording()
        assert child.get_span_context().trace_id == 0xABC and child.get_span_context().span_id != 0xDEF
        grandchild = telemetry.start_span("kvbroker.wait", parent=child)
        assert grandchild is not child and grandchild.is_recording()
        grandchild.end()
    finally:
        child.end()

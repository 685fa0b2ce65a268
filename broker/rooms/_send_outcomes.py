"""How a source ends and what its receivers hear of it: SUCCESS, or FAILED with its first cause.

:class:`SourceOutcomes` moves a source forward as its destinations complete
(:meth:`~SourceOutcomes.advance`: WAITING_FOR_INPUT, TRANSFERRING, SUCCESS),
fails it (:meth:`~SourceOutcomes.fail`: the first cause is kept, and every
receiver's broker is told with a ``CompletionReport``,
:meth:`~SourceOutcomes.report`, and told again once nothing of the source is
in flight), publishes each change of a source (:meth:`~SourceOutcomes.changed`,
every ``Source``'s listener) and keeps its room span. It holds no state of
its own beyond the shared :class:`~kvbroker.broker.rooms._machine.MachineCore`:
every other collaborator of ``SenderCore`` (``_sender``) ends sources
through it.
"""

from __future__ import annotations

from typing import Any

import structlog

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._effects import Publish, RoomEnded, SendReport
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._sender_records import Destination, Source
from kvbroker.broker.rooms._sides import SUCCESS, TRANSFERRING, WAITING_FOR_INPUT, Side
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["SourceOutcomes"]

log = structlog.get_logger(__name__)


class SourceOutcomes:
    """Sources moved forward, failed and reported to their receivers; their spans."""

    def __init__(self, core: MachineCore) -> None:
        self._id = core.broker_id
        self._counters = core.counters
        self._emit = core.emit

    def fail(self, source: Source, why: common_pb2.FailureCause) -> None:
        """Fail ``source`` (first cause wins) and report to every receiver."""
        if not source.terminal:
            self.ensure_span(source)
        if not source.fail(why, settled=source.inflight == 0):
            return
        self._counters.rooms_failed += 1
        log.info(
            "send_failed",
            room=source.room,
            engine=source.engine.label,
            peer=",".join(sorted({d.info.receiver_broker_id for d in source.destinations.values()})),
            cause=why.message,
            **telemetry.span_ids(source.span),
        )
        for dest in source.destinations.values():
            self.report(source, dest)

    def advance(self, source: Source) -> None:
        """Move ``source`` forward once every receiver registered: SUCCESS when
        every destination completed the last chunk, else TRANSFERRING or
        WAITING_FOR_INPUT."""
        if source.terminal or not source.ready():
            return
        if source.wait_span is not None:
            source.wait_span.set_attribute("kvbroker.receivers", len(source.destinations))
            source.wait_span.end()
            source.wait_span = None
        source.mark("ready")
        if source.last_received and all(d.complete for d in source.destinations.values()):
            source.mark("last_byte")
            telemetry.child_done(source.span, "kvbroker.completion", {"kvbroker.receivers": len(source.destinations)})
            if source.advance(SUCCESS):
                self._counters.rooms_succeeded += 1
                log.debug(
                    "send_done", room=source.room, engine=source.engine.label, bytes=source.bytes, **telemetry.span_ids(source.span)
                )
        elif source.chunk_list:
            source.advance(TRANSFERRING)
        else:
            source.advance(WAITING_FOR_INPUT)

    def report(self, source: Source, dest: Destination) -> None:
        """Tell the receiver's broker this source failed (if it did), and whether it settled."""
        settled = dest.inflight == 0
        dest.failure_reported = source.cause is not None
        dest.settle_reported = settled
        report = peer_pb2.CompletionReport(
            room=source.room,
            sender_broker_id=self._id,
            source=source.key.to_proto(),
            receiver=dest.info.receiver.to_proto(),
            settled=settled,
        )
        if source.cause is not None:
            report.failure.CopyFrom(source.cause)
        self._emit(SendReport(dest.info.receiver_broker_id, report))

    def changed(self, side: Side) -> None:
        """Every source's listener: publish its status; hand on its end once."""
        self._emit(Publish(side.engine.engine_id, side.status()))
        if side.terminal and not side.ended:
            side.ended = True
            self._emit(RoomEnded(side))

    def open_span(self, source: Source, parent: Any) -> None:
        """The sender's room span (back-dated to BeginSend) and its wait for transfer info."""
        span = telemetry.open_room_span(source, "sender", parent, start_ns=source.opened_ns)
        if not source.ready():
            source.wait_span = telemetry.start_span(
                "kvbroker.wait_for_transfer_info", parent=span, start_ns=source.opened_ns
            )

    def ensure_span(self, source: Source) -> None:
        """A room span even for a source that ends before any receiver registered."""
        if source.span is None:
            self.open_span(source, source.begin_context)

"""The end of a room's side: its span closes, its metrics are recorded, and
its one canonical log line (``room_ended``) is written. A receiver rank's
waits for room in a receive buffer (a sender's ReserveStaging, still queued)
end with it."""

from __future__ import annotations

import time

import structlog

from kvbroker.broker import telemetry
from kvbroker.broker.memory import StagingPools
from kvbroker.broker.rooms import Receiver, Side, Source
from kvbroker.broker.telemetry import BrokerMetrics
from kvbroker.errors import FailedPrecondition
from kvbroker.plan import RankKey
from kvbroker.v1 import common_pb2

__all__ = ["end_receive_waits", "receive_wait_owner", "record_room_end"]

log = structlog.get_logger(__name__)


def record_room_end(side: Side, metrics: BrokerMetrics) -> None:
    """End the room span, record metrics, write the one canonical log line."""
    sender = isinstance(side, Source)
    name = "sender" if sender else "receiver"
    if isinstance(side, Source):
        peer = ",".join(sorted({d.info.receiver_broker_id for d in side.destinations.values()}))
        pages = side.cursor
    else:
        assert isinstance(side, Receiver)
        peer = side.peer_broker_id or side.sender_address
        pages = int(side.pages.size)
    telemetry.close_room_span(
        side,
        {"kvbroker.peer": peer, "kvbroker.pages": pages, "kvbroker.priority": side.priority, "kvbroker.queued_s": side.queued_s},
    )
    state = common_pb2.RoomState.Name(side.state)
    total = (side.finished_at or time.monotonic()) - side.opened_at
    metrics.room_seconds.record(total, {"side": name, "state": state})
    kind = common_pb2.FailureKind.Name(side.cause.kind) if side.cause is not None else ""
    if side.cause is not None:
        metrics.failures.add(1, {"side": name, "cause": kind})
    times = dict(side.timeline)
    log.info(
        "room_ended",
        room=side.room,
        side=name,
        engine=side.engine.label,
        peer=peer,
        state=state,
        cause=kind or None,
        cause_message=side.cause.message if side.cause is not None else None,
        bytes=side.bytes,
        chunks=side.chunks,
        priority=common_pb2.RoomPriority.Name(side.priority),
        queued_s=round(side.queued_s, 6),
        pages=pages,
        total_s=round(total, 6),
        bootstrap_s=_between(times, "opened", "registered" if not sender else "ready"),
        transfer_s=_between(times, "first_byte", "last_byte"),
        **telemetry.span_ids(side.span),
    )


def _between(times: dict[str, float], start: str, end: str) -> float | None:
    if start in times and end in times:
        return round(times[end] - times[start], 6)
    return None


def receive_wait_owner(room: int, receiver: RankKey) -> tuple[str, int, RankKey]:
    """Whose wait for room in a receive buffer: one receiver rank's room."""
    return ("receive", room, receiver)


def end_receive_waits(side: Side, pools: StagingPools) -> None:
    """A receiver rank ended: the reservations still queued for it fail now.
    Granted later, they would only be given back; and the slots they wait for
    may be held by the same rank until it settles, which waits for the
    sources whose parts wait here (both stalled until the wait ran out)."""
    if isinstance(side, Receiver):
        why = FailedPrecondition(f"room {side.room} ended while it waited for staging")
        pools.abandon("receive", receive_wait_owner(side.room, side.key), why)

"""One engine rank's side of a room, the room states and failure causes: the bottom of ``rooms``.

:class:`Side` is what a ``Source`` (``_sender_records``) and a ``Receiver``
(``_receiver_records``) have in common: the room state, the first failure
cause, the timeline of events and whether its pages are settled. The state
constants (``FAILED`` ... ``SUCCESS``) and the failure causes
(:func:`cause`, :func:`cause_of`) are here too. This module imports nothing
else of ``rooms``, so every record module can build on it.

State rules (docs/design.md section 1): states only move forward,
``FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS``;
FAILED is terminal and keeps the first cause; SUCCESS is terminal.
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvbroker.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    NixlError,
    Unavailable,
    Unimplemented,
)
from kvbroker.plan import RankKey
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from kvbroker.broker.memory import Engine

__all__ = [
    "BOOTSTRAPPING",
    "EVENTS",
    "FAILED",
    "SUCCESS",
    "TRANSFERRING",
    "WAITING_FOR_INPUT",
    "Side",
    "StateTally",
    "cause",
    "cause_of",
]

FAILED = common_pb2.ROOM_STATE_FAILED
BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
WAITING_FOR_INPUT = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
SUCCESS = common_pb2.ROOM_STATE_SUCCESS


def cause(kind: int, message: str, origin: str) -> common_pb2.FailureCause:
    """A ``FailureCause`` message."""
    return common_pb2.FailureCause(kind=kind, message=message, origin_broker=origin)  # type: ignore[arg-type]


def cause_of(error: KvBrokerError, origin: str) -> common_pb2.FailureCause:
    """The failure cause a room gets when ``error`` ends it."""
    if isinstance(error, NixlError):
        kind = common_pb2.FAILURE_KIND_TRANSFER
    elif isinstance(error, (Unavailable, DeadlineExceeded)):
        kind = common_pb2.FAILURE_KIND_PEER
    elif isinstance(error, (FailedPrecondition, Unimplemented, InvalidArgument)):
        kind = common_pb2.FAILURE_KIND_MISMATCH
    else:
        kind = common_pb2.FAILURE_KIND_UNSPECIFIED
    return cause(kind, error.message, origin)


#: The events of a side's timeline, in the order they can happen.
EVENTS = ("opened", "handshaken", "registered", "ready", "first_byte", "last_byte", "success", "failed", "settled")
_EVENT_INDEX = {name: i for i, name in enumerate(EVENTS)}


def _no_marks() -> array[float]:
    return array("d", (math.nan,) * len(EVENTS))


class StateTally:
    """The sides of one kind a broker holds, by state, and those not over yet,
    kept as they change: the room gauges and the searches for a peer's rooms
    read it instead of scanning every record (a broker holds every room of
    the finished-room TTL, tens of thousands at speed)."""

    __slots__ = ("counts", "unfinished")

    def __init__(self) -> None:
        #: State -> sides held in it.
        self.counts: dict[int, int] = {}
        #: The sides held that are not ``over`` (an ordered set).
        self.unfinished: dict[Side, None] = {}

    def hold(self, side: Side) -> None:
        """``side`` is held from now on (counted, and its changes with it)."""
        side.tally = self
        self.counts[side.state] = self.counts.get(side.state, 0) + 1
        if not side.over:
            self.unfinished[side] = None

    def drop(self, side: Side) -> None:
        """``side`` is no longer held."""
        if side.tally is self:
            side.tally = None
            self.counts[side.state] -= 1
            self.unfinished.pop(side, None)

    def changed(self, side: Side, old_state: int) -> None:
        """``side`` changed (it was in ``old_state``)."""
        if side.state != old_state:
            self.counts[old_state] -= 1
            self.counts[side.state] = self.counts.get(side.state, 0) + 1
        if side.over:
            self.unfinished.pop(side, None)


# Per-room records use __slots__ (slots=True) and compact fields: a broker
# holds one of each per open room, and their size is the broker's memory
# per room (bench/scale_rooms.py measures it).
@dataclass(eq=False, slots=True)
class Side:
    """One engine rank's side of one room: its state and first failure cause.

    ``listener`` is called after every change (the state machine that owns
    the record turns it into effects: a published status, the room's end).
    """

    room: int
    engine: Engine
    listener: Callable[[Side], None]
    state: int = BOOTSTRAPPING
    cause: common_pb2.FailureCause | None = None
    opened_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    chunks: int = 0
    bytes: int = 0
    #: Whether nothing posted can still touch this rank's pages.
    pages_settled: bool = False
    #: When ``pages_settled`` became true (monotonic): a finished room stays
    #: pollable for the finished-room TTL from the later of this and
    #: ``finished_at``, so an engine waiting for its pages sees them settle.
    settled_at: float | None = None
    #: Wall-clock (ns) when the side opened: span start times.
    opened_ns: int = field(default_factory=time.time_ns)
    #: Wall-clock seconds of each of ``EVENTS`` (NaN: not yet); read it
    #: through ``timeline``.
    marks: array[float] = field(default_factory=_no_marks)
    #: The room span of this side (``telemetry``); None until it exists.
    span: Span | None = None
    #: The span of a wait in progress (for transfer info, or for data).
    wait_span: Span | None = None
    #: The room's end was handed on (span closed, canonical log line written).
    ended: bool = False
    #: The room's class here (``common_pb2.RoomPriority``; 0: unspecified,
    #: served as STANDARD) and deadline (monotonic seconds; None: none): what
    #: its work is queued by (``scheduling``).
    priority: int = 0
    deadline: float | None = None
    #: Seconds its work waited in the broker's ordered queues (the send window), all parts together.
    queued_s: float = 0.0
    #: The tally that counts it while the broker holds it (``RoomTables``).
    tally: StateTally | None = None

    def __post_init__(self) -> None:
        self.marks[0] = self.opened_ns / 1e9

    @property
    def key(self) -> RankKey:
        return self.engine.key

    @property
    def terminal(self) -> bool:
        return self.state in (FAILED, SUCCESS)

    @property
    def over(self) -> bool:
        """Terminal, with its pages settled: nothing of it changes or touches
        its pages any more (a source posts nothing once terminal, so it has
        nothing in flight either)."""
        return self.terminal and self.pages_settled

    def mark(self, event: str) -> None:
        """Note ``event`` on the timeline (the first time only)."""
        i = _EVENT_INDEX[event]
        if math.isnan(self.marks[i]):
            self.marks[i] = time.time()

    @property
    def timeline(self) -> list[tuple[str, float]]:
        """(event, wall-clock seconds) of the events so far, in order (GetRoom):
        opened, handshaken, registered, ready, first_byte, last_byte,
        success/failed, settled."""
        marked = [(at, i) for i, at in enumerate(self.marks) if not math.isnan(at)]
        return [(EVENTS[i], at) for at, i in sorted(marked)]

    def advance(self, state: int) -> bool:
        """Move forward to ``state``; False (no change) if not forward or terminal."""
        if self.terminal or state <= self.state or state == FAILED:
            return False
        old = self.state
        self.state = state
        if state == SUCCESS:
            self.finished_at = self.settled_at = time.monotonic()
            self.pages_settled = True
            self.mark("success")
            self.mark("settled")
        if self.tally is not None:
            self.tally.changed(self, old)
        self.listener(self)
        return True

    def fail(self, why: common_pb2.FailureCause, *, settled: bool = False) -> bool:
        """Fail with ``why`` unless already terminal (the first cause is kept).

        ``settled``: nothing posted can touch the pages any more (reported in
        the same status change, so a waiter sees it with the failure).
        """
        if self.terminal:
            return False
        old = self.state
        self.state = FAILED
        self.cause = why
        self.finished_at = time.monotonic()
        self.pages_settled = settled
        self.mark("failed")
        if settled:
            self.settled_at = self.finished_at
            self.mark("settled")
        if self.tally is not None:
            self.tally.changed(self, old)
        self.listener(self)
        return True

    def mark_settled(self) -> None:
        if not self.pages_settled:
            self.pages_settled = True
            self.settled_at = time.monotonic()
            self.mark("settled")
            if self.tally is not None:
                self.tally.changed(self, self.state)
            self.listener(self)

    def status(self) -> common_pb2.RoomStatus:
        status = common_pb2.RoomStatus(
            room=self.room,
            state=self.state,  # type: ignore[arg-type]
            pages_settled=self.pages_settled,
            chunks=self.chunks,
            bytes=self.bytes,
            prefix_pages=self.known_prefix(),
            priority=self.priority,  # type: ignore[arg-type]
        )
        if self.cause is not None:
            status.cause.CopyFrom(self.cause)
        return status

    def known_prefix(self) -> int:
        """``RoomStatus.prefix_pages`` of this side (incremental transfer)."""
        return 0

    def holds_resources(self) -> bool:
        """Whether the record must stay because something still refers to it
        (transfers in flight, staging reservations)."""
        return False

    def expired(self, now: float, ttl_seconds: float, unsettled_ttl_seconds: float) -> bool:
        """Whether eviction may drop this record now."""
        if not self.terminal or self.finished_at is None or self.holds_resources():
            return False
        if not self.pages_settled:
            return now - self.finished_at >= unsettled_ttl_seconds
        # Pollable for the TTL after it ended AND its pages settled: a room that
        # settles late must not vanish before its engine could see it settle.
        since = self.finished_at if self.settled_at is None else max(self.finished_at, self.settled_at)
        return now - since >= ttl_seconds

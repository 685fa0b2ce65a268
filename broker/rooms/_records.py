"""Room records: one side of a room, the room tables, eviction and tombstones.

A room has a sender side (prefill ranks) and a receiver side (decode ranks);
both may sit on one broker. Each side keeps one record per room id
(:class:`SenderRoom`, :class:`ReceiverRoom`) holding one :class:`Side` per
local engine rank: a ``Source`` (``_sender_records``) or a ``Receiver``
(``_receiver_records``), moved by their state machines, ``SenderCore``
(``_sender``) and ``ReceiverCore`` (``_receiver``).

State rules (docs/design.md section 1): states only move forward,
``FAILED < BOOTSTRAPPING < WAITING_FOR_INPUT < TRANSFERRING < SUCCESS``;
FAILED is terminal and keeps the first cause; SUCCESS is terminal.

Every per-room table is a field of :class:`RoomTables`, and
:meth:`RoomTables.sizes` reports each one (``GetStats.per_room_state``): a
table that does not return to zero when the broker is idle is a leak.
Removal happens in one place, :meth:`RoomTables.evict`. A message for a
room id that is not here never creates a record, except the calls that
open a side (ExpectRoom, BeginSend) and the transfer info or abort that may
precede BeginSend; evicted ids are remembered (tombstones) so late messages
for them are refused (lesson 6).
"""

from __future__ import annotations

import math
import time
from array import array
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbroker.broker.rooms._smallmap import SmallMap
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
    from kvbroker.broker.rooms._receiver_records import Receiver
    from kvbroker.broker.rooms._sender_records import Source, TransferInfo

__all__ = [
    "BOOTSTRAPPING",
    "FAILED",
    "SUCCESS",
    "TRANSFERRING",
    "WAITING_FOR_INPUT",
    "ReceiverRoom",
    "RoomTables",
    "SenderRoom",
    "Side",
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

    def __post_init__(self) -> None:
        self.marks[0] = self.opened_ns / 1e9

    @property
    def key(self) -> RankKey:
        return self.engine.key

    @property
    def terminal(self) -> bool:
        return self.state in (FAILED, SUCCESS)

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
        self.state = state
        if state == SUCCESS:
            self.finished_at = self.settled_at = time.monotonic()
            self.pages_settled = True
            self.mark("success")
            self.mark("settled")
        self.listener(self)
        return True

    def fail(self, why: common_pb2.FailureCause, *, settled: bool = False) -> bool:
        """Fail with ``why`` unless already terminal (the first cause is kept).

        ``settled``: nothing posted can touch the pages any more (reported in
        the same status change, so a waiter sees it with the failure).
        """
        if self.terminal:
            return False
        self.state = FAILED
        self.cause = why
        self.finished_at = time.monotonic()
        self.pages_settled = settled
        self.mark("failed")
        if settled:
            self.settled_at = self.finished_at
            self.mark("settled")
        self.listener(self)
        return True

    def mark_settled(self) -> None:
        if not self.pages_settled:
            self.pages_settled = True
            self.settled_at = time.monotonic()
            self.mark("settled")
            self.listener(self)

    def status(self) -> common_pb2.RoomStatus:
        status = common_pb2.RoomStatus(
            room=self.room,
            state=self.state,  # type: ignore[arg-type]
            pages_settled=self.pages_settled,
            chunks=self.chunks,
            bytes=self.bytes,
            prefix_pages=self.known_prefix(),
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


@dataclass(eq=False, slots=True)
class SenderRoom:
    """The sender side of one room on this broker."""

    room: int
    sources: SmallMap[RankKey, Source] = field(default_factory=SmallMap)
    #: Transfer infos by receiver rank; they may arrive before BeginSend.
    infos: SmallMap[RankKey, TransferInfo] = field(default_factory=SmallMap)
    created_at: float = field(default_factory=time.monotonic)
    #: Source ranks that opened this room here (BeginSend), kept after
    #: their records are evicted: a rank opens a room once, and a receiver
    #: is never told that a source which did open it never will.
    opened: tuple[RankKey, ...] = ()
    #: A receiver's broker aborted the room (first cause); sources that open
    #: it later fail at once.
    aborted: common_pb2.FailureCause | None = None
    #: (receiver, source) -> the cause the receiver was told when it learned
    #: that the source would never open the room (its engine went away
    #: first, or it did not come within the orphan timeout). That receiver
    #: may have reused its pages since: its transfer info is never attached
    #: to that source again.
    abandoned: dict[tuple[RankKey, RankKey], common_pb2.FailureCause] = field(default_factory=dict)

    def unserved(self) -> Iterator[tuple[TransferInfo, RankKey]]:
        """(transfer info, source rank) pairs whose source never opened the
        room here and whose receiver was not told so yet."""
        for info in self.infos.values():
            for plan in info.sources:
                if plan.rank not in self.opened and (info.receiver, plan.rank) not in self.abandoned:
                    yield info, plan.rank


@dataclass(eq=False, slots=True)
class ReceiverRoom:
    """The receiver side of one room on this broker."""

    room: int
    ranks: SmallMap[RankKey, Receiver] = field(default_factory=SmallMap)
    created_at: float = field(default_factory=time.monotonic)


@dataclass
class RoomTables:
    """Every per-room table of the broker."""

    sender: dict[int, SenderRoom] = field(default_factory=dict)
    receiver: dict[int, ReceiverRoom] = field(default_factory=dict)
    #: (side, room) -> when the tombstone expires.
    tombstones: dict[tuple[str, int], float] = field(default_factory=dict)
    #: (sender's broker address, room) -> (cause, when): a receiver rank of
    #: the room failed without the sender's broker process it registered
    #: with hearing of it (that process went away, or could not be reached).
    #: Whichever broker answers at that address next is told, so a source
    #: opened there does not wait for a transfer info that will never come.
    #: Dropped when told, or after the sender-info timeout (the wait it saves).
    successor_notices: dict[tuple[str, int], tuple[common_pb2.FailureCause, float]] = field(default_factory=dict)

    def sizes(self) -> dict[str, int]:
        """Name -> size of every per-room table (``GetStats.per_room_state``)."""
        sources = list(self.all_sources())
        ranks = list(self.all_receivers())
        return {
            "sender_rooms": len(self.sender),
            "sender_sources": len(sources),
            "sender_chunks": sum(len(s.chunk_list) for s in sources),
            "sender_destinations": sum(len(s.destinations) for s in sources),
            "transfer_infos": sum(len(r.infos) for r in self.sender.values()),
            "inflight_transfers": sum(s.inflight for s in sources),
            "prefetch_requests": sum(len(d.prefetch) for s in sources for d in s.destinations.values()),
            "receiver_rooms": len(self.receiver),
            "receiver_ranks": len(ranks),
            "receiver_expected_sources": sum(len(r.expected or {}) for r in ranks),
            "staging_reservations": sum(len(r.staging) for r in ranks),
            "tombstones": len(self.tombstones),
            "successor_notices": len(self.successor_notices),
        }

    def all_sources(self) -> Iterator[Source]:
        for room in self.sender.values():
            yield from room.sources.values()

    def all_receivers(self) -> Iterator[Receiver]:
        for room in self.receiver.values():
            yield from room.ranks.values()

    def is_tombstoned(self, side: str, room: int) -> bool:
        return (side, room) in self.tombstones

    def evict(
        self,
        now: float,
        ttl_seconds: float,
        tombstone_ttl_seconds: float,
        orphan_seconds: float,
        unsettled_ttl_seconds: float | None = None,
        on_evict: Callable[[Side], None] | None = None,
        notice_ttl_seconds: float | None = None,
    ) -> int:
        """Drop terminal records older than ``ttl_seconds``, then empty rooms.

        A sender room whose sources all went takes its transfer infos with it,
        unless one of them still waits for a source that never opened the
        room (then it stays until the orphan timeout has told its receiver);
        one that only ever held transfer infos (BeginSend never came) goes
        after ``orphan_seconds``. A failed receiver whose pages are not
        settled stays (so its engine can learn when they are) for
        ``unsettled_ttl_seconds`` (default: ``ttl_seconds``). Tombstones go
        after ``tombstone_ttl_seconds``, successor notices after
        ``notice_ttl_seconds`` (default: the tombstone TTL). Returns how many
        room records went.
        """
        unsettled = ttl_seconds if unsettled_ttl_seconds is None else unsettled_ttl_seconds
        removed = 0
        for side, table in (("sender", self.sender), ("receiver", self.receiver)):
            for room_id in list(table):
                room = table[room_id]
                members: MutableMapping[RankKey, Any] = room.sources if isinstance(room, SenderRoom) else room.ranks
                for member in [k for k, p in members.items() if p.expired(now, ttl_seconds, unsettled)]:
                    if on_evict is not None:
                        on_evict(members[member])
                    del members[member]
                    removed += 1
                if members:
                    continue
                if isinstance(room, SenderRoom) and not room.opened:
                    # Transfer infos (or an abort) waiting for a BeginSend that may still come.
                    wait = ttl_seconds if room.aborted is not None else orphan_seconds
                    if now - room.created_at < wait:
                        continue
                elif isinstance(room, SenderRoom) and any(
                    now - info.received_at < orphan_seconds for info, _ in room.unserved()
                ):
                    # Some of its sources finished, but a receiver still waits
                    # for one that never opened it: the room stays until the
                    # orphan timeout has told that receiver.
                    continue
                del table[room_id]
                self.tombstones[(side, room_id)] = now + tombstone_ttl_seconds
                removed += 1
        for tomb in [k for k, expiry in self.tombstones.items() if expiry <= now]:
            del self.tombstones[tomb]
        notice_ttl = tombstone_ttl_seconds if notice_ttl_seconds is None else notice_ttl_seconds
        for notice in [k for k, (_, at) in self.successor_notices.items() if now - at >= notice_ttl]:
            del self.successor_notices[notice]
        return removed

"""Room records: the sender and receiver side of one room, the room tables, eviction and tombstones.

A room has a sender side (prefill ranks) and a receiver side (decode ranks);
both may sit on one broker. Each side keeps one record per room id
(:class:`SenderRoom`, :class:`ReceiverRoom`) holding one ``Side``
(``_sides``) per local engine rank: a ``Source`` (``_sender_records``) or a
``Receiver`` (``_receiver_records``), moved by their state machines,
``SenderCore`` (``_sender``) and ``ReceiverCore`` (``_receiver``).

Every per-room table is a field of :class:`RoomTables`, and
:meth:`RoomTables.sizes` reports each one (``GetStats.per_room_state``): a
table that does not return to zero when the broker is idle is a leak.
Removal happens in one place, :meth:`RoomTables.evict`. A message for a
room id that is not here never creates a record, except the calls that
open a side (ExpectRoom, BeginSend) and the transfer info or abort that may
precede BeginSend; evicted ids are remembered (tombstones) so late messages
for them are refused (lesson 6).

This module sits above the side records (``_sides``, ``_sender_records``,
``_receiver_records``), which never import it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbroker.broker.rooms._sides import StateTally
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.plan import RankKey
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.rooms._receiver_records import LandingGate, Receiver
    from kvbroker.broker.rooms._sender_records import Source, TransferInfo
    from kvbroker.broker.rooms._sides import Side

__all__ = ["ReceiverRoom", "RoomTables", "SenderRoom"]

#: What a room record holds (its sides, its transfer infos) is made at most
#: this long before the room: a scan by creation time looks this much further.
_MADE_BEFORE_ROOM_S = 1.0


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
    #: (room, receiver rank) -> the rank's gate while it is open to packed parts
    #: landing without the control loop (``LandingGate``): the data-plane thread
    #: looks it up by a notice's room and receiver; only the loop changes it.
    gates: dict[tuple[int, RankKey], LandingGate] = field(default_factory=dict)
    #: Sides held, by state, kept as they change (the room gauges read them
    #: without scanning every record).
    tallies: dict[str, StateTally] = field(default_factory=lambda: {"sender": StateTally(), "receiver": StateTally()})

    def add_source(self, room: SenderRoom, source: Source) -> None:
        room.sources[source.key] = source
        self.tallies["sender"].hold(source)

    def add_receiver(self, room: ReceiverRoom, rank: Receiver) -> None:
        room.ranks[rank.key] = rank
        self.tallies["receiver"].hold(rank)

    def sender_rooms_made_by(self, at: float) -> list[SenderRoom]:
        """The sender rooms made by monotonic time ``at`` (and a few made just after it),
        oldest first, without looking at younger ones."""
        return [room for _, room in _made_by(self.sender, at + _MADE_BEFORE_ROOM_S)]

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
            "credits_held": sum(len(r.credits) for r in ranks),
            "tombstones": len(self.tombstones),
            "successor_notices": len(self.successor_notices),
            "landing_gates": len(self.gates),
        }

    def all_sources(self) -> Iterator[Source]:
        for room in self.sender.values():
            yield from room.sources.values()

    def all_receivers(self) -> Iterator[Receiver]:
        for room in self.receiver.values():
            yield from room.ranks.values()

    def unfinished_sources(self) -> list[Source]:
        """The sources held that are not over (terminal with their pages settled)."""
        return list(self.tallies["sender"].unfinished)  # type: ignore[arg-type]

    def unfinished_receivers(self) -> list[Receiver]:
        """The receivers held that are not over."""
        return list(self.tallies["receiver"].unfinished)  # type: ignore[arg-type]

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
        # Nothing younger than the shortest wait can go: the scan stops at the
        # first room made after it (rooms are kept in the order they were made).
        for side, table in (("sender", self.sender), ("receiver", self.receiver)):
            for room_id, room in _made_by(table, now - min(ttl_seconds, orphan_seconds)):
                members: MutableMapping[RankKey, Any] = room.sources if isinstance(room, SenderRoom) else room.ranks
                for member in [k for k, p in members.items() if p.expired(now, ttl_seconds, unsettled)]:
                    gone = members.pop(member)
                    self.tallies[side].drop(gone)
                    if on_evict is not None:
                        on_evict(gone)
                    self.gates.pop((room_id, member), None)  # (a rank's is gone when it ends: this is a guard)
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
        # Tombstones expire in the order they were made (one TTL), but for
        # those made with a TTL of 0 (tests): those are looked for everywhere.
        expired = []
        for tomb, expiry in self.tombstones.items():
            if expiry > now:
                if tombstone_ttl_seconds > 0:
                    break
                continue
            expired.append(tomb)
        for tomb in expired:
            del self.tombstones[tomb]
        notice_ttl = tombstone_ttl_seconds if notice_ttl_seconds is None else notice_ttl_seconds
        for notice in [k for k, (_, at) in self.successor_notices.items() if now - at >= notice_ttl]:
            del self.successor_notices[notice]
        return removed


def _made_by(table: dict[int, Any], at: float) -> list[tuple[int, Any]]:
    """(room id, room) of ``table``'s rooms made by ``at``, oldest first.

    A table's rooms are in the order they were made (a room is added once,
    when made, and never again), so the walk stops at the first one made
    after ``at``: its cost is the rooms old enough, not every room. A room
    whose ``created_at`` is out of that order is only seen once those made
    before it are old enough too.
    """
    found = []
    for room_id, room in table.items():
        if room.created_at > at:
            break
        found.append((room_id, room))
    return found

"""The receiver side of rooms, as a state machine without I/O.

A **receiver** is one decode engine rank's side of one room. Its life:

1. ``expect`` (ExpectRoom) validates the destination indices, records the
   room (BOOTSTRAPPING) and asks for the sender's broker to be found
   (``FindSender``: handshake, retried up to the bootstrap timeout).
2. ``sender_found``: it computes which sources owe it what
   (``mapping.plan_sources``), records that plan and only then registers the
   room with the sender's broker (``RegisterRoom``), since the sender may
   start writing the moment it has the transfer info. A rank whose sources
   live on several brokers (a sender group spread over hosts, found through
   etcd) has one ``SenderLeg`` per broker and registers with each, for the
   sources it holds. ``room_registered`` from every one: WAITING_FOR_INPUT;
   the data timeout runs from here.
3. ``notices``: each NIXL notification says one part of one chunk of one
   source landed. A staged part is scattered from the receive staging
   buffer into the pages first (``Scatter`` -> ``scattered``). TRANSFERRING.
4. SUCCESS when every source it expects, counted by unique (group, tp rank,
   pp rank) (lesson 2), is complete: every part of every chunk of its last
   notice's count landed, the aux row if it asked for one, and every state
   component it listed with indices (lesson 1).
5. Failure (abort from the engine, the operator or the sender's broker; a
   source's report; a timeout; a lost peer or engine; a mismatch) keeps the
   first cause and tells its sender brokers (``AbortAtPeer``; not the one
   that told it, or is gone), or, if one went away, whichever broker answers
   at its address next (``TellSuccessor``). The pages are settled (``pages_settled``) only when
   nothing can land in them any more: every source completed, settled,
   owes no data, or its broker is gone — and no scatter is running.

Notices for rooms that are not here are counted and dropped; they never
create a room (lesson 6). Every method leaves effects
(``kvbroker.broker.effects``) in the outbox; :meth:`ReceiverCore.take`
hands them to the executor.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import structlog
from google.protobuf.message import DecodeError

from kvbroker.broker import telemetry
from kvbroker.broker.memory import Reservation
from kvbroker.broker.rooms._checksum import chunk_checksum
from kvbroker.broker.rooms._effects import (
    AbortAtPeer,
    Effect,
    FindSender,
    Publish,
    RegisterRoom,
    ReleaseStaging,
    RoomEnded,
    Scatter,
    TellSuccessor,
)
from kvbroker.broker.rooms._records import (
    BOOTSTRAPPING,
    FAILED,
    SUCCESS,
    TRANSFERRING,
    WAITING_FOR_INPUT,
    ReceiverRoom,
    RoomTables,
    Side,
    cause,
    cause_of,
)
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    NotFound,
)
from kvbroker.plan import (
    MAX_PARTS,
    NO_INDICES,
    Block,
    GroupShape,
    IndexArray,
    Layout,
    RankKey,
    SourcePlan,
    TokenRange,
    check_room_indices,
    check_state_supported,
    encode_indices,
    kv_block,
    kv_regions,
    landing_blocks,
    packed_bytes,
    plan_sources,
    rank_key,
    slice_side,
    state_regions,
    transfer_pool,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["Landing", "Receiver", "ReceiverCore", "SourceExpectation", "StagingKey"]

log = structlog.get_logger(__name__)

#: (memory kind, device) of a receive staging pool.
PoolKey = tuple[int, int]
#: (source, chunk, part) of a staged part.
StagingKey = tuple[RankKey, int, int]
#: ``components_seen`` of a source that sent no state yet (shared: most never do).
NO_COMPONENTS: frozenset[str] = frozenset()


# -- records -----------------------------------------------------------------


@dataclass(eq=False, slots=True)
class SenderLeg:
    """One sender broker a receiver rank reads from: one, unless the sender
    group's ranks live on several hosts and this rank's sources with them
    (found through etcd, ``discovery.find_in_fleet``)."""

    broker_id: str
    address: str
    #: The sender ranks (tp, pp) it holds for this rank; None: all of them.
    ranks: frozenset[tuple[int, int]] | None = None
    #: It may have the transfer info (so it may write).
    registered: bool = False
    #: A RegisterRoom call to it is out: which process it reaches is not
    #: known until it returns, so a peer loss meanwhile leaves it to the call.
    registering: bool = False

    def holds(self, source: RankKey) -> bool:
        return self.ranks is None or (source.tp_rank, source.pp_rank) in self.ranks


@dataclass(eq=False, slots=True)
class SourceExpectation:
    """What a receiver rank waits for from one source."""

    plan: SourcePlan
    #: The broker that holds the source.
    leg: SenderLeg
    expects_aux: bool
    expected_components: frozenset[str]
    #: chunk index -> the parts received, as a bit mask (bit ``i``: part ``i``;
    #: a notice's part index is checked against ``MAX_PARTS`` first).
    parts_received: dict[int, int] = field(default_factory=dict)
    parts_expected: dict[int, int] = field(default_factory=dict)
    #: chunk index -> (offset in the receiver's pages, pages) of the chunk
    #: (the pages it completed, when the page sizes differ).
    chunk_pages: dict[int, tuple[int, int]] = field(default_factory=dict)
    #: Different page sizes: chunk index -> the room tokens it wrote
    #: [begin, end) (chunks that wrote none are absent). None otherwise.
    chunk_tokens: dict[int, tuple[int, int]] | None = None
    total_chunks: int | None = None
    aux_seen: bool = False
    components_seen: frozenset[str] = NO_COMPONENTS
    complete: bool = False
    #: The source told us nothing of its is in flight (after a failure).
    settled: bool = False
    #: Chunks with a staged or packed part that landed after the rank failed:
    #: never scattered, so their pages did not arrive.
    unapplied: frozenset[int] = frozenset()

    def has_part(self, chunk: int, part: int) -> bool:
        return bool(self.parts_received.get(chunk, 0) >> part & 1)

    def parts_of(self, chunk: int) -> int:
        return self.parts_received.get(chunk, 0).bit_count()

    def chunks_landed(self) -> int:
        return sum(1 for c, mask in self.parts_received.items() if mask.bit_count() == self.parts_expected.get(c, -1))

    def pages_landed(self) -> int:
        return sum(pages for _, pages in self.chunk_pages.values())

    def landed_positions(self, first: int, page_size: int) -> set[int]:
        """Positions in the receiver's pages (which hold room pages from
        ``first``, of ``page_size`` tokens) that this source wrote whole: of the
        chunks every part of which landed, and, when the page sizes differ,
        whose earlier tokens came with chunks that landed too."""
        done = {chunk for chunk in self.chunk_pages if self.parts_of(chunk) == self.parts_expected.get(chunk, -1)} - self.unapplied
        return {
            position
            for chunk in done
            for position in range(self.chunk_pages[chunk][0], sum(self.chunk_pages[chunk]))
            if self.chunk_tokens is None or self._whole(chunk, (first + position) * page_size, done)
        }

    def _whole(self, chunk: int, page_begin: int, done: set[int]) -> bool:
        """Whether every chunk that wrote tokens of the page beginning at room
        token ``page_begin`` (``chunk`` wrote its last ones) landed. Chunks
        are consecutive in tokens, so those are ``chunk`` and the ones before
        it back to the one that wrote ``page_begin``."""
        assert self.chunk_tokens is not None
        while True:
            span = self.chunk_tokens.get(chunk)
            if chunk not in done or span is None:
                return False
            if span[0] <= page_begin:
                return True
            chunk -= 1

    def all_parts_landed(self) -> bool:
        """Every part of every chunk of the source's last notice's count has landed."""
        assert self.total_chunks is not None
        return all(
            self.parts_of(chunk) == self.parts_expected.get(chunk, -1) for chunk in range(self.total_chunks)
        )


@dataclass(eq=False, slots=True)
class Receiver(Side):
    """A receiver engine rank's side of a room."""

    sender_address: str = ""
    sender_group: str = ""
    pages: IndexArray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    aux_row: int | None = None
    state_indices: dict[str, IndexArray] = field(default_factory=dict)
    #: The leading pages of the room this rank already holds (its prefix
    #: cache): ``pages`` are the room's pages after them.
    prefix_pages: int = 0
    #: Every chunk is checked against the sender's checksum (``checksum``).
    verify_checksum: bool = False
    #: Sources this rank waits for; None until the plan is made.
    expected: SmallMap[RankKey, SourceExpectation] | None = None
    #: The sender brokers it reads from, once found (one, usually).
    legs: tuple[SenderLeg, ...] = ()
    #: When every sender broker accepted the room (the data timeout runs from here).
    registered_at: float | None = None
    #: Staging reservations made for senders' parts: (source, chunk, part) ->
    #: (pool, reservation) in this broker's receive staging. Released after
    #: the part is scattered, or when the rank ends and its pages are settled.
    staging: dict[StagingKey, tuple[PoolKey, Reservation]] = field(default_factory=dict)
    #: Staged parts being scattered into the pages right now (a dict used as
    #: a set: an empty dict is a quarter of an empty set's size).
    scattering: dict[StagingKey, None] = field(default_factory=dict)
    #: While its sender is not found yet: why not, the last time it was looked for.
    waiting_for: str = ""

    def holds_resources(self) -> bool:
        return bool(self.scattering) or (bool(self.staging) and not self.pages_settled)

    def known_prefix(self) -> int:
        return self.prefix_pages

    def leg(self, broker_id: str) -> SenderLeg | None:
        """The sender broker ``broker_id`` of this rank, if it is one."""
        return next((leg for leg in self.legs if leg.broker_id == broker_id), None)

    @property
    def peer_broker_id(self) -> str | None:
        """The sender broker(s), comma-separated (logs, Admin); None until found."""
        return ",".join(leg.broker_id for leg in self.legs) if self.legs else None

    @property
    def registered_with_sender(self) -> bool:
        """A sender broker may have the transfer info (so it may write)."""
        return any(leg.registered for leg in self.legs)

    @property
    def registering(self) -> bool:
        return any(leg.registering for leg in self.legs)

    def status(self) -> common_pb2.RoomStatus:
        status = Side.status(self)
        if self.waiting_for and self.state == BOOTSTRAPPING:
            status.waiting_for = self.waiting_for
        if self.state == FAILED and self.pages_settled and self.pages.size:
            status.landed_pages.packed = encode_indices(self.pages[sorted(self.landed_positions())]).packed
        return status

    def landed_positions(self) -> set[int]:
        """Positions in ``pages`` that arrived whole: every source that writes
        them delivered them (all the parts of a chunk that covers them).
        Meaningful once the pages are settled (nothing can still land)."""
        if self.state == SUCCESS:
            return set(range(int(self.pages.size)))
        writers = [e for e in (self.expected or {}).values() if e.plan.writes_data]
        if not writers or not self.registered_with_sender:
            return set()
        first, size = self.prefix_pages, self.engine.layout.page_size_tokens
        landed = writers[0].landed_positions(first, size)
        for exp in writers[1:]:
            landed &= exp.landed_positions(first, size)
        return landed


@dataclass(frozen=True, slots=True)
class Landing:
    """A staged or packed part that landed in the receive staging buffer, to scatter."""

    key: StagingKey
    pool: PoolKey
    reservation: Reservation
    nbytes: int
    #: Where its bytes go in the rank's memory, in packing order (``packing``).
    blocks: tuple[Block, ...]
    notice: peer_pb2.TransferNotice


# -- the state machine ---------------------------------------------------------


class ReceiverCore:
    """Every receiver rank of this broker. No I/O: calls leave effects (:meth:`take`)."""

    def __init__(
        self,
        *,
        broker_id: str,
        rooms: RoomTables,
        counters: Counters,
        on_bytes: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self._id = broker_id
        self._rooms = rooms
        self._counters = counters
        self._on_bytes = on_bytes
        self._out: list[Effect] = []
        self._open: set[Receiver] = set()
        #: Addresses being told of lost rooms (TellSuccessor), and when last tried.
        self._telling: set[str] = set()
        self._told_at: dict[str, float] = {}

    def take(self) -> list[Effect]:
        """The effects of the calls so far, in order; the outbox is emptied."""
        out, self._out = self._out, []
        return out

    def awaiting_data(self) -> bool:
        """Whether a rank still waits for notices (the data plane polls for them
        then): an open one, or a failed one whose pages may still be written
        (the notice of a write in flight settles them). Ranks leave ``_open``
        as they settle (``_changed``), or in ``tick`` once evicted unsettled:
        this is called after every batch of events and must not scan."""
        return bool(self._open)

    def _recorded(self, rank: Receiver) -> bool:
        """Whether ``rank`` is still in the room table (not evicted)."""
        room = self._rooms.receiver.get(rank.room)
        return room is not None and room.ranks.get(rank.key) is rank

    # -- engine calls ----------------------------------------------------
    def expect(
        self,
        engine: Engine,
        room_id: int,
        *,
        sender_address: str,
        sender_group: str,
        pages: IndexArray,
        aux_row: int | None,
        state: dict[str, IndexArray],
        prefix_pages: int = 0,
        verify_checksum: bool = False,
    ) -> Receiver:
        """Open ``room_id`` for receiving into ``engine`` (ExpectRoom) and start
        bootstrapping; ``prefix_pages``: the leading pages of the room it holds."""
        if not sender_group:
            raise InvalidArgument("sender.group must name the prefill engine group")
        if self._rooms.is_tombstoned("receiver", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        check_room_indices(engine.layout, pages=pages, aux_row=aux_row, state=state)
        room = self._rooms.receiver.get(room_id)
        if room is not None and engine.key in room.ranks:
            raise AlreadyExists(f"engine rank {engine.key} already expects room {room_id}")
        if room is None:
            room = self._rooms.receiver[room_id] = ReceiverRoom(room_id)
        rank = Receiver(
            room=room_id,
            engine=engine,
            listener=self._changed,
            sender_address=sender_address,
            sender_group=sender_group,
            pages=pages,
            aux_row=aux_row,
            prefix_pages=prefix_pages,
            verify_checksum=verify_checksum,
            # Lesson 1: a component listed with no indices is not expected.
            state_indices={name: indices for name, indices in state.items() if indices.size},
        )
        room.ranks[engine.key] = rank
        self._open.add(rank)
        # The room span continues the engine's trace (the context its
        # ExpectRoom came with) or starts one; the bootstrap runs in it, so
        # the handshake and the registration (and, through the registration,
        # the sender's side) join the trace.
        telemetry.open_room_span(rank, "receiver", None)
        self._out.append(FindSender(rank))
        return rank

    def abort(self, engine: Engine, room_id: int, reason: str, *, by: str = "engine") -> Receiver | None:
        """Fail the engine's side of the room and tell the sender's broker. Idempotent."""
        room = self._rooms.receiver.get(room_id)
        rank = room.ranks.get(engine.key) if room is not None else None
        if rank is not None:
            why = reason or "aborted by the receiving engine"
            telemetry.child_done(rank.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self.fail(rank, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return rank

    def fail(self, rank: Receiver, why: common_pb2.FailureCause, *, told_by: str | None = None) -> None:
        """Fail ``rank`` (first cause wins); tell its sender brokers, but
        ``told_by`` (the one that told us, or that is gone)."""
        if not rank.fail(why, settled=_nothing_in_flight(rank)):
            return
        if rank.pages_settled:
            self._release_staging(rank)
        self._counters.rooms_failed += 1
        log.info(
            "receive_failed",
            room=rank.room,
            engine=rank.engine.label,
            peer=rank.peer_broker_id or rank.sender_address,
            cause=why.message,
            **telemetry.span_ids(rank.span),
        )
        for leg in rank.legs:
            # Also when the room never reached the sender's broker (a plan it
            # cannot do): its engine must not wait for a transfer info.
            if leg.broker_id != told_by:
                self._out.append(AbortAtPeer(leg.broker_id, rank.room, why))
        if not rank.legs and told_by is None:
            # Its sender's broker was never reached (down, or restarting):
            # whoever answers at that address next is told.
            self._remember_for_successor(rank.sender_address, rank.room, why)

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its ranks. Returns how many failed."""
        ranks = [r for r in self._rooms.all_receivers() if r.engine is engine]
        for rank in ranks:
            self.fail(rank, why)
        return sum(1 for r in ranks if r.cause is why)

    # -- bootstrapping ---------------------------------------------------
    def sender_found(self, rank: Receiver, found: str | list[SenderLeg], layouts: list[Layout]) -> None:
        """The sender's broker answered and has the group: plan, then register
        the room. ``found``: that broker's id, or (a group whose ranks live on
        several hosts, found through etcd) one leg per broker holding some of
        this rank's sources: the room is registered with each, for its sources."""
        rank.mark("handshaken")
        rank.waiting_for = ""
        rank.legs = (SenderLeg(found, rank.sender_address),) if isinstance(found, str) else tuple(found)
        if rank.terminal:
            # Failed while we looked for the sender: its engine may have
            # opened the room there already; tell it (the way a broker that
            # was not there when the room failed is told, when it was
            # remembered for it).
            for leg in rank.legs:
                if (leg.address, rank.room) in self._rooms.successor_notices:
                    self._tell_successor_now(leg.address)
                elif rank.cause is not None:
                    self._out.append(AbortAtPeer(leg.broker_id, rank.room, rank.cause))
            return
        try:
            sender_shape, receiver_shape = GroupShape.of(layouts[0]), GroupShape.of(rank.engine.layout)
            if rank.state_indices:
                check_state_supported(sender_shape, receiver_shape)
            plans = plan_sources(sender_shape, rank.sender_group, receiver_shape, rank.key.tp_rank, rank.key.pp_rank)
            placed = [(p, _leg_of(rank, p.rank)) for p in plans]
        except KvBrokerError as exc:
            self.fail(rank, cause_of(exc, self._id))
            return
        rank.expected = SmallMap((p.rank, _expectation(rank, p, leg)) for p, leg in placed)
        for leg in rank.legs:
            mine = [p for p, at in placed if at is leg]
            if not mine:
                continue  # (a leg the plan does not need: nothing to register there)
            request = peer_pb2.RegisterRoomRequest(
                protocol_version=PROTOCOL_VERSION,
                room=rank.room,
                receiver_broker_id=self._id,
                receiver=rank.key.to_proto(),
                receiver_generation=rank.engine.generation,
                sender_group=rank.sender_group,
                pages=encode_indices(rank.pages),
                state=[common_pb2.StateIndices(component=n, indices=encode_indices(i)) for n, i in rank.state_indices.items()],
                sources=[p.to_proto() for p in mine],
                sender_broker_id=leg.broker_id,
                prefix_pages=rank.prefix_pages,
                verify_checksum=rank.verify_checksum,
            )
            if rank.aux_row is not None:
                request.aux_row = rank.aux_row
            leg.registered = leg.registering = True
            self._out.append(RegisterRoom(rank, leg, request))

    def still_looking(self, rank: Receiver, why: str) -> None:
        """Its sender was looked for and not found yet (retried until the
        bootstrap timeout): the engine's status says why, when that changes."""
        if rank.state == BOOTSTRAPPING and why != rank.waiting_for:
            rank.waiting_for = why
            self._out.append(Publish(rank.engine.engine_id, rank.status()))

    def bootstrap_failed(self, rank: Receiver, error: KvBrokerError) -> None:
        """The sender's broker or group could not be found within the bootstrap timeout."""
        self.fail(rank, cause_of(error, self._id))

    def registration_stale(self, rank: Receiver, leg: SenderLeg) -> None:
        """The sender broker ``leg`` refused the registration as stale
        (ABORTED: its view of us is old, or it restarted and never met us): it
        did not take the room. The executor handshakes again, then calls
        :meth:`register_again`."""
        leg.registering = leg.registered = False

    def register_again(self, rank: Receiver, leg: SenderLeg, now: str) -> bool:
        """After a fresh handshake, register with ``now``, the process found at
        ``leg``'s address (maybe a restarted one). False: the rank ended
        meanwhile, do not."""
        if rank.terminal:
            return False
        leg.broker_id = now
        leg.registered = leg.registering = True
        return True

    def registration_error(self, rank: Receiver, leg: SenderLeg, error: KvBrokerError) -> None:
        """Registering with ``leg`` ended in ``error`` before the room reached it."""
        leg.registering = False
        self.bootstrap_failed(rank, error)

    def room_registered(self, rank: Receiver, leg: SenderLeg, broker_id: str, *, still_known: bool) -> None:
        """The sender broker process ``broker_id`` (at ``leg``'s address)
        accepted the room. ``still_known``: that process is still the one we
        track (it was not lost meanwhile)."""
        leg.registering = False
        leg.broker_id = broker_id  # the process that has the room writes it
        if not still_known:
            # The process that took the room died or restarted while the call
            # was out (peer_lost left this rank to us).
            why = cause(
                common_pb2.FAILURE_KIND_PEER,
                f"peer broker {leg.address} ({broker_id}) went away while room {rank.room} registered there",
                self._id,
            )
            self._lose_sender(rank, why, leg)
            return
        if rank.terminal:
            # Aborted while we registered: the sender has the info now.
            if rank.cause is not None:
                self._out.append(AbortAtPeer(broker_id, rank.room, rank.cause))
            return
        if rank.registering:
            return  # another sender broker has not answered yet
        rank.registered_at = time.monotonic()
        rank.mark("registered")
        rank.wait_span = telemetry.start_span("kvbroker.wait_for_data", parent=rank.span)
        rank.advance(WAITING_FOR_INPUT)

    def registration_failed(self, rank: Receiver, leg: SenderLeg, error: KvBrokerError, *, maybe_delivered: bool) -> None:
        """RegisterRoom with ``leg`` failed. ``maybe_delivered``: it may still
        have reached the sender (a timeout, a broken connection), so the sender
        may write: the pages are not settled until it says so or is lost."""
        leg.registering = False
        leg.registered = leg.registered and maybe_delivered
        self.fail(rank, cause_of(type(error)(f"the sender's broker refused room {rank.room}: {error.message}"), self._id))

    # -- data --------------------------------------------------------------
    def notices(self, items: list[tuple[str, bytes]]) -> None:
        """NIXL notifications: each says one part of one chunk of one source landed."""
        for agent, payload in items:
            self._notice(agent, payload)

    def _notice(self, agent: str, payload: bytes) -> None:
        try:
            notice = peer_pb2.TransferNotice.FromString(payload)
        except DecodeError:
            self._counters.bad_notices += 1
            log.warning("bad_notification", agent=agent, size=len(payload))
            return
        if notice.protocol_version != PROTOCOL_VERSION:
            self._counters.bad_notices += 1
            log.warning("bad_notification", agent=agent, protocol_version=notice.protocol_version, speaks=PROTOCOL_VERSION)
            return
        room = self._rooms.receiver.get(notice.room)
        rank = room.ranks.get(rank_key(notice.receiver)) if room is not None else None
        leg = rank.leg(notice.sender_broker_id) if rank is not None else None
        if rank is None or (rank.legs and leg is None):
            self._counters.late_notices += 1
            log.debug("late_notification", room=notice.room, receiver=str(rank_key(notice.receiver)))
            return
        source_key = rank_key(notice.source)
        exp = rank.expected.get(source_key) if rank.expected is not None else None
        if exp is None or exp.leg is not leg:
            self.fail(
                rank,
                cause(common_pb2.FAILURE_KIND_MISMATCH, f"an unexpected source {source_key} wrote into the room", self._id),
            )
            return
        key = (source_key, notice.chunk_index, notice.part)
        if not notice.part < max(1, notice.parts) <= MAX_PARTS:
            self.fail(
                rank,
                cause(
                    common_pb2.FAILURE_KIND_MISMATCH,
                    f"source {source_key} sent a notice for part {notice.part} of {notice.parts} (at most {MAX_PARTS})",
                    self._id,
                ),
            )
            return
        if exp.has_part(notice.chunk_index, notice.part) or key in rank.scattering:
            return
        if notice.token_end and (problem := _token_problem(rank, notice)):
            self.fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, f"source {source_key} {problem}", self._id))
            return
        if notice.staged:
            if rank.terminal:
                # A failed rank scatters nothing more: the part counts as
                # settled, but its chunk's pages did not arrive.
                exp.unapplied = exp.unapplied | {notice.chunk_index}
            else:
                try:
                    landing = self._landing(rank, key, exp, notice)
                except KvBrokerError as exc:
                    self.fail(rank, cause_of(exc, self._id))
                    return
                rank.scattering[key] = None
                self._out.append(Scatter(rank, landing))
                return
        self._landed(rank, source_key, exp, notice)

    def scattered(self, rank: Receiver, landing: Landing, error: KvBrokerError | None) -> None:
        """A staged or packed part was unpacked into the pages, or could not be
        (it arrived corrupted, or the copy failed): then it never counts as
        landed, so its pages are not reported among those that arrived."""
        rank.scattering.pop(landing.key, None)
        held = rank.staging.pop(landing.key, None)
        if held is not None:
            self._out.append(ReleaseStaging(((*held[0], held[1]),)))
        exp = rank.expected.get(landing.key[0]) if rank.expected is not None else None
        if error is not None:
            self.fail(rank, cause_of(error, self._id))
        if exp is not None and error is None:
            self._landed(rank, landing.key[0], exp, landing.notice)
        else:
            self._maybe_settled(rank)

    def _landed(self, rank: Receiver, source_key: RankKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> None:
        exp.parts_received[notice.chunk_index] = exp.parts_received.get(notice.chunk_index, 0) | 1 << notice.part
        exp.parts_expected[notice.chunk_index] = max(1, notice.parts)
        exp.chunk_pages[notice.chunk_index] = (notice.page_offset, notice.pages)
        if notice.token_end > notice.token_begin:
            if exp.chunk_tokens is None:
                exp.chunk_tokens = {}
            exp.chunk_tokens[notice.chunk_index] = (notice.token_begin, notice.token_end)
        exp.aux_seen |= notice.aux
        if notice.state_components:
            exp.components_seen = exp.components_seen.union(notice.state_components)
        if notice.is_last:
            exp.total_chunks = notice.total_chunks
        if rank.verify_checksum and exp.parts_of(notice.chunk_index) == exp.parts_expected[notice.chunk_index]:
            self._verify(rank, source_key, exp, notice)
        rank.bytes += notice.bytes
        self._counters.bytes_received += notice.bytes
        self._on_bytes(notice.bytes)
        rank.mark("first_byte")
        assert rank.expected is not None
        rank.chunks = sum(e.chunks_landed() for e in rank.expected.values())
        if rank.terminal:
            # Data still landing after an abort: once a source's parts have
            # all landed, nothing of it is in flight any more.
            if exp.total_chunks is not None and exp.all_parts_landed():
                exp.complete = True
            self._maybe_settled(rank)
            return
        rank.advance(TRANSFERRING)
        self._check_source(rank, source_key, exp)
        if rank.state != FAILED and all(e.complete for e in rank.expected.values()):
            rank.mark("last_byte")
            telemetry.child_done(rank.span, "kvbroker.completion", {"kvbroker.sources": len(rank.expected)})
            if rank.advance(SUCCESS):
                self._counters.rooms_succeeded += 1
                self._release_staging(rank)
                log.debug(
                    "receive_done",
                    room=rank.room,
                    engine=rank.engine.label,
                    peer=rank.peer_broker_id,
                    bytes=rank.bytes,
                    **telemetry.span_ids(rank.span),
                )

    def completion_report(self, report: peer_pb2.CompletionReport) -> None:
        """A source's out-of-band report: it failed, and maybe it settled."""
        room = self._rooms.receiver.get(report.room)
        rank = room.ranks.get(rank_key(report.receiver)) if room is not None else None
        if rank is None or rank.leg(report.sender_broker_id) is None:
            self._counters.late_notices += 1
            return
        exp = rank.expected.get(rank_key(report.source)) if rank.expected is not None else None
        if report.settled and exp is not None and exp.leg.broker_id == report.sender_broker_id:
            exp.settled = True
        if report.HasField("failure"):
            self.fail(rank, report.failure, told_by=report.sender_broker_id)
        self._maybe_settled(rank)

    # -- staging -------------------------------------------------------------
    def staging_wanted(self, request: peer_pb2.ReserveStagingRequest) -> tuple[PoolKey, Reservation | None]:
        """A sender's prefetch for one staged part: which receive pool to reserve
        in, and the reservation already made for it (idempotent) or None."""
        rank = self._staging_rank(request)
        key = (rank_key(request.source), request.chunk_index, request.part)
        held = rank.staging.get(key)
        if held is not None:
            return held
        if rank.terminal:
            raise FailedPrecondition(f"room {request.room} already ended on the receiver")
        return _pool_of(rank), None

    def staging_granted(
        self, request: peer_pb2.ReserveStagingRequest, pool: PoolKey, reservation: Reservation
    ) -> Reservation:
        """Record a reservation made for ``request``. ``FailedPrecondition`` if the
        room ended while it waited for room (the caller releases it then)."""
        rank = self._staging_rank(request)
        key = (rank_key(request.source), request.chunk_index, request.part)
        held = rank.staging.get(key)
        if held is not None:
            self._out.append(ReleaseStaging(((*pool, reservation),)))
            return held[1]
        if rank.terminal:
            raise FailedPrecondition(f"room {request.room} ended while it waited for staging")
        rank.staging[key] = (pool, reservation)
        return reservation

    def _staging_rank(self, request: peer_pb2.ReserveStagingRequest) -> Receiver:
        room = self._rooms.receiver.get(request.room)
        rank = room.ranks.get(rank_key(request.receiver)) if room is not None else None
        if rank is None or rank.leg(request.sender_broker_id) is None:
            raise NotFound(f"room {request.room} has no receiver {rank_key(request.receiver)} expecting this broker")
        return rank

    def _landing(self, rank: Receiver, key: StagingKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> Landing:
        held = rank.staging.get(key)
        if held is None or held[1].offset != notice.staging_offset or notice.staging_bytes > held[1].nbytes:
            raise FailedPrecondition(f"source {key[0]} wrote a staged part this broker did not reserve")
        plan = exp.plan
        layout = rank.engine.layout
        if notice.packed:
            blocks = landing_blocks(layout, plan, rank.pages, rank.prefix_pages, rank.aux_row, rank.state_indices, notice)
            what = "packed part"
        else:
            side = slice_side(layout, plan.dst_head_start, plan.num_heads, "receiver")
            regions = kv_regions(layout, plan.layer_begin, plan.layer_end, "receiver")
            pages = rank.pages[notice.page_offset : notice.page_offset + notice.pages]
            if pages.size != notice.pages:
                raise FailedPrecondition(f"source {key[0]}'s staged part names pages this rank does not have")
            blocks = [kv_block(layout, regions, pages, side, tokens=False)]
            what = "staged part"
        if packed_bytes(blocks) != notice.staging_bytes:
            raise FailedPrecondition(
                f"source {key[0]}'s {what} is {notice.staging_bytes} bytes; this rank's pages, heads, rows and state "
                f"it names come to {packed_bytes(blocks)}"
            )
        return Landing(
            key=key, pool=held[0], reservation=held[1], nbytes=notice.staging_bytes, blocks=tuple(blocks), notice=notice
        )

    # -- peers -----------------------------------------------------------------
    def peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str) -> int:
        """The sender's broker aborted the room: fail our ranks that it serves."""
        room = self._rooms.receiver.get(room_id)
        if room is None:
            return 0
        ranks = [r for r in room.ranks.values() if r.leg(from_broker) is not None]
        for rank in ranks:
            self.fail(rank, why, told_by=from_broker)
        return len(ranks)

    def peer_settled(self, broker_id: str, room_id: int) -> None:
        """The sender's broker answered an abort with "nothing of the room is in
        flight from here" (its sources may even be evicted already, so no report
        would come): the failed ranks it fed are settled as far as it goes."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            if rank.leg(broker_id) is not None and rank.state == FAILED:
                self._settle_sources(rank, broker_id)

    def abort_undelivered(self, broker_id: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """An abort could not reach ``broker_id`` (it went away): tell the broker
        that answers at its address next."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            leg = rank.leg(broker_id)
            if leg is not None:
                self._remember_for_successor(leg.address, room_id, why)

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The sender's broker ``broker_id`` is gone: fail our ranks it feeds.

        A dead broker writes nothing more, so their pages are settled. A rank
        whose registration is out learns where it landed when the call returns
        (:meth:`room_registered`); one still bootstrapping registers with
        whoever answers at the address now.
        """
        lost = [
            (r, leg)
            for r in self._rooms.all_receivers()
            if (leg := r.leg(broker_id)) is not None and (leg.registered or r.terminal) and not leg.registering
        ]
        for rank, leg in lost:
            self._lose_sender(rank, why, leg)
        return len(lost)

    def _lose_sender(self, rank: Receiver, why: common_pb2.FailureCause, leg: SenderLeg) -> None:
        """Fail ``rank``: its sender broker ``leg``'s process is gone, so
        nothing more can come from it (its other sender brokers are told). If
        it had the room, the broker that answers at its address next is told."""
        if not rank.terminal and leg.registered:
            self._remember_for_successor(leg.address, rank.room, why)
        self.fail(rank, why, told_by=leg.broker_id)
        self._settle_sources(rank, leg.broker_id)

    def _settle_sources(self, rank: Receiver, broker_id: str) -> None:
        """Nothing of the room is in flight from sender broker ``broker_id`` any more."""
        for exp in (rank.expected or {}).values():
            if exp.leg.broker_id == broker_id:
                exp.settled = True
        self._maybe_settled(rank)

    def has_business(self, broker_id: str) -> bool:
        """Whether a rank still waits on (or may still be written by) ``broker_id``."""
        return any(
            r.leg(broker_id) is not None and (not r.terminal or not r.pages_settled) for r in self._rooms.all_receivers()
        )

    # -- timers ----------------------------------------------------------------
    def tick(self, now: float, *, data_timeout_seconds: float, retry_seconds: float) -> None:
        """Time out ranks waiting for data; tell successors of lost rooms (every ``retry_seconds``)."""
        for rank in list(self._open):
            if rank.terminal and not self._recorded(rank):
                self._open.discard(rank)  # evicted before its pages settled
                continue
            if rank.terminal or rank.registered_at is None or now - rank.registered_at <= data_timeout_seconds:
                continue
            pending = [str(k) for k, e in (rank.expected or {}).items() if not e.complete]
            self.fail(
                rank,
                cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"waited {data_timeout_seconds:g} s for data from the sender's broker; sources not complete: {pending}",
                    self._id,
                ),
            )
        for address in {a for a, _ in self._rooms.successor_notices}:
            if now - self._told_at.get(address, -1e9) >= retry_seconds:
                self._tell_successor_now(address, now)
        for address in [a for a in self._told_at if now - self._told_at[a] > 10 * retry_seconds]:
            del self._told_at[address]

    def _tell_successor_now(self, address: str, now: float | None = None) -> None:
        if address in self._telling:
            return
        self._telling.add(address)
        self._told_at[address] = time.monotonic() if now is None else now
        self._out.append(TellSuccessor(address))

    def successor_notices(self, address: str) -> list[tuple[int, common_pb2.FailureCause]]:
        """Take the rooms to tell the broker now at ``address`` (they leave the table)."""
        out = []
        for key in [k for k in self._rooms.successor_notices if k[0] == address]:
            notice = self._rooms.successor_notices.pop(key)
            out.append((key[1], notice[0]))
        return out

    def successor_done(self, address: str) -> None:
        """A TellSuccessor finished (told, or unreachable: tried again later)."""
        self._telling.discard(address)

    # -- internals ---------------------------------------------------------------
    def _check_source(self, rank: Receiver, key: RankKey, exp: SourceExpectation) -> None:
        if exp.complete or exp.total_chunks is None or not exp.all_parts_landed():
            return
        problem = None
        if exp.expects_aux and not exp.aux_seen:
            problem = f"source {key} finished without sending aux row {rank.aux_row}"
        elif missing := exp.expected_components - exp.components_seen:
            problem = f"source {key} finished without sending state components {sorted(missing)}"
        elif exp.plan.writes_data and exp.pages_landed() != rank.pages.size:
            problem = f"source {key} sent {exp.pages_landed()} pages, this rank expects {rank.pages.size}"
        exp.complete = True
        if problem:
            self.fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))

    def _verify(self, rank: Receiver, source_key: RankKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> None:
        """Check a chunk whose parts all landed against the sender's checksum (fails the rank on a difference)."""
        if rank.terminal:
            return
        if not notice.HasField("checksum"):
            problem = f"source {source_key} sent chunk {notice.chunk_index} without the checksum this rank asked for"
        else:
            plan = exp.plan
            try:
                head = (
                    slice_side(rank.engine.layout, plan.dst_head_start, plan.num_heads, "receiver") if plan.head_sliced else None
                )
                # What moved packed was checked part by part (packed_checksum).
                if notice.kv_packed:
                    pages, tokens = NO_INDICES, None
                elif notice.token_end:
                    pages = NO_INDICES
                    tokens = TokenRange(rank.pages, rank.prefix_pages, notice.token_begin, notice.token_end)
                else:
                    pages, tokens = rank.pages[notice.page_offset : notice.page_offset + notice.pages], None
                aux_row = rank.aux_row if notice.is_last and exp.expects_aux and not notice.aux_packed else None
                got = chunk_checksum(rank.engine, plan, pages, head, aux_row, "receiver", tokens)
            except KvBrokerError as exc:
                self.fail(rank, cause_of(exc, self._id))
                return
            if got == notice.checksum:
                return
            problem = (
                f"chunk {notice.chunk_index} from source {source_key} arrived with checksum {got:08x}, the sender read "
                f"{notice.checksum:08x}: the transport corrupted it"
            )
        self._counters.checksum_mismatches += 1
        self.fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))

    def _maybe_settled(self, rank: Receiver) -> None:
        if not rank.pages_settled and rank.state == FAILED and _nothing_in_flight(rank):
            rank.mark_settled()
        if rank.pages_settled:
            self._release_staging(rank)

    def _release_staging(self, rank: Receiver) -> None:
        """The one release routine for a rank's staging reservations (room ended, settled)."""
        held = [(*pool, reservation) for key, (pool, reservation) in rank.staging.items() if key not in rank.scattering]
        if held:
            self._out.append(ReleaseStaging(tuple(held)))
        rank.staging = {k: v for k, v in rank.staging.items() if k in rank.scattering}

    def _remember_for_successor(self, address: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """The broker at ``address`` has not heard that ``room_id`` failed here: tell the next one that answers there."""
        if address:
            self._rooms.successor_notices.setdefault((address, room_id), (why, time.monotonic()))

    def _changed(self, side: Side) -> None:
        if side.terminal and side.pages_settled:
            self._open.discard(side)
        self._out.append(Publish(side.engine.engine_id, side.status()))
        if side.terminal and not side.ended:
            side.ended = True
            self._out.append(RoomEnded(side))


def _pool_of(rank: Receiver) -> PoolKey:
    """The receive staging pool for the rank: its KV's GPU's, or host memory."""
    return transfer_pool(rank.engine.layout, rank.engine.table)


def _leg_of(rank: Receiver, source: RankKey) -> SenderLeg:
    """The sender broker of ``source``; ``FailedPrecondition`` if none holds it."""
    for leg in rank.legs:
        if leg.holds(source):
            return leg
    raise FailedPrecondition(f"no sender broker found for source {source} of room {rank.room}")


def _expectation(rank: Receiver, plan: SourcePlan, leg: SenderLeg) -> SourceExpectation:
    """What ``rank`` waits for from the source of ``plan``, at ``leg``."""
    return SourceExpectation(
        plan=plan,
        leg=leg,
        expects_aux=plan.sends_aux and rank.aux_row is not None,
        expected_components=frozenset(
            name
            for name in rank.state_indices
            if plan.sends_state and state_regions(rank.engine.layout, name, plan.layer_begin, plan.layer_end)
        )
        or NO_COMPONENTS,
    )


def _nothing_in_flight(rank: Receiver) -> bool:
    """No source can still write into the rank's pages: the sender never had
    the room, or every source completed, settled, or owes no data; and no
    staged part is being unpacked into them."""
    if rank.scattering:
        return False
    if rank.expected is None:
        return True
    return all(e.complete or e.settled or not e.plan.writes_data or not e.leg.registered for e in rank.expected.values())


def _token_problem(rank: Receiver, notice: peer_pb2.TransferNotice) -> str | None:
    """What is wrong with a token-run notice (different page sizes), if anything:
    its tokens must be among the rank's pages, the pages it completes too."""
    size = rank.engine.layout.page_size_tokens
    lo, hi = rank.prefix_pages * size, (rank.prefix_pages + int(rank.pages.size)) * size
    if not lo <= notice.token_begin <= notice.token_end <= hi:
        return f"wrote room tokens [{notice.token_begin}, {notice.token_end}); this rank's pages hold [{lo}, {hi})"
    if notice.page_offset + notice.pages > rank.pages.size:
        return f"completed pages {notice.page_offset}..{notice.page_offset + notice.pages - 1}; this rank has {rank.pages.size}"
    return None

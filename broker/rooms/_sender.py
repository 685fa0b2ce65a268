"""The sender side of rooms, as a state machine without I/O.

A **source** is one prefill engine rank's side of one room. Its life:

1. ``begin`` (BeginSend) opens it; it is BOOTSTRAPPING until every receiver
   rank it serves has registered the room here (their transfer infos,
   ``transfer_info``, may come before or after BeginSend), then
   WAITING_FOR_INPUT.
2. ``chunk`` (SendChunk) accepts chunks of source pages, validated against
   the engine's regions; the last one carries the aux row and state.
3. Every accepted chunk is posted to every registered destination, in chunk
   order: :func:`~kvbroker.broker.parts.plan_chunk` splits it into parts,
   each a NIXL write with a ``TransferNotice`` (explicit completion,
   docs/design.md section 4). A staged part first reserves room at the
   receiver (``ReserveStaging`` -> ``staging_reserved``). The source counts
   its parts in flight until each settles (``part_settled``); TRANSFERRING
   meanwhile.
4. SUCCESS when every destination registered and every part through the
   last chunk settled DONE.
5. Failure (an abort from the engine, the operator or the receiver's broker;
   a NIXL error; a mismatch; a timeout; a lost peer or engine) keeps the
   first cause, stops posting, and tells each receiver's broker with a
   ``CompletionReport``; once no part of the source is in flight any more it
   says so (``settled``), so the receiver knows its pages are safe to reuse.

Transfer infos whose source never opens the room are answered too: when the
source's engine goes away (``engine_gone``) or after the orphan timeout
(``tick``), the receiver is told that source will never come, and that
receiver's info is never attached to that source again (its pages may have
been reused since).

Every method returns nothing but leaves effects (``kvbroker.broker.effects``)
in the outbox; :meth:`SenderCore.take` hands them to the executor.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import structlog
from opentelemetry import trace

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import XferState
from kvbroker.broker.rooms._checksum import chunk_checksum
from kvbroker.broker.rooms._effects import (
    Effect,
    PostPart,
    Publish,
    ReserveStaging,
    RoomEnded,
    SendReport,
)
from kvbroker.broker.rooms._records import (
    FAILED,
    SUCCESS,
    TRANSFERRING,
    WAITING_FOR_INPUT,
    RoomTables,
    SenderRoom,
    Side,
    cause,
    cause_of,
)
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    NotFound,
    PermissionDenied,
)
from kvbroker.plan import (
    FULL_PAGES,
    NO_INDICES,
    ChunkShape,
    IndexArray,
    KvPairs,
    PackLimit,
    PartKind,
    PartSpec,
    RankKey,
    SourcePlan,
    StagePolicy,
    TokenRange,
    check_chunk,
    check_declared_pages,
    check_room_indices,
    completed_pages,
    held_pages,
    kv_pairs,
    plan_chunk,
    same_token_count,
    slice_side,
    state_regions,
    token_runs,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine
    from kvbroker.broker.peers import RemoteEngine

__all__ = ["Chunk", "Destination", "Part", "PeerView", "SenderCore", "Source", "TransferInfo"]

log = structlog.get_logger(__name__)

#: KV pairings kept (``SenderCore._kv_pairs``): far more than the (engine,
#: receiver rank) pairs of a fleet; each is a few small arrays.
_KV_PLANS = 4096


# -- records -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunk:
    """One SendChunk of a source: pages fill the receiver's pages from ``page_offset``."""

    index: int
    pages: IndexArray
    page_offset: int
    is_last: bool
    aux_row: int | None
    state: dict[str, IndexArray]


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """A receiver rank's registration of a room with the sender's broker."""

    room: int
    receiver_broker_id: str
    receiver: RankKey
    receiver_generation: int
    sender_group: str
    pages: IndexArray
    aux_row: int | None
    state: dict[str, IndexArray]
    sources: tuple[SourcePlan, ...]
    #: The leading pages of the room the receiver already holds: ``pages``
    #: are the room's pages after them (incremental transfer).
    prefix_pages: int = 0
    #: The receiver checks every chunk against a checksum of what was read.
    verify_checksum: bool = False
    #: Tokens per page of the receiver (its room pages count in these); 0:
    #: not known (its engine was not described), taken as the sender's.
    page_size: int = 0
    received_at: float = field(default_factory=time.monotonic)
    #: The span current in the RegisterRoom call (the receiver's room span
    #: is its ancestor): the sender's room span joins that trace.
    trace_context: Any = None

    def plan_for(self, source: RankKey) -> SourcePlan | None:
        for plan in self.sources:
            if plan.rank == source:
                return plan
        return None


@dataclass(eq=False, slots=True)
class Destination:
    """What one source owes one receiver rank, and how far it got."""

    info: TransferInfo
    plan: SourcePlan
    #: Chunks of the source handed on for this receiver.
    posted_chunks: int = 0
    #: Parts posted (or being staged) and not settled yet.
    inflight: int = 0
    #: The last chunk (or the completion-only notice) was posted.
    last_posted: bool = False
    #: Every posted part settled DONE after the last one was posted.
    complete: bool = False
    #: The receiver was told of this source's failure.
    failure_reported: bool = False
    #: The receiver was told nothing is in flight any more.
    settle_reported: bool = False
    #: Prefetch requests answered for staged parts: (chunk, part) -> offset
    #: in the receiver's staging buffer. Dropped when the part settles.
    prefetch: dict[tuple[int, int], int] = field(default_factory=dict)
    #: The KV regions this source writes whole into this receiver, planned
    #: on the first chunk (``parts.kv_pairs``) for the receiver's generation.
    kv: KvPairs | None = None
    #: Different page sizes: the receiver's pages the chunks posted so far
    #: complete (``tokens.completed_pages``).
    completed: int = 0


@dataclass(eq=False, slots=True)
class Source(Side):
    """A sender engine rank's side of a room."""

    num_pages: int = 0
    #: The room page the first chunk starts at (its ``room_page``; 0 unless
    #: the sender sends only the pages after its receivers' prefix).
    first_page: int = 0
    chunk_list: list[Chunk] = field(default_factory=list)
    #: Pages accepted so far (the next chunk's page offset).
    cursor: int = 0
    last_received: bool = False
    destinations: SmallMap[RankKey, Destination] = field(default_factory=SmallMap)
    #: How many receiver ranks this source serves (known from the first plan).
    expected_destinations: int | None = None
    #: Parts in flight over all destinations.
    inflight: int = 0
    #: The span current in BeginSend, and whether the engine sent its own.
    begin_context: Any = None
    engine_traced: bool = False

    def known_prefix(self) -> int:
        """The smallest prefix its receivers hold, in this source's pages (0
        until one registered): whole pages of it when the page sizes differ."""
        size = self.engine.layout.page_size_tokens
        return min((held_pages(d.info.prefix_pages, d.info.page_size or size, size) for d in self.destinations.values()), default=0)

    def ready(self) -> bool:
        """All receivers this source serves have registered."""
        return self.expected_destinations is not None and len(self.destinations) >= self.expected_destinations

    def holds_resources(self) -> bool:
        return self.inflight > 0


@dataclass(eq=False, slots=True)
class Part:
    """One part of one chunk to one receiver, from planning until it settles."""

    source: Source
    dest: Destination
    chunk: Chunk
    index: int
    spec: PartSpec
    notice: peer_pb2.TransferNotice
    #: The receiver rank as its broker described it (layout, descriptor table).
    remote: RemoteEngine
    #: STAGED: where the receiver reserved room for the packed block.
    staging_buffer: peer_pb2.RemoteBuffer | None = None
    staging_offset: int = 0

    @property
    def kind(self) -> PartKind:
        return self.spec.kind

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def key(self) -> tuple[int, int]:
        return (self.notice.chunk_index, self.index)


class PeerView(Protocol):
    """What the sender state machine may read of the peer table."""

    def remote_engine(self, broker_id: str, rank: RankKey) -> RemoteEngine | None:
        """The receiver rank as broker ``broker_id`` last described it."""

    def receive_staging_bytes(self, broker_id: str, kind: int, device: int) -> int:
        """Size of the peer's receive staging buffer for memory ``kind`` on GPU
        ``device`` (0: none)."""

    def address_of(self, broker_id: str) -> str:
        """Where broker ``broker_id`` was reached ("" if it is not known)."""


# -- the state machine ---------------------------------------------------------


class SenderCore:
    """Every source of this broker. No I/O: calls leave effects (:meth:`take`)."""

    def __init__(
        self,
        *,
        broker_id: str,
        rooms: RoomTables,
        counters: Counters,
        peers: PeerView,
        send_staging_bytes: Callable[[int, int], int],
        on_bytes: Callable[[int], None] = lambda _n: None,
        part_bytes: int = 64 << 20,
    ) -> None:
        self._id = broker_id
        self._rooms = rooms
        self._counters = counters
        self._peers = peers
        self._send_staging_bytes = send_staging_bytes
        #: The largest packed part (``BrokerConfig.device_part_bytes``).
        self._part_bytes = part_bytes
        #: KV pairings by (engine, its generation, receiver broker, rank, its generation, layers).
        self._kv_plans: collections.OrderedDict[tuple[Any, ...], KvPairs] = collections.OrderedDict()
        self._on_bytes = on_bytes
        self._out: list[Effect] = []
        #: Sources that were open at the last look (the timeouts scan these, not every record).
        self._open: set[Source] = set()
        self._orphans_checked_at = 0.0

    def take(self) -> list[Effect]:
        """The effects of the calls so far, in order; the outbox is emptied."""
        out, self._out = self._out, []
        return out

    # -- engine calls ----------------------------------------------------
    def begin(self, engine: Engine, room_id: int, num_pages: int) -> Source:
        """Open ``room_id`` for sending from ``engine`` (BeginSend): ``num_pages``
        over all chunks (0: not said)."""
        if self._rooms.is_tombstoned("sender", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        room = self._rooms.sender.get(room_id)
        if room is not None and engine.key in room.opened:
            raise AlreadyExists(f"engine rank {engine.key} already opened room {room_id}")
        check_declared_pages(engine.layout, num_pages)
        if room is None:
            room = self._rooms.sender[room_id] = SenderRoom(room_id)
        room.opened += (engine.key,)
        source = Source(room=room_id, engine=engine, listener=self._changed, num_pages=num_pages)
        source.begin_context = telemetry.current_span()
        source.engine_traced = telemetry.has_remote_parent(trace.get_current_span())
        if source.engine_traced:
            # The engine passed its request's trace: the room joins it.
            self._open_span(source, source.begin_context)
        room.sources[engine.key] = source
        self._open.add(source)
        log.debug("send_opened", room=room_id, engine=engine.label, num_pages=num_pages)
        if room.aborted is not None:
            self.fail(source, room.aborted)
            return source
        gave_up = [(info, room.abandoned[(info.receiver, engine.key)]) for info in room.infos.values()
                   if (info.receiver, engine.key) in room.abandoned]
        if gave_up:
            info, told = gave_up[0]
            self.fail(
                source,
                cause(
                    told.kind,
                    f"room {room_id} cannot be opened again: receiver {info.receiver} was told that this source "
                    f"would never open it ({told.message}) and may have reused its pages",
                    self._id,
                ),
            )
        for info in list(room.infos.values()):
            if info.plan_for(engine.key) is not None and (info.receiver, engine.key) not in room.abandoned:
                self._attach(source, info)
        return source

    def chunk(
        self,
        engine: Engine,
        room_id: int,
        pages: IndexArray,
        *,
        is_last: bool,
        aux_row: int | None,
        state: dict[str, IndexArray],
        room_page: int | None = None,
    ) -> tuple[int, Source]:
        """Accept one chunk (SendChunk) and post it to every known destination.

        Returns the chunk index and the source. A chunk for a FAILED source is
        accepted and dropped (the status says why); everything is validated
        before anything is recorded. ``room_page``: the room page the chunk
        starts at; only the first chunk may move it (incremental transfer).
        """
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is None:
            raise NotFound(f"room {room_id} is not open for sending on engine {engine.engine_id}; call BeginSend first")
        if source.last_received:
            raise FailedPrecondition(f"room {room_id} already received its last chunk")
        self._validate_chunk(source, pages, is_last=is_last, aux_row=aux_row, state=state)
        first = source.chunks == 0
        if room_page is not None and not first and room_page != source.first_page + source.cursor:
            raise InvalidArgument(
                f"room {room_id}: chunk {source.chunks} starts at room page {room_page}, but it follows on at "
                f"{source.first_page + source.cursor} (only the first chunk may say where it starts)"
            )
        if first and room_page:
            source.first_page = room_page
        if source.state == FAILED:
            # Accepted and dropped: keep counting, so the engine's later
            # chunks validate as they would have.
            source.cursor += int(pages.size)
            source.chunks += 1
            source.last_received = is_last
            return source.chunks - 1, source
        chunk = Chunk(
            index=len(source.chunk_list),
            pages=pages,
            page_offset=source.cursor,
            is_last=is_last,
            aux_row=aux_row,
            state=state,
        )
        source.chunk_list.append(chunk)
        source.cursor += int(pages.size)
        source.chunks += 1
        source.last_received = is_last
        if first:
            # Where the source starts is known now: check it against the receivers that registered.
            for dest in list(source.destinations.values()):
                problem = _room_mismatch(source, dest.info) if dest.plan.writes_data else None
                if problem:
                    self.fail(source, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
                    return chunk.index, source
        self._pump_all(source)
        return chunk.index, source

    def abort(self, engine: Engine, room_id: int, reason: str, *, by: str = "engine") -> Source | None:
        """Fail the engine's side of the room and tell its receivers. Idempotent."""
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is not None:
            why = reason or "aborted by the sending engine"
            self.ensure_span(source)
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self.fail(source, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return source

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
            self._report(source, dest)

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its sources, and tell receivers
        waiting for it in rooms it never opened that it never will. Returns the
        sources failed."""
        sources = [s for s in self._rooms.all_sources() if s.engine is engine]
        for source in sources:
            self.fail(source, why)
        self.abandon(engine.key, why)
        return sum(1 for s in sources if s.cause is why)

    # -- peer calls ------------------------------------------------------
    def transfer_info(self, info: TransferInfo) -> None:
        """A receiver rank's transfer info (RegisterRoom). Idempotent for the same receiver."""
        if self._rooms.is_tombstoned("sender", info.room):
            raise FailedPrecondition(f"room {info.room} already ended on this broker")
        remote = self._peers.remote_engine(info.receiver_broker_id, info.receiver)
        if remote is None or remote.generation != info.receiver_generation:
            raise Aborted(
                f"receiver {info.receiver} generation {info.receiver_generation} is not in this broker's view of "
                f"broker {info.receiver_broker_id}; handshake again"
            )
        # The receiver's broker checked these against its engine; check again
        # against what it announced, so no index outside a region it
        # registered can ever become a descriptor here.
        check_room_indices(
            remote.layout, pages=info.pages, aux_row=info.aux_row, state=info.state, who=f"receiver {info.receiver} "
        )
        room = self._rooms.sender.get(info.room)
        if room is None:
            room = self._rooms.sender[info.room] = SenderRoom(info.room)
        known = room.infos.get(info.receiver)
        if known is not None:
            if (known.receiver_broker_id, known.receiver_generation) == (info.receiver_broker_id, info.receiver_generation):
                return  # the same registration again
            raise FailedPrecondition(
                f"room {info.room} was registered here for receiver {info.receiver} by broker "
                f"{known.receiver_broker_id} (engine generation {known.receiver_generation}); a room is registered once"
            )
        room.infos[info.receiver] = info
        for plan in info.sources:
            source = room.sources.get(plan.rank)
            if source is not None:
                self._attach(source, info)

    def peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str | None = None) -> bool:
        """A receiver's broker aborted the room: fail every local source of it.

        The room is remembered as aborted (until evicted), so a source that
        opens it afterwards fails at once with the same cause instead of
        waiting for a transfer info that will never come. Returns whether no
        part of the room is in flight from here any more.
        """
        if self._rooms.is_tombstoned("sender", room_id):
            return True
        room = self._rooms.sender.get(room_id)
        if room is None:
            room = self._rooms.sender[room_id] = SenderRoom(room_id)
        elif from_broker is not None and room.infos and all(i.receiver_broker_id != from_broker for i in room.infos.values()):
            raise PermissionDenied(f"broker {from_broker} has no receiver in room {room_id} here")
        if room.aborted is None:
            room.aborted = why
        for source in room.sources.values():
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why.message, "kvbroker.by": from_broker or "peer"})
            if source.terminal:
                # Already finished or failed: still tell the receivers whether
                # anything of it can land, so their pages settle.
                for dest in source.destinations.values():
                    if dest.inflight == 0 and not dest.settle_reported:
                        self._report(source, dest)
            else:
                self.fail(source, why)
        return all(source.inflight == 0 for source in room.sources.values())

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The receivers' broker ``broker_id`` is gone: fail every source serving it."""
        lost = [
            s
            for s in self._rooms.all_sources()
            if not s.terminal and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
        ]
        for source in lost:
            self.fail(source, why)
        return len(lost)

    def abandon(self, source_key: RankKey, why: common_pb2.FailureCause, *, older_than: float | None = None) -> int:
        """Tell receivers waiting for ``source_key`` in rooms it never opened here that it never will.

        For a source engine that died (or unregistered) before BeginSend, and
        for transfer infos older than the orphan timeout; without this the
        receiver would wait for its data timeout. ``older_than``: only infos
        received before that time. Returns how many receivers were told.
        """
        told = 0
        for room in self._rooms.sender.values():
            if source_key in room.opened:
                continue
            for info in room.infos.values():
                pair = (info.receiver, source_key)
                if info.plan_for(source_key) is None or pair in room.abandoned:
                    continue
                if older_than is not None and info.received_at > older_than:
                    continue
                room.abandoned[pair] = why
                report = peer_pb2.CompletionReport(
                    room=room.room,
                    sender_broker_id=self._id,
                    source=source_key.to_proto(),
                    receiver=info.receiver.to_proto(),
                    failure=why,
                    settled=True,
                )
                self._out.append(SendReport(info.receiver_broker_id, report))
                told += 1
        return told

    # -- transfers -------------------------------------------------------
    def staging_reserved(self, part: Part, buffer: peer_pb2.RemoteBuffer, offset: int) -> None:
        """The receiver reserved room for a staged part: gather and post it."""
        source, dest = part.source, part.dest
        dest.prefetch[part.key] = offset
        if source.state == FAILED:
            self.part_settled(part, XferState.ERR, None, FailedPrecondition("the room failed before its staged part was written"))
            return
        part.staging_buffer = buffer
        part.staging_offset = offset
        part.notice.staged = True
        part.notice.staging_offset = offset
        part.notice.staging_bytes = part.nbytes
        self._out.append(PostPart(part))

    def part_settled(self, part: Part, state: XferState, descriptors: int | None, error: KvBrokerError | None) -> None:
        """A part finished (DONE or ERR), or could not be posted or staged (``error``)."""
        source, dest = part.source, part.dest
        source.inflight -= 1
        dest.inflight -= 1
        dest.prefetch.pop(part.key, None)
        self._counters.descriptors_transferred += descriptors or 0
        if state is XferState.DONE:
            source.bytes += part.nbytes
            self._counters.bytes_sent += part.nbytes
            self._on_bytes(part.nbytes)
            source.mark("first_byte")
        elif error is not None:
            self.fail(source, cause_of(error, self._id))
        else:
            self.fail(
                source,
                cause(
                    common_pb2.FAILURE_KIND_TRANSFER,
                    f"a NIXL write to receiver {dest.info.receiver} at broker "
                    f"{self._peers.address_of(dest.info.receiver_broker_id) or '?'} ({dest.info.receiver_broker_id}) failed",
                    self._id,
                ),
            )
        if source.state == FAILED:
            if source.inflight == 0:
                source.mark_settled()
            if dest.inflight == 0 and dest.failure_reported and not dest.settle_reported:
                self._report(source, dest)
            return
        self._check_complete(source, dest)
        self._update(source)

    # -- timers ----------------------------------------------------------
    def tick(self, now: float, *, info_timeout_seconds: float, orphan_timeout_seconds: float, orphans_every: float = 0.0) -> None:
        """Time out sources waiting for transfer infos; answer infos whose source
        never came (that scan of every room at most every ``orphans_every`` s)."""
        for source in list(self._open):
            if source.terminal:
                self._open.discard(source)
                continue
            if source.ready() or now - source.opened_at <= info_timeout_seconds:
                continue
            want = source.expected_destinations
            self.fail(
                source,
                cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"waited {info_timeout_seconds:g} s for the receivers' transfer info (ExpectRoom on the decode "
                    f"side); {len(source.destinations)} of {want if want is not None else 'an unknown number of'} "
                    "receivers registered",
                    self._id,
                ),
            )
        if now - self._orphans_checked_at < orphans_every:
            return
        self._orphans_checked_at = now
        for room in list(self._rooms.sender.values()):
            for info, rank in list(room.unserved()):
                if now - info.received_at <= orphan_timeout_seconds:
                    continue
                why = cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"source rank {rank} did not open the room (BeginSend) within {orphan_timeout_seconds:g} s",
                    self._id,
                )
                self.abandon(rank, why, older_than=now - orphan_timeout_seconds)

    # -- queries ---------------------------------------------------------
    def has_business(self, broker_id: str) -> bool:
        """Whether a source still serves (or writes to) a receiver at ``broker_id``."""
        return any(
            (not s.terminal or s.inflight) and any(d.info.receiver_broker_id == broker_id for d in s.destinations.values())
            for s in self._rooms.all_sources()
        )

    # -- internals ---------------------------------------------------------
    def _validate_chunk(
        self,
        source: Source,
        pages: IndexArray,
        *,
        is_last: bool,
        aux_row: int | None,
        state: dict[str, IndexArray],
    ) -> None:
        check_chunk(
            source.engine.layout,
            declared=source.num_pages,
            sent=source.cursor,
            pages=pages,
            is_last=is_last,
            aux_row=aux_row,
            state=state,
        )

    def _attach(self, source: Source, info: TransferInfo) -> None:
        plan = info.plan_for(source.key)
        if plan is None or info.receiver in source.destinations:
            return
        if source.expected_destinations is None:
            source.expected_destinations = plan.num_destinations
        dest = Destination(info=info, plan=plan)
        source.destinations[info.receiver] = dest
        if source.span is None:
            self._open_span(source, info.trace_context)
        if source.state == FAILED:
            self._report(source, dest)
            return
        problem = _room_mismatch(source, info) if plan.writes_data else None
        if problem:
            self.fail(source, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
            return
        self._pump(source, dest)
        self._update(source)

    def _pump_all(self, source: Source) -> None:
        for dest in list(source.destinations.values()):
            self._pump(source, dest)
        self._update(source)

    def _pump(self, source: Source, dest: Destination) -> None:
        """Post every accepted chunk not yet posted to ``dest``, in order."""
        while dest.posted_chunks < len(source.chunk_list) and source.state != FAILED:
            chunk = source.chunk_list[dest.posted_chunks]
            try:
                self._post_chunk(source, dest, chunk)
            except KvBrokerError as exc:
                self.fail(source, cause_of(exc, self._id))
                return
            dest.posted_chunks += 1
            dest.last_posted = chunk.is_last
        self._check_complete(source, dest)

    def _post_chunk(self, source: Source, dest: Destination, chunk: Chunk) -> None:
        """Plan ``chunk``'s parts for ``dest`` and hand them on. Raises
        ``KvBrokerError`` if nothing could be planned."""
        info, plan = dest.info, dest.plan
        remote = self._peers.remote_engine(info.receiver_broker_id, info.receiver)
        if remote is None or remote.generation != info.receiver_generation:
            raise FailedPrecondition(f"receiver {info.receiver} is gone from broker {info.receiver_broker_id}")
        if not plan.writes_data:
            if chunk.is_last:
                notice = self._notice(source, dest, chunk, total_chunks=1, pages=0)
                self._send_parts(source, dest, chunk, remote, [PartSpec(kind=PartKind.NOTICE, nbytes=0)], notice)
            return
        layout, table = source.engine.layout, source.engine.table
        # Room pages [start, end) of this chunk (in the sender's pages); the
        # receiver holds the room's first prefix_pages pages (in its own), its
        # `pages` are the rest.
        ps, pd = layout.page_size_tokens, remote.layout.page_size_tokens
        start = source.first_page + chunk.page_offset
        end = start + int(chunk.pages.size)
        expected = info.prefix_pages + int(info.pages.size)
        if (end > start and (end - 1) * ps >= expected * pd) or (chunk.is_last and not same_token_count(end, ps, expected, pd)):
            raise FailedPrecondition(
                f"the sender sent room pages up to {end}{' in all' if chunk.is_last else ' so far'}, "
                f"receiver {info.receiver} expects {expected} ({info.prefix_pages} of them held already){_sizes(ps, pd)}"
            )
        tokens: TokenRange | None = None
        runs = None
        if ps != pd and plan.mode != FULL_PAGES:
            raise FailedPrecondition(f"head slices between pages of {ps} and {pd} tokens are not implemented")
        if ps == pd:
            # Its first `skip` pages are the receiver's already; the rest fill the
            # receiver's pages from dst_start.
            skip = min(int(chunk.pages.size), max(0, info.prefix_pages - start))
            dst_start = max(0, start - info.prefix_pages)
            src_pages, dst_pages = chunk.pages[skip:], info.pages[dst_start : max(0, end - info.prefix_pages)]
            completes = int(src_pages.size)
        else:
            # Different page sizes: the tokens of its pages the receiver lacks,
            # [begin, stop) inside the receiver's [lo, hi) (empty for a chunk
            # wholly inside its prefix, or a zero-page last chunk).
            lo, hi = info.prefix_pages * pd, expected * pd
            begin = min(max(start * ps, lo), hi)
            stop = max(begin, min(end * ps, hi))
            runs = token_runs(chunk.pages, start, ps, info.pages, info.prefix_pages, pd, begin, stop)
            dst_start, completes = completed_pages(dest.completed, int(info.pages.size), info.prefix_pages, pd, stop, chunk.is_last)
            dest.completed = dst_start + completes
            tokens = TokenRange(chunk.pages, start, begin, stop)
            src_pages = dst_pages = NO_INDICES
        shape = ChunkShape(
            src_pages=src_pages,
            dst_pages=dst_pages,
            aux_rows=_aux_rows(chunk, dest),
            state=_state_pairs(chunk, dest, remote),
            tokens=tokens,
            runs=runs,
            dst_tokens=TokenRange(info.pages, info.prefix_pages, tokens.begin, tokens.end) if tokens is not None else None,
        )
        if dest.kv is None and plan.mode == FULL_PAGES and shape.src_pages.size:
            dest.kv = self._kv_pairs(source, info, remote, plan)
        specs = plan_chunk(
            layout, table, remote.layout, remote.table, plan, shape, self._stage_policy(dest), dest.kv, self._pack_limit(dest)
        )
        kv_packed = any(s.packing is not None and s.packing.kv_end > s.packing.kv_begin for s in specs)
        aux_packed = any(s.packing is not None and s.packing.aux for s in specs)
        notice = self._notice(
            source,
            dest,
            chunk,
            total_chunks=len(source.chunk_list) if chunk.is_last else 0,
            pages=completes,
            page_offset=dst_start,
        )
        notice.aux = shape.aux_rows is not None
        notice.state_components.extend(sorted(shape.state))
        if tokens is not None:
            notice.token_begin, notice.token_end = tokens.begin, tokens.end
        notice.kv_packed, notice.aux_packed = kv_packed, aux_packed
        if info.verify_checksum:
            # What moves packed, each packed part's own checksum covers.
            head = slice_side(layout, plan.src_head_start, plan.num_heads, "sender") if plan.head_sliced else None
            aux_row = shape.aux_rows[0] if shape.aux_rows is not None and not aux_packed else None
            pages, runs_of = (NO_INDICES, None) if kv_packed else (shape.src_pages, tokens)
            notice.checksum = chunk_checksum(source.engine, plan, pages, head, aux_row, "sender", runs_of)
        self._send_parts(source, dest, chunk, remote, specs, notice)

    def _send_parts(
        self,
        source: Source,
        dest: Destination,
        chunk: Chunk,
        remote: RemoteEngine,
        specs: list[PartSpec],
        notice: peer_pb2.TransferNotice,
    ) -> None:
        for i, spec in enumerate(specs):
            part_notice = peer_pb2.TransferNotice()
            part_notice.CopyFrom(notice)
            part_notice.part, part_notice.parts, part_notice.bytes = i, len(specs), spec.nbytes
            if spec.packing is not None:
                packing = spec.packing
                part_notice.packed = True
                part_notice.packed_kv_begin, part_notice.packed_kv_end = packing.kv_begin, packing.kv_end
                part_notice.packed_aux = packing.aux
                for name, items in packing.state:
                    part_notice.packed_state.add(component=name, items=items)
            part = Part(source=source, dest=dest, chunk=chunk, index=i, spec=spec, notice=part_notice, remote=remote)
            source.inflight += 1
            dest.inflight += 1
            staged = spec.kind is PartKind.STAGED or spec.kind is PartKind.PACKED
            self._out.append(ReserveStaging(part) if staged else PostPart(part))

    def _kv_pairs(self, source: Source, info: TransferInfo, remote: RemoteEngine, plan: SourcePlan) -> KvPairs:
        """How ``source``'s KV pages pair with the receiver's: planned once per
        (sending engine registration, receiver rank registration, layer range),
        not per room; the newest ``_KV_PLANS`` are kept (receivers come and go)."""
        engine = source.engine
        key = (engine.key, engine.generation, info.receiver_broker_id, info.receiver, remote.generation, plan.layer_begin, plan.layer_end)
        pairs = self._kv_plans.get(key)
        if pairs is None:
            pairs = self._kv_plans[key] = kv_pairs(engine.layout, engine.table, remote.layout, remote.table, plan)
            if len(self._kv_plans) > _KV_PLANS:
                self._kv_plans.popitem(last=False)
        else:
            self._kv_plans.move_to_end(key)
        return pairs

    def _pack_limit(self, dest: Destination) -> PackLimit:
        """The largest packed part to ``dest``: this broker's part size, and
        at most half of either transfer buffer (so consecutive parts overlap)."""

        def limit(send: tuple[int, int], receive: tuple[int, int]) -> int:
            ours = self._send_staging_bytes(*send)
            theirs = self._peers.receive_staging_bytes(dest.info.receiver_broker_id, *receive)
            return min(self._part_bytes, ours // 2, theirs // 2) if ours and theirs else 0

        return limit

    def _stage_policy(self, dest: Destination) -> StagePolicy:
        def stage(nbytes: int, where: str, kind: int, device: int) -> bool:
            if where == "send":
                size = self._send_staging_bytes(kind, device)
            else:
                size = self._peers.receive_staging_bytes(dest.info.receiver_broker_id, kind, device)
            if not size:
                return False
            if nbytes > size:
                log.warning(
                    "staging_block_too_large", bytes=nbytes, buffer=size, side=where, fallback="per-token descriptors"
                )
                return False
            return True

        return stage

    def _notice(
        self, source: Source, dest: Destination, chunk: Chunk, *, total_chunks: int, pages: int, page_offset: int = 0
    ) -> peer_pb2.TransferNotice:
        """The notice of one chunk to one receiver: ``pages`` written from the
        receiver's page ``page_offset`` (in its ``pages``)."""
        writes = dest.plan.writes_data
        return peer_pb2.TransferNotice(
            protocol_version=PROTOCOL_VERSION,
            room=source.room,
            sender_broker_id=self._id,
            source=source.key.to_proto(),
            receiver=dest.info.receiver.to_proto(),
            chunk_index=chunk.index if writes else 0,
            is_last=chunk.is_last,
            total_chunks=total_chunks,
            pages=pages,
            page_offset=page_offset if writes else 0,
        )

    def _check_complete(self, source: Source, dest: Destination) -> None:
        if not dest.complete and dest.last_posted and dest.inflight == 0 and source.state != FAILED:
            dest.complete = True

    def _update(self, source: Source) -> None:
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

    def _report(self, source: Source, dest: Destination) -> None:
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
        self._out.append(SendReport(dest.info.receiver_broker_id, report))

    def _changed(self, side: Side) -> None:
        self._out.append(Publish(side.engine.engine_id, side.status()))
        if side.terminal and not side.ended:
            side.ended = True
            self._out.append(RoomEnded(side))

    def _open_span(self, source: Source, parent: Any) -> None:
        """The sender's room span (back-dated to BeginSend) and its wait for transfer info."""
        span = telemetry.open_room_span(source, "sender", parent, start_ns=source.opened_ns)
        if not source.ready():
            source.wait_span = telemetry.start_span(
                "kvbroker.wait_for_transfer_info", parent=span, start_ns=source.opened_ns
            )

    def ensure_span(self, source: Source) -> None:
        """A room span even for a source that ends before any receiver registered."""
        if source.span is None:
            self._open_span(source, source.begin_context)


def _sizes(ps: int, pd: int) -> str:
    """What to add to a page-count message when the two sides' page sizes differ."""
    return "" if ps == pd else f" (pages of {ps} and {pd} tokens)"


def _room_mismatch(source: Source, info: TransferInfo) -> str | None:
    """Why ``source`` cannot fill receiver ``info`` (None if it can, or if
    that is not known yet): it must start at or below the receiver's prefix,
    and end where the room ends (the same tokens, when the page sizes
    differ). Where it starts is known with its first chunk."""
    ps = source.engine.layout.page_size_tokens
    pd = info.page_size or ps
    sizes = _sizes(ps, pd)
    if not source.chunks:
        return (
            f"the sender will send {source.num_pages} pages, receiver {info.receiver} expects {info.pages.size}{sizes}"
            if source.num_pages and not info.prefix_pages and not same_token_count(source.num_pages, ps, int(info.pages.size), pd)
            else None
        )
    if source.first_page * ps > info.prefix_pages * pd:
        return (
            f"the sender starts at room page {source.first_page}, receiver {info.receiver} holds only the first "
            f"{info.prefix_pages}{sizes}"
        )
    if source.num_pages and not same_token_count(
        source.first_page + source.num_pages, ps, info.prefix_pages + int(info.pages.size), pd
    ):
        return (
            f"the sender will send {source.num_pages} pages from room page {source.first_page}, receiver "
            f"{info.receiver} expects {info.pages.size} after the {info.prefix_pages} it holds{sizes}"
        )
    return None

def _aux_rows(chunk: Chunk, dest: Destination) -> tuple[int, int] | None:
    # Lesson 1: aux goes on every last chunk, whether or not there is state
    # or KV, whenever the receiver asked for a row.
    if not (chunk.is_last and dest.plan.sends_aux and dest.info.aux_row is not None):
        return None
    if chunk.aux_row is None:
        raise FailedPrecondition(
            f"receiver {dest.info.receiver} expects aux row {dest.info.aux_row} but the sender has no aux regions"
        )
    return chunk.aux_row, dest.info.aux_row


def _state_pairs(chunk: Chunk, dest: Destination, remote: RemoteEngine) -> dict[str, tuple[IndexArray, IndexArray]]:
    """(source, destination) indices of every component this source owes the receiver."""
    plan = dest.plan
    if not (chunk.is_last and plan.sends_state):
        return {}
    pairs = {}
    for name, dst in dest.info.state.items():
        if not state_regions(remote.layout, name, plan.layer_begin, plan.layer_end):
            continue
        src = chunk.state.get(name)
        if src is None or src.size == 0:
            raise FailedPrecondition(f"receiver {dest.info.receiver} expects state component {name!r} but the sender sent none")
        pairs[name] = (src, dst)
    return pairs

"""The sender side's records: a source and what it owes each receiver rank.

A :class:`Source` is one prefill engine rank's side of one room; it keeps
the chunks its engine handed over (:class:`Chunk`) and one
:class:`Destination` per receiver rank it serves, made from that rank's
registration of the room (:class:`TransferInfo`). Each chunk goes to each
destination as parts (:class:`Part`), from planning until they settle.
:class:`PeerView` is what the sender state machine may read of the peer
table. The state machine that moves these records is ``SenderCore``
(``_sender``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvbroker.broker.rooms._sides import Side
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.plan import (
    ChunkSum,
    IndexArray,
    KvPairs,
    PartKind,
    PartSpec,
    RankKey,
    SourcePlan,
    held_pages,
    read_only,
)
from kvbroker.v1 import peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.peers import RemoteEngine

__all__ = ["Chunk", "Destination", "Part", "PeerView", "Source", "TransferInfo"]


@dataclass(frozen=True, slots=True)
class Chunk:
    """One SendChunk of a source: pages fill the receiver's pages from ``page_offset``.
    ``pages`` and ``state`` are the command's, read-only."""

    index: int
    pages: IndexArray
    page_offset: int
    is_last: bool
    aux_row: int | None
    state: Mapping[str, IndexArray]


@dataclass(frozen=True, slots=True)
class TransferInfo:
    """A receiver rank's registration of a room with the sender's broker."""

    room: int
    receiver_broker_id: str
    receiver: RankKey
    receiver_generation: int
    sender_group: str
    #: The receiver's pages and state indices, read-only once built (the
    #: destinations keep and read them; nothing may change them afterwards).
    pages: IndexArray
    aux_row: int | None
    state: Mapping[str, IndexArray]
    sources: tuple[SourcePlan, ...]
    #: The leading pages of the room the receiver already holds: ``pages``
    #: are the room's pages after them (incremental transfer).
    prefix_pages: int = 0
    #: The receiver checks every chunk against a checksum of what was read.
    verify_checksum: bool = False
    #: The decode side's class for the room (0: unspecified: the sender's
    #: stands) and deadline (monotonic seconds here).
    priority: int = 0
    deadline: float | None = None
    #: Tokens per page of the receiver (its room pages count in these); 0:
    #: not known (its engine was not described), taken as the sender's.
    page_size: int = 0
    received_at: float = field(default_factory=time.monotonic)
    #: The span current in the RegisterRoom call (the receiver's room span
    #: is its ancestor): the sender's room span joins that trace.
    trace_context: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "state", read_only(self.pages, self.state))

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
    #: When a receiver's broker last renewed this source's lease for a
    #: decode that announced the room (``RenewLeases``; 0: never): the wait
    #: for transfer infos runs from the later of this and ``opened_at``.
    lease_from: float = 0.0

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


@dataclass(frozen=True, eq=False, slots=True, weakref_slot=True)
class ChunkChecksum:
    """What the sender hashes of one chunk for its receiver: one per chunk,
    shared by its parts (the executor computes the CRC-32 once, for them all)."""

    what: ChunkSum


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
    #: The chunk's checksum, when its receiver verifies: one per chunk, shared
    #: by its parts (the executor computes it off the control loop before the
    #: first of them is written; every part's notice carries it).
    checksum: ChunkChecksum | None = None
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

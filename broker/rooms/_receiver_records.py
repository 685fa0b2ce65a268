"""The receiver side's records: a receiver rank, its sender brokers, and what it waits for from each source.

A :class:`Receiver` is one decode engine rank's side of one room. It reads
from one :class:`SenderLeg` per sender broker that holds some of its sources
(one, unless the sender group spans hosts), and keeps a
:class:`SourceExpectation` per source: which parts of which chunks landed,
the aux row and state components seen, whether the source completed or
settled. A staged or packed part that landed in the receive staging buffer,
to be scattered into the pages, is a :class:`Landing`. A rank that takes
packed parts off the control loop has a :class:`LandingGate` while it is
open. The state machine that moves these records is ``ReceiverCore``
(``_receiver``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from kvbroker.broker.memory import CreditRange, StagingReservation
from kvbroker.broker.rooms._sides import BOOTSTRAPPING, FAILED, SUCCESS, Side
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.plan import Block, IndexArray, RankKey, SourcePlan, encode_indices, transfer_pool
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = [
    "NO_COMPONENTS",
    "Landing",
    "LandingGate",
    "PoolKey",
    "Receiver",
    "SenderLeg",
    "SourceExpectation",
    "StagingKey",
    "receive_pool",
]

#: (memory kind, device) of a receive staging pool.
PoolKey = tuple[int, int]
#: (source, chunk, part) of a staged part.
StagingKey = tuple[RankKey, int, int]
#: ``components_seen`` of a source that sent no state yet (shared: most never do).
NO_COMPONENTS: frozenset[str] = frozenset()


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
    #: Chunks every part of which landed (kept by :meth:`part_landed`: counting
    #: them per part was quadratic in a room's chunks).
    whole_chunks: int = 0
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

    def part_landed(self, chunk: int, part: int, parts: int) -> bool:
        """Part ``part`` of ``parts`` of chunk ``chunk`` landed; whether every part of the chunk has."""
        before = self._whole(chunk)
        self.parts_received[chunk] = self.parts_received.get(chunk, 0) | 1 << part
        self.parts_expected[chunk] = max(1, parts)
        after = self._whole(chunk)
        self.whole_chunks += after - before
        return after

    def _whole(self, chunk: int) -> bool:
        return self.parts_received.get(chunk, 0).bit_count() == self.parts_expected.get(chunk, -1)

    def chunks_landed(self) -> int:
        return self.whole_chunks

    def pages_landed(self) -> int:
        return sum(pages for _, pages in self.chunk_pages.values())

    def landed_positions(self, first: int, page_size: int) -> set[int]:
        """Positions in the receiver's pages (which hold room pages from
        ``first``, of ``page_size`` tokens) that this source wrote whole: of the
        chunks every part of which landed, and, when the page sizes differ,
        whose earlier tokens came with chunks that landed too."""
        done = {chunk for chunk in self.chunk_pages if self._whole(chunk)} - self.unapplied
        return {
            position
            for chunk in done
            for position in range(self.chunk_pages[chunk][0], sum(self.chunk_pages[chunk]))
            if self.chunk_tokens is None or self._wrote_page(chunk, (first + position) * page_size, done)
        }

    def _wrote_page(self, chunk: int, page_begin: int, done: set[int]) -> bool:
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
        return self.whole_chunks >= self.total_chunks and all(self._whole(chunk) for chunk in range(self.total_chunks))


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
    #: Staging reservations made for senders' staged parts: (source, chunk,
    #: part) -> (pool, reservation) in this broker's receive staging. Released
    #: after the part is scattered, or when the rank ends and its pages are settled.
    staging: dict[StagingKey, tuple[PoolKey, StagingReservation]] = field(default_factory=dict)
    #: Ranges of senders' credits their packed parts landed in: (source, chunk,
    #: part) -> (receive buffer, range). Handed back to the sender after the
    #: part is scattered, or when the rank ends and its pages are settled.
    credits: dict[StagingKey, tuple[PoolKey, CreditRange]] = field(default_factory=dict)
    #: Staged parts being scattered into the pages right now (a dict used as
    #: a set: an empty dict is a quarter of an empty set's size).
    scattering: dict[StagingKey, None] = field(default_factory=dict)
    #: Chunks whose checksum the executor is computing over the rank's pages
    #: (``VerifyChunk``): the rank is SUCCESS, and settled, only once none is.
    verifying: int = 0
    #: While its sender is not found yet: why not, the last time it was looked for.
    waiting_for: str = ""
    #: While it is open to packed parts landing without the control loop (from
    #: its plan until it ends): what the data-plane thread reads, and what it took.
    gate: LandingGate | None = None

    def holds_resources(self) -> bool:
        busy = self.gate is not None and self.gate.busy()
        return busy or bool(self.scattering) or ((bool(self.staging) or bool(self.credits)) and not self.pages_settled)

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
    """A staged part that landed in the receive staging buffer, or a packed part
    that landed in its sender's credits in a receive transfer buffer, to scatter."""

    key: StagingKey
    pool: PoolKey
    #: Where it lies in ``pool``: a staging reservation, or a range of its sender's credits.
    held: StagingReservation | CreditRange
    nbytes: int
    #: Where its bytes go in the rank's memory, in packing order (``packing``).
    blocks: tuple[Block, ...]
    notice: peer_pb2.TransferNotice


class LandingGate:
    """A receiving rank's packed parts, taken without the control loop.

    From the rank's plan until it ends, the data-plane thread that reads a
    packed part's notice may take the part itself (``ReceivingParts.take``):
    it checks the notice against this snapshot of the rank (its pages, the
    sources it expects from which sender broker, its receive buffer), claims
    the part here and starts its scatter; the loop hears the outcome
    (``RankLanding.taken``). The snapshot never changes; the claims are
    under the gate's lock. Once shut (the rank failed or succeeded) nothing
    more is claimed, and the parts claimed before keep the rank's pages
    unsettled until each is counted (:meth:`busy`). The loop claims the
    parts it takes itself too (:meth:`mark`), so that no part is taken twice.
    """

    __slots__ = ("_claimed", "_in_flight", "_lock", "_open", "pool", "rank", "sources")

    def __init__(self, rank: Receiver, pool: PoolKey, sources: dict[RankKey, tuple[SourcePlan, str]]) -> None:
        self.rank = rank
        #: The receive buffer its packed parts land in.
        self.pool = pool
        #: Each source it expects: its plan and the sender broker that writes it.
        self.sources = sources
        self._lock = threading.Lock()
        self._open = True
        self._claimed: set[StagingKey] = set()
        self._in_flight = 0

    def claim(self, key: StagingKey) -> bool:
        """Take part ``key`` off the loop (data-plane thread): False if the gate is
        shut or the part was taken already."""
        with self._lock:
            if not self._open or key in self._claimed:
                return False
            self._claimed.add(key)
            self._in_flight += 1
            return True

    def mark(self, key: StagingKey) -> bool:
        """The loop takes part ``key`` itself: False if it was taken already."""
        with self._lock:
            if key in self._claimed:
                return False
            self._claimed.add(key)
            return True

    def counted(self) -> None:
        """A part taken off the loop was counted (loop)."""
        with self._lock:
            self._in_flight -= 1

    def shut(self) -> None:
        """Nothing more is taken off the loop (loop: the rank ended)."""
        with self._lock:
            self._open = False

    def busy(self) -> bool:
        """Whether parts taken off the loop are not counted yet (they may still write the pages)."""
        with self._lock:
            return self._in_flight > 0


def receive_pool(rank: Receiver) -> PoolKey:
    """The receive buffer the rank's staged and packed parts land in: its KV's GPU's, or host memory."""
    return transfer_pool(rank.engine.layout, rank.engine.table)

"""Data landing in a receiver rank: notices, scattered parts, checksums and completion.

:class:`RankLanding` takes the NIXL notifications
(:meth:`~RankLanding.notices`): each says one part of one chunk of one
source landed. A staged or packed part landed in the receive staging buffer
(reserved for it by the sender's prefetch, :meth:`~RankLanding.staging_wanted`
and :meth:`~RankLanding.staging_granted`) and is scattered into the
pages first (``Scatter`` -> :meth:`~RankLanding.scattered`);
TRANSFERRING. A chunk all of whose parts landed is checked against the
sender's checksum when the rank asked for that. SUCCESS when every source
it expects, counted by unique (group, tp rank, pp rank) (lesson 2), is
complete: every part of every chunk of its last notice's count landed, the
aux row if it asked for one, and every state component it listed with
indices (lesson 1). A source's out-of-band report
(:meth:`~RankLanding.completion_report`) says it failed, and whether
anything of it is still in flight. Notices for rooms that are not here are
counted and dropped; they never create a room (lesson 6). It holds the
ledger of the credits this broker granted sending peers (a packed part's
range must lie in one); ranks fail and settle through ``RankSettling``
(``_receive_settling``), given at construction.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from google.protobuf.message import DecodeError

from kvbroker.broker import telemetry
from kvbroker.broker.memory import CreditLedger, CreditRange, StagingReservation
from kvbroker.broker.rooms._effects import HandBackCredits, ReleaseStaging, Scatter, VerifyChunk
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._receive_settling import RankSettling
from kvbroker.broker.rooms._receiver_records import (
    Landing,
    PoolKey,
    Receiver,
    SourceExpectation,
    StagingKey,
    receive_pool,
)
from kvbroker.broker.rooms._sides import FAILED, SUCCESS, TRANSFERRING, cause, cause_of
from kvbroker.errors import FailedPrecondition, KvBrokerError, NotFound
from kvbroker.plan import (
    MAX_PARTS,
    NO_INDICES,
    ChunkSum,
    RankKey,
    TokenRange,
    kv_block,
    kv_regions,
    landing_blocks,
    packed_bytes,
    rank_key,
    slice_side,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["RankLanding", "landing_of", "token_problem"]

log = structlog.get_logger(__name__)


class RankLanding:
    """What lands in receiver ranks, and when a rank is complete; the credits granted to senders."""

    def __init__(
        self, core: MachineCore, settling: RankSettling, *, credits: CreditLedger, on_bytes: Callable[[int], None]
    ) -> None:
        self._id = core.broker_id
        self._rooms = core.rooms
        self._counters = core.counters
        self._emit = core.emit
        # Bound once: these run for every notice.
        self._fail = settling.fail
        self._maybe_settled = settling.maybe_settled
        self._release_held = settling.release_held
        self._close_gate = settling.close_gate
        #: The grants this broker gave sending peers (a packed part's range must lie in one).
        self._credits = credits
        self._on_bytes = on_bytes

    # -- data --------------------------------------------------------------
    def notices(self, items: list[tuple[str, bytes]]) -> None:
        """NIXL notifications: each says one part of one chunk of one source
        landed. A part written into its sender's credits whose range is not
        held here afterwards (its room is gone, the notice was refused) goes
        back to the sender at once."""
        for agent, payload in items:
            try:
                notice = peer_pb2.TransferNotice.FromString(payload)
            except DecodeError:
                self._counters.bad_notices += 1
                log.warning("bad_notification", agent=agent, size=len(payload))
                continue
            if notice.protocol_version != PROTOCOL_VERSION:
                self._counters.bad_notices += 1
                log.warning("bad_notification", agent=agent, protocol_version=notice.protocol_version, speaks=PROTOCOL_VERSION)
                continue
            if not self._notice(notice) and notice.credit_id:
                credit = CreditRange(notice.staging_offset, notice.staging_bytes, notice.sender_broker_id, notice.credit_id)
                self._emit(HandBackCredits(((0, 0, credit),)))

    def _notice(self, notice: peer_pb2.TransferNotice) -> bool:
        """Take one notice; whether its credit range (if any) is held by a rank now."""
        room = self._rooms.receiver.get(notice.room)
        rank = room.ranks.get(rank_key(notice.receiver)) if room is not None else None
        leg = rank.leg(notice.sender_broker_id) if rank is not None else None
        if rank is None or (rank.legs and leg is None):
            self._counters.late_notices += 1
            log.debug("late_notification", room=notice.room, receiver=str(rank_key(notice.receiver)))
            return False
        source_key = rank_key(notice.source)
        exp = rank.expected.get(source_key) if rank.expected is not None else None
        if exp is None or exp.leg is not leg:
            self._fail(
                rank,
                cause(common_pb2.FAILURE_KIND_MISMATCH, f"an unexpected source {source_key} wrote into the room", self._id),
            )
            return False
        key = (source_key, notice.chunk_index, notice.part)
        if not notice.part < max(1, notice.parts) <= MAX_PARTS:
            self._fail(
                rank,
                cause(
                    common_pb2.FAILURE_KIND_MISMATCH,
                    f"source {source_key} sent a notice for part {notice.part} of {notice.parts} (at most {MAX_PARTS})",
                    self._id,
                ),
            )
            return False
        if exp.has_part(notice.chunk_index, notice.part) or key in rank.scattering:
            return False
        if notice.token_end and (problem := token_problem(rank, notice)):
            self._fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, f"source {source_key} {problem}", self._id))
            return False
        if notice.staged:
            if rank.terminal:
                # A failed rank scatters nothing more: the part counts as
                # settled, but its chunk's pages did not arrive.
                exp.unapplied = exp.unapplied | {notice.chunk_index}
            else:
                if rank.gate is not None and not rank.gate.mark(key):
                    return True  # the data-plane thread took it (through the gate): its range is that part's
                if notice.credit_id and not self._hold_credit(rank, key, notice):
                    return False
                try:
                    landing = landing_of(rank, key, exp, notice)
                except KvBrokerError as exc:
                    self._fail(rank, cause_of(exc, self._id))
                    return key in rank.credits
                rank.scattering[key] = None
                self._emit(Scatter(rank, landing))
                return True
        self._landed(rank, source_key, exp, notice)
        return False

    def _hold_credit(self, rank: Receiver, key: StagingKey, notice: peer_pb2.TransferNotice) -> bool:
        """A packed part written into its sender's credits: the rank holds its
        range until it is scattered (or the rank ends). Fails the rank if the
        range is not the sender's to write."""
        pool = receive_pool(rank)
        if not self._credits.holds(notice.sender_broker_id, pool, notice.staging_offset, notice.staging_bytes):
            problem = (
                f"source {key[0]} wrote packed part {notice.part} of chunk {notice.chunk_index} at offset "
                f"{notice.staging_offset} (+{notice.staging_bytes}), outside the credits this broker granted it"
            )
            self._fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
            return False
        rank.credits[key] = (pool, CreditRange(notice.staging_offset, notice.staging_bytes, notice.sender_broker_id, notice.credit_id))
        return True

    def scattered(self, rank: Receiver, landing: Landing, error: KvBrokerError | None, handed_back: bool = False) -> None:
        """A staged or packed part was unpacked into the pages, or could not be
        (it arrived corrupted, or the copy failed): then it never counts as
        landed, so its pages are not reported among those that arrived.
        ``handed_back``: its range went back to its sender already (the lane's
        thread returned it as soon as it was scattered)."""
        rank.scattering.pop(landing.key, None)
        staged = rank.staging.pop(landing.key, None)
        if staged is not None:
            self._emit(ReleaseStaging(((*staged[0], staged[1]),)))
        credit = rank.credits.pop(landing.key, None)
        if credit is not None and not handed_back:
            self._emit(HandBackCredits(((*credit[0], credit[1]),)))
        exp = rank.expected.get(landing.key[0]) if rank.expected is not None else None
        if error is not None:
            self._fail(rank, cause_of(error, self._id))
        if exp is not None and error is None:
            self._landed(rank, landing.key[0], exp, landing.notice)
        else:
            self._maybe_settled(rank)

    def taken(self, rank: Receiver, landing: Landing, error: KvBrokerError | None, handed_back: bool) -> None:
        """A packed part the data-plane thread took through the rank's gate (it
        checked the notice against the gate's snapshot, claimed the part and
        scattered it, or could not): counted as one scattered on the loop's word
        is. Its range goes back to its sender here unless the thread sent it."""
        if rank.gate is not None:
            rank.gate.counted()
        if not handed_back and isinstance(landing.held, CreditRange):
            self._emit(HandBackCredits(((*landing.pool, landing.held),)))
        notice = landing.notice
        exp = rank.expected.get(landing.key[0]) if rank.expected is not None else None
        if error is not None:
            self._fail(rank, cause_of(error, self._id))
        if exp is not None and error is None and not exp.has_part(notice.chunk_index, notice.part):
            self._landed(rank, landing.key[0], exp, notice)
        else:
            self._maybe_settled(rank)

    def _landed(self, rank: Receiver, source_key: RankKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> None:
        had = exp.whole_chunks
        whole = exp.part_landed(notice.chunk_index, notice.part, notice.parts)
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
        if rank.verify_checksum and whole:
            self._verify(rank, source_key, exp, notice)
        rank.bytes += notice.bytes
        self._counters.bytes_received += notice.bytes
        self._on_bytes(notice.bytes)
        rank.mark("first_byte")
        assert rank.expected is not None
        rank.chunks += exp.whole_chunks - had
        if rank.terminal:
            # Data still landing after an abort: once a source's parts have
            # all landed, nothing of it is in flight any more.
            if exp.total_chunks is not None and exp.all_parts_landed():
                exp.complete = True
            self._maybe_settled(rank)
            return
        rank.advance(TRANSFERRING)
        self._check_source(rank, source_key, exp)
        self._maybe_done(rank)

    def chunk_verified(self, effect: VerifyChunk, got: int | None, error: KvBrokerError | None) -> None:
        """The checksum of a chunk in the rank's pages (``got``), or why it could
        not be computed: a difference from the sender's fails the rank."""
        rank = effect.receiver
        rank.verifying -= 1
        if error is not None:
            self._fail(rank, cause_of(error, self._id))
        elif got != effect.expected and not rank.terminal:
            self._counters.checksum_mismatches += 1
            problem = (
                f"chunk {effect.chunk_index} from source {effect.source} arrived with checksum {got:08x}, the sender read "
                f"{effect.expected:08x}: the transport corrupted it"
            )
            self._fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
        if rank.terminal:
            self._maybe_settled(rank)
        else:
            self._maybe_done(rank)

    def _maybe_done(self, rank: Receiver) -> None:
        """SUCCESS once every source is complete and no chunk is being verified."""
        assert rank.expected is not None
        if rank.state != FAILED and not rank.verifying and all(e.complete for e in rank.expected.values()):
            rank.mark("last_byte")
            telemetry.child_done(rank.span, "kvbroker.completion", {"kvbroker.sources": len(rank.expected)})
            if rank.advance(SUCCESS):
                self._counters.rooms_succeeded += 1
                self._close_gate(rank)
                self._release_held(rank)
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
            self._fail(rank, report.failure, told_by=report.sender_broker_id)
        self._maybe_settled(rank)

    # -- staging -------------------------------------------------------------
    def staging_wanted(self, request: peer_pb2.ReserveStagingRequest) -> tuple[PoolKey, StagingReservation | None]:
        """A sender's prefetch for one staged part: which receive pool to reserve
        in, and the reservation already made for it (idempotent) or None."""
        rank = self._staging_rank(request)
        key = (rank_key(request.source), request.chunk_index, request.part)
        held = rank.staging.get(key)
        if held is not None:
            return held
        if rank.terminal:
            raise FailedPrecondition(f"room {request.room} already ended on the receiver")
        return receive_pool(rank), None

    def staging_granted(
        self, request: peer_pb2.ReserveStagingRequest, pool: PoolKey, reservation: StagingReservation
    ) -> StagingReservation:
        """Record a reservation made for ``request``. ``FailedPrecondition`` if the
        room ended while it waited for room (the caller releases it then)."""
        rank = self._staging_rank(request)
        key = (rank_key(request.source), request.chunk_index, request.part)
        held = rank.staging.get(key)
        if held is not None:
            self._emit(ReleaseStaging(((*pool, reservation),)))
            return held[1]
        if rank.terminal:
            raise FailedPrecondition(f"room {request.room} ended while it waited for staging")
        rank.staging[key] = (pool, reservation)
        return reservation

    def staging_rank(self, request: peer_pb2.ReserveStagingRequest) -> Receiver:
        """The receiver rank a sender's prefetch is for (its wait is queued by the rank's class)."""
        return self._staging_rank(request)

    def _staging_rank(self, request: peer_pb2.ReserveStagingRequest) -> Receiver:
        room = self._rooms.receiver.get(request.room)
        rank = room.ranks.get(rank_key(request.receiver)) if room is not None else None
        if rank is None or rank.leg(request.sender_broker_id) is None:
            raise NotFound(f"room {request.room} has no receiver {rank_key(request.receiver)} expecting this broker")
        return rank

    # -- checks ----------------------------------------------------------------
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
            self._fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))

    def _verify(self, rank: Receiver, source_key: RankKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> None:
        """Have a chunk whose parts all landed checked against the sender's
        checksum (``VerifyChunk``; the executor reads the pages)."""
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
            except KvBrokerError as exc:
                self._fail(rank, cause_of(exc, self._id))
                return
            what = ChunkSum(plan, pages, head, aux_row, "receiver", tokens)
            rank.verifying += 1
            self._emit(VerifyChunk(rank, source_key, notice.chunk_index, notice.checksum, what))
            return
        self._counters.checksum_mismatches += 1
        self._fail(rank, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))


def landing_of(rank: Receiver, key: StagingKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> Landing:
    """The landing of a staged or packed part ``key`` that ``notice`` says landed in
    the staging reserved for it (or, packed, in the range of its sender's credits the
    rank holds for it), to scatter into ``rank``'s pages; ``FailedPrecondition``
    if it does not match the reservation, or what it names does not add up."""
    held = rank.credits.get(key) if notice.credit_id else rank.staging.get(key)
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
        key=key, pool=held[0], held=held[1], nbytes=notice.staging_bytes, blocks=tuple(blocks), notice=notice
    )


def token_problem(rank: Receiver, notice: peer_pb2.TransferNotice) -> str | None:
    """What is wrong with a token-run notice (different page sizes), if anything:
    its tokens must be among the rank's pages, the pages it completes too."""
    size = rank.engine.layout.page_size_tokens
    lo, hi = rank.prefix_pages * size, (rank.prefix_pages + int(rank.pages.size)) * size
    if not lo <= notice.token_begin <= notice.token_end <= hi:
        return f"wrote room tokens [{notice.token_begin}, {notice.token_end}); this rank's pages hold [{lo}, {hi})"
    if notice.page_offset + notice.pages > rank.pages.size:
        return f"completed pages {notice.page_offset}..{notice.page_offset + notice.pages - 1}; this rank has {rank.pages.size}"
    return None

"""The receiver side of rooms: ExpectRoom, bootstrapping, notices, completion.

ExpectRoom validates the destination indices, records the room and returns;
a background task handshakes with the sender's broker (if our engines changed
since the last handshake), computes which sources owe this rank what
(``mapping.plan_sources``), records that plan and only then registers the
room with the sender's broker, since the sender may start writing the moment
it has the transfer info.

Completion is explicit (DESIGN.md section 4, lesson 2): each source's notices
say which chunk and part they carry and, on the last chunk, how many chunks
the source sent, whether the aux row came and which state components came.
A source is complete when every part of every chunk landed and what the
receiver expects from it (aux only if it asked for a row, state only for
components it listed with indices: lesson 1) is there. The rank is SUCCESS
when every source it expects, counted by unique (group, tp rank, pp rank), is
complete. Notices for rooms that are not here are counted and dropped; they
never create a room (lesson 6).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import structlog
from google.protobuf.message import DecodeError
from opentelemetry import trace

from kvbroker.broker import telemetry
from kvbroker.broker.counters import Counters
from kvbroker.broker.descriptors import check_index, check_indices
from kvbroker.broker.engines import Engine
from kvbroker.broker.layout import Layout, RankKey, rank_key
from kvbroker.broker.mapping import GroupShape, check_state_supported, plan_sources
from kvbroker.broker.metrics import BrokerMetrics
from kvbroker.broker.peers import Peer, PeerTable
from kvbroker.broker.progress import ProgressLoop
from kvbroker.broker.rooms import (
    FAILED,
    SUCCESS,
    TRANSFERRING,
    WAITING_FOR_INPUT,
    Progress,
    ReceiverProgress,
    ReceiverRoom,
    RoomTables,
    SourceExpectation,
    cause,
    cause_of,
)
from kvbroker.broker.segments import state_regions
from kvbroker.broker.slicing import kv_regions, scatter, slice_side, staged_bytes
from kvbroker.broker.staging import Reservation, StagingPool
from kvbroker.broker.tasks import TaskSet
from kvbroker.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    NotFound,
    Unavailable,
    from_rpc_error,
)
from kvbroker.indices import IndexArray, encode_indices
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["ReceiverSide"]

log = structlog.get_logger(__name__)

# A RegisterRoom that failed with one of these may still have reached the
# sender, so the sender may write: the pages are not settled.
_MAYBE_DELIVERED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNKNOWN)


class ReceiverSide:
    """Receiver-side room logic. Event-loop thread only."""

    def __init__(
        self,
        *,
        broker_id: str,
        peers: PeerTable,
        rooms: RoomTables,
        progress: ProgressLoop,
        counters: Counters,
        tasks: TaskSet,
        publish: Callable[[Progress], None],
        bootstrap_timeout_seconds: float,
        staging: StagingPool | None,
        staging_wait_seconds: float,
        metrics: BrokerMetrics,
    ) -> None:
        self._id = broker_id
        self._metrics = metrics
        self._staging = staging
        self._staging_wait = staging_wait_seconds
        self._bootstrap_timeout = bootstrap_timeout_seconds
        self._peers = peers
        self._rooms = rooms
        self._progress = progress
        self._counters = counters
        self._tasks = tasks
        self._publish = publish
        self._open: set[ReceiverProgress] = set()
        #: Addresses being told of lost rooms (tell_successors), and when last tried.
        self._telling: set[str] = set()
        self._told_at: dict[str, float] = {}

    def awaiting_data(self) -> bool:
        """Whether a rank still waits for notices (the progress loop polls then)."""
        for rank in [r for r in self._open if r.terminal]:
            self._open.discard(rank)
        return bool(self._open)

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
    ) -> ReceiverProgress:
        """Open ``room_id`` for receiving into ``engine`` and start bootstrapping."""
        layout = engine.layout
        if not sender_group:
            raise InvalidArgument("sender.group must name the prefill engine group")
        if self._rooms.is_tombstoned("receiver", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        check_indices(pages, layout.num_pages, "pages")
        if aux_row is not None:
            if not layout.aux_regions:
                raise InvalidArgument("aux_row given but this engine registered no aux regions")
            check_index(aux_row, layout.aux_rows, "aux_row")
        expected_state: dict[str, IndexArray] = {}
        for name, indices in state.items():
            if name not in layout.state_components:
                raise InvalidArgument(f"state component {name!r} is not in this engine's layout")
            check_indices(indices, layout.state_items[name], f"state {name!r}")
            if indices.size:
                expected_state[name] = indices
        room = self._rooms.receiver.get(room_id)
        if room is not None and engine.key in room.ranks:
            raise AlreadyExists(f"engine rank {engine.key} already expects room {room_id}")
        if room is None:
            room = self._rooms.receiver[room_id] = ReceiverRoom(room_id)
        rank = ReceiverProgress(
            room=room_id,
            engine=engine,
            listener=self._publish,
            sender_address=sender_address,
            sender_group=sender_group,
            pages=pages,
            aux_row=aux_row,
            state_indices=expected_state,
        )
        room.ranks[engine.key] = rank
        self._open.add(rank)
        # The room span is a child of the engine's ExpectRoom call; the
        # bootstrap task runs in it, so the handshake and RegisterRoom (and,
        # through RegisterRoom, the sender's side) join the trace.
        span = telemetry.open_room_span(rank, "receiver", None)
        with trace.use_span(span, end_on_exit=False):
            self._tasks.spawn(self._bootstrap(rank), name=f"bootstrap-{room_id}")
        return rank

    def abort(self, engine: Engine, room_id: int, reason: str) -> ReceiverProgress | None:
        """Fail the engine's side of the room and tell the sender's broker. Idempotent."""
        room = self._rooms.receiver.get(room_id)
        rank = room.ranks.get(engine.key) if room is not None else None
        if rank is not None:
            why = reason or "aborted by the receiving engine"
            telemetry.child_done(rank.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": "engine"})
            self.fail(rank, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return rank

    def fail(self, rank: ReceiverProgress, why: common_pb2.FailureCause, *, tell_sender: bool = True) -> None:
        """Fail ``rank`` (first cause wins); tell the sender's broker unless it told us."""
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
        if tell_sender and rank.peer_broker_id is not None:
            # Also when the room never reached the sender's broker (a plan it
            # cannot do): its engine must not wait for a transfer info.
            self._tasks.spawn(self._abort_sender(rank.peer_broker_id, rank.room, why), name=f"abort-{rank.room}")
        elif tell_sender:
            # Its sender's broker was never reached (down, or restarting):
            # whoever answers at that address next is told.
            self._remember_for_successor(rank.sender_address, rank.room, why)

    # -- peer calls ------------------------------------------------------
    def on_notice(self, _agent_name: str, payload: bytes) -> None:
        """A NIXL notification: one part of one chunk of one source landed."""
        try:
            notice = peer_pb2.TransferNotice.FromString(payload)
        except DecodeError:
            self._counters.bad_notices += 1
            log.warning("bad_notification", agent=_agent_name, size=len(payload))
            return
        room = self._rooms.receiver.get(notice.room)
        rank = room.ranks.get(rank_key(notice.receiver)) if room is not None else None
        if rank is None or (rank.peer_broker_id is not None and notice.sender_broker_id != rank.peer_broker_id):
            self._counters.late_notices += 1
            log.debug("late_notification", room=notice.room, receiver=str(rank_key(notice.receiver)))
            return
        source_key = rank_key(notice.source)
        exp = rank.expected.get(source_key) if rank.expected is not None else None
        if exp is None:
            self.fail(
                rank,
                cause(common_pb2.FAILURE_KIND_MISMATCH, f"an unexpected source {source_key} wrote into the room", self._id),
            )
            return
        parts = exp.parts_received.setdefault(notice.chunk_index, set())
        if notice.part in parts:
            return
        if notice.staged and not rank.terminal:
            try:
                self._unstage(rank, source_key, exp, notice)
            except KvBrokerError as exc:
                self.fail(rank, cause_of(exc, self._id))
                return
        parts.add(notice.part)
        exp.parts_expected[notice.chunk_index] = max(1, notice.parts)
        exp.pages_by_chunk[notice.chunk_index] = notice.pages
        exp.aux_seen |= notice.aux
        exp.components_seen.update(notice.state_components)
        if notice.is_last:
            exp.total_chunks = notice.total_chunks
        rank.bytes += notice.bytes
        self._counters.bytes_received += notice.bytes
        self._metrics.bytes.add(notice.bytes, {"direction": "received"})
        rank.mark("first_byte")
        assert rank.expected is not None
        rank.chunks = sum(e.chunks_landed() for e in rank.expected.values())
        if rank.terminal:
            # Data still landing after an abort: once a source's parts have
            # all landed, nothing of it is in flight any more.
            if exp.total_chunks is not None and _all_parts_landed(exp):
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

    def on_completion_report(self, report: peer_pb2.CompletionReport) -> None:
        """A source's out-of-band report: it failed, and maybe it settled."""
        room = self._rooms.receiver.get(report.room)
        rank = room.ranks.get(rank_key(report.receiver)) if room is not None else None
        if rank is None or rank.peer_broker_id != report.sender_broker_id:
            self._counters.late_notices += 1
            return
        exp = rank.expected.get(rank_key(report.source)) if rank.expected is not None else None
        if report.settled and exp is not None:
            exp.settled = True
        if report.HasField("failure"):
            self.fail(rank, report.failure, tell_sender=False)
        self._maybe_settled(rank)

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The sender's broker ``broker_id`` is gone: fail our ranks it feeds.

        A dead broker writes nothing more, so their pages are settled.
        """
        # A rank still registering never reached that process; it registers
        # with whoever answers at the address now.
        # A rank whose registration is out learns where it landed when the
        # call returns (_register).
        ranks = [
            r
            for r in self._rooms.all_receivers()
            if r.peer_broker_id == broker_id and (r.registered_with_sender or r.terminal) and not r.registering
        ]
        for rank in ranks:
            self._lose_sender(rank, why)
        return len(ranks)

    def _lose_sender(self, rank: ReceiverProgress, why: common_pb2.FailureCause) -> None:
        """Fail ``rank``: its sender's broker process is gone, so nothing more
        can write into its pages. If it had the room, the broker that answers
        at its address next is told (:meth:`tell_successors`)."""
        if not rank.terminal and rank.registered_with_sender:
            self._remember_for_successor(rank.sender_address, rank.room, why)
        self.fail(rank, why, tell_sender=False)
        for exp in (rank.expected or {}).values():
            exp.settled = True
        self._maybe_settled(rank)

    def time_out(self, now: float, data_timeout_seconds: float) -> None:
        """Fail ranks that waited longer than the data timeout since registering."""
        for rank in list(self._rooms.all_receivers()):
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

    def on_peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str) -> int:
        """The sender's broker aborted the room: fail our ranks that it serves."""
        room = self._rooms.receiver.get(room_id)
        if room is None:
            return 0
        ranks = [r for r in room.ranks.values() if r.peer_broker_id == from_broker]
        for rank in ranks:
            self.fail(rank, why, tell_sender=False)
        return len(ranks)

    # -- internals ---------------------------------------------------------
    async def _bootstrap(self, rank: ReceiverProgress) -> None:
        try:
            await self._register(rank)
        except KvBrokerError as exc:
            self.fail(rank, cause_of(exc, self._id))
            return
        if rank.terminal:
            # Aborted while we registered: the sender has the info now.
            if rank.peer_broker_id is not None and rank.cause is not None:
                await self._abort_sender(rank.peer_broker_id, rank.room, rank.cause)
            return
        rank.registered_at = time.monotonic()
        rank.mark("registered")
        rank.wait_span = telemetry.start_span("kvbroker.wait_for_data", parent=rank.span)
        rank.advance(WAITING_FOR_INPUT)
        self._progress.wake()

    async def _find_sender(self, rank: ReceiverProgress) -> tuple[Peer, list[Layout]]:
        """Handshake with the sender's broker and find the sender group there,
        retrying with backoff for up to the bootstrap timeout (the sender's
        broker or engines may still be starting)."""
        deadline = time.monotonic() + self._bootstrap_timeout
        delay = 0.01
        while True:
            try:
                peer = await self._peers.connect(rank.sender_address)
                layouts = peer.group_layouts(rank.sender_group)
                if not layouts:
                    # The group may have registered after our last handshake.
                    await self._peers.handshake(peer)
                    layouts = peer.group_layouts(rank.sender_group)
                if layouts:
                    return peer, layouts
                error: KvBrokerError = FailedPrecondition(
                    f"no rank of engine group {rank.sender_group!r} is registered at the broker at {peer.address}"
                )
            except Unavailable as exc:
                error = exc
            if rank.terminal or time.monotonic() + delay > deadline:
                raise type(error)(f"{error.message} (gave up after {self._bootstrap_timeout:g} s)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _register(self, rank: ReceiverProgress) -> None:
        peer, layouts = await self._find_sender(rank)
        rank.mark("handshaken")
        rank.peer_broker_id = peer.broker_id
        if rank.terminal:
            return
        sender_shape, receiver_shape = GroupShape.of(layouts[0]), GroupShape.of(rank.engine.layout)
        if rank.state_indices:
            check_state_supported(sender_shape, receiver_shape)
        plans = plan_sources(sender_shape, rank.sender_group, receiver_shape, rank.key.tp_rank, rank.key.pp_rank)
        rank.expected = {
            p.rank: SourceExpectation(
                plan=p,
                expects_aux=p.sends_aux and rank.aux_row is not None,
                expected_components=frozenset(
                    name
                    for name in rank.state_indices
                    if p.sends_state and state_regions(rank.engine.layout, name, p.layer_begin, p.layer_end)
                ),
            )
            for p in plans
        }
        rank.peer_broker_id = peer.broker_id
        request = peer_pb2.RegisterRoomRequest(
            room=rank.room,
            receiver_broker_id=self._id,
            receiver=rank.key.to_proto(),
            receiver_generation=rank.engine.generation,
            sender_group=rank.sender_group,
            pages=encode_indices(rank.pages),
            state=[common_pb2.StateIndices(component=n, indices=encode_indices(i)) for n, i in rank.state_indices.items()],
            sources=[p.to_proto() for p in plans],
        )
        if rank.aux_row is not None:
            request.aux_row = rank.aux_row
        rank.registered_with_sender = True
        for attempt in (1, 2):
            registered_with = request.sender_broker_id = peer.broker_id or ""
            try:
                rank.registering = True
                try:
                    await self._peers.stub(peer).RegisterRoom(request, timeout=self._peers.timeout)
                finally:
                    rank.registering = False
                if registered_with not in self._peers.by_id:
                    # The process that took the room died or restarted while
                    # the call was out (peer_lost left this rank to us).
                    why = cause(
                        common_pb2.FAILURE_KIND_PEER,
                        f"peer broker {peer.address} ({registered_with}) went away while room {rank.room} registered there",
                        self._id,
                    )
                    self._lose_sender(rank, why)
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if err.code not in _MAYBE_DELIVERED:
                    rank.registered_with_sender = False
                if attempt == 1 and isinstance(err, Aborted):
                    # The sender's view of us is stale, or it restarted and
                    # never met us: handshake afresh (a restart detected here
                    # fails only rooms the old process had), then retry with
                    # the broker that answers now.
                    await self._peers.handshake(peer)
                    if rank.terminal:
                        return
                    rank.peer_broker_id = peer.broker_id
                    rank.registered_with_sender = True
                    continue
                raise type(err)(f"the sender's broker refused room {rank.room}: {err.message}") from exc

    def _check_source(self, rank: ReceiverProgress, key: object, exp: SourceExpectation) -> None:
        if exp.complete or exp.total_chunks is None or not _all_parts_landed(exp):
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

    def _maybe_settled(self, rank: ReceiverProgress) -> None:
        if not rank.pages_settled and rank.state == FAILED and _nothing_in_flight(rank):
            rank.mark_settled()
        if rank.pages_settled:
            self._release_staging(rank)

    # -- staging ------------------------------------------------------------
    async def reserve_staging(self, request: peer_pb2.ReserveStagingRequest) -> Reservation:
        """Reserve room in the staging buffer for one staged part (the prefetch).

        Recorded per (room, receiver rank, source, chunk, part); released when
        the part is scattered, or by :meth:`_release_staging` when the rank
        ends and no write can still land. Idempotent.
        """
        if self._staging is None:
            raise FailedPrecondition("this broker has no staging buffer (started with --no-staging)")
        room = self._rooms.receiver.get(request.room)
        rank = room.ranks.get(rank_key(request.receiver)) if room is not None else None
        if rank is None or rank.peer_broker_id != request.sender_broker_id:
            raise NotFound(f"room {request.room} has no receiver {rank_key(request.receiver)} expecting this broker")
        key = (rank_key(request.source), request.chunk_index, request.part)
        if key in rank.staging:
            return rank.staging[key]
        if rank.terminal:
            raise FailedPrecondition(f"room {request.room} already ended on the receiver")
        reservation = await self._staging.reserve(request.bytes, self._staging_wait)
        if rank.terminal or key in rank.staging:
            self._staging.release(reservation)
            if key in rank.staging:
                return rank.staging[key]
            raise FailedPrecondition(f"room {request.room} ended while it waited for staging")
        rank.staging[key] = reservation
        return reservation

    def _unstage(self, rank: ReceiverProgress, source: RankKey, exp: SourceExpectation, notice: peer_pb2.TransferNotice) -> None:
        """Scatter a staged part into the rank's pages and release its reservation."""
        assert self._staging is not None
        key = (source, notice.chunk_index, notice.part)
        reservation = rank.staging.get(key)
        if reservation is None or reservation.offset != notice.staging_offset or notice.staging_bytes > reservation.nbytes:
            raise FailedPrecondition(f"source {source} wrote a staged part this broker did not reserve")
        plan = exp.plan
        layout = rank.engine.layout
        side = slice_side(layout, plan.dst_head_start, plan.num_heads, "receiver")
        regions = kv_regions(layout, plan.layer_begin, plan.layer_end, "receiver")
        pages = rank.pages[notice.page_offset : notice.page_offset + notice.pages]
        if pages.size != notice.pages or staged_bytes(len(regions), notice.pages, side) != notice.staging_bytes:
            raise FailedPrecondition(f"source {source}'s staged part does not match this rank's pages and heads")
        span = telemetry.start_span(
            "kvbroker.staging.scatter",
            parent=rank.span,
            attributes={"kvbroker.bytes": notice.staging_bytes, "kvbroker.chunk": notice.chunk_index, "kvbroker.source": str(source)},
        )
        scatter(
            self._staging.view(reservation, notice.staging_bytes),
            [rank.engine.region_array(r) for r in regions],
            pages,
            side,
        )
        span.end()
        del rank.staging[key]
        self._staging.release(reservation)

    def _release_staging(self, rank: ReceiverProgress) -> None:
        """The one release routine for a rank's staging reservations (room ended, settled)."""
        if self._staging is None:
            return
        for reservation in rank.staging.values():
            self._staging.release(reservation)
        rank.staging.clear()

    def _remember_for_successor(self, address: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """The broker at ``address`` has not heard that ``room_id`` failed here: tell the next one that answers there."""
        if address:
            self._rooms.successor_notices.setdefault((address, room_id), (why, time.monotonic()))

    def tell_successors(self, now: float, retry_seconds: float) -> None:
        """Tell the broker now at each address in ``successor_notices`` that
        those rooms failed here (PeerAbort), retrying every ``retry_seconds``.

        A prefill engine re-registered with a restarted broker may open a
        room there whose receiver failed with the old process; without this
        its source would wait the whole transfer-info timeout.
        """
        for address in {a for a, _ in self._rooms.successor_notices}:
            if address in self._telling or now - self._told_at.get(address, -1e9) < retry_seconds:
                continue
            self._telling.add(address)
            self._told_at[address] = now
            self._tasks.spawn(self._tell_successor(address), name=f"tell-successor-{address}")
        for address in [a for a in self._told_at if now - self._told_at[a] > 10 * retry_seconds]:
            del self._told_at[address]

    async def _tell_successor(self, address: str) -> None:
        try:
            try:
                peer = self._peers.by_address.get(address)
                if peer is None or peer.broker_id is None:
                    peer = await self._peers.connect(address)
                else:
                    # Is the process we know still the one there? (A restart
                    # found here fails what we had with the old one.)
                    await self._peers.handshake(peer)
            except KvBrokerError as exc:
                log.debug("successor_unreachable", peer=address, error=exc.message)
                return
            broker_id = peer.broker_id or ""
            for key in [k for k in self._rooms.successor_notices if k[0] == address]:
                # Handshaken, so a broker answers there: a refusal would not change on a retry.
                notice = self._rooms.successor_notices.pop(key, None)
                if notice is None:
                    continue  # expired meanwhile
                told = cause(
                    common_pb2.FAILURE_KIND_PEER, f"the receiving broker {self._id} failed the room: {notice[0].message}", self._id
                )
                await self._abort_sender(broker_id, key[1], told, remember=False)
                log.info("successor_told", room=key[1], peer=address, broker=broker_id)
        finally:
            self._telling.discard(address)

    async def _abort_sender(
        self, broker_id: str, room_id: int, why: common_pb2.FailureCause, *, remember: bool = True
    ) -> None:
        """Tell the sender's broker ``broker_id`` that the room failed here. If
        it cannot be told (it went away), and ``remember``, the broker that
        answers at its address next is told instead."""
        request = peer_pb2.PeerAbortRequest(room=room_id, from_broker_id=self._id, cause=why)

        def gone() -> None:
            room = self._rooms.receiver.get(room_id)
            for rank in room.ranks.values() if room is not None and remember else ():
                if rank.peer_broker_id == broker_id:
                    self._remember_for_successor(rank.sender_address, room_id, why)

        response = await self._peers.deliver(
            broker_id,
            f"AbortRoom(room {room_id})",
            lambda stub: stub.AbortRoom(request, timeout=self._peers.timeout),
            on_unreachable=gone,
        )
        if response is None or not response.settled:
            return
        # Nothing of the room is in flight from that broker (its sources may
        # even be evicted already, so no report would come).
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            if rank.peer_broker_id == broker_id and rank.state == FAILED:
                for exp in (rank.expected or {}).values():
                    exp.settled = True
                self._maybe_settled(rank)


def _nothing_in_flight(rank: ReceiverProgress) -> bool:
    """No source can still write into the rank's pages: the sender never had
    the room, or every source completed, settled, or owes no data."""
    if not rank.registered_with_sender or rank.expected is None:
        return True
    return all(e.complete or e.settled or not e.plan.writes_data for e in rank.expected.values())


def _all_parts_landed(exp: SourceExpectation) -> bool:
    """Every part of every chunk of the source's last notice's count has landed."""
    assert exp.total_chunks is not None
    return all(
        len(exp.parts_received.get(chunk, ())) == exp.parts_expected.get(chunk, -1) for chunk in range(exp.total_chunks)
    )

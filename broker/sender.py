"""The sender side of rooms: BeginSend, SendChunk, transfer infos, posting.

A source (one prefill engine rank in one room) accepts chunks from its engine
and transfer infos from receivers' brokers, in either order, and posts every
accepted chunk to every known destination in chunk order. Each posted
transfer carries a ``TransferNotice``; the receiver counts them per source
(explicit completion, DESIGN.md section 4). The source is SUCCESS when every
receiver it serves has registered and every transfer, through the last chunk,
finished DONE.

On failure (abort, NIXL error, mismatch) the source fails with the first
cause and tells each receiver's broker with a ``CompletionReport``; once no
transfer of the source is in flight any more it says so (``settled``), so the
receiver knows its pages are safe to reuse.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace

from kvbroker.broker import telemetry
from kvbroker.broker.counters import Counters
from kvbroker.broker.descriptors import check_index, check_indices
from kvbroker.broker.engines import Engine
from kvbroker.broker.layout import RankKey
from kvbroker.broker.metrics import BrokerMetrics
from kvbroker.broker.nixl_agent import Agent, XferState
from kvbroker.broker.peers import Peer, PeerTable
from kvbroker.broker.progress import ProgressLoop
from kvbroker.broker.rooms import (
    FAILED,
    SUCCESS,
    TRANSFERRING,
    WAITING_FOR_INPUT,
    Chunk,
    Destination,
    Progress,
    RoomTables,
    SenderRoom,
    SourceProgress,
    TransferInfo,
    cause,
    cause_of,
)
from kvbroker.broker.staging import StagingPool
from kvbroker.broker.tasks import TaskSet
from kvbroker.broker.transfers import ChunkPoster
from kvbroker.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    NotFound,
    PermissionDenied,
)
from kvbroker.indices import IndexArray
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["SenderSide"]

_FLUSH_FALLBACK_SECONDS = 0.002

log = structlog.get_logger(__name__)


class SenderSide:
    """Sender-side room logic. Event-loop thread only."""

    def __init__(
        self,
        *,
        broker_id: str,
        agent: Agent,
        peers: PeerTable,
        rooms: RoomTables,
        progress: ProgressLoop,
        counters: Counters,
        tasks: TaskSet,
        publish: Callable[[Progress], None],
        staging: StagingPool | None,
        staging_wait_seconds: float,
        metrics: BrokerMetrics,
        vram_slow_gbps: float,
    ) -> None:
        self._id = broker_id
        self._metrics = metrics
        self._peers = peers
        self._poster = ChunkPoster(
            broker_id=broker_id,
            agent=agent,
            peers=peers,
            progress=progress,
            counters=counters,
            tasks=tasks,
            staging=staging,
            staging_wait_seconds=staging_wait_seconds,
            on_settled=self._settled,
            metrics=metrics,
            vram_slow_gbps=vram_slow_gbps,
        )
        self._rooms = rooms
        self._counters = counters
        self._tasks = tasks
        self._publish = publish
        #: Sources with chunks to post after the current call (insertion-ordered set).
        self._scheduled: dict[SourceProgress, None] = {}

    # -- engine calls ----------------------------------------------------
    def begin(self, engine: Engine, room_id: int, num_pages: int) -> SourceProgress:
        """Open ``room_id`` for sending from ``engine``."""
        if self._rooms.is_tombstoned("sender", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        room = self._rooms.sender.get(room_id)
        if room is not None and engine.key in room.opened:
            raise AlreadyExists(f"engine rank {engine.key} already opened room {room_id}")
        if num_pages > engine.layout.num_pages and engine.layout.num_pages:
            raise InvalidArgument(f"num_pages {num_pages} exceeds the engine's {engine.layout.num_pages} pages")
        if room is None:
            room = self._rooms.sender[room_id] = SenderRoom(room_id)
        room.opened.add(engine.key)
        source = SourceProgress(room=room_id, engine=engine, listener=self._publish, num_pages=num_pages)
        source.begin_context = otel_context.get_current()
        source.engine_traced = telemetry.has_remote_parent(trace.get_current_span())
        if source.engine_traced:
            # The engine passed its request's trace: the room joins it.
            self._open_span(source, source.begin_context)
        room.sources[engine.key] = source
        log.debug("send_opened", room=room_id, engine=engine.label, num_pages=num_pages)
        if room.aborted is not None:
            self.fail(source, room.aborted)
            return source
        for info in list(room.infos.values()):
            plan = info.plan_for(engine.key)
            if plan is not None:
                self._attach(source, info)
        return source

    def send_chunk(
        self,
        engine: Engine,
        room_id: int,
        pages: IndexArray,
        *,
        is_last: bool,
        aux_row: int | None,
        state: dict[str, IndexArray],
    ) -> tuple[int, SourceProgress]:
        """Accept one chunk and post it to every known destination.

        Returns the chunk index and the source. A chunk for a FAILED source is
        accepted and dropped (the status says why); everything is validated
        before anything is recorded.
        """
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is None:
            raise NotFound(f"room {room_id} is not open for sending on engine {engine.engine_id}; call BeginSend first")
        if source.last_received:
            raise FailedPrecondition(f"room {room_id} already received its last chunk")
        self._validate_chunk(source, pages, is_last=is_last, aux_row=aux_row, state=state)
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
        self._schedule(source)
        self._update(source)
        return chunk.index, source

    def abort(self, engine: Engine, room_id: int, reason: str) -> SourceProgress | None:
        """Fail the engine's side of the room and tell its receivers. Idempotent."""
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is not None:
            why = reason or "aborted by the sending engine"
            self.ensure_span(source)
            telemetry.child_done(source.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": "engine"})
            self.fail(source, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return source

    def fail(self, source: SourceProgress, why: common_pb2.FailureCause) -> None:
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

    # -- peer calls ------------------------------------------------------
    def on_register_room(self, info: TransferInfo, peer: Peer) -> None:
        """A receiver rank's transfer info. Idempotent for the same receiver."""
        if self._rooms.is_tombstoned("sender", info.room):
            raise FailedPrecondition(f"room {info.room} already ended on this broker")
        remote = peer.engines.get(info.receiver)
        if remote is None or remote.generation != info.receiver_generation:
            raise Aborted(
                f"receiver {info.receiver} generation {info.receiver_generation} is not in this broker's view of "
                f"broker {info.receiver_broker_id}; handshake again"
            )
        # The receiver's broker checked these against its engine; check again
        # against what it announced, so no index outside a region it
        # registered can ever become a descriptor here.
        layout = remote.layout
        check_indices(info.pages, layout.num_pages, f"receiver {info.receiver} pages")
        if info.aux_row is not None:
            check_index(info.aux_row, layout.aux_rows, f"receiver {info.receiver} aux_row")
        for name, indices in info.state.items():
            if name not in layout.state_components:
                raise InvalidArgument(f"receiver {info.receiver} has no state component {name!r}")
            check_indices(indices, layout.state_items[name], f"receiver {info.receiver} state {name!r}")
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

    def on_peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str | None = None) -> bool:
        """A receiver's broker aborted the room: fail every local source of it.

        The room is remembered as aborted (until evicted), so a source that
        opens it afterwards fails at once with the same cause instead of
        waiting for a transfer info that will never come. Returns whether no
        transfer of the room is in flight from here any more.
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
                room.abandoned.add(pair)
                report = peer_pb2.CompletionReport(
                    room=room.room,
                    sender_broker_id=self._id,
                    source=source_key.to_proto(),
                    receiver=info.receiver.to_proto(),
                    failure=why,
                    settled=True,
                )
                self._tasks.spawn(self._send_report(info.receiver_broker_id, report), name=f"abandon-{room.room}")
                told += 1
        return told

    def abandon_orphans(self, now: float, orphan_seconds: float) -> None:
        """Receivers whose sources never opened the room within ``orphan_seconds`` learn so."""
        for room in list(self._rooms.sender.values()):
            for info, rank in list(room.unserved()):
                if now - info.received_at <= orphan_seconds:
                    continue
                why = cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"source rank {rank} did not open the room (BeginSend) within {orphan_seconds:g} s",
                    self._id,
                )
                self.abandon(rank, why, older_than=now - orphan_seconds)

    def time_out(self, now: float, info_timeout_seconds: float) -> None:
        """Fail sources that waited longer than the timeout for their receivers' transfer infos."""
        for source in list(self._rooms.all_sources()):
            if source.terminal or source.ready() or now - source.opened_at <= info_timeout_seconds:
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

    # -- internals ---------------------------------------------------------
    def _validate_chunk(
        self,
        source: SourceProgress,
        pages: IndexArray,
        *,
        is_last: bool,
        aux_row: int | None,
        state: dict[str, IndexArray],
    ) -> None:
        layout = source.engine.layout
        check_indices(pages, layout.num_pages, "pages")
        total = source.cursor + int(pages.size)
        if source.num_pages and total > source.num_pages:
            raise InvalidArgument(f"this chunk brings the room to {total} pages; BeginSend declared {source.num_pages}")
        if not is_last:
            if aux_row is not None or state:
                raise InvalidArgument("aux_row and state go on the last chunk (is_last)")
            return
        if source.num_pages and total != source.num_pages:
            raise InvalidArgument(f"the last chunk brings the room to {total} pages; BeginSend declared {source.num_pages}")
        if layout.aux_regions and aux_row is None:
            raise InvalidArgument("the last chunk must carry aux_row: this engine registered aux regions")
        if aux_row is not None:
            if not layout.aux_regions:
                raise InvalidArgument("aux_row given but this engine registered no aux regions")
            check_index(aux_row, layout.aux_rows, "aux_row")
        for name, indices in state.items():
            if name not in layout.state_components:
                raise InvalidArgument(f"state component {name!r} is not in this engine's layout")
            check_indices(indices, layout.state_items[name], f"state {name!r}")

    def _attach(self, source: SourceProgress, info: TransferInfo) -> None:
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
        if source.num_pages and plan.writes_data and source.num_pages != info.pages.size:
            self.fail(
                source,
                cause(
                    common_pb2.FAILURE_KIND_MISMATCH,
                    f"the sender will send {source.num_pages} pages, receiver {info.receiver} expects {info.pages.size}",
                    self._id,
                ),
            )
            return
        self._schedule(source)
        self._update(source)

    def _schedule(self, source: SourceProgress) -> None:
        """Post the source's pending chunks once the current RPC has answered.

        Posting may copy the bytes synchronously (UCX's cma transport copies
        inside the post), so the RPC that accepted a chunk answers first
        (the servicers call :meth:`flush` when their RPC is done) and the
        engine prepares its next chunk while this broker copies. A short
        timer flushes anyway, for calls that do not come through an RPC.
        """
        if not self._scheduled:
            asyncio.get_running_loop().call_later(_FLUSH_FALLBACK_SECONDS, self.flush)
        self._scheduled[source] = None

    def flush(self) -> None:
        """Post every scheduled source's pending chunks now."""
        if not self._scheduled:
            return
        scheduled, self._scheduled = self._scheduled, {}
        for source in scheduled:
            try:
                for dest in list(source.destinations.values()):
                    self._pump(source, dest)
                self._update(source)
            except Exception as exc:
                # Runs from an RPC's done-callback: nothing above would log it.
                log.exception("post_failed", room=source.room, engine=source.engine.label)
                self.fail(source, cause(common_pb2.FAILURE_KIND_UNSPECIFIED, f"posting failed inside the broker: {exc!r}", self._id))

    def _pump(self, source: SourceProgress, dest: Destination) -> None:
        """Post every accepted chunk not yet posted to ``dest``, in order."""
        while dest.posted_chunks < len(source.chunk_list) and source.state != FAILED:
            chunk = source.chunk_list[dest.posted_chunks]
            try:
                self._poster.post(source, dest, chunk)
            except KvBrokerError as exc:
                self.fail(source, cause_of(exc, self._id))
                return
            dest.posted_chunks += 1
            dest.last_posted = chunk.is_last
        self._check_complete(source, dest)

    def _settled(
        self,
        source: SourceProgress,
        dest: Destination,
        nbytes: int,
        state: XferState,
        descs: int | None,
        error: KvBrokerError | None,
    ) -> None:
        """A posted part finished (DONE or ERR), or could not be posted (``error``)."""
        source.inflight -= 1
        dest.inflight -= 1
        self._counters.descriptors_transferred += descs or 0
        if state is XferState.DONE:
            source.bytes += nbytes
            self._counters.bytes_sent += nbytes
            self._metrics.bytes.add(nbytes, {"direction": "sent"})
            source.mark("first_byte")
        elif error is not None:
            self.fail(source, cause_of(error, self._id))
        else:
            peer = self._peers.by_id.get(dest.info.receiver_broker_id)
            where = f"broker {peer.address if peer else '?'} ({dest.info.receiver_broker_id})"
            self.fail(
                source,
                cause(common_pb2.FAILURE_KIND_TRANSFER, f"a NIXL write to receiver {dest.info.receiver} at {where} failed", self._id),
            )
        if source.state == FAILED:
            if source.inflight == 0:
                source.mark_settled()
            if dest.inflight == 0 and dest.failure_reported and not dest.settle_reported:
                self._report(source, dest)
            return
        self._check_complete(source, dest)
        self._update(source)

    def _check_complete(self, source: SourceProgress, dest: Destination) -> None:
        if not dest.complete and dest.last_posted and dest.inflight == 0 and source.state != FAILED:
            dest.complete = True

    def _open_span(self, source: SourceProgress, parent: object) -> None:
        """The sender's room span (back-dated to BeginSend) and its wait for transfer info."""
        span = telemetry.open_room_span(source, "sender", parent, start_ns=source.opened_ns)  # type: ignore[arg-type]
        if not source.ready():
            source.wait_span = telemetry.start_span(
                "kvbroker.wait_for_transfer_info", parent=span, start_ns=source.opened_ns
            )

    def ensure_span(self, source: SourceProgress) -> None:
        """A room span even for a source that ends before any receiver registered."""
        if source.span is None:
            self._open_span(source, source.begin_context)

    def _update(self, source: SourceProgress) -> None:
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

    def _report(self, source: SourceProgress, dest: Destination) -> None:
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
        self._tasks.spawn(self._send_report(dest.info.receiver_broker_id, report), name=f"report-{source.room}")

    async def _send_report(self, broker_id: str, report: peer_pb2.CompletionReport) -> None:
        await self._peers.deliver(
            broker_id,
            f"ReportCompletion(room {report.room})",
            lambda stub: stub.ReportCompletion(report, timeout=self._peers.timeout),
        )

"""A source's parts, from planning until they settle: the ground floor of ``SenderCore``.

:class:`SenderParts` holds the sender state machine's state and outbox and
what every one of its calls comes down to: posting every accepted chunk of a
source to every destination, in chunk order (each chunk planned by
``_send_chunks`` into parts: NIXL writes, each with a ``TransferNotice``; a
staged part first reserves room at the receiver, ``ReserveStaging`` ->
:meth:`~SenderParts.staging_reserved`), settling the parts
(:meth:`~SenderParts.part_settled`), moving the source forward to SUCCESS,
and failing it (the first cause is kept; every receiver's broker is told
with a ``CompletionReport``, and told again once nothing of the source is in
flight). ``SenderRegistration`` (``_send_registration``) and ``SenderCore``
(``_sender``) build on it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import XferState
from kvbroker.broker.rooms._effects import (
    Effect,
    PostPart,
    Publish,
    ReserveStaging,
    RoomEnded,
    SendReport,
)
from kvbroker.broker.rooms._records import RoomTables
from kvbroker.broker.rooms._send_chunks import (
    chunk_notice,
    chunk_window,
    data_notice,
    pack_limit,
    part_notices,
    stage_policy,
)
from kvbroker.broker.rooms._sender_records import (
    Chunk,
    ChunkChecksum,
    Destination,
    Part,
    PeerView,
    Source,
    TransferInfo,
)
from kvbroker.broker.rooms._sides import (
    FAILED,
    SUCCESS,
    TRANSFERRING,
    WAITING_FOR_INPUT,
    Side,
    cause,
    cause_of,
)
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, KvBrokerError
from kvbroker.plan import (
    FULL_PAGES,
    NO_INDICES,
    ChunkSum,
    KvPairs,
    PartKind,
    PartSpec,
    SourcePlan,
    kv_pairs,
    plan_chunk,
    slice_side,
)
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.peers import RemoteEngine

__all__ = ["SenderParts"]

log = structlog.get_logger(__name__)

#: KV pairings kept (``SenderParts._kv_plans``): far more than the (engine,
#: receiver rank) pairs of a fleet; each is a few small arrays.
_KV_PLANS = 4096


class SenderParts:
    """The sender state machine's state, outbox, failures and parts in flight."""

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

    # -- posting ---------------------------------------------------------
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
                notice = chunk_notice(self._id, source, dest, chunk, total_chunks=1, pages=0)
                self._send_parts(source, dest, chunk, remote, [PartSpec(kind=PartKind.NOTICE, nbytes=0)], notice)
            return
        window = chunk_window(source, dest, chunk, remote)
        if window.completed is not None:
            dest.completed = window.completed
        shape = window.shape
        layout, table = source.engine.layout, source.engine.table
        if dest.kv is None and plan.mode == FULL_PAGES and shape.src_pages.size:
            dest.kv = self._kv_pairs(source, info, remote, plan)
        receive = partial(self._peers.receive_staging_bytes, info.receiver_broker_id)
        specs = plan_chunk(
            layout,
            table,
            remote.layout,
            remote.table,
            plan,
            shape,
            stage_policy(self._send_staging_bytes, receive),
            dest.kv,
            pack_limit(self._part_bytes, self._send_staging_bytes, receive),
        )
        notice = data_notice(self._id, source, dest, chunk, window, specs)
        checksum = None
        if info.verify_checksum:
            # What moves packed, each packed part's own checksum covers. The
            # executor reads the pages (off the control loop) before the first
            # part is written.
            head = slice_side(layout, plan.src_head_start, plan.num_heads, "sender") if plan.head_sliced else None
            aux_row = shape.aux_rows[0] if shape.aux_rows is not None and not notice.aux_packed else None
            pages, runs_of = (NO_INDICES, None) if notice.kv_packed else (shape.src_pages, shape.tokens)
            checksum = ChunkChecksum(ChunkSum(plan, pages, head, aux_row, "sender", runs_of))
        self._send_parts(source, dest, chunk, remote, specs, notice, checksum)

    def _send_parts(
        self,
        source: Source,
        dest: Destination,
        chunk: Chunk,
        remote: RemoteEngine,
        specs: list[PartSpec],
        notice: peer_pb2.TransferNotice,
        checksum: ChunkChecksum | None = None,
    ) -> None:
        for i, (spec, part_notice) in enumerate(zip(specs, part_notices(notice, specs), strict=True)):
            part = Part(
                source=source, dest=dest, chunk=chunk, index=i, spec=spec, notice=part_notice, remote=remote, checksum=checksum
            )
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

    # -- progress and reports ----------------------------------------------
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

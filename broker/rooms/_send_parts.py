"""A source's chunks and parts, from SendChunk until every part settles.

:class:`PartLedger` accepts each chunk of a source
(:meth:`~PartLedger.chunk`, SendChunk: validated against the engine's regions
before anything is recorded) and posts every accepted chunk to every
destination, in chunk order (:meth:`~PartLedger.pump`; each chunk planned by
``_send_chunks`` into parts: NIXL writes, each with a ``TransferNotice``; a
staged part first reserves room at the receiver, ``ReserveStaging`` ->
:meth:`~PartLedger.staging_reserved`). It counts the parts in flight until
each settles (:meth:`~PartLedger.part_settled`), and owns the KV pairings
planned once per (engine, receiver rank) pair. How a source ends is
``SourceOutcomes``'s (``_send_outcomes``), which it is given at
construction; ``SourceBootstrap`` (``_send_bootstrap``) pumps a new
destination through it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from kvbroker.broker.dataplane import XferState
from kvbroker.broker.rooms._commands import SendChunk
from kvbroker.broker.rooms._effects import PostPart, ReserveStaging
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._send_chunks import (
    chunk_notice,
    chunk_window,
    data_notice,
    pack_limit,
    part_notices,
    room_mismatch,
    stage_policy,
)
from kvbroker.broker.rooms._send_outcomes import SourceOutcomes
from kvbroker.broker.rooms._sender_records import (
    Chunk,
    ChunkChecksum,
    Destination,
    Part,
    PeerView,
    Source,
    TransferInfo,
)
from kvbroker.broker.rooms._sides import FAILED, cause, cause_of
from kvbroker.errors import FailedPrecondition, InvalidArgument, KvBrokerError, NotFound
from kvbroker.plan import (
    FULL_PAGES,
    NO_INDICES,
    ChunkSum,
    KvPairs,
    PartKind,
    PartSpec,
    SourcePlan,
    check_chunk,
    kv_pairs,
    plan_chunk,
    slice_side,
)
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.peers import RemoteEngine

__all__ = ["PartLedger"]

#: KV pairings kept (``PartLedger._kv_plans``): far more than the (engine,
#: receiver rank) pairs of a fleet; each is a few small arrays.
_KV_PLANS = 4096


class PartLedger:
    """Every source's accepted chunks and its parts in flight to each destination."""

    def __init__(
        self,
        core: MachineCore,
        outcomes: SourceOutcomes,
        *,
        peers: PeerView,
        send_staging_bytes: Callable[[int, int], int],
        part_bytes: int,
        host_part_bytes: int = 0,
    ) -> None:
        self._id = core.broker_id
        self._rooms = core.rooms
        self._counters = core.counters
        self._emit = core.emit
        # Bound once: these run for every part.
        self._fail = outcomes.fail
        self._advance = outcomes.advance
        self._report = outcomes.report
        self._peers = peers
        self._send_staging_bytes = send_staging_bytes
        #: The largest packed part (``BrokerConfig.device_part_bytes``).
        self._part_bytes = part_bytes
        #: The largest part written straight between engines' pages (``BrokerConfig.part_bytes``; 0: any).
        self._host_part_bytes = host_part_bytes
        #: KV pairings by (engine, its generation, receiver broker, rank, its generation, layers).
        self._kv_plans: collections.OrderedDict[tuple[Any, ...], KvPairs] = collections.OrderedDict()

    # -- chunks ------------------------------------------------------------
    def chunk(self, command: SendChunk) -> tuple[int, Source]:
        """Accept one chunk (SendChunk) and post it to every known destination.

        Returns the chunk index and the source. A chunk for a FAILED source is
        accepted and dropped (the status says why); everything is validated
        before anything is recorded. ``room_page``: the room page the chunk
        starts at; only the first chunk may move it (incremental transfer).
        """
        engine, room_id, pages, is_last = command.engine, command.room, command.pages, command.is_last
        aux_row, state, room_page = command.aux_row, command.state, command.room_page
        room = self._rooms.sender.get(room_id)
        source = room.sources.get(engine.key) if room is not None else None
        if source is None:
            raise NotFound(f"room {room_id} is not open for sending on engine {engine.engine_id}; call BeginSend first")
        if source.last_received:
            raise FailedPrecondition(f"room {room_id} already received its last chunk")
        check_chunk(
            source.engine.layout,
            declared=source.num_pages,
            sent=source.cursor,
            pages=pages,
            is_last=is_last,
            aux_row=aux_row,
            state=state,
        )
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
                problem = room_mismatch(source, dest.info) if dest.plan.writes_data else None
                if problem:
                    self._fail(source, cause(common_pb2.FAILURE_KIND_MISMATCH, problem, self._id))
                    return chunk.index, source
        self.pump_all(source)
        return chunk.index, source

    # -- transfers -------------------------------------------------------
    def staging_reserved(self, part: Part, buffer: peer_pb2.RemoteBuffer, offset: int, credit_id: int = 0) -> None:
        """The receiver reserved room for a staged part (or, ``credit_id``, a packed
        part holds a range of this broker's credits there): gather and post it."""
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
        part.notice.credit_id = credit_id
        self._emit(PostPart(part))

    def part_settled(
        self, part: Part, state: XferState, descriptors: int | None, error: KvBrokerError | None, queued_s: float = 0.0
    ) -> None:
        """A part finished (DONE or ERR), or could not be posted or staged
        (``error``); ``queued_s``: how long it waited in the send window."""
        source, dest = part.source, part.dest
        source.queued_s += queued_s
        source.inflight -= 1
        dest.inflight -= 1
        dest.prefetch.pop(part.key, None)
        self._counters.descriptors_transferred += descriptors or 0
        if state is XferState.DONE:
            source.bytes += part.nbytes
            self._counters.bytes_sent += part.nbytes
            source.mark("first_byte")
        elif error is not None:
            self._fail(source, cause_of(error, self._id))
        else:
            self._fail(
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
        _check_complete(source, dest)
        self._advance(source)

    # -- posting ---------------------------------------------------------
    def pump_all(self, source: Source) -> None:
        """Post what every destination of ``source`` was not posted yet, then move it forward."""
        for dest in list(source.destinations.values()):
            self.pump(source, dest)
        self._advance(source)

    def pump(self, source: Source, dest: Destination) -> None:
        """Post every accepted chunk not yet posted to ``dest``, in order."""
        while dest.posted_chunks < len(source.chunk_list) and source.state != FAILED:
            chunk = source.chunk_list[dest.posted_chunks]
            try:
                self._post_chunk(source, dest, chunk)
            except KvBrokerError as exc:
                self._fail(source, cause_of(exc, self._id))
                return
            dest.posted_chunks += 1
            dest.last_posted = chunk.is_last
        _check_complete(source, dest)

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
            self._host_part_bytes,
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
            self._emit(ReserveStaging(part) if staged else PostPart(part))

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


def _check_complete(source: Source, dest: Destination) -> None:
    """``dest`` completed: every part through the last chunk posted to it settled DONE."""
    if not dest.complete and dest.last_posted and dest.inflight == 0 and source.state != FAILED:
        dest.complete = True

"""Building and posting the NIXL transfers of one chunk to one destination.

A chunk becomes one or more parts, each one NIXL WRITE carrying its own
``TransferNotice`` (``part``/``parts``):

- whole items (KV pages of FULL_PAGES sources, aux rows, state items), by
  index into the prepared descriptor lists, one part per memory-kind pair;
- head slices of KV pages (HEAD_SLICE sources), either staged (gather into
  this broker's send buffer, one bulk write into a reservation in the
  receiver's staging buffer made just before: the prefetch) or, when staging
  is off or the block cannot fit, one transient descriptor per (layer region,
  page, token);
- nothing at all: a notification-only notice (a completion-only source, or a
  last chunk with no pages, aux or state), so completion stays explicit.

The caller (``SenderSide``) owns the room bookkeeping; this module reports
every posted part back through ``on_settled`` exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import grpc
import numpy as np
import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.counters import Counters
from kvbroker.broker.descriptors import DescriptorTable, Segment, plan_parts
from kvbroker.broker.layout import Layout
from kvbroker.broker.metrics import BrokerMetrics
from kvbroker.broker.nixl_agent import Agent, XferState
from kvbroker.broker.peers import Peer, PeerTable, RemoteEngine
from kvbroker.broker.progress import InflightTransfer, ProgressLoop
from kvbroker.broker.rooms import Chunk, Destination, SourceProgress
from kvbroker.broker.segments import ChunkShape, build_segments, state_regions
from kvbroker.broker.slicing import (
    SliceSide,
    gather,
    head_slice,
    kv_region_pairs,
    staged_bytes,
    token_descriptors,
)
from kvbroker.broker.staging import Reservation, StagingPool
from kvbroker.broker.tasks import TaskSet
from kvbroker.errors import FailedPrecondition, KvBrokerError, from_rpc_error
from kvbroker.indices import IndexArray
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["ChunkPoster", "SettledCallback"]

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
#: Transfers smaller than this do not count for throughput (latency dominates).
_THROUGHPUT_MIN_BYTES = 1 << 20
T = TypeVar("T")

log = structlog.get_logger(__name__)

#: (source, destination, bytes moved, final state, NIXL descriptors or None, failure or None)
SettledCallback = Callable[[SourceProgress, Destination, int, XferState, "int | None", "KvBrokerError | None"], None]


class ChunkPoster:
    """Posts chunks. Event-loop thread only."""

    def __init__(
        self,
        *,
        broker_id: str,
        agent: Agent,
        peers: PeerTable,
        progress: ProgressLoop,
        counters: Counters,
        tasks: TaskSet,
        staging: StagingPool | None,
        staging_wait_seconds: float,
        on_settled: SettledCallback,
        metrics: BrokerMetrics,
        vram_slow_gbps: float,
    ) -> None:
        self._metrics = metrics
        self._vram_slow_bps = vram_slow_gbps * 1e9
        self._id = broker_id
        self._agent = agent
        self._peers = peers
        self._progress = progress
        self._counters = counters
        self._tasks = tasks
        self._staging = staging
        self._staging_wait = staging_wait_seconds
        self._on_settled = on_settled

    def post(self, source: SourceProgress, dest: Destination, chunk: Chunk) -> None:
        """Post ``chunk`` of ``source`` to ``dest``. Raises ``KvBrokerError`` if
        nothing could be posted; later failures come through ``on_settled``."""
        info, plan = dest.info, dest.plan
        peer = self._peers.get(info.receiver_broker_id)
        remote = peer.engines.get(info.receiver)
        if remote is None or remote.generation != info.receiver_generation:
            raise FailedPrecondition(f"receiver {info.receiver} is gone from broker {info.receiver_broker_id}")
        if not plan.writes_data:
            if chunk.is_last:
                self._notify(peer, self._notice(source, dest, chunk, total_chunks=1, parts=1, pages=0))
            return
        end = chunk.page_offset + int(chunk.pages.size)
        if end > info.pages.size or (chunk.is_last and end != info.pages.size):
            raise FailedPrecondition(
                f"the sender sent {end} pages{' in all' if chunk.is_last else ' so far'}, "
                f"receiver {info.receiver} expects {info.pages.size}"
            )
        shape = ChunkShape(
            src_pages=chunk.pages,
            dst_pages=info.pages[chunk.page_offset : end],
            aux_rows=_aux_rows(chunk, dest),
            state=_state_pairs(chunk, dest, remote),
        )
        src_layout = source.engine.layout
        segments = build_segments(src_layout, remote.layout, plan, shape)
        whole = plan_parts(source.engine.table, remote.table, segments)
        sliced = plan.head_sliced and shape.src_pages.size > 0
        notice = self._notice(
            source,
            dest,
            chunk,
            total_chunks=len(source.chunk_list) if chunk.is_last else 0,
            parts=len(whole) + int(sliced),
            pages=int(chunk.pages.size),
        )
        notice.aux = shape.aux_rows is not None
        notice.state_components.extend(sorted(shape.state))
        if not whole and not sliced:
            notice.parts = 1
            self._notify(peer, notice)
            return
        carried = _carried(source.engine.table, remote.table, segments, src_layout)
        for i, part in enumerate(whole):
            notice.part, notice.bytes = i, part.bytes
            kinds = (part.local_kind, part.remote_kind)
            span = self._transfer_span(source, dest, notice, "prepped", kinds, carried.get(kinds, ()))
            handle = self._post_or_end(
                span,
                lambda part=part: self._agent.post_write(  # type: ignore[misc]
                    source.engine.dlists[part.local_kind],
                    part.local_indices,
                    self._peers.remote_dlist(peer, remote, part.remote_kind),
                    part.remote_indices,
                    notice.SerializeToString(),
                ),
            )
            self._track(source, dest, peer, handle, part.bytes, span, "prepped", kinds)
        if sliced:
            notice.part = len(whole)
            self._post_slice(source, dest, peer, remote, shape, notice)

    # -- head slices ------------------------------------------------------
    def _post_slice(
        self,
        source: SourceProgress,
        dest: Destination,
        peer: Peer,
        remote: RemoteEngine,
        shape: ChunkShape,
        notice: peer_pb2.TransferNotice,
    ) -> None:
        src_layout = source.engine.layout
        plan = dest.plan
        hs = head_slice(src_layout, remote.layout, plan)
        pairs = kv_region_pairs(src_layout, remote.layout, plan.layer_begin, plan.layer_end)
        nbytes = staged_bytes(len(pairs), int(shape.src_pages.size), hs.src)
        if self._can_stage(peer, nbytes, source.engine.table, remote.table, pairs):
            source.inflight += 1
            dest.inflight += 1
            span = self._transfer_span(source, dest, notice, "staged", (DRAM, DRAM), ())
            self._tasks.spawn(
                self._post_staged(source, dest, peer, [s for s, _ in pairs], shape.src_pages, hs.src, nbytes, notice, span),
                name=f"staged-{source.room}",
            )
            return
        local_kind, remote_kind, local, remote_descs = token_descriptors(
            source.engine.table, remote.table, pairs, shape.src_pages, shape.dst_pages, hs
        )
        notice.bytes = nbytes
        assert peer.agent_name is not None
        agent_name = peer.agent_name
        kinds = (local_kind, remote_kind)
        span = self._transfer_span(source, dest, notice, "per_token", kinds, ())
        span.set_attribute("kvbroker.descriptors_built", len(local))
        handle = self._post_or_end(
            span,
            lambda: self._agent.post_write_descs(
                local, local_kind, remote_descs, remote_kind, agent_name, notice.SerializeToString()
            ),
        )
        self._counters.transfers_per_token += 1
        self._track(source, dest, peer, handle, nbytes, span, "per_token", kinds)

    def _can_stage(
        self, peer: Peer, nbytes: int, src: DescriptorTable, dst: DescriptorTable, pairs: list[tuple[int, int]]
    ) -> bool:
        if self._staging is None or peer.staging is None:
            return False
        if any(src.region_kind[s] != DRAM or dst.region_kind[d] != DRAM for s, d in pairs):
            # Gather and scatter are host copies; VRAM head slices go per token
            # (GPU-direct), not through host staging buffers.
            return False
        if nbytes > min(self._staging.size_bytes, peer.staging.size_bytes):
            log.warning(
                "staging_block_too_large",
                bytes=nbytes,
                local_buffer=self._staging.size_bytes,
                peer_buffer=peer.staging.size_bytes,
                fallback="per-token descriptors",
            )
            return False
        return True

    async def _post_staged(
        self,
        source: SourceProgress,
        dest: Destination,
        peer: Peer,
        regions: list[int],
        pages: IndexArray,
        side: SliceSide,
        nbytes: int,
        notice: peer_pb2.TransferNotice,
        span: Span,
    ) -> None:
        """Prefetch a reservation at the receiver, gather, write in bulk.

        ``source.inflight``/``dest.inflight`` were raised by the caller; exactly
        one ``on_settled`` lowers them again. ``span`` covers all of it.
        """
        assert self._staging is not None and peer.staging is not None and peer.agent_name is not None
        key = (notice.chunk_index, notice.part)
        local: Reservation | None = None
        start = time.monotonic()
        try:
            request = peer_pb2.ReserveStagingRequest(
                room=source.room,
                sender_broker_id=self._id,
                source=notice.source,
                receiver=notice.receiver,
                chunk_index=notice.chunk_index,
                part=notice.part,
                bytes=nbytes,
            )
            try:
                with trace.use_span(span, end_on_exit=False):
                    response = await self._peers.stub(peer).ReserveStaging(
                        request, timeout=self._staging_wait + self._peers.timeout
                    )
            except grpc.RpcError as exc:
                raise type(from_rpc_error(exc))(f"the receiver could not reserve staging: {from_rpc_error(exc).message}") from exc
            dest.prefetch[key] = response.offset
            local = await self._staging.reserve(nbytes, self._staging_wait)
            if source.state == common_pb2.ROOM_STATE_FAILED:
                raise FailedPrecondition("the room failed before its staged part was written")
            gathering = telemetry.start_span("kvbroker.staging.gather", parent=span, attributes={"kvbroker.bytes": nbytes})
            gather([source.engine.region_array(r) for r in regions], pages, side, self._staging.view(local, nbytes))
            gathering.end()
            notice.staged = True
            notice.staging_offset = response.offset
            notice.staging_bytes = nbytes
            notice.bytes = nbytes
            handle = self._agent.post_write_descs(
                np.array([[self._staging.address + local.offset, nbytes, 0]], dtype=np.uint64),
                DRAM,
                np.array([[peer.staging.address + response.offset, nbytes, peer.staging.device_id]], dtype=np.uint64),
                peer.staging.kind,
                peer.agent_name,
                notice.SerializeToString(),
            )
        except KvBrokerError as exc:
            if local is not None:
                self._staging.release(local)
            dest.prefetch.pop(key, None)
            telemetry.end_with_status(span, False, exc.message)
            self._on_settled(source, dest, 0, XferState.ERR, None, exc)
            return
        self._counters.transfers_staged += 1
        reservation = local

        def release() -> None:
            assert self._staging is not None
            self._staging.release(reservation)
            dest.prefetch.pop(key, None)

        self._track(
            source, dest, peer, handle, nbytes, span, "staged", (DRAM, DRAM), started=start, before_settle=release, counted=True
        )

    # -- helpers ---------------------------------------------------------------
    def _transfer_span(
        self,
        source: SourceProgress,
        dest: Destination,
        notice: peer_pb2.TransferNotice,
        path: str,
        kinds: tuple[int, int],
        carried: tuple[str, ...],
    ) -> Span:
        """The span of one transfer part, child of the source's room span; aux and
        state components it carries become child spans ending with it."""
        span = telemetry.start_span(
            "kvbroker.transfer",
            parent=source.span,
            attributes={
                "kvbroker.room": source.room,
                "kvbroker.receiver": str(dest.info.receiver),
                "kvbroker.chunk": notice.chunk_index,
                "kvbroker.part": notice.part,
                "kvbroker.pages": notice.pages,
                "kvbroker.bytes": notice.bytes,
                "kvbroker.path": path,
                "kvbroker.memory": _kinds_text(kinds),
            },
        )
        for name in carried:
            telemetry.start_span(name, parent=span).end()
        return span

    def _post_or_end(self, span: Span, post: Callable[[], T]) -> T:
        try:
            return post()
        except KvBrokerError as exc:
            telemetry.end_with_status(span, False, exc.message)
            raise

    def _track(
        self,
        source: SourceProgress,
        dest: Destination,
        peer: Peer,
        handle: object,
        nbytes: int,
        span: Span,
        path: str,
        kinds: tuple[int, int],
        *,
        started: float | None = None,
        before_settle: Callable[[], None] | None = None,
        counted: bool = False,
    ) -> None:
        """Poll the posted ``handle`` until it settles; ``counted``: the caller
        already raised the in-flight counts (a staged part, from its start)."""
        if not counted:
            source.inflight += 1
            dest.inflight += 1
        self._counters.transfers_posted += 1
        start = time.monotonic() if started is None else started

        def settled(state: XferState, descs: int | None, error: KvBrokerError | None) -> None:
            elapsed = time.monotonic() - start
            if before_settle is not None:
                before_settle()
            self._observe(peer, nbytes, elapsed, path, kinds, state)
            span.set_attribute("kvbroker.descriptors", descs or 0)
            span.set_attribute("kvbroker.duration_s", elapsed)
            telemetry.end_with_status(span, state is XferState.DONE, error.message if error else "NIXL reported an error")
            self._on_settled(source, dest, nbytes, state, descs, error)

        self._progress.track(
            InflightTransfer(handle=handle, bytes=nbytes, on_settled=settled, remote_agent=peer.agent_name or "")
        )

    def _observe(self, peer: Peer, nbytes: int, elapsed: float, path: str, kinds: tuple[int, int], state: XferState) -> None:
        """Metrics and the per-peer throughput; warn when VRAM moves at host-copy speed."""
        ok = state is XferState.DONE
        self._metrics.transfers.add(1, {"path": path, "result": "done" if ok else "error"})
        if not ok:
            return
        self._metrics.transfer_seconds.record(elapsed, {"path": path})
        peer.bytes_sent += nbytes
        peer.kinds.add(_kinds_text(kinds))
        if nbytes < _THROUGHPUT_MIN_BYTES or elapsed <= 0:
            return
        rate = nbytes / elapsed
        peer.throughput_bps = rate if not peer.throughput_bps else 0.8 * peer.throughput_bps + 0.2 * rate
        vram = VRAM in kinds
        if vram and rate < self._vram_slow_bps and time.monotonic() - peer.slow_warned_at > 60:
            peer.slow_warned_at = time.monotonic()
            log.warning(
                "vram_transfer_at_host_speed",
                peer=peer.address,
                memory=_kinds_text(kinds),
                gbps=round(rate / 1e9, 3),
                threshold_gbps=self._vram_slow_bps / 1e9,
                hint="UCX may have fallen back to TCP or a host copy; check UCX_TLS / UCX_NET_DEVICES and UCX_PROTO_INFO=y",
            )

    def _notice(
        self, source: SourceProgress, dest: Destination, chunk: Chunk, *, total_chunks: int, parts: int, pages: int
    ) -> peer_pb2.TransferNotice:
        return peer_pb2.TransferNotice(
            room=source.room,
            sender_broker_id=self._id,
            source=source.key.to_proto(),
            receiver=dest.info.receiver.to_proto(),
            chunk_index=chunk.index if dest.plan.writes_data else 0,
            is_last=chunk.is_last,
            total_chunks=total_chunks,
            pages=pages,
            parts=parts,
            page_offset=chunk.page_offset if dest.plan.writes_data else 0,
        )

    def _notify(self, peer: Peer, notice: peer_pb2.TransferNotice) -> None:
        assert peer.agent_name is not None
        self._agent.send_notif(peer.agent_name, notice.SerializeToString())


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


def _kinds_text(kinds: tuple[int, int]) -> str:
    names: dict[int, str] = {DRAM: "DRAM", VRAM: "VRAM"}
    return f"{names.get(kinds[0], '?')}->{names.get(kinds[1], '?')}"


def _carried(
    src: DescriptorTable, dst: DescriptorTable, segments: list[Segment], layout: Layout
) -> dict[tuple[int, int], tuple[str, ...]]:
    """(local kind, remote kind) -> span names of the aux rows and state components
    that travel in that part."""
    out: dict[tuple[int, int], list[str]] = {}
    for seg in segments:
        region = layout.regions[seg.src_region]
        if region.kind == common_pb2.REGION_KIND_AUX:
            name = "kvbroker.aux"
        elif region.kind == common_pb2.REGION_KIND_STATE:
            name = f"kvbroker.state.{region.component}"
        else:
            continue
        names = out.setdefault((src.region_kind[seg.src_region], dst.region_kind[seg.dst_region]), [])
        if name not in names:
            names.append(name)
    return {k: tuple(v) for k, v in out.items()}

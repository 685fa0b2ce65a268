"""Parts in flight: posting each part the sender's state machine hands on, and settling it.

A part (``rooms.Part``: some pages of one chunk for one destination) gets a
span, then goes to the data-plane thread in the write its kind takes
(``_writes``). Some need room first:

- a staged part asks the receiver for room in its staging buffer
  (ReserveStaging) before it is written there;
- a packed part takes a slot of the local send transfer buffer, then a
  range of this broker's credits in the receiver's buffer while it is
  gathered into ours, then goes as one write, slot to slot
  (``_packed_parts``: ``PackedParts``);
- a gathered part (the sender's side packs the head slice) takes a slot of
  the local send pool, is gathered into it, and is written page by page.

Its outcome comes back from the data plane (``Settled``), or, for a part
that never reached NIXL, it settles here as failed; either way the slots it
held are given back, its span ends, the metrics and the peer's throughput
count it, and ``SenderCore.part_settled`` hears it.
"""

from __future__ import annotations

import asyncio
import time
import weakref

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Posting, Settled, XferState
from kvbroker.broker.execution._bundles import Machines, Telemetry, Transport
from kvbroker.broker.execution._credits import Credits
from kvbroker.broker.execution._device_copies import DeviceCopies, as_broker_error, slot_of
from kvbroker.broker.execution._packed_parts import PackedParts, PartsHeld
from kvbroker.broker.execution._probes import TransportProbes
from kvbroker.broker.execution._send_window import SendWindow
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._tickets import part_ticket
from kvbroker.broker.execution._turn import in_turn
from kvbroker.broker.execution._writes import (
    notice_bytes,
    whole_write,
    write_from_staging,
    write_into_staging,
    write_runs,
    write_tokens,
)
from kvbroker.broker.memory import StagingPool, StagingReservation
from kvbroker.broker.rooms import FAILED, ChunkChecksum, Part, Source
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError
from kvbroker.plan import PartKind, kv_block
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["PartsInFlight"]

log = structlog.get_logger(__name__)

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
#: Transfers smaller than this do not count for throughput (latency dominates).
_THROUGHPUT_MIN_BYTES = 1 << 20


class PartsInFlight:
    """The sender's parts from handing on to settling. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        transport: Transport,
        credits: Credits,
        probes: TransportProbes,
        copies: DeviceCopies,
        tasks: TaskSet,
        telemetry: Telemetry,
    ) -> None:
        self._id = machines.broker_id
        self._config = config
        self._sender = machines.sender
        #: Each answer to the sender's state machine is a turn.
        self._turn = machines.turn
        self._dataplane = transport.dataplane
        self._peers = transport.peers
        self._client = transport.client
        self._pools = transport.pools
        self._copies = copies
        self._tasks = tasks
        self._counters = telemetry.counters
        self._metrics = telemetry.metrics
        #: Parts handed on and not settled: their span and when they started.
        self._parts: dict[Part, tuple[Span, float]] = {}
        #: GATHERED parts' reservations in the host send staging buffer, until they settle.
        self._sending: dict[Part, tuple[StagingPool, StagingReservation]] = {}
        #: Direct and staged writes posted and not settled, bounded; the rest queue by ticket.
        self._window = SendWindow(
            config.send_window_bytes,
            self._dataplane.post,
            self.fail,
            waited=self._waited,
            observer=telemetry.counters.queues.observer("send_window"),
        )
        #: The packed path (``_packed_parts``): it reads the spans and adds to what is sending.
        self._packed = PackedParts(
            config=config,
            machines=machines,
            transport=transport,
            credits=credits,
            probes=probes,
            copies=copies,
            tasks=tasks,
            held=PartsHeld(spans=self._parts, counters=self._counters, fail=self.fail),
        )
        #: Seconds each part waited in the send window, until it settles.
        self._queued: dict[Part, float] = {}
        #: Chunk checksums, computing or computed, for as long as their chunk's
        #: parts live (the first part of a chunk to be posted starts it; the
        #: others wait for the same, or read it).
        self._sums: weakref.WeakKeyDictionary[ChunkChecksum, asyncio.Task[tuple[int | None, KvBrokerError | None]]] = (
            weakref.WeakKeyDictionary()
        )

    # -- handing on ----------------------------------------------------------------
    def start(self, part: Part) -> Span:
        """The span of one part, child of the source's room span (reused if it exists)."""
        known = self._parts.get(part)
        if known is not None:
            return known[0]
        parent = part.source.span
        if parent is not None and not telemetry.records_children(parent):
            # An untraced room: the part's span would be the room's own (start_span hands it back).
            self._parts[part] = (parent, time.monotonic())
            return parent
        dest, notice = part.dest, part.notice
        kinds = (part.spec.local_kind, part.spec.remote_kind) if part.kind is not PartKind.NOTICE else (DRAM, DRAM)
        span = telemetry.start_span(
            "kvbroker.transfer",
            parent=part.source.span,
            attributes={
                "kvbroker.room": part.source.room,
                "kvbroker.receiver": str(dest.info.receiver),
                "kvbroker.chunk": notice.chunk_index,
                "kvbroker.part": notice.part,
                "kvbroker.pages": notice.pages,
                "kvbroker.bytes": notice.bytes,
                "kvbroker.path": part.kind.value,
                "kvbroker.memory": _kinds_text(kinds),
            },
        )
        for name in part.spec.carries:
            telemetry.start_span(name, parent=span).end()
        self._parts[part] = (span, time.monotonic())
        return span

    def reserve_slots(self, part: Part) -> None:
        """Room for a staged or packed part before it is posted: a packed one
        takes our slot first, then the receiver's (asked for while we gather)."""
        self.start(part)
        if part.kind is PartKind.PACKED:
            self._packed.reserve(part)
        else:
            self._tasks.spawn(self._reserve(part), name=f"reserve-{part.source.room}")

    def post(self, part: Part) -> None:
        """Hand one part to the data plane (a gathered one is packed first; a
        part whose chunk's checksum is not computed yet waits for it)."""
        span = self.start(part)
        chunk_sum: int | None = None
        if part.checksum is not None:
            summing = self._sums.get(part.checksum)
            if summing is None or not summing.done():
                self._tasks.spawn(self._post_summed(part), name=f"checksum-{part.source.room}")
                return
            got, error = summing.result()
            if error is not None or got is None:
                self.fail(part, error or Internal("a chunk's checksum came back empty"))
                return
            chunk_sum = got
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self.fail(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return
        agent_name = peer.agent_name
        self._counters.transfers_posted += part.kind is not PartKind.NOTICE
        if part.kind is PartKind.PACKED:  # its notice is complete once gathered (checksum)
            self._packed.post(part, agent_name, chunk_sum)
            return
        notif = notice_bytes(part, chunk_sum)
        ticket = part_ticket(part, self._config.priorities)
        if part.kind is PartKind.NOTICE:
            self._dataplane.notify(part, agent_name, notif)
        elif part.kind is PartKind.WHOLE:
            self._window.post(Posting(part, whole_write(part, agent_name, notif), agent_name, part.nbytes, ticket))
        elif part.kind is PartKind.TOKENS:
            self._counters.transfers_per_token += 1
            spec = part.spec
            if spec.src_pages is not None and spec.slice is not None:
                span.set_attribute("kvbroker.descriptors_built", len(spec.pairs) * int(spec.src_pages.size) * spec.slice.src.page_size)
            self._window.post(Posting(part, write_tokens(part, agent_name, notif), agent_name, part.nbytes, ticket))
        elif part.kind is PartKind.RUNS:
            self._counters.transfers_token_runs += 1
            self._window.post(Posting(part, write_runs(part, agent_name, notif), agent_name, part.nbytes, ticket))
        elif part.kind is PartKind.STAGED:
            self._counters.transfers_staged += 1
            self._window.post(Posting(part, write_into_staging(part, agent_name, notif), agent_name, part.nbytes, ticket))
        else:
            self._tasks.spawn(self._gather(part, agent_name, notif, span), name=f"gather-{part.source.room}")

    async def _post_summed(self, part: Part) -> None:
        """Post ``part`` once its chunk's checksum is computed (once per chunk, on the copy thread)."""
        holder = part.checksum
        assert holder is not None
        task = self._sums.get(holder)
        if task is None:
            task = self._tasks.spawn(self._copies.chunk_checksum(part.source.engine, holder.what), name=f"sum-{part.source.room}")
            self._sums[holder] = task
        got, error = await asyncio.shield(task)
        if error is not None or got is None:
            self.fail(part, error or Internal("a chunk's checksum came back empty"))
            return
        if part.source.state == FAILED:
            self.fail(part, FailedPrecondition("the room failed before its part was written"))
            return
        self.post(part)

    # -- parts that need room first ---------------------------------------------------
    async def _reserve(self, part: Part) -> None:
        """The prefetch of a staged part at the receiver."""
        notice = part.notice
        request = peer_pb2.ReserveStagingRequest(
            protocol_version=PROTOCOL_VERSION,
            room=part.source.room,
            sender_broker_id=self._id,
            source=notice.source,
            receiver=notice.receiver,
            chunk_index=notice.chunk_index,
            part=notice.part,
            bytes=part.nbytes,
        )
        span = self._parts[part][0]
        try:
            with trace.use_span(span, end_on_exit=False):
                response = await self._client.reserve_staging(part.dest.info.receiver_broker_id, request)
        except KvBrokerError as exc:
            self.fail(part, exc)
            return
        buffer = response.buffer if response.HasField("buffer") else self._peers.by_id[part.dest.info.receiver_broker_id].receive_staging.get((DRAM, 0))
        if buffer is None:
            self.fail(part, FailedPrecondition("the receiver reserved staging in a buffer it never announced"))
            return
        if part.source.state == FAILED:
            self.fail(part, FailedPrecondition("the room failed before its staged part was written"))
            return
        with self._turn:
            self._sender.staging_reserved(part, buffer, response.offset)

    async def _gather(self, part: Part, agent_name: str, notif: bytes, span: Span) -> None:
        """Reserve in the local send pool, pack the head slice on the copy thread,
        write each packed page straight into the receiver's page."""
        spec = part.spec
        engine = part.source.engine
        assert spec.slice is not None and spec.src_pages is not None and spec.dst_pages is not None
        device = engine.table.region_device[spec.pairs[0][0]]
        pool = self._pools.pool("send", spec.local_kind, device)
        reservation: StagingReservation | None = None
        try:
            if pool is None:
                raise FailedPrecondition("this broker has no send staging buffer for that memory")
            reservation = await pool.reserve(
                part.nbytes, self._config.staging_wait_seconds, ticket=part_ticket(part, self._config.priorities)
            )
            if part.source.state == FAILED:
                raise FailedPrecondition("the room failed before its staged part was written")
            block = kv_block(engine.layout, [s for s, _ in spec.pairs], spec.src_pages, spec.slice.src, tokens=False)
            slot = slot_of(pool, reservation, part.nbytes)
            ticket = part_ticket(part, self._config.priorities)
            await self._copies.gather(engine, [block], pool.buffer, slot, span, with_checksum=False, ticket=ticket)
        except Exception as exc:
            if reservation is not None and pool is not None:
                pool.release(reservation)
            self.fail(part, as_broker_error(exc, "staging the part"))
            return
        assert pool is not None and reservation is not None
        self._sending[part] = (pool, reservation)
        self._counters.transfers_staged += 1
        make = write_from_staging(part, pool.buffer, reservation.offset, agent_name, notif)
        self._window.post(Posting(part, make, agent_name, part.nbytes, part_ticket(part, self._config.priorities)))

    def _waited(self, part: Part, seconds: float, behind: str) -> None:
        """A part waited in the send window: on its span, and (once it settles) added up on its room's."""
        self._queued[part] = seconds
        span = self._parts.get(part, (None, 0.0))[0]
        if span is not None:
            span.set_attribute("kvbroker.queued_s", seconds)
            span.set_attribute("kvbroker.queued_behind", behind)

    def room_ended(self, source: Source) -> None:
        """A sending room ended: its parts still queued for the window fail (and free their place)."""
        self._window.drop(source)

    # -- settling ----------------------------------------------------------------------
    @in_turn
    def fail(self, part: Part, error: KvBrokerError) -> None:
        """A part that never reached NIXL: it settles now, as failed."""
        self.settled(Settled(part, XferState.ERR, None, error, 0.0))

    def settled(self, event: Settled) -> None:
        """A part's outcome: give back what it held, end its span, count it,
        and tell the sender's state machine."""
        part: Part = event.token
        self._window.settled(part)
        held = self._sending.pop(part, None)
        if held is not None:
            held[0].release(held[1])
        span, started = self._parts.pop(part, (None, time.monotonic()))
        elapsed = time.monotonic() - started
        ok = event.state is XferState.DONE
        if part.kind is not PartKind.NOTICE:
            self._observe(part, elapsed, event.elapsed_s, ok)
        if span is not None:
            span.set_attribute("kvbroker.descriptors", event.descriptors or 0)
            span.set_attribute("kvbroker.duration_s", elapsed)
        # A packed part's span stays open until its credit comes back (its last hop).
        if not self._packed.settled(part, ok, span, event.settled_at) and span is not None:
            telemetry.end_with_status(span, ok, event.error.message if event.error else "NIXL reported an error")
        self._sender.part_settled(part, event.state, event.descriptors, event.error, self._queued.pop(part, 0.0))

    def _observe(self, part: Part, elapsed: float, writing: float, ok: bool) -> None:
        """Metrics (``elapsed``: from planning to settling) and the per-peer
        throughput (``writing``: the NIXL write alone); warn when VRAM moves at
        host-copy speed."""
        path = part.kind.value
        self._metrics.count_transfer(path, "done" if ok else "error")
        if not ok:
            return
        self._metrics.count_bytes("sent", part.nbytes)
        self._metrics.transfer_seconds.record(elapsed, {"path": path})
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is not None:
            peer.wrote(part.nbytes, writing, _kinds_text((part.spec.local_kind, part.spec.remote_kind)), min_bytes=_THROUGHPUT_MIN_BYTES)


def _kinds_text(kinds: tuple[int, int]) -> str:
    """A write's memory kinds, source to destination: ``"VRAM->DRAM"``."""
    names: dict[int, str] = {DRAM: "DRAM", VRAM: "VRAM"}
    return f"{names.get(kinds[0], '?')}->{names.get(kinds[1], '?')}"

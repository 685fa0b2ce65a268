"""Parts in flight: posting each part the sender's state machine hands on, and settling it.

A part (``rooms.Part``: some pages of one chunk for one destination) gets a
span, then goes to the data-plane thread in the write its kind takes
(``_writes``). Some need room first:

- a staged part asks the receiver for room in its staging buffer
  (ReserveStaging) before it is written there;
- a packed part takes a slot of the local send transfer buffer, then a
  range of this broker's credits in the receiver's buffer (``_credits``: no
  call to the receiver in steady state) while it is gathered into ours
  (``_staging_copies``),
  then goes as one write, slot to slot;
- a gathered part (the sender's side packs the head slice) takes a slot of
  the local send pool, is gathered into it, and is written page by page.

Its outcome comes back from the data plane (``Settled``), or, for a part
that never reached NIXL, it settles here as failed; either way the slots it
held are given back, its span ends, the metrics and the peer's throughput
count it, and ``SenderCore.part_settled`` hears it.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import dataclass

import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Posting, Settled, XferState
from kvbroker.broker.execution._bundles import Machines, Telemetry, Transport
from kvbroker.broker.execution._credits import Credits
from kvbroker.broker.execution._probes import TransportProbes
from kvbroker.broker.execution._staging_copies import StagingCopies, as_broker_error, slot_of
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._turn import in_turn
from kvbroker.broker.execution._writes import (
    packed_write,
    whole_write,
    write_from_staging,
    write_into_staging,
    write_runs,
    write_tokens,
)
from kvbroker.broker.memory import Credit, Reservation, StagingPool
from kvbroker.broker.peers import TransportVerdict
from kvbroker.broker.rooms import FAILED, ChunkChecksum, Part
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError
from kvbroker.plan import PartKind, kv_block, pool_text
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
        copies: StagingCopies,
        tasks: TaskSet,
        telemetry: Telemetry,
    ) -> None:
        self._probes = probes
        self._credits = credits
        #: Packed parts' ranges in the receiver's credits, until they settle:
        #: one that never reached the receiver gives its range back here.
        self._credited: dict[Part, Credit] = {}
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
        #: Staged parts' reservations in the local send pool, until they settle.
        self._sending: dict[Part, tuple[StagingPool, Reservation]] = {}
        #: Packed parts being gathered into a slot of the send transfer buffer
        #: (while the receiver reserves its slot): what the gather gave, or why not.
        self._packing: dict[Part, asyncio.Future[_Packed | KvBrokerError | None]] = {}
        #: Chunk checksums being computed (the first part of a chunk to be
        #: posted starts it; the others wait for the same).
        self._summing: dict[ChunkChecksum, asyncio.Task[tuple[int | None, KvBrokerError | None]]] = {}

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

    def reserve_staging(self, part: Part) -> None:
        """Room for a staged or packed part before it is posted: a packed one
        takes our slot first, then the receiver's (asked for while we gather)."""
        self.start(part)
        if part.kind is PartKind.PACKED:
            if not self._pack_now(part):
                self._packing[part] = self._tasks.spawn(self._pack(part), name=f"pack-{part.source.room}")
        else:
            self._tasks.spawn(self._reserve(part), name=f"reserve-{part.source.room}")

    def post(self, part: Part) -> None:
        """Hand one part to the data plane (a gathered one is packed first; a
        part whose chunk's checksum is not computed yet waits for it)."""
        span = self.start(part)
        if part.checksum is not None:
            if part.checksum.value is None:
                self._tasks.spawn(self._post_summed(part), name=f"checksum-{part.source.room}")
                return
            part.notice.checksum = part.checksum.value
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self.fail(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return
        agent_name = peer.agent_name
        self._counters.transfers_posted += part.kind is not PartKind.NOTICE
        if part.kind is PartKind.PACKED:  # its notice is complete once gathered (checksum)
            packing = self._packing.get(part)
            if packing is None:
                self.fail(part, Internal("a packed part was posted without its gather"))
            else:
                packing.add_done_callback(functools.partial(self._post_packed, part, agent_name))
            return
        notif = part.notice.SerializeToString()
        if part.kind is PartKind.NOTICE:
            self._dataplane.notify(part, agent_name, notif)
        elif part.kind is PartKind.WHOLE:
            self._dataplane.post(Posting(part, whole_write(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.TOKENS:
            self._counters.transfers_per_token += 1
            spec = part.spec
            if spec.src_pages is not None and spec.slice is not None:
                span.set_attribute("kvbroker.descriptors_built", len(spec.pairs) * int(spec.src_pages.size) * spec.slice.src.page_size)
            self._dataplane.post(Posting(part, write_tokens(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.RUNS:
            self._counters.transfers_token_runs += 1
            self._dataplane.post(Posting(part, write_runs(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.STAGED:
            self._counters.transfers_staged += 1
            self._dataplane.post(Posting(part, write_into_staging(part, agent_name, notif), agent_name, part.nbytes))
        else:
            self._tasks.spawn(self._gather(part, agent_name, notif, span), name=f"gather-{part.source.room}")

    async def _post_summed(self, part: Part) -> None:
        """Post ``part`` once its chunk's checksum is computed (once per chunk, on the copy thread)."""
        holder = part.checksum
        assert holder is not None
        task = self._summing.get(holder)
        if task is None:
            task = self._tasks.spawn(self._copies.chunk_checksum(part.source.engine, holder.what), name=f"sum-{part.source.room}")
            self._summing[holder] = task
        got, error = await asyncio.shield(task)
        self._summing.pop(holder, None)
        if error is not None or got is None:
            self.fail(part, error or Internal("a chunk's checksum came back empty"))
            return
        holder.value = got
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

    def _pack_now(self, part: Part) -> bool:
        """The steady state of a packed part, without a task: where nothing
        must be waited for (the pair's transport verdict is known, nobody
        waits before it, our send buffer and our credits at the receiver have
        room now), take both ranges and start the gather here. False where
        something must be waited for: ``_pack`` then does it all."""
        spec = part.spec
        local, remote = spec.pools
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        pool = self._pools.pool("send", *local)
        held = self._parts.get(part)
        if peer is None or peer.agent_name is None or pool is None or pool.waiting or held is None or part.source.state == FAILED:
            return False
        verdict = self._probes.verdict(peer, local, remote) if VRAM in (local[0], remote[0]) else None
        if verdict is None and VRAM in (local[0], remote[0]):
            return False
        reservation = pool.try_reserve(part.nbytes)
        if reservation is None:
            return False
        got = self._credits.try_acquire(peer, remote, part.nbytes)
        if got is None:
            pool.release(reservation)
            return False
        if verdict is not None:
            self._show_transport(part, verdict)
        self._packing[part] = self._gather_into(part, held[0], pool, reservation)
        self._placed(part, *got)
        return True

    async def _pack(self, part: Part) -> _Packed | KvBrokerError | None:
        """Reserve a slot of the send transfer buffer, then a range of our
        credits in the receiver's buffer, then gather the part (and its
        checksum, if asked for). The order matters: a part that holds a
        receive range already holds its send slot and waits for nothing else,
        so parts waiting for one buffer never hold the other one full (they
        did, deadlocked, when both were asked for at once). A part that gets
        no slot or range fails here (None); past that, the error is returned,
        not raised: ``_post_packed`` or ``settled`` takes the outcome."""
        spec = part.spec
        assert spec.packing is not None
        pool = self._pools.pool("send", *spec.pools[0])
        try:
            await self._transport(part)
            if pool is None:
                raise FailedPrecondition(f"this broker has no send transfer buffer for {pool_text(spec.pools[0])}")
            reservation = await pool.reserve(part.nbytes, self._config.staging_wait_seconds)
        except Exception as exc:
            self._packing.pop(part, None)
            self.fail(part, as_broker_error(exc, "reserving a send slot"))
            return None
        if part not in self._parts:  # it settled (failed) while it waited
            pool.release(reservation)
            return None
        if part.source.state == FAILED:
            pool.release(reservation)
            self._packing.pop(part, None)
            self.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        got = await self._credit(part)
        held = self._parts.get(part)
        if got is None or held is None:
            pool.release(reservation)
            if got is not None:  # it settled (failed) while it waited
                self._credits.release(got[1])
            return None
        gathering = self._gather_into(part, held[0], pool, reservation)
        self._placed(part, *got)
        return await gathering

    async def _credit(self, part: Part) -> tuple[peer_pb2.RemoteBuffer, Credit] | None:
        """A packed part's range in the receiver's transfer buffer, from this
        broker's credits there (no call to the receiver unless its window must
        grow); None if the part failed (settled) instead."""
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self._packing.pop(part, None)
            self.fail(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return None
        try:
            got = await self._credits.acquire(peer, part.spec.pools[1], part.nbytes)
        except KvBrokerError as exc:
            self._packing.pop(part, None)
            self.fail(part, exc)
            return None
        if part not in self._parts:  # it settled (failed) while it waited
            self._credits.release(got[1])
            return None
        if part.source.state == FAILED:
            self._credits.release(got[1])
            self._packing.pop(part, None)
            self.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        return got

    @in_turn
    def _placed(self, part: Part, buffer: peer_pb2.RemoteBuffer, credit: Credit) -> None:
        """A packed part holds its range in the receiver's buffer: its notice
        names the credit, and the sender's state machine hands it on to be
        posted (once gathered)."""
        self._credited[part] = credit
        part.notice.credit_id = credit.credit_id
        self._sender.staging_reserved(part, buffer, credit.offset)

    def _gather_into(self, part: Part, span: Span, pool: StagingPool, reservation: Reservation) -> asyncio.Future[_Packed | KvBrokerError | None]:
        """Start gathering a packed part into its send slot; what the gather
        gave (or why not: its slot is then given back) in the future."""
        spec = part.spec
        assert spec.packing is not None
        outcome: asyncio.Future[_Packed | KvBrokerError | None] = asyncio.get_running_loop().create_future()

        def gathered(done: asyncio.Future[int | None]) -> None:
            error = Internal("a packed part's gather was cancelled") if done.cancelled() else done.exception()
            if error is not None or outcome.done():
                pool.release(reservation)
            if outcome.done():  # its awaiter gave up (the broker is stopping)
                return
            if error is not None:
                outcome.set_result(as_broker_error(error if isinstance(error, Exception) else Internal(repr(error)), "gathering a packed part"))
            else:
                outcome.set_result(_Packed(pool, reservation, done.result()))

        try:
            slot = slot_of(pool, reservation, part.nbytes)
            self._copies.gather_soon(
                part.source.engine, spec.packing.blocks, pool.buffer, slot, span, with_checksum=part.dest.info.verify_checksum, then=gathered
            )
        except Exception as exc:
            pool.release(reservation)
            outcome.set_result(as_broker_error(exc, "gathering a packed part"))
        return outcome

    async def _transport(self, part: Part) -> None:
        """The transport self-test of the part's pair of transfer buffers (the
        first part of a pair waits for its probe); its verdict on the part's
        and the room's spans."""
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            return  # posting it fails it, naming the peer
        local, remote = part.spec.pools
        verdict = await self._probes.ensure(peer, local, remote)
        if verdict is not None:
            self._show_transport(part, verdict)

    def _show_transport(self, part: Part, verdict: TransportVerdict) -> None:
        """The transport verdict on the part's and the room's spans."""
        held = self._parts.get(part)
        spans = [span for span in (held[0] if held is not None else None, part.source.span) if span is not None and span.is_recording()]
        if spans:  # (an untraced room's spans record nothing: no text to make per part)
            text = verdict.text()
            for span in spans:
                span.set_attribute("kvbroker.transport", text)

    def _post_packed(self, part: Part, agent_name: str, packing: asyncio.Future[_Packed | KvBrokerError | None]) -> None:
        """Post a packed part once its gather is done (a callback of its
        ``_pack`` task, not a task of its own): one write, slot to slot."""
        if part not in self._parts:
            return  # it settled meanwhile; settled() gives its slot back
        self._packing.pop(part, None)
        outcome: _Packed | KvBrokerError | None = None
        if not packing.cancelled():
            try:
                outcome = packing.result()
            except Exception as exc:  # a bug in _pack: the part fails, naming it
                outcome = as_broker_error(exc, "packing a part")
        if not isinstance(outcome, _Packed):
            self.fail(part, outcome or Internal("a packed part was posted without its gather"))
            return
        if part.source.state == FAILED:
            outcome.pool.release(outcome.reservation)
            self.fail(part, FailedPrecondition("the room failed before its packed part was written"))
            return
        if outcome.checksum is not None:
            part.notice.packed_checksum = outcome.checksum
        self._sending[part] = (outcome.pool, outcome.reservation)
        self._counters.transfers_packed += 1
        make = packed_write(part, outcome.pool.buffer, outcome.reservation.offset, agent_name, part.notice.SerializeToString())
        self._dataplane.post(Posting(part, make, agent_name, part.nbytes))

    async def _gather(self, part: Part, agent_name: str, notif: bytes, span: Span) -> None:
        """Reserve in the local send pool, pack the head slice on the copy thread,
        write each packed page straight into the receiver's page."""
        spec = part.spec
        engine = part.source.engine
        assert spec.slice is not None and spec.src_pages is not None and spec.dst_pages is not None
        device = engine.table.region_device[spec.pairs[0][0]]
        pool = self._pools.pool("send", spec.local_kind, device)
        reservation: Reservation | None = None
        try:
            if pool is None:
                raise FailedPrecondition("this broker has no send staging buffer for that memory")
            reservation = await pool.reserve(part.nbytes, self._config.staging_wait_seconds)
            if part.source.state == FAILED:
                raise FailedPrecondition("the room failed before its staged part was written")
            block = kv_block(engine.layout, [s for s, _ in spec.pairs], spec.src_pages, spec.slice.src, tokens=False)
            slot = slot_of(pool, reservation, part.nbytes)
            await self._copies.gather(engine, [block], pool.buffer, slot, span, with_checksum=False)
        except Exception as exc:
            if reservation is not None and pool is not None:
                pool.release(reservation)
            self.fail(part, as_broker_error(exc, "staging the part"))
            return
        assert pool is not None and reservation is not None
        self._sending[part] = (pool, reservation)
        self._counters.transfers_staged += 1
        make = write_from_staging(part, pool.buffer, reservation.offset, agent_name, notif)
        self._dataplane.post(Posting(part, make, agent_name, part.nbytes))

    # -- settling ----------------------------------------------------------------------
    @in_turn
    def fail(self, part: Part, error: KvBrokerError) -> None:
        """A part that never reached NIXL: it settles now, as failed."""
        self.settled(Settled(part, XferState.ERR, None, error, 0.0))

    def settled(self, event: Settled) -> None:
        """A part's outcome: give back what it held, end its span, count it,
        and tell the sender's state machine."""
        part: Part = event.token
        held = self._sending.pop(part, None)
        if held is not None:
            held[0].release(held[1])
        credit = self._credited.pop(part, None)
        if credit is not None and event.state is not XferState.DONE:
            # It never reached the receiver: its range is free (a DONE one the receiver hands back).
            self._credits.release(credit)
        packing = self._packing.pop(part, None)
        if packing is not None:
            # It settled before its gather was posted: give the slot back once it is gathered.
            packing.add_done_callback(_release_packed)
        span, started = self._parts.pop(part, (None, time.monotonic()))
        elapsed = time.monotonic() - started
        ok = event.state is XferState.DONE
        if part.kind is not PartKind.NOTICE:
            self._observe(part, elapsed, event.elapsed_s, ok)
        if span is not None:
            span.set_attribute("kvbroker.descriptors", event.descriptors or 0)
            span.set_attribute("kvbroker.duration_s", elapsed)
            telemetry.end_with_status(span, ok, event.error.message if event.error else "NIXL reported an error")
        self._sender.part_settled(part, event.state, event.descriptors, event.error)

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


@dataclass(frozen=True)
class _Packed:
    """A gathered packed part: its slot in the send transfer buffer, and its checksum."""

    pool: StagingPool
    reservation: Reservation
    checksum: int | None


def _release_packed(packing: asyncio.Future[_Packed | KvBrokerError | None]) -> None:
    if not packing.cancelled() and packing.exception() is None and isinstance(outcome := packing.result(), _Packed):
        outcome.pool.release(outcome.reservation)

"""The effect executor: carries out what the room state machines decided.

The sender and receiver state machines (``sender``, ``receiver``) leave
effects (``effects``); :meth:`Executor.drain` takes them and does each one,
without blocking the control loop:

- NIXL work goes to the data-plane thread (``dataplane``): a part is posted
  there and settles there; its outcome comes back through
  :meth:`Executor.on_events` as ``SenderCore.part_settled``; notifications
  come back the same way as ``ReceiverCore.notices``;
- staging copies go to the copy thread (``workers``): a staged part is
  gathered there before it is posted, a landed one scattered there before
  it counts;
- calls to other brokers go through ``peer_client`` in tasks of their own;
  their answers come back as calls on the state machines;
- statuses go to the engines' watch streams (``watch``); a room's end
  closes its span, records its metrics and writes its one canonical log
  line.

Every answer that reaches a state machine is followed by :meth:`drain`, so
the effects it causes are carried out in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog
from opentelemetry import trace
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import (
    Agent,
    DataPlane,
    Event,
    Notices,
    Posting,
    Settled,
    Workers,
    XferState,
)
from kvbroker.broker.device import ArrayViews, Extent, Lanes, checksum, gather, scatter
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.memory import Engine, Reservation, StagingBuffer, StagingPool, StagingPools
from kvbroker.broker.peers import FleetView, Peer, PeerClient, PeerTable, find_in_fleet
from kvbroker.broker.rooms import (
    FAILED,
    AbortAtPeer,
    Effect,
    FindSender,
    Part,
    PostPart,
    Publish,
    Receiver,
    ReceiverCore,
    RegisterRoom,
    ReleaseStaging,
    ReserveStaging,
    RoomEnded,
    Scatter,
    SenderCore,
    SenderLeg,
    SendReport,
    Side,
    Source,
    TellSuccessor,
    WatchHub,
    cause,
)
from kvbroker.broker.telemetry import BrokerMetrics, Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError, RegistrationError
from kvbroker.plan import (
    Block,
    PartKind,
    kv_block,
    page_blocks,
    pool_text,
    run_descriptors,
    token_descriptors,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["Executor", "observe_write"]

log = structlog.get_logger(__name__)

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
#: Transfers smaller than this do not count for throughput (latency dominates).
_THROUGHPUT_MIN_BYTES = 1 << 20


class Executor:
    """Carries out effects. Control loop only."""

    def __init__(
        self,
        *,
        broker_id: str,
        config: BrokerConfig,
        sender: SenderCore,
        receiver: ReceiverCore,
        dataplane: DataPlane,
        peers: PeerTable,
        client: PeerClient,
        pools: StagingPools,
        workers: Workers,
        views: ArrayViews,
        lanes: Lanes,
        hub: WatchHub,
        tasks: TaskSet,
        counters: Counters,
        metrics: BrokerMetrics,
    ) -> None:
        self._id = broker_id
        self._config = config
        self._sender = sender
        self._receiver = receiver
        self._dataplane = dataplane
        self._peers = peers
        self._client = client
        self._pools = pools
        self._workers = workers
        self._views = views
        self._lanes = lanes
        self._hub = hub
        self._tasks = tasks
        self._counters = counters
        self._metrics = metrics
        #: Parts handed on and not settled: their span and when they started.
        self._parts: dict[Part, tuple[Span, float]] = {}
        #: Staged parts' reservations in the local send pool, until they settle.
        self._sending: dict[Part, tuple[StagingPool, Reservation]] = {}
        #: Packed parts being gathered into a slot of the send transfer buffer
        #: (while the receiver reserves its slot): what the gather gave, or why not.
        self._packing: dict[Part, asyncio.Task[_Packed | KvBrokerError | None]] = {}
        self._vram_slow_bps = config.vram_slow_gbps * 1e9
        #: The fleet in etcd (``serve --etcd``): resolves senders named by group alone.
        self.fleet: FleetView | None = None

    # -- the loop -------------------------------------------------------------
    def drain(self) -> None:
        """Carry out every effect the state machines left, until none is left."""
        while True:
            effects = self._sender.take() + self._receiver.take()
            if not effects:
                break
            for effect in effects:
                try:
                    self._run(effect)
                except Exception:
                    log.exception("effect_failed", effect=type(effect).__name__)
        self._dataplane.listening = self._receiver.awaiting_data()

    def on_events(self, events: list[Event]) -> None:
        """What the data plane reports (on the loop): settled parts, notifications."""
        for event in events:
            if isinstance(event, Settled):
                self._settled(event)
            elif isinstance(event, Notices):
                self._receiver.notices(event.items)
        self.drain()

    def _run(self, effect: Effect) -> None:
        if isinstance(effect, Publish):
            self._hub.publish(effect.engine_id, effect.status)
        elif isinstance(effect, RoomEnded):
            self._room_ended(effect.side)
        elif isinstance(effect, PostPart):
            self._post(effect.part)
        elif isinstance(effect, ReserveStaging):
            part = effect.part
            self._start_part(part)
            if part.kind is PartKind.PACKED:
                # Our slot first, then the receiver's (asked for while we gather).
                self._packing[part] = self._tasks.spawn(self._pack(part), name=f"pack-{part.source.room}")
            else:
                self._tasks.spawn(self._reserve(part), name=f"reserve-{part.source.room}")
        elif isinstance(effect, SendReport):
            effect.report.protocol_version = PROTOCOL_VERSION
            self._tasks.spawn(self._client.report_completion(effect.broker_id, effect.report), name=f"report-{effect.report.room}")
        elif isinstance(effect, FindSender):
            self._tasks.spawn(self._find_sender(effect.receiver), name=f"bootstrap-{effect.receiver.room}")
        elif isinstance(effect, RegisterRoom):
            self._register_soon(effect)
        elif isinstance(effect, AbortAtPeer):
            self._tasks.spawn(self._abort_at_peer(effect), name=f"abort-{effect.room}")
        elif isinstance(effect, Scatter):
            self._tasks.spawn(self._scatter(effect), name=f"scatter-{effect.receiver.room}")
        elif isinstance(effect, ReleaseStaging):
            for kind, device, reservation in effect.reservations:
                pool = self._pools.pool("receive", kind, device)
                if pool is not None:
                    pool.release(reservation)
        elif isinstance(effect, TellSuccessor):
            self._tasks.spawn(self._tell_successor(effect.address), name=f"tell-successor-{effect.address}")
        else:  # pragma: no cover - a new effect without a handler is a bug
            raise AssertionError(f"no handler for {effect!r}")

    # -- parts --------------------------------------------------------------------
    def _start_part(self, part: Part) -> Span:
        """The span of one part, child of the source's room span (reused if it exists)."""
        known = self._parts.get(part)
        if known is not None:
            return known[0]
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

    def _post(self, part: Part) -> None:
        """Hand one part to the data plane (a gathered one is packed first)."""
        span = self._start_part(part)
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is None or peer.agent_name is None:
            self._fail_part(part, FailedPrecondition(f"broker {part.dest.info.receiver_broker_id} is gone"))
            return
        agent_name = peer.agent_name
        notif = part.notice.SerializeToString()
        self._counters.transfers_posted += part.kind is not PartKind.NOTICE
        if part.kind is PartKind.NOTICE:
            self._dataplane.notify(part, agent_name, notif)
        elif part.kind is PartKind.WHOLE:
            self._dataplane.post(Posting(part, _whole(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.TOKENS:
            self._counters.transfers_per_token += 1
            spec = part.spec
            if spec.src_pages is not None and spec.slice is not None:
                span.set_attribute("kvbroker.descriptors_built", len(spec.pairs) * int(spec.src_pages.size) * spec.slice.src.page_size)
            self._dataplane.post(Posting(part, _tokens(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.RUNS:
            self._counters.transfers_token_runs += 1
            self._dataplane.post(Posting(part, _runs(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.STAGED:
            self._counters.transfers_staged += 1
            self._dataplane.post(Posting(part, _into_staging(part, agent_name, notif), agent_name, part.nbytes))
        elif part.kind is PartKind.PACKED:
            self._tasks.spawn(self._post_packed(part, agent_name), name=f"post-packed-{part.source.room}")
        else:
            self._tasks.spawn(self._gather(part, agent_name, notif, span), name=f"gather-{part.source.room}")

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
            self._fail_part(part, exc)
            return
        buffer = response.buffer if response.HasField("buffer") else self._peers.by_id[part.dest.info.receiver_broker_id].receive_staging.get((DRAM, 0))
        if buffer is None:
            self._fail_part(part, FailedPrecondition("the receiver reserved staging in a buffer it never announced"))
            return
        if part.source.state == FAILED:
            self._fail_part(part, FailedPrecondition("the room failed before its staged part was written"))
            return
        self._sender.staging_reserved(part, buffer, response.offset)
        self.drain()

    async def _pack(self, part: Part) -> _Packed | KvBrokerError | None:
        """Reserve a slot of the send transfer buffer, then ask the receiver for
        its slot and gather the part meanwhile (and its checksum, if asked
        for). The order matters: a part that holds a receive slot already holds
        its send slot and waits for nothing else, so parts waiting for one
        buffer never hold the other one full (they did, deadlocked, when both
        were asked for at once). A part that gets no send slot fails here
        (None); past that, the error is returned, not raised: ``_post_packed``
        or ``_settled`` takes the outcome."""
        spec = part.spec
        assert spec.packing is not None
        pool = self._pools.pool("send", *spec.pools[0])
        try:
            if pool is None:
                raise FailedPrecondition(f"this broker has no send transfer buffer for {pool_text(spec.pools[0])}")
            reservation = await pool.reserve(part.nbytes, self._config.staging_wait_seconds)
        except Exception as exc:
            self._packing.pop(part, None)
            self._fail_part(part, _as_broker_error(exc, "reserving a send slot"))
            return None
        if part.source.state == FAILED:
            pool.release(reservation)
            self._packing.pop(part, None)
            self._fail_part(part, FailedPrecondition("the room failed before its packed part was written"))
            return None
        self._tasks.spawn(self._reserve(part), name=f"reserve-{part.source.room}")
        span = self._parts[part][0]
        try:
            blocks = spec.packing.blocks
            regions = [self._spans(part.source.engine, block) for block in blocks]
            slot = _slot(pool, reservation, part.nbytes)
            verify = part.dest.info.verify_checksum
            gathering = telemetry.start_span("kvbroker.staging.gather", parent=span, attributes={"kvbroker.bytes": part.nbytes})

            def job() -> Callable[[], int | None]:
                gather(self._views, blocks, regions, slot)
                crc = checksum(self._views, slot) if verify else None
                return lambda: None if crc is None else int(crc)

            try:
                crc = await self._lanes.run(slot, job)
            finally:
                gathering.end()
        except Exception as exc:
            pool.release(reservation)
            return _as_broker_error(exc, "gathering a packed part")
        return _Packed(pool, reservation, crc)

    async def _post_packed(self, part: Part, agent_name: str) -> None:
        """Post a packed part once its gather is done: one write, slot to slot."""
        packing = self._packing.pop(part, None)
        outcome = await packing if packing is not None else None
        if not isinstance(outcome, _Packed):
            self._fail_part(part, outcome or Internal("a packed part was posted without its gather"))
            return
        if part.source.state == FAILED:
            outcome.pool.release(outcome.reservation)
            self._fail_part(part, FailedPrecondition("the room failed before its packed part was written"))
            return
        if outcome.checksum is not None:
            part.notice.packed_checksum = outcome.checksum
        self._sending[part] = (outcome.pool, outcome.reservation)
        self._counters.transfers_packed += 1
        make = _packed_write(part, outcome.pool.buffer, outcome.reservation.offset, agent_name, part.notice.SerializeToString())
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
            regions = [self._spans(engine, block)]
            slot = _slot(pool, reservation, part.nbytes)
            gathering = telemetry.start_span("kvbroker.staging.gather", parent=span, attributes={"kvbroker.bytes": part.nbytes})

            def job() -> Callable[[], None]:
                gather(self._views, [block], regions, slot)
                return lambda: None

            try:
                await self._lanes.run(slot, job)
            finally:
                gathering.end()
        except Exception as exc:
            if reservation is not None and pool is not None:
                pool.release(reservation)
            self._fail_part(part, _as_broker_error(exc, "staging the part"))
            return
        assert pool is not None and reservation is not None
        self._sending[part] = (pool, reservation)
        self._counters.transfers_staged += 1
        make = _from_staging(part, pool.buffer, reservation.offset, agent_name, notif)
        self._dataplane.post(Posting(part, make, agent_name, part.nbytes))

    def _fail_part(self, part: Part, error: KvBrokerError) -> None:
        """A part that never reached NIXL: it settles now, as failed."""
        self._settled(Settled(part, XferState.ERR, None, error, 0.0))
        self.drain()

    def _settled(self, event: Settled) -> None:
        part: Part = event.token
        held = self._sending.pop(part, None)
        if held is not None:
            held[0].release(held[1])
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
        self._metrics.transfers.add(1, {"path": path, "result": "done" if ok else "error"})
        if not ok:
            return
        self._metrics.bytes.add(part.nbytes, {"direction": "sent"})
        self._metrics.transfer_seconds.record(elapsed, {"path": path})
        peer = self._peers.by_id.get(part.dest.info.receiver_broker_id)
        if peer is not None:
            observe_write(peer, part.nbytes, writing, (part.spec.local_kind, part.spec.remote_kind), self._vram_slow_bps)

    # -- receiving ----------------------------------------------------------------
    async def _find_sender(self, rank: Receiver) -> None:
        def missed(error: KvBrokerError) -> None:
            self._receiver.still_looking(rank, error.message)
            self.drain()

        try:
            found: str | list[SenderLeg]
            with _in_span(rank.span):
                if rank.sender_address or self.fleet is None:
                    peer, layouts = await self._client.find_sender(
                        rank.sender_address, rank.sender_group, stop=lambda: rank.terminal, missed=missed
                    )
                    found = peer.broker_id or ""
                else:
                    # A group and no address: the broker(s) etcd says hold its sources.
                    placed, layouts = await find_in_fleet(
                        self._client,
                        self.fleet,
                        rank.sender_group,
                        rank.engine.layout,
                        rank.key,
                        stop=lambda: rank.terminal,
                        missed=missed,
                    )
                    rank.sender_address = placed[0][0].address
                    found = [SenderLeg(p.broker_id or "", p.address, ranks) for p, ranks in placed]
        except KvBrokerError as exc:
            self._receiver.bootstrap_failed(rank, exc)
        else:
            self._receiver.sender_found(rank, found, layouts)
        self.drain()

    def _register_soon(self, effect: RegisterRoom) -> None:
        """The first attempt of a registration, queued for the peer's next
        batch without a task: a task (and its frames) per room was most of a
        broker's memory while a burst of rooms registered (scale_rooms). A
        registration that does not simply succeed goes on in ``_register``."""
        rank = effect.receiver
        peer = self._peers.by_id.get(effect.broker_id)
        if peer is None:
            self._tasks.spawn(self._register(effect), name=f"register-{rank.room}")
            return
        with _in_span(rank.span):
            first = self._client.submit_registration(peer, effect.request)

        def answered(done: asyncio.Future[None]) -> None:
            if done.cancelled() or done.exception() is not None:
                self._tasks.spawn(self._register(effect, first=(peer, done)), name=f"register-{rank.room}")
                return
            self._registered(effect, effect.request.sender_broker_id)
            self.drain()

        first.add_done_callback(answered)

    def _registered(self, effect: RegisterRoom, took: str) -> None:
        self._receiver.room_registered(effect.receiver, effect.leg, took, still_known=took in self._peers.by_id)
        self._dataplane.hurry()

    async def _register(self, effect: RegisterRoom, first: tuple[Peer, asyncio.Future[None]] | None = None) -> None:
        """A registration, or the rest of one whose first attempt (``first``:
        the peer it went to, and its outcome) did not simply succeed."""
        rank = effect.receiver
        try:
            # The peer record of the first attempt: a handshake meanwhile may
            # have found a new process at its address (and re-keyed it).
            peer = first[0] if first is not None else self._peers.get(effect.broker_id)
            with _in_span(rank.span):
                took = await self._client.register_room(
                    peer,
                    effect.request,
                    stale=lambda: self._receiver.registration_stale(rank, effect.leg),
                    again=lambda now: self._receiver.register_again(rank, effect.leg, now),
                    first=first[1] if first is not None else None,
                )
        except RegistrationError as exc:
            self._receiver.registration_failed(rank, effect.leg, exc.error, maybe_delivered=exc.maybe_delivered)
        except KvBrokerError as exc:
            self._receiver.registration_error(rank, effect.leg, exc)
        else:
            if took is not None:
                self._registered(effect, took)
        self.drain()

    async def _abort_at_peer(self, effect: AbortAtPeer) -> None:
        request = peer_pb2.PeerAbortRequest(
            protocol_version=PROTOCOL_VERSION, room=effect.room, from_broker_id=self._id, cause=effect.cause
        )
        unreachable: Callable[[], None] | None = None
        if effect.remember:

            def unreachable() -> None:
                self._receiver.abort_undelivered(effect.broker_id, effect.room, effect.cause)

        response = await self._client.abort_room(effect.broker_id, request, on_unreachable=unreachable)
        if response is not None and response.settled:
            # Nothing of the room is in flight from that broker (its sources
            # may even be evicted already, so no report would come).
            self._receiver.peer_settled(effect.broker_id, effect.room)
        self.drain()

    async def _scatter(self, effect: Scatter) -> None:
        """Unpack a landed staged or packed part into the rank's pages (a packed
        part's checksum, when the sender sent one, is checked first: a part that
        arrived corrupted is never scattered)."""
        rank, landing = effect.receiver, effect.landing
        error: KvBrokerError | None = None
        pool = self._pools.pool("receive", *landing.pool)
        span = telemetry.start_span(
            "kvbroker.staging.scatter",
            parent=rank.span,
            attributes={"kvbroker.bytes": landing.nbytes, "kvbroker.chunk": landing.key[1], "kvbroker.source": str(landing.key[0])},
        )
        try:
            if pool is None:
                raise FailedPrecondition("the receive staging pool of this part is gone")
            slot = _slot(pool, landing.reservation, landing.nbytes)
            notice = landing.notice
            if notice.HasField("packed_checksum"):

                def crc_job() -> Callable[[], int]:
                    crc = checksum(self._views, slot)
                    return lambda: int(crc)

                got = await self._lanes.run(slot, crc_job)
                if got != notice.packed_checksum:
                    self._counters.checksum_mismatches += 1
                    raise FailedPrecondition(
                        f"packed part {notice.part} of chunk {notice.chunk_index} from source {landing.key[0]} arrived "
                        f"with checksum {got:08x}, the sender wrote {notice.packed_checksum:08x}: the transport corrupted it"
                    )
            regions = [self._spans(rank.engine, block) for block in landing.blocks]

            def job() -> Callable[[], None]:
                scatter(self._views, slot, landing.blocks, regions)
                return lambda: None

            await self._lanes.run(slot, job)
        except Exception as exc:
            error = _as_broker_error(exc, "scattering a staged part")
        finally:
            span.end()
        self._receiver.scattered(rank, landing, error)
        self.drain()

    async def _tell_successor(self, address: str) -> None:
        try:
            try:
                peer = self._peers.by_address.get(address)
                if peer is None or peer.broker_id is None:
                    peer = await self._client.connect(address)
                else:
                    # Is the process we know still the one there? (A restart
                    # found here fails what we had with the old one.)
                    await self._client.handshake(peer)
            except KvBrokerError as exc:
                log.debug("successor_unreachable", peer=address, error=exc.message)
                return
            broker_id = peer.broker_id or ""
            for room, why in self._receiver.successor_notices(address):
                told = cause(
                    common_pb2.FAILURE_KIND_PEER, f"the receiving broker {self._id} failed the room: {why.message}", self._id
                )
                request = peer_pb2.PeerAbortRequest(
                    protocol_version=PROTOCOL_VERSION, room=room, from_broker_id=self._id, cause=told
                )
                await self._client.abort_room(broker_id, request)
                log.info("successor_told", room=room, peer=address, broker=broker_id)
        finally:
            self._receiver.successor_done(address)
            self.drain()

    # -- the end of a room -------------------------------------------------------
    def _room_ended(self, side: Side) -> None:
        """End the room span, record metrics, write the one canonical log line."""
        sender = isinstance(side, Source)
        name = "sender" if sender else "receiver"
        if isinstance(side, Source):
            peer = ",".join(sorted({d.info.receiver_broker_id for d in side.destinations.values()}))
            pages = side.cursor
        else:
            assert isinstance(side, Receiver)
            peer = side.peer_broker_id or side.sender_address
            pages = int(side.pages.size)
        telemetry.close_room_span(side, {"kvbroker.peer": peer, "kvbroker.pages": pages})
        state = common_pb2.RoomState.Name(side.state)
        total = (side.finished_at or time.monotonic()) - side.opened_at
        self._metrics.room_seconds.record(total, {"side": name, "state": state})
        kind = common_pb2.FailureKind.Name(side.cause.kind) if side.cause is not None else ""
        if side.cause is not None:
            self._metrics.failures.add(1, {"side": name, "cause": kind})
        times = dict(side.timeline)
        log.info(
            "room_ended",
            room=side.room,
            side=name,
            engine=side.engine.label,
            peer=peer,
            state=state,
            cause=kind or None,
            cause_message=side.cause.message if side.cause is not None else None,
            bytes=side.bytes,
            chunks=side.chunks,
            pages=pages,
            total_s=round(total, 6),
            bootstrap_s=_between(times, "opened", "registered" if not sender else "ready"),
            transfer_s=_between(times, "first_byte", "last_byte"),
            **telemetry.span_ids(side.span),
        )

    # -- helpers -------------------------------------------------------------------
    @staticmethod
    def _spans(engine: Engine, block: Block) -> list[Extent]:
        """Where ``block``'s regions lie in this broker."""
        return [Extent(*engine.region_address(region)) for region in block.regions]

    def transport(self) -> str:
        """What carries the bytes, as far as the broker can tell (NIXL does not
        report the UCX lane it picked; UCX_PROTO_INFO=y in the broker's
        environment makes UCX print it)."""
        env = os.environ
        return (
            f"NIXL UCX (error mode {self._config.ucx_error_mode}, UCX_TLS={env.get('UCX_TLS', 'auto')}, "
            f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES', 'auto')})"
        )


def observe_write(peer: Peer, nbytes: int, elapsed: float, kinds: tuple[int, int], vram_slow_bps: float) -> None:
    """Count a write to ``peer`` into its throughput; warn (once a minute) when
    VRAM moves slower than ``vram_slow_bps``: UCX probably fell back to TCP or
    a host copy."""
    peer.bytes_sent += nbytes
    peer.kinds.add(_kinds_text(kinds))
    if nbytes < _THROUGHPUT_MIN_BYTES or elapsed <= 0:
        return
    rate = nbytes / elapsed
    peer.throughput_bps = rate if not peer.throughput_bps else 0.8 * peer.throughput_bps + 0.2 * rate
    if VRAM in kinds and rate < vram_slow_bps and time.monotonic() - peer.slow_warned_at > 60:
        peer.slow_warned_at = time.monotonic()
        log.warning(
            "vram_transfer_at_host_speed",
            peer=peer.address,
            memory=_kinds_text(kinds),
            gbps=round(rate / 1e9, 3),
            threshold_gbps=vram_slow_bps / 1e9,
            hint="UCX may have fallen back to TCP or a host copy; check UCX_TLS / UCX_NET_DEVICES and UCX_PROTO_INFO=y",
        )


def _whole(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build and post a prepared-list write (runs on the data-plane thread)."""
    spec, local_dlists, remote = part.spec, part.source.engine.dlists, part.remote

    def make(agent: Agent) -> Any:
        assert spec.local_indices is not None and spec.remote_indices is not None
        return agent.post_write(
            local_dlists[spec.local_kind],
            spec.local_indices,
            remote.dlist(agent, agent_name, spec.remote_kind),
            spec.remote_indices,
            notif,
        )

    return make


def _tokens(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build one descriptor per (region, page, token) and post (data-plane thread)."""
    spec, src_table, dst_table = part.spec, part.source.engine.table, part.remote.table

    def make(agent: Agent) -> Any:
        assert spec.src_pages is not None and spec.dst_pages is not None and spec.slice is not None
        local_kind, remote_kind, local, remote = token_descriptors(
            src_table, dst_table, list(spec.pairs), spec.src_pages, spec.dst_pages, spec.slice
        )
        return agent.post_write_descs(local, local_kind, remote, remote_kind, agent_name, notif)

    return make


def _runs(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Build one descriptor per (region, token run), merged where adjacent, and post (data-plane thread)."""
    spec, src_table, dst_table = part.spec, part.source.engine.table, part.remote.table

    def make(agent: Agent) -> Any:
        assert spec.runs is not None and spec.geometry is not None
        local, remote = run_descriptors(src_table, dst_table, spec.pairs, spec.runs, *spec.geometry)
        return agent.post_write_descs(local, spec.local_kind, remote, spec.remote_kind, agent_name, notif)

    return make


def _into_staging(part: Part, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """Write the source's whole pages into the receiver's staging reservation
    (runs on the data-plane thread)."""
    spec, table = part.spec, part.source.engine.table
    remote = part.staging_buffer
    assert spec.src_pages is not None and spec.slice is not None and remote is not None

    def make(agent: Agent) -> Any:
        page_bytes = spec.slice.src.page_size * spec.slice.src.token_bytes  # type: ignore[union-attr]
        local, far = page_blocks(
            table, tuple(s for s, _ in spec.pairs), spec.src_pages, page_bytes,  # type: ignore[arg-type]
            remote.address + part.staging_offset, remote.device_id,
        )
        return agent.post_write_descs(local, spec.local_kind, far, remote.kind, agent_name, notif)

    return make


def _from_staging(
    part: Part, buffer: StagingBuffer, offset: int, agent_name: str, notif: bytes
) -> Callable[[Agent], Any]:
    """Write each packed page at ``offset`` of the local send ``buffer`` into the
    receiver's page (descriptors built on the data-plane thread)."""
    spec, table = part.spec, part.remote.table
    assert spec.dst_pages is not None and spec.slice is not None

    def make(agent: Agent) -> Any:
        page_bytes = spec.slice.dst.page_size * spec.slice.dst.token_bytes  # type: ignore[union-attr]
        far, local = page_blocks(
            table, tuple(d for _, d in spec.pairs), spec.dst_pages, page_bytes,  # type: ignore[arg-type]
            buffer.address + offset, buffer.device_id,
        )
        return agent.post_write_descs(local, buffer.kind, far, spec.remote_kind, agent_name, notif)

    return make


def _packed_write(part: Part, buffer: StagingBuffer, offset: int, agent_name: str, notif: bytes) -> Callable[[Agent], Any]:
    """One descriptor: the packed part's slot here to the slot the receiver
    reserved (its transfer buffer; data-plane thread)."""
    remote = part.staging_buffer
    assert remote is not None

    def make(agent: Agent) -> Any:
        local = np.array([[buffer.address + offset, part.nbytes, buffer.device_id]], dtype=np.uint64)
        far = np.array([[remote.address + part.staging_offset, part.nbytes, remote.device_id]], dtype=np.uint64)
        return agent.post_write_descs(local, buffer.kind, far, remote.kind, agent_name, notif)

    return make


@dataclass(frozen=True)
class _Packed:
    """A gathered packed part: its slot in the send transfer buffer, and its checksum."""

    pool: StagingPool
    reservation: Reservation
    checksum: int | None


def _release_packed(task: asyncio.Task[_Packed | KvBrokerError | None]) -> None:
    if not task.cancelled() and isinstance(outcome := task.result(), _Packed):
        outcome.pool.release(outcome.reservation)


def _slot(pool: StagingPool, reservation: Reservation, nbytes: int) -> Extent:
    buffer = pool.buffer
    return Extent(buffer.address + reservation.offset, nbytes, buffer.kind, buffer.device_id)


def _as_broker_error(exc: Exception, doing: str) -> KvBrokerError:
    """``exc`` as it fails a room (a bug inside the broker is logged with its traceback)."""
    if isinstance(exc, KvBrokerError):
        return exc
    log.error("copy_failed", doing=doing, error=repr(exc), exc_info=exc)
    return Internal(f"{doing} failed inside the broker: {exc!r}")


def _kinds_text(kinds: tuple[int, int]) -> str:
    names: dict[int, str] = {DRAM: "DRAM", VRAM: "VRAM"}
    return f"{names.get(kinds[0], '?')}->{names.get(kinds[1], '?')}"


def _between(times: dict[str, float], start: str, end: str) -> float | None:
    if start in times and end in times:
        return round(times[end] - times[start], 6)
    return None


def _in_span(span: trace.Span | None) -> contextlib.AbstractContextManager[object]:
    """Run a block with ``span`` current (calls it makes carry its trace), if there is one."""
    return trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext()

"""The broker's state and operations, behind the thin gRPC servicers.

One :class:`BrokerRuntime` per broker process. Everything in it runs on the
event-loop thread, which is also the NIXL agent's owner thread: no locks, and
every table changes between two awaits or not at all.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import structlog
from opentelemetry import context as otel_context

from kvbroker import __version__
from kvbroker.broker import telemetry
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.counters import Counters
from kvbroker.broker.engines import Engine, EngineTable
from kvbroker.broker.fdsocket import FdSession, FdSocketServer
from kvbroker.broker.layout import rank_key
from kvbroker.broker.liveness import PeerMonitor
from kvbroker.broker.mapping import SourcePlan
from kvbroker.broker.metrics import BrokerMetrics, GaugeSnapshot
from kvbroker.broker.nixl_agent import Agent, NixlError
from kvbroker.broker.peers import PROTOCOL_VERSION, Peer, PeerTable
from kvbroker.broker.progress import ProgressLoop
from kvbroker.broker.receiver import ReceiverSide
from kvbroker.broker.rooms import (
    Progress,
    ReceiverProgress,
    RoomTables,
    SourceProgress,
    TransferInfo,
    cause,
)
from kvbroker.broker.sender import SenderSide
from kvbroker.broker.staging import StagingPool
from kvbroker.broker.tasks import TaskSet
from kvbroker.broker.tls import channel_credentials
from kvbroker.broker.watch import WatchHub
from kvbroker.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unavailable,
)
from kvbroker.indices import IndexArray, decode_indices
from kvbroker.v1 import common_pb2, peer_pb2, transfer_pb2

__all__ = ["BrokerRuntime"]

log = structlog.get_logger(__name__)


class BrokerRuntime:
    """Tables, sides and peers of one broker. See the module docstring."""

    def __init__(self, config: BrokerConfig, agent: Agent, broker_id: str | None = None) -> None:
        self.config = config
        self.broker_id = broker_id or uuid.uuid4().hex
        self.agent = agent
        self.started_at = time.monotonic()
        self.address = ""
        self.engine_socket_path = ""
        self.fd_server: FdSocketServer | None = None
        self.engines = EngineTable(agent)
        staged = config.staging_send_bytes > 0 and config.staging_receive_bytes > 0
        self.send_staging = StagingPool(agent, config.staging_send_bytes) if staged else None
        self.receive_staging = StagingPool(agent, config.staging_receive_bytes) if staged else None
        self.rooms = RoomTables()
        self.counters = Counters()
        self.tasks = TaskSet()
        self.hub = WatchHub()
        self.peers = PeerTable(
            agent=agent,
            engines=self.engines,
            broker_id=self.broker_id,
            rpc_timeout_seconds=config.peer_rpc_timeout_seconds,
            channel_options=channel_options(config),
            staging=self.receive_staging.descriptor() if self.receive_staging else None,
            on_restart=self.on_peer_lost,
            credentials=channel_credentials(config) if config.tls else None,
        )
        self.progress = ProgressLoop(
            agent,
            on_notification=self._on_notification,
            awaiting_data=self._awaiting_data,
            idle_poll_interval_millis=config.idle_poll_interval_millis,
        )
        common = dict(
            broker_id=self.broker_id,
            peers=self.peers,
            rooms=self.rooms,
            progress=self.progress,
            counters=self.counters,
            tasks=self.tasks,
            publish=self._publish,
        )
        self.metrics = BrokerMetrics()
        self.draining = False
        #: Called with the draining flag (the server points it at its health service).
        self.on_draining: Callable[[bool], Awaitable[None]] | None = None
        self.sender = SenderSide(
            agent=agent,
            staging=self.send_staging,
            staging_wait_seconds=config.staging_wait_seconds,
            metrics=self.metrics,
            vram_slow_gbps=config.vram_slow_gbps,
            **common,  # type: ignore[arg-type]
        )
        self.receiver = ReceiverSide(
            bootstrap_timeout_seconds=config.bootstrap_timeout_seconds,
            staging=self.receive_staging,
            staging_wait_seconds=config.staging_wait_seconds,
            metrics=self.metrics,
            **common,  # type: ignore[arg-type]
        )
        self.monitor = PeerMonitor(
            self.peers,
            interval_seconds=config.peer_heartbeat_seconds,
            dead_after_seconds=config.peer_dead_after_seconds,
            has_business=self._has_business,
            on_lost=self.on_peer_lost,
        )
        self._housekeeping: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None

    # -- lifecycle --------------------------------------------------------
    def start(self, address: str) -> None:
        """Start progress and housekeeping; ``address`` is where peers reach us."""
        self.address = address
        self.peers.address = address
        self.progress.start()
        loop = asyncio.get_running_loop()
        self._housekeeping = loop.create_task(self._housekeep(), name="housekeeping")
        self._monitor = loop.create_task(self.monitor.run(), name="peer-monitor")

    async def stop(self) -> None:
        """Fail open rooms, let in-flight transfers settle, release everything in reverse order."""
        why = cause(common_pb2.FAILURE_KIND_SHUTDOWN, "the broker is shutting down", self.broker_id)
        for source in list(self.rooms.all_sources()):
            self.sender.fail(source, why)
        for rank in list(self.rooms.all_receivers()):
            self.receiver.fail(rank, why)
        await self._wait_settled(list(self.engines.by_id.values()), self.config.unregister_settle_timeout_seconds)
        await self.tasks.drain(timeout_seconds=2.0)
        for task in (self._housekeeping, self._monitor):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.progress.stop()
        for engine in list(self.engines.by_id.values()):
            self.hub.close(engine.engine_id)
            self.engines.release(engine)
        for pool in (self.send_staging, self.receive_staging):
            if pool is not None:
                pool.close()
        await self.peers.close()
        self.agent.close()

    # -- engine API ---------------------------------------------------------
    def broker_info(self) -> transfer_pb2.BrokerInfo:
        return transfer_pb2.BrokerInfo(
            broker_id=self.broker_id,
            protocol_version=PROTOCOL_VERSION,
            version=__version__,
            fd_socket_path=self.fd_server.path if self.fd_server else "",
            engine_socket_path=self.engine_socket_path,
            listen_address=self.address,
            nixl_agent_name=self.agent.name,
        )

    def register_engine(self, request: transfer_pb2.RegisterEngineRequest) -> Engine:
        if self.fd_server is None:
            raise FailedPrecondition("this broker has no fd socket")
        engine_id_holder = f"pending-{request.session_token[:8]}"
        claimed = self.fd_server.claim(request.session_token, engine_id_holder)
        if claimed is None:
            raise NotFound("unknown or already used session_token: upload the buffers over the fd socket first")
        session, fds = claimed
        try:
            engine = self.engines.register(
                rank=request.rank,
                layout_msg=request.layout,
                specs=session.specs,
                fds=fds,
                session_token=session.token,
                pid=session.pid,
            )
        except BaseException:
            session.engine_id = None
            raise
        session.engine_id = engine.engine_id
        if session.closed:
            # The engine died while we registered it.
            self.tasks.spawn(self.unregister_engine(engine.engine_id, lost=True), name=f"lost-{engine.engine_id}")
        return engine

    async def unregister_engine(self, engine_id: str, *, lost: bool = False) -> int:
        """Fail the engine's rooms, wait for its transfers to settle, release it."""
        engine = self.engines.get(engine_id)
        kind = common_pb2.FAILURE_KIND_ENGINE_LOST
        why = cause(
            kind,
            f"engine rank {engine.key} {'went away (its session closed)' if lost else 'unregistered'}",
            self.broker_id,
        )
        sources, ranks = self._rooms_of(engine)
        for source in sources:
            self.sender.fail(source, why)
        if engine.role == common_pb2.ROLE_PREFILL:
            # Rooms whose receivers registered but this engine never opened.
            self.sender.abandon(engine.key, why)
        for rank in ranks:
            self.receiver.fail(rank, why)
        await self._wait_settled([engine], self.config.unregister_settle_timeout_seconds)
        if self.engines.by_id.get(engine_id) is not engine:
            return 0
        # The failed records stay until eviction: a transfer info that arrives
        # later for one of them is answered with the failure, not left waiting.
        self.hub.close(engine_id)
        self.engines.release(engine)
        log.info("engine_unregistered", engine=engine.label, lost=lost, rooms_failed=len(sources) + len(ranks))
        return sum(1 for p in (*sources, *ranks) if p.cause is why)

    def expect_room(self, request: transfer_pb2.ExpectRoomRequest) -> ReceiverProgress:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_DECODE, "expect rooms")
        self._refuse_if_draining()
        rank = self.receiver.expect(
            engine,
            request.room,
            sender_address=request.sender.broker_address,
            sender_group=request.sender.group,
            pages=decode_indices(request.pages),
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
        )
        self.progress.wake()
        return rank

    def begin_send(self, request: transfer_pb2.BeginSendRequest) -> SourceProgress:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_PREFILL, "send rooms")
        self._refuse_if_draining()
        return self.sender.begin(engine, request.room, request.num_pages)

    def send_chunk(self, request: transfer_pb2.SendChunkRequest) -> tuple[int, SourceProgress]:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_PREFILL, "send chunks")
        return self.sender.send_chunk(
            engine,
            request.room,
            decode_indices(request.pages),
            is_last=request.is_last,
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
        )

    def poll(self, request: transfer_pb2.PollRequest) -> list[common_pb2.RoomStatus]:
        engine = self.engines.get(request.engine_id)
        return [self._status(engine, room) for room in request.rooms]

    async def watch(self, request: transfer_pb2.WatchRoomsRequest) -> AsyncIterator[common_pb2.RoomStatus]:
        engine = self.engines.get(request.engine_id)
        rooms = frozenset(request.rooms) or None
        sub = self.hub.subscribe(engine.engine_id, rooms)
        try:
            for room in sorted(rooms or self._open_rooms(engine)):
                yield self._status(engine, room)
            while True:
                status = await sub.queue.get()
                if status is None:
                    return
                yield status
        finally:
            self.hub.unsubscribe(engine.engine_id, sub)

    def abort(self, request: transfer_pb2.AbortRequest) -> common_pb2.RoomStatus:
        engine = self.engines.get(request.engine_id)
        if engine.role == common_pb2.ROLE_PREFILL:
            self.sender.abort(engine, request.room, request.reason)
        else:
            self.receiver.abort(engine, request.room, request.reason)
        return self._status(engine, request.room)

    # -- peer API -------------------------------------------------------------
    def handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        return self.peers.on_handshake(request)

    def register_room(self, request: peer_pb2.RegisterRoomRequest) -> None:
        if request.sender_broker_id and request.sender_broker_id != self.broker_id:
            raise Aborted(
                f"room {request.room} was meant for broker {request.sender_broker_id}; this is broker "
                f"{self.broker_id} (a restart): handshake again"
            )
        peer = self.peers.get(request.receiver_broker_id)
        room = self.rooms.sender.get(request.room)
        if self.draining and (room is None or not room.sources):
            raise Unavailable("this broker is draining: it accepts no new rooms")
        if not request.sources:
            raise InvalidArgument("a room registration must list its sources")
        info = TransferInfo(
            trace_context=otel_context.get_current(),
            room=request.room,
            receiver_broker_id=request.receiver_broker_id,
            receiver=rank_key(request.receiver),
            receiver_generation=request.receiver_generation,
            sender_group=request.sender_group,
            pages=decode_indices(request.pages),
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
            sources=tuple(SourcePlan.from_proto(s) for s in request.sources),
        )
        self.sender.on_register_room(info, peer)

    async def reserve_staging(self, request: peer_pb2.ReserveStagingRequest) -> peer_pb2.ReserveStagingResponse:
        reservation = await self.receiver.reserve_staging(request)
        return peer_pb2.ReserveStagingResponse(offset=reservation.offset, bytes=reservation.nbytes)

    def completion_report(self, request: peer_pb2.CompletionReport) -> None:
        self.receiver.on_completion_report(request)

    def peer_abort(self, request: peer_pb2.PeerAbortRequest) -> peer_pb2.PeerAbortResponse:
        why = request.cause if request.HasField("cause") else cause(
            common_pb2.FAILURE_KIND_ABORTED, "aborted by the peer broker", request.from_broker_id
        )
        if request.from_broker_id not in self.peers.by_id:
            raise PermissionDenied(f"broker {request.from_broker_id!r} is not a handshaken peer of this broker")
        settled = self.sender.on_peer_abort(request.room, why, request.from_broker_id)
        self.receiver.on_peer_abort(request.room, why, request.from_broker_id)
        return peer_pb2.PeerAbortResponse(settled=settled)

    def open_rooms(self) -> int:
        """Room sides not yet SUCCESS or FAILED."""
        return sum(1 for s in self.rooms.all_sources() if not s.terminal) + sum(
            1 for r in self.rooms.all_receivers() if not r.terminal
        )

    async def set_draining(self, draining: bool) -> None:
        """Refuse (or accept again) new rooms; the engine service's health follows."""
        if draining != self.draining:
            log.warning("broker_draining" if draining else "broker_resumed", open_rooms=self.open_rooms())
        self.draining = draining
        if self.on_draining is not None:
            await self.on_draining(draining)

    def _refuse_if_draining(self) -> None:
        if self.draining:
            raise Unavailable("this broker is draining: it accepts no new rooms (Admin.Drain)")

    def after_rpc(self, _context: object) -> None:
        """An RPC finished: post the chunks it scheduled (``SenderSide.flush``)."""
        self.sender.flush()

    # -- peers --------------------------------------------------------------------
    def on_peer_lost(self, peer: Peer, what: str) -> None:
        """``peer`` died or restarted: fail its rooms, cancel transfers to it, drop it."""
        broker_id = peer.broker_id
        if broker_id is None or peer.is_self:
            return
        why = cause(common_pb2.FAILURE_KIND_PEER, f"peer broker {peer.address} ({broker_id}) {what}", self.broker_id)
        log.warning("peer_lost", peer=peer.address, broker=broker_id, reason=what)
        sources = self.sender.peer_lost(broker_id, why)
        ranks = self.receiver.peer_lost(broker_id, why)
        agent = peer.agent_name
        self.progress.cancel(
            lambda t: t.remote_agent == agent,
            lambda t: NixlError(f"transfer to lost peer {peer.address} cancelled"),
        )
        self.peers.drop(peer)
        log.info("peer_dropped", peer=peer.address, broker=broker_id, sources_failed=sources, receivers_failed=ranks)

    def _refresh_gauges(self) -> None:
        """The snapshot the metric gauges read (scrapes run on another thread)."""
        rooms: dict[tuple[str, str], int] = {}
        for side, records in (("sender", self.rooms.all_sources()), ("receiver", self.rooms.all_receivers())):
            for p in records:
                key = (side, common_pb2.RoomState.Name(p.state))
                rooms[key] = rooms.get(key, 0) + 1
        peers = {id(p): p for p in self.peers.by_id.values() if not p.is_self}.values()
        self.metrics.snapshot = GaugeSnapshot(
            rooms=rooms,
            staging={
                "send": self.send_staging.in_use_bytes if self.send_staging else 0,
                "receive": self.receive_staging.in_use_bytes if self.receive_staging else 0,
            },
            sessions=len(self.engines.by_id),
            peers=len(peers),
            throughput={(p.address, self.transport): p.throughput_bps for p in peers if p.throughput_bps},
        )

    @property
    def transport(self) -> str:
        """What carries the bytes, as far as the broker can tell (NIXL does not
        report the UCX lane it picked; UCX_PROTO_INFO=y in the broker's
        environment makes UCX print it)."""
        env = os.environ
        return (
            f"NIXL UCX (error mode {self.config.ucx_error_mode}, UCX_TLS={env.get('UCX_TLS', 'auto')}, "
            f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES', 'auto')})"
        )

    def _has_business(self, peer: Peer) -> bool:
        broker_id = peer.broker_id
        for source in self.rooms.all_sources():
            if (not source.terminal or source.inflight) and any(
                d.info.receiver_broker_id == broker_id for d in source.destinations.values()
            ):
                return True
        return any(
            r.peer_broker_id == broker_id and (not r.terminal or not r.pages_settled) for r in self.rooms.all_receivers()
        )

    # -- sessions ---------------------------------------------------------------
    def on_session_closed(self, session: FdSession) -> None:
        """The engine's fd connection closed: if it never unregistered, it is gone."""
        engine_id = session.engine_id
        if engine_id and engine_id in self.engines.by_id:
            log.warning("engine_session_lost", engine=self.engines.by_id[engine_id].label, pid=session.pid)
            self.tasks.spawn(self.unregister_engine(engine_id, lost=True), name=f"lost-{engine_id}")

    # -- internals --------------------------------------------------------------
    def _publish(self, progress: Progress) -> None:
        self.hub.publish(progress.engine.engine_id, progress.status())
        if progress.terminal and not progress.closed:
            progress.closed = True
            self._room_ended(progress)

    def _room_ended(self, progress: Progress) -> None:
        """End the room span, record metrics, write the one canonical log line."""
        sender = isinstance(progress, SourceProgress)
        side = "sender" if sender else "receiver"
        if sender:
            peer = ",".join(sorted({d.info.receiver_broker_id for d in progress.destinations.values()}))  # type: ignore[attr-defined]
            pages = progress.cursor  # type: ignore[attr-defined]
        else:
            peer = progress.peer_broker_id or progress.sender_address  # type: ignore[attr-defined]
            pages = int(progress.pages.size)  # type: ignore[attr-defined]
        telemetry.close_room_span(progress, {"kvbroker.peer": peer, "kvbroker.pages": pages})
        state = common_pb2.RoomState.Name(progress.state)
        total = (progress.finished_at or time.monotonic()) - progress.opened_at
        self.metrics.room_seconds.record(total, {"side": side, "state": state})
        kind = common_pb2.FailureKind.Name(progress.cause.kind) if progress.cause is not None else ""
        if progress.cause is not None:
            self.metrics.failures.add(1, {"side": side, "cause": kind})
        times = dict(progress.timeline)
        log.info(
            "room_ended",
            room=progress.room,
            side=side,
            engine=progress.engine.label,
            peer=peer,
            state=state,
            cause=kind or None,
            cause_message=progress.cause.message if progress.cause is not None else None,
            bytes=progress.bytes,
            chunks=progress.chunks,
            pages=pages,
            total_s=round(total, 6),
            bootstrap_s=_between(times, "opened", "registered" if not sender else "ready"),
            transfer_s=_between(times, "first_byte", "last_byte"),
            **telemetry.span_ids(progress.span),
        )

    def _evicted(self, progress: Progress) -> None:
        telemetry.child_done(progress.span, "kvbroker.cleanup", {"kvbroker.settled": progress.pages_settled})

    def _on_notification(self, agent_name: str, payload: bytes) -> None:
        self.receiver.on_notice(agent_name, payload)

    def _awaiting_data(self) -> bool:
        return self.receiver.awaiting_data()

    def _status(self, engine: Engine, room: int) -> common_pb2.RoomStatus:
        progress: Progress | None
        if engine.role == common_pb2.ROLE_PREFILL:
            sroom = self.rooms.sender.get(room)
            progress = sroom.sources.get(engine.key) if sroom is not None else None
        else:
            rroom = self.rooms.receiver.get(room)
            progress = rroom.ranks.get(engine.key) if rroom is not None else None
        if progress is None:
            return common_pb2.RoomStatus(
                room=room,
                state=common_pb2.ROOM_STATE_FAILED,
                cause=cause(
                    common_pb2.FAILURE_KIND_UNKNOWN_ROOM,
                    f"engine {engine.engine_id} has no room {room} here (never opened, or evicted)",
                    self.broker_id,
                ),
            )
        return progress.status()

    def _rooms_of(self, engine: Engine) -> tuple[list[SourceProgress], list[ReceiverProgress]]:
        sources = [s for s in self.rooms.all_sources() if s.engine is engine]
        ranks = [r for r in self.rooms.all_receivers() if r.engine is engine]
        return sources, ranks

    def _open_rooms(self, engine: Engine) -> list[int]:
        sources, ranks = self._rooms_of(engine)
        return [p.room for p in (*sources, *ranks) if not p.terminal]

    async def _wait_settled(self, engines: list[Engine], timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            pending = [p for engine in engines for side in self._rooms_of(engine) for p in side if _unsettled(p)]
            if not pending:
                return
            await asyncio.sleep(0.01)
        log.warning("settle_timeout", engines=[e.label for e in engines], timeout_seconds=timeout_seconds)

    async def _housekeep(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.housekeeping_interval_seconds)
            try:
                now = time.monotonic()
                self.sender.time_out(now, cfg.sender_info_timeout_seconds)
                self.sender.abandon_orphans(now, cfg.orphan_room_timeout_seconds)
                self.receiver.time_out(now, cfg.receiver_data_timeout_seconds)
                self.receiver.tell_successors(now, cfg.peer_heartbeat_seconds)
                self.progress.cancel_overdue(now, cfg.transfer_timeout_seconds)
                self.rooms.evict(
                    time.monotonic(),
                    cfg.finished_room_ttl_seconds,
                    cfg.tombstone_ttl_seconds,
                    cfg.orphan_room_timeout_seconds,
                    max(cfg.unsettled_room_ttl_seconds, cfg.finished_room_ttl_seconds),
                    on_evict=self._evicted,
                    notice_ttl_seconds=cfg.sender_info_timeout_seconds,
                )
                self._refresh_gauges()
            except Exception:
                log.exception("housekeeping_failed")


def _between(times: dict[str, float], start: str, end: str) -> float | None:
    if start in times and end in times:
        return round(times[end] - times[start], 6)
    return None


def _unsettled(progress: Progress) -> bool:
    """A source with transfers in flight, or a receiver whose pages may still be written."""
    if isinstance(progress, SourceProgress):
        return progress.inflight > 0
    return not progress.pages_settled


def _state(entries: Iterable[common_pb2.StateIndices]) -> dict[str, IndexArray]:
    out: dict[str, IndexArray] = {}
    for entry in entries:
        if entry.component in out:
            raise InvalidArgument(f"state component {entry.component!r} listed twice")
        out[entry.component] = decode_indices(entry.indices, what=f"state {entry.component!r}")
    return out


def channel_options(config: BrokerConfig) -> list[tuple[str, int]]:
    """gRPC options for channels and the server: message size limits, and a
    channel to a peer that went away tries to connect again at least once per
    heartbeat (gRPC's default backoff grows to 120 s, which would keep a
    restarted peer unreachable long after it is back)."""
    backoff_ms = max(100, int(config.peer_heartbeat_seconds * 1000))
    return [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.initial_reconnect_backoff_ms", min(backoff_ms, 1000)),
        ("grpc.min_reconnect_backoff_ms", min(backoff_ms, 1000)),
        ("grpc.max_reconnect_backoff_ms", backoff_ms),
    ]

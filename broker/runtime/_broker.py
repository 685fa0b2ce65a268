"""The dispatcher: one broker's parts, and the path of every call through them.

``servicer -> Broker method (proto to command) -> state machine -> effects ->
executor``. The servicers (``service``) are thin; each :class:`Broker` method
decodes its request, checks the caller, calls the sender or receiver state
machine, and lets the executor carry out the effects
(:meth:`Executor.drain`) before it answers.

Threads (docs/architecture.md): everything here runs on the control loop
(the asyncio thread that serves gRPC). NIXL runs on the data-plane thread,
staging copies and buffer mappings on the worker threads; the loop awaits
them and never blocks on them.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvbroker import __version__
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Agent, DataPlane, Event, Workers
from kvbroker.broker.device import ArrayViews, Lanes
from kvbroker.broker.execution import Executor, TaskSet
from kvbroker.broker.memory import Engine, EngineTable, FdSession, FdSocketServer, StagingPools
from kvbroker.broker.peers import (
    FleetRecord,
    FleetView,
    HandshakeMessage,
    Member,
    Peer,
    PeerClient,
    PeerMonitor,
    PeerTable,
)
from kvbroker.broker.rooms import (
    Receiver,
    ReceiverCore,
    RoomTables,
    SenderCore,
    Side,
    Source,
    TransferInfo,
    WatchHub,
    cause,
)
from kvbroker.broker.runtime._streams import SessionStream
from kvbroker.broker.telemetry import BrokerMetrics, Counters, GaugeSnapshot, child_done
from kvbroker.broker.tls import channel_credentials
from kvbroker.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvBrokerError,
    NixlError,
    NotFound,
    Unavailable,
)
from kvbroker.plan import IndexArray, SourcePlan, decode_indices, rank_key
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2, transfer_pb2

__all__ = ["Broker"]

log = structlog.get_logger(__name__)

#: Housekeeping passes per pass that scans every record (eviction, gauges).
_SLOW_PASSES = 4
#: The context of a session command that carries none: no parent span.
_NO_TRACE = otel_context.Context()


class Broker:
    """One broker: its tables, state machines, executor and threads."""

    def __init__(self, config: BrokerConfig, agent: Agent, broker_id: str | None = None) -> None:
        self.config = config
        self.broker_id = broker_id or uuid.uuid4().hex
        self.agent = agent
        self.started_at = time.monotonic()
        self.address = ""
        self.engine_socket_path = ""
        self.fd_server: FdSocketServer | None = None
        self.counters = Counters()
        self.metrics = BrokerMetrics()
        self.rooms = RoomTables()
        self.tasks = TaskSet()
        self.hub = WatchHub()
        self.workers = Workers()
        self.views = ArrayViews()
        self.lanes = Lanes(self.workers, self.views)
        self.dataplane = DataPlane(agent, on_events=self._on_events, transfer_timeout_seconds=config.transfer_timeout_seconds)
        self.engines = EngineTable(self.dataplane, self.workers)
        self.pools = StagingPools(
            send_bytes=config.staging_send_bytes,
            receive_bytes=config.staging_receive_bytes,
            dataplane=self.dataplane,
            workers=self.workers,
            device_send_bytes=config.device_send_bytes,
            device_receive_bytes=config.device_receive_bytes,
        )
        self.peers = PeerTable(broker_id=self.broker_id, agent_name=agent.name, dataplane=self.dataplane, on_restart=self.peer_lost)
        self.client = PeerClient(
            peers=self.peers,
            config=config,
            handshake_message=self._handshake_message,
            epoch=lambda: self.engines.epoch,
            credentials=channel_credentials(config) if config.tls else None,
        )
        self.sender = SenderCore(
            broker_id=self.broker_id,
            rooms=self.rooms,
            counters=self.counters,
            peers=self.peers,
            send_staging_bytes=self.pools.send_bytes,
            part_bytes=config.device_part_bytes,
        )
        self.receiver = ReceiverCore(
            broker_id=self.broker_id,
            rooms=self.rooms,
            counters=self.counters,
            on_bytes=lambda n: self.metrics.bytes.add(n, {"direction": "received"}),
        )
        self.executor = Executor(
            broker_id=self.broker_id,
            config=config,
            sender=self.sender,
            receiver=self.receiver,
            dataplane=self.dataplane,
            peers=self.peers,
            client=self.client,
            pools=self.pools,
            workers=self.workers,
            views=self.views,
            lanes=self.lanes,
            hub=self.hub,
            tasks=self.tasks,
            counters=self.counters,
            metrics=self.metrics,
        )
        self.monitor = PeerMonitor(
            self.peers,
            self.client,
            interval_seconds=config.peer_heartbeat_seconds,
            dead_after_seconds=config.peer_dead_after_seconds,
            has_business=self._has_business,
            on_lost=self.peer_lost,
        )
        #: Session commands by name (``SessionCommand.command``).
        self._engine_commands: dict[str, Callable[[Any], object]] = {
            "expect_room": self.expect_room,
            "begin_send": self.begin_send,
            "send_chunk": self.send_chunk,
            "abort": self.abort,
        }
        self.draining = False
        #: Called with the draining flag (the server points it at its health service).
        self.on_draining: Callable[[bool], Awaitable[None]] | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self._monitor: asyncio.Task[None] | None = None
        #: The fleet in etcd (``serve --etcd``; the server sets both): this
        #: broker's record, and its view of every broker's.
        self.fleet_record: FleetRecord | None = None
        self.fleet_view: FleetView | None = None

    # -- lifecycle --------------------------------------------------------
    async def start(self, address: str) -> None:
        """Start the data plane, staging, housekeeping; ``address`` is where peers reach us."""
        self.address = address
        self.peers.address = address
        self.dataplane.start()
        await self.pools.start()
        loop = asyncio.get_running_loop()
        self._housekeeping = loop.create_task(self._housekeep(), name="housekeeping")
        self._monitor = loop.create_task(self.monitor.run(), name="peer-monitor")

    async def stop(self) -> None:
        """Fail open rooms, let in-flight transfers settle, release everything in reverse order."""
        why = cause(common_pb2.FAILURE_KIND_SHUTDOWN, "the broker is shutting down", self.broker_id)
        for engine in self.engines.by_id.values():
            if engine.session is not None:
                # An error, not a clean end: the engine's session reconnects
                # and registers again with the next process at this address.
                engine.session.end(Unavailable("the broker is shutting down"))
        for source in list(self.rooms.all_sources()):
            self.sender.fail(source, why)
        for rank in list(self.rooms.all_receivers()):
            self.receiver.fail(rank, why)
        self.executor.drain()
        await self._wait_settled(list(self.engines.by_id.values()), self.config.unregister_settle_timeout_seconds)
        await self.tasks.drain(timeout_seconds=2.0)
        for task in (self._housekeeping, self._monitor):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for engine in list(self.engines.by_id.values()):
            self.hub.close(engine.engine_id)
            await self._release_engine(engine)
        await self.pools.close()
        for peer in self.peers.peers():
            self.peers.drop(peer)
        await self.client.close()
        await self.dataplane.stop()
        self.agent.close()
        await asyncio.get_running_loop().run_in_executor(None, self.workers.shutdown)
        self.lanes.close()

    # -- engine calls ---------------------------------------------------------
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

    async def register_engine(self, request: transfer_pb2.RegisterEngineRequest) -> Engine:
        if self.fd_server is None:
            raise FailedPrecondition("this broker has no fd socket")
        claimed = self.fd_server.claim(request.session_token, f"pending-{request.session_token[:8]}")
        if claimed is None:
            raise NotFound("unknown or already used session_token: upload the buffers over the fd socket first")
        session, fds = claimed
        try:
            engine = await self.engines.register(
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
        try:
            # The engine's VRAM moves only through this broker's transfer
            # buffers on its GPU: without them, refuse the engine.
            for device in sorted(_vram_devices(engine)):
                await self.pools.ensure_device(device, self.engines.cuda_driver)
        except BaseException:
            session.engine_id = None
            await self._release_engine(engine)
            raise
        session.engine_id = engine.engine_id
        if session.closed:
            # The engine died while we registered it.
            self.tasks.spawn(self.unregister_engine(engine.engine_id, lost=True), name=f"lost-{engine.engine_id}")
        return engine

    async def unregister_engine(self, engine_id: str, *, lost: bool = False) -> int:
        """Fail the engine's rooms, wait for its transfers to settle, release it."""
        engine = self.engines.get(engine_id)
        why = cause(
            common_pb2.FAILURE_KIND_ENGINE_LOST,
            f"engine rank {engine.key} {'went away (its session closed)' if lost else 'unregistered'}",
            self.broker_id,
        )
        failed = self.sender.engine_gone(engine, why) + self.receiver.engine_gone(engine, why)
        self.executor.drain()
        await self._wait_settled([engine], self.config.unregister_settle_timeout_seconds)
        if self.engines.by_id.get(engine_id) is not engine:
            return 0
        # The failed records stay until eviction: a transfer info that arrives
        # later for one of them is answered with the failure, not left waiting.
        self.hub.close(engine_id)
        await self._release_engine(engine)
        log.info("engine_unregistered", engine=engine.label, lost=lost, rooms_failed=failed)
        return failed

    async def _release_engine(self, engine: Engine) -> None:
        """Release an engine, and its GPUs' staging pools if no other engine uses them."""
        await self.engines.release(engine)
        for device in _vram_devices(engine) - {d for e in self.engines.by_id.values() for d in _vram_devices(e)}:
            await self.pools.release_device(device)

    def expect_room(self, request: transfer_pb2.ExpectRoomRequest) -> Receiver:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_DECODE, "expect rooms")
        self._refuse_if_draining()
        rank = self.receiver.expect(
            engine,
            request.room,
            # Interned: every room of a sender group names the same two strings.
            sender_address=sys.intern(request.sender.broker_address),
            sender_group=sys.intern(request.sender.group),
            pages=decode_indices(request.pages),
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
            prefix_pages=request.prefix_pages,
            verify_checksum=request.verify_checksum or self.config.verify_checksums,
        )
        self.executor.drain()
        return rank

    def begin_send(self, request: transfer_pb2.BeginSendRequest) -> Source:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_PREFILL, "send rooms")
        self._refuse_if_draining()
        source = self.sender.begin(engine, request.room, request.num_pages)
        self.executor.drain()
        return source

    def send_chunk(self, request: transfer_pb2.SendChunkRequest) -> tuple[int, Source]:
        engine = self.engines.get(request.engine_id)
        self.engines.check_role(engine, common_pb2.ROLE_PREFILL, "send chunks")
        result = self.sender.chunk(
            engine,
            request.room,
            decode_indices(request.pages),
            is_last=request.is_last,
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
            room_page=request.room_page if request.HasField("room_page") else None,
        )
        self.executor.drain()
        return result

    def poll(self, request: transfer_pb2.PollRequest) -> list[common_pb2.RoomStatus]:
        engine = self.engines.get(request.engine_id)
        return [self.status(engine, room) for room in request.rooms]

    async def watch(self, request: transfer_pb2.WatchRoomsRequest) -> AsyncIterator[common_pb2.RoomStatus]:
        engine = self.engines.get(request.engine_id)
        rooms = frozenset(request.rooms) or None
        sub = self.hub.subscribe(engine.engine_id, rooms)
        try:
            for room in sorted(rooms or self._open_rooms(engine)):
                yield self.status(engine, room)
            while True:
                status = await sub.queue.get()
                if status is None:
                    return
                yield status
        finally:
            self.hub.unsubscribe(engine.engine_id, sub)

    # -- engine session streams ------------------------------------------------
    def open_session(self, opening: transfer_pb2.SessionOpen) -> tuple[Engine, SessionStream]:
        """Start a Session stream for the engine in ``opening``; a previous one ends."""
        _check_version(opening.protocol_version, "Session")
        engine = self.engines.get(opening.engine_id)
        if engine.session is not None:
            engine.session.end(Aborted("another session stream of this engine rank replaced this one"))
            self.hub.unsubscribe(engine.engine_id, engine.session)
        if engine.applied == 0:
            engine.applied = opening.resume_after
        elif opening.resume_after > engine.applied:
            raise FailedPrecondition(
                f"the engine says command {opening.resume_after} was applied; this broker applied up to {engine.applied}"
            )
        stream = SessionStream(engine.engine_id)
        engine.session = stream
        self.hub.add(engine.engine_id, stream)
        for room in opening.rooms:
            stream.offer(self.status(engine, room))
        stream.applied(engine.applied)
        return engine, stream

    def close_session(self, engine: Engine, stream: SessionStream) -> None:
        self.hub.unsubscribe(engine.engine_id, stream)
        if engine.session is stream:
            engine.session = None

    def apply_commands(self, engine: Engine, stream: SessionStream, commands: Iterable[transfer_pb2.SessionCommand]) -> None:
        """Apply a session message's commands in order. A command sent again
        after a reconnect (seq already applied) is skipped; a gap in the
        numbering ends the stream (INVALID_ARGUMENT). A refused command is
        reported on the stream, and fails its room if the room was open."""
        if self.engines.by_id.get(engine.engine_id) is not engine:
            raise NotFound(f"engine {engine.engine_id} is no longer registered")
        for command in commands:
            if command.seq <= engine.applied:
                continue
            if command.seq != engine.applied + 1:
                stream.applied(engine.applied)  # the commands before the gap were applied
                raise InvalidArgument(f"session command {command.seq} follows {engine.applied}: commands were lost")
            which = command.WhichOneof("command")
            request = getattr(command, which) if which else None
            room = request.room if request is not None else 0
            # The room's spans join the engine's trace, or start their own:
            # never the long-lived stream's.
            token = otel_context.attach(propagate.extract(command.trace_context) if command.trace_context else _NO_TRACE)
            error: KvBrokerError | None = None
            try:
                if request is None:
                    raise InvalidArgument(f"session command {command.seq} carries no command")
                request.engine_id = engine.engine_id
                self._engine_commands[which](request)
            except KvBrokerError as exc:
                error = exc
            except Exception:
                log.exception("session_command_failed", engine=engine.label, command=which, room=room)
                error = Internal(f"{which} failed inside the broker; see its log")
            finally:
                otel_context.detach(token)
            if error is not None:
                failed, settled = self._refused(engine, which or "", room, error)
                stream.refuse(command.seq, room, error, room_failed=failed, pages_settled=settled)
            engine.applied = command.seq
        stream.applied(engine.applied)

    def _refused(self, engine: Engine, which: str, room: int, error: KvBrokerError) -> tuple[bool, bool]:
        """After a refused command: (the room was open and is failed now, its pages are settled).

        A refused opening (ExpectRoom, BeginSend) leaves any room already there
        alone; a refused chunk or abort of an open room fails the room: the
        engine's stream of commands for it has a hole.
        """
        side = self._side(engine, room)
        if which in ("expect_room", "begin_send"):
            return False, side is None or _settled(side)
        if side is None or side.terminal:
            return False, side is None or _settled(side)
        why = cause(common_pb2.FAILURE_KIND_REFUSED, f"{which} refused: {error.message}", self.broker_id)
        if isinstance(side, Source):
            self.sender.fail(side, why)
        else:
            assert isinstance(side, Receiver)
            self.receiver.fail(side, why)
        self.executor.drain()
        return True, _settled(side)

    def abort(self, request: transfer_pb2.AbortRequest) -> common_pb2.RoomStatus:
        engine = self.engines.get(request.engine_id)
        if engine.role == common_pb2.ROLE_PREFILL:
            self.sender.abort(engine, request.room, request.reason)
        else:
            self.receiver.abort(engine, request.room, request.reason)
        self.executor.drain()
        return self.status(engine, request.room)

    def _side(self, engine: Engine, room: int) -> Side | None:
        """``engine``'s side of ``room``, if it has one here."""
        if engine.role == common_pb2.ROLE_PREFILL:
            sroom = self.rooms.sender.get(room)
            return sroom.sources.get(engine.key) if sroom is not None else None
        rroom = self.rooms.receiver.get(room)
        return rroom.ranks.get(engine.key) if rroom is not None else None

    def status(self, engine: Engine, room: int) -> common_pb2.RoomStatus:
        """The status of ``engine``'s side of ``room`` (FAILED UNKNOWN_ROOM if it has none)."""
        side = self._side(engine, room)
        if side is None:
            return common_pb2.RoomStatus(
                room=room,
                state=common_pb2.ROOM_STATE_FAILED,
                cause=cause(
                    common_pb2.FAILURE_KIND_UNKNOWN_ROOM,
                    f"engine {engine.engine_id} has no room {room} here (never opened, or evicted)",
                    self.broker_id,
                ),
            )
        return side.status()

    # -- peer calls -------------------------------------------------------------
    async def handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        return await self.peers.answer(request, await self._handshake_message())

    def register_rooms(self, request: peer_pb2.RegisterRoomsRequest) -> peer_pb2.RegisterRoomsResponse:
        """Many RegisterRoom in one call: each succeeds or fails on its own, in
        its room's trace."""
        _check_version(request.protocol_version, "RegisterRooms")
        response = peer_pb2.RegisterRoomsResponse()
        for item in request.rooms:
            item.protocol_version = item.protocol_version or request.protocol_version
            token = otel_context.attach(propagate.extract(item.trace_context) if item.trace_context else _NO_TRACE)
            try:
                self.register_room(item)
                response.results.add()
            except KvBrokerError as exc:
                response.results.add(code=exc.status_number, message=exc.message)
            finally:
                otel_context.detach(token)
        return response

    def register_room(self, request: peer_pb2.RegisterRoomRequest) -> None:
        _check_version(request.protocol_version, "RegisterRoom")
        if request.sender_broker_id and request.sender_broker_id != self.broker_id:
            raise Aborted(
                f"room {request.room} was meant for broker {request.sender_broker_id}; this is broker "
                f"{self.broker_id} (a restart): handshake again"
            )
        self.peers.get(request.receiver_broker_id)
        room = self.rooms.sender.get(request.room)
        if self.draining and (room is None or not room.sources):
            raise Unavailable("this broker is draining: it accepts no new rooms")
        if not request.sources:
            raise InvalidArgument("a room registration must list its sources")
        remote = self.peers.remote_engine(request.receiver_broker_id, rank_key(request.receiver))
        info = TransferInfo(
            trace_context=trace.get_current_span(),
            room=request.room,
            receiver_broker_id=sys.intern(request.receiver_broker_id),
            receiver=rank_key(request.receiver),
            receiver_generation=request.receiver_generation,
            sender_group=sys.intern(request.sender_group),
            pages=decode_indices(request.pages),
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=_state(request.state),
            sources=tuple(SourcePlan.from_proto(s) for s in request.sources),
            prefix_pages=request.prefix_pages,
            verify_checksum=request.verify_checksum,
            page_size=remote.layout.page_size_tokens if remote is not None else 0,
        )
        self.sender.transfer_info(info)
        self.executor.drain()

    async def reserve_staging(self, request: peer_pb2.ReserveStagingRequest) -> peer_pb2.ReserveStagingResponse:
        """Room in a receive staging buffer for one staged part (the prefetch). Idempotent."""
        _check_version(request.protocol_version, "ReserveStaging")
        pool_key, held = self.receiver.staging_wanted(request)
        pool = self.pools.pool("receive", *pool_key)
        if pool is None:
            raise FailedPrecondition("this broker has no receive staging buffer for that memory (--no-staging?)")
        if held is None:
            reservation = await pool.reserve(request.bytes, self.config.staging_wait_seconds)
            try:
                held = self.receiver.staging_granted(request, pool_key, reservation)
            except BaseException:
                pool.release(reservation)
                raise
            finally:
                self.executor.drain()
        return peer_pb2.ReserveStagingResponse(offset=held.offset, bytes=held.nbytes, buffer=pool.buffer.descriptor())

    def completion_report(self, request: peer_pb2.CompletionReport) -> None:
        _check_version(request.protocol_version, "ReportCompletion")
        self.receiver.completion_report(request)
        self.executor.drain()

    def peer_aborts(self, request: peer_pb2.PeerAbortRoomsRequest) -> peer_pb2.PeerAbortRoomsResponse:
        """Many AbortRoom in one call: each succeeds or fails on its own."""
        _check_version(request.protocol_version, "AbortRooms")
        response = peer_pb2.PeerAbortRoomsResponse()
        for item in request.aborts:
            item.protocol_version = item.protocol_version or request.protocol_version
            try:
                response.results.add(settled=self.peer_abort(item).settled)
            except KvBrokerError as exc:
                response.results.add(code=exc.status_number, message=exc.message)
        return response

    def peer_abort(self, request: peer_pb2.PeerAbortRequest) -> peer_pb2.PeerAbortResponse:
        _check_version(request.protocol_version, "AbortRoom")
        why = request.cause if request.HasField("cause") else cause(
            common_pb2.FAILURE_KIND_ABORTED, "aborted by the peer broker", request.from_broker_id
        )
        if request.from_broker_id not in self.peers.by_id:
            raise Aborted(
                f"broker {request.from_broker_id!r} is not a handshaken peer of this broker (it took it for lost, "
                "or restarted): handshake again"
            )
        settled = self.sender.peer_abort(request.room, why, request.from_broker_id)
        self.receiver.peer_abort(request.room, why, request.from_broker_id)
        self.executor.drain()
        return peer_pb2.PeerAbortResponse(settled=settled)

    # -- operators ------------------------------------------------------------------
    def admin_abort(self, room: int, reason: str) -> int:
        """Fail every open local side of ``room``; the peers hear of it."""
        why = cause(common_pb2.FAILURE_KIND_ABORTED, f"aborted by the operator: {reason or 'no reason given'}", self.broker_id)
        sides = self.sides_of(room)
        if not sides:
            raise NotFound(f"this broker has no side of room {room}")
        aborted = 0
        for side in sides:
            if side.terminal:
                continue
            child_done(side.span, "kvbroker.abort", {"kvbroker.reason": why.message, "kvbroker.by": "operator"})
            if isinstance(side, Source):
                self.sender.fail(side, why)
            else:
                assert isinstance(side, Receiver)
                self.receiver.fail(side, why)
            aborted += 1
        self.executor.drain()
        return aborted

    def sides_of(self, room: int) -> list[Side]:
        sroom, rroom = self.rooms.sender.get(room), self.rooms.receiver.get(room)
        return [*(sroom.sources.values() if sroom else ()), *(rroom.ranks.values() if rroom else ())]

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

    # -- peers and sessions ------------------------------------------------------------
    def peer_lost(self, peer: Peer, what: str) -> None:
        """``peer`` died or restarted: fail its rooms, cancel transfers to it, drop it."""
        broker_id = peer.broker_id
        if broker_id is None or peer.is_self:
            return
        why = cause(common_pb2.FAILURE_KIND_PEER, f"peer broker {peer.address} ({broker_id}) {what}", self.broker_id)
        log.warning("peer_lost", peer=peer.address, broker=broker_id, reason=what)
        sources = self.sender.peer_lost(broker_id, why)
        ranks = self.receiver.peer_lost(broker_id, why)
        if peer.agent_name:
            address = peer.address
            self.dataplane.cancel(peer.agent_name, lambda: NixlError(f"transfer to lost peer {address} cancelled"))
        self.peers.drop(peer)
        self.executor.drain()
        log.info("peer_dropped", peer=peer.address, broker=broker_id, sources_failed=sources, receivers_failed=ranks)

    def etcd_status(self) -> str:
        """"off" (no --etcd), "ok" (registered and watching) or "unreachable"."""
        if self.fleet_record is None or self.fleet_view is None:
            return "off"
        return "ok" if self.fleet_record.registered and self.fleet_view.watching else "unreachable"

    def broker_left(self, member: Member) -> None:
        """A broker's key left etcd (its lease expired or was revoked): lost, as a silent peer is."""
        peer = self.peers.by_id.get(member.broker_id)
        if peer is not None:
            self.peer_lost(peer, "left the fleet: its etcd lease expired or was revoked")

    def session_closed(self, session: FdSession) -> None:
        """The engine's fd connection closed: if it never unregistered, it is gone."""
        engine_id = session.engine_id
        if engine_id and engine_id in self.engines.by_id:
            log.warning("engine_session_lost", engine=self.engines.by_id[engine_id].label, pid=session.pid)
            self.tasks.spawn(self.unregister_engine(engine_id, lost=True), name=f"lost-{engine_id}")

    def _has_business(self, peer: Peer) -> bool:
        broker_id = peer.broker_id or ""
        return self.sender.has_business(broker_id) or self.receiver.has_business(broker_id)

    async def _handshake_message(self) -> HandshakeMessage:
        epoch = self.engines.epoch
        metadata = await self.dataplane.call(lambda agent: agent.metadata())
        engines = [e.descriptor() for e in self.engines.by_id.values()]
        return metadata, engines, self.pools.receive_buffers(), epoch

    # -- internals -----------------------------------------------------------------------
    def _on_events(self, events: list[Event]) -> None:
        self.executor.on_events(events)

    def _open_rooms(self, engine: Engine) -> list[int]:
        sides: Iterable[Side] = (*self.rooms.all_sources(), *self.rooms.all_receivers())
        return [s.room for s in sides if s.engine is engine and not s.terminal]

    async def _wait_settled(self, engines: list[Engine], timeout_seconds: float) -> None:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if not any(_unsettled(s) for s in (*self.rooms.all_sources(), *self.rooms.all_receivers()) if s.engine in engines):
                return
            await asyncio.sleep(0.01)
        log.warning("settle_timeout", engines=[e.label for e in engines], timeout_seconds=timeout_seconds)

    async def _housekeep(self) -> None:
        """Timeouts of open rooms every housekeeping interval; what scans every
        record (eviction, orphaned transfer infos, the gauges) every
        ``_SLOW_PASSES`` intervals, so its cost does not grow with the rate."""
        cfg = self.config
        slow_every = cfg.housekeeping_interval_seconds * _SLOW_PASSES
        slow_at = 0.0
        while True:
            await asyncio.sleep(cfg.housekeeping_interval_seconds)
            try:
                now = time.monotonic()
                self.sender.tick(
                    now,
                    info_timeout_seconds=cfg.sender_info_timeout_seconds,
                    orphan_timeout_seconds=cfg.orphan_room_timeout_seconds,
                    orphans_every=slow_every,
                )
                self.receiver.tick(now, data_timeout_seconds=cfg.receiver_data_timeout_seconds, retry_seconds=cfg.peer_heartbeat_seconds)
                if now - slow_at >= slow_every:
                    slow_at = now
                    self.evict(now)
                    self._refresh_gauges()
                self.executor.drain()
            except Exception:
                log.exception("housekeeping_failed")

    def evict(self, now: float, *, everything: bool = False) -> int:
        """One eviction pass (``everything``: as if every TTL had passed; tests)."""
        cfg = self.config
        return self.rooms.evict(
            now,
            0.0 if everything else cfg.finished_room_ttl_seconds,
            0.0 if everything else cfg.tombstone_ttl_seconds,
            0.0 if everything else cfg.orphan_room_timeout_seconds,
            0.0 if everything else max(cfg.unsettled_room_ttl_seconds, cfg.finished_room_ttl_seconds),
            on_evict=lambda side: child_done(side.span, "kvbroker.cleanup", {"kvbroker.settled": side.pages_settled}),
            notice_ttl_seconds=0.0 if everything else cfg.sender_info_timeout_seconds,
        )

    def _refresh_gauges(self) -> None:
        """The snapshot the metric gauges read (scrapes run on another thread)."""
        rooms: dict[tuple[str, str], int] = {}
        sides: list[tuple[str, Iterable[Side]]] = [("sender", self.rooms.all_sources()), ("receiver", self.rooms.all_receivers())]
        for name, records in sides:
            for side in records:
                key = (name, common_pb2.RoomState.Name(side.state))
                rooms[key] = rooms.get(key, 0) + 1
        peers = [p for p in self.peers.peers() if not p.is_self and p.broker_id]
        transport = self.executor.transport()
        self.metrics.snapshot = GaugeSnapshot(
            rooms=rooms,
            staging={"send": self.pools.in_use_bytes("send"), "receive": self.pools.in_use_bytes("receive")},
            sessions=len(self.engines.by_id),
            peers=len(peers),
            throughput={(p.address, transport): p.throughput_bps for p in peers if p.throughput_bps},
        )


def _vram_devices(engine: Engine) -> set[int]:
    """The GPUs holding some of ``engine``'s regions (where transfer buffers serve it)."""
    table = engine.table
    return {device for kind, device in zip(table.region_kind, table.region_device) if kind == common_pb2.MEMORY_KIND_VRAM}


def _settled(side: Side) -> bool:
    """No transfer can still write into this side's pages (a source's are only read)."""
    return isinstance(side, Source) or side.pages_settled


def _unsettled(side: Side) -> bool:
    """A source with parts in flight, or a receiver whose pages may still be written."""
    if isinstance(side, Source):
        return side.inflight > 0
    return not side.pages_settled


def _state(entries: Iterable[common_pb2.StateIndices]) -> dict[str, IndexArray]:
    out: dict[str, IndexArray] = {}
    for entry in entries:
        if entry.component in out:
            raise InvalidArgument(f"state component {entry.component!r} listed twice")
        out[entry.component] = decode_indices(entry.indices, what=f"state {entry.component!r}")
    return out


def _check_version(version: int, call: str) -> None:
    if version != PROTOCOL_VERSION:
        raise FailedPrecondition(f"{call} speaks protocol version {version}; this broker speaks {PROTOCOL_VERSION}")

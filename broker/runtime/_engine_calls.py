"""What engines on this host ask of their broker (``kvbroker.v1.TransferBroker``):
register and unregister, open rooms (ExpectRoom, BeginSend), send chunks,
abort, and ask for their rooms' states (Poll, WatchRooms).

Each room command decodes its request, checks the caller and calls the
sender or receiver state machine in a turn (``execution.Turn``): the
effects it leaves are carried out when the turn ends, before it answers. The engine's session stream
(``_sessions``) carries the same room commands. The GPUs an engine's memory
is on (:func:`table_vram_devices`) are those whose transfer buffers and copy
lanes its registration opens (:func:`open_gpus`, bound to them when the
broker is built); they stay until the broker stops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import structlog

from kvbroker import cudavmm
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.device import Lanes
from kvbroker.broker.execution import Machines, TaskSet, in_turn
from kvbroker.broker.memory import Engine, EngineTable, FdConnection, FdSocketServer, StagingPools
from kvbroker.broker.rooms import (
    Receiver,
    Source,
    cause,
)
from kvbroker.broker.runtime._commands import (
    decode_abort,
    decode_announce_room,
    decode_begin_send,
    decode_expect_room,
    decode_send_chunk,
)
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._room_sides import side_of, sides, wait_settled
from kvbroker.errors import InvalidArgument, NotFound
from kvbroker.plan import DescriptorTable, RoomTimeouts
from kvbroker.v1 import common_pb2, transfer_pb2

__all__ = ["EngineCalls", "open_gpus"]

log = structlog.get_logger(__name__)


class EngineCalls:
    """The engine API of one broker. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        engines: EngineTable,
        fd_server: FdSocketServer,
        open_gpus: Callable[[DescriptorTable], Awaitable[None]],
        tasks: TaskSet,
        operators: Operators,
    ) -> None:
        self._broker_id = machines.broker_id
        self._config = config
        self._engines = engines
        self._fd_server = fd_server
        #: Opens the transfer buffers and copy lanes of the GPUs a registering rank's memory is on.
        self._open_gpus = open_gpus
        self._rooms = machines.rooms
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._hub = machines.hub
        self._tasks = tasks
        self._operators = operators

    # -- an engine arrives and leaves -----------------------------------------------
    async def register_engine(self, request: transfer_pb2.RegisterEngineRequest) -> Engine:
        """Register the engine whose fd connection handed out ``request.session_token``: its buffers' fds."""
        timeouts = RoomTimeouts.from_proto(request.timeouts)
        claimed = self._fd_server.claim(request.session_token, f"pending-{request.session_token[:8]}")
        if claimed is None:
            raise NotFound("unknown or already used session_token: upload the buffers over the fd socket first")
        connection, fds = claimed
        try:
            engine = await self._engines.register(
                rank=request.rank,
                layout_msg=request.layout,
                specs=connection.specs,
                fds=fds,
                session_token=connection.token,
                pid=connection.pid,
                timeouts=timeouts,
                before_publish=self._open_gpus,
            )
        except BaseException:
            connection.engine_id = None
            raise
        connection.engine_id = engine.engine_id
        if connection.closed:
            # The engine died while we registered it.
            self._tasks.spawn(self.unregister_engine(engine.engine_id, lost=True), name=f"lost-{engine.engine_id}")
        return engine

    async def unregister_engine(self, engine_id: str, *, lost: bool = False, reason: str | None = None) -> int:
        """Fail the engine's rooms, wait for its transfers to settle, release it.
        ``reason``: why the broker let it go (else it went away, or unregistered)."""
        engine = self._engines.get(engine_id)
        said = reason or ("went away (its fd connection closed)" if lost else "unregistered")
        why = cause(common_pb2.FAILURE_KIND_ENGINE_LOST, f"engine rank {engine.key} {said}", self._broker_id)
        with self._turn:
            failed = self._sender.engine_gone(engine, why) + self._receiver.engine_gone(engine, why)
        await wait_settled(self._rooms, [engine], self._config.unregister_settle_timeout_seconds)
        if self._engines.by_id.get(engine_id) is not engine:
            return 0
        # The failed records stay until eviction: a transfer info that arrives
        # later for one of them is answered with the failure, not left waiting.
        self._hub.close(engine_id)
        await self._engines.release(engine)
        log.info("engine_unregistered", engine=engine.label, lost=lost, rooms_failed=failed)
        return failed

    def memory_unbacked(self, engine: Engine, why: str) -> None:
        """The host cannot back ``engine``'s memory: unregister it (its rooms fail)."""
        if self._engines.by_id.get(engine.engine_id) is engine:
            self._tasks.spawn(
                self.unregister_engine(engine.engine_id, lost=True, reason=f"was let go: {why}"),
                name=f"unbacked-{engine.engine_id}",
            )

    def fd_connection_closed(self, connection: FdConnection) -> None:
        """The engine's fd connection closed: if it never unregistered, it is gone."""
        engine_id = connection.engine_id
        if engine_id and engine_id in self._engines.by_id:
            log.warning("engine_connection_lost", engine=self._engines.by_id[engine_id].label, pid=connection.pid)
            self._tasks.spawn(self.unregister_engine(engine_id, lost=True), name=f"lost-{engine_id}")

    # -- room commands ---------------------------------------------------------------
    @in_turn
    def expect_room(self, request: transfer_pb2.ExpectRoomRequest) -> Receiver:
        """A decode rank expects a room's KV from a sender group."""
        engine = self._engines.get(request.engine_id)
        self._engines.check_role(engine, common_pb2.ROLE_DECODE, "expect rooms")
        self._operators.refuse_if_draining()
        rank = self._receiver.expect(decode_expect_room(request, engine, verify_checksums=self._config.verify_checksums))
        return rank

    @in_turn
    def announce_room(self, request: transfer_pb2.AnnounceRoomRequest) -> None:
        """A decode rank still wants a room it has not opened: its sources'
        leases are renewed until it opens it (ExpectRoom), aborts it, or goes
        away. Idempotent; nothing once the engine holds the room (or it ended
        here and was evicted)."""
        engine = self._engines.get(request.engine_id)
        self._engines.check_role(engine, common_pb2.ROLE_DECODE, "announce rooms")
        if not request.sender.group:
            raise InvalidArgument("AnnounceRoom needs the sender's engine group")
        if side_of(self._rooms, engine, request.room) is None and not self._rooms.is_tombstoned("receiver", request.room):
            self._receiver.announcements.announce(decode_announce_room(request, engine))

    @in_turn
    def begin_send(self, request: transfer_pb2.BeginSendRequest) -> Source:
        """A prefill rank opens its side of a room."""
        engine = self._engines.get(request.engine_id)
        self._engines.check_role(engine, common_pb2.ROLE_PREFILL, "send rooms")
        self._operators.refuse_if_draining()
        source = self._sender.begin(decode_begin_send(request, engine))
        return source

    @in_turn
    def send_chunk(self, request: transfer_pb2.SendChunkRequest) -> tuple[int, Source]:
        """A prefill rank's next computed pages of a room: (the chunk's index, the source)."""
        engine = self._engines.get(request.engine_id)
        self._engines.check_role(engine, common_pb2.ROLE_PREFILL, "send chunks")
        result = self._sender.chunk(decode_send_chunk(request, engine))
        return result

    def abort(self, request: transfer_pb2.AbortRequest) -> common_pb2.RoomStatus:
        """The engine gives up its side of a room; the peers hear of it. (Its
        status is read once the turn's effects are carried out.)"""
        engine = self._engines.get(request.engine_id)
        command = decode_abort(request, engine)
        with self._turn:
            if engine.role == common_pb2.ROLE_PREFILL:
                self._sender.abort(command)
            else:
                self._receiver.abort(command)
        return self.status(engine, request.room)

    # -- room states -----------------------------------------------------------------
    def poll(self, request: transfer_pb2.PollRequest) -> list[common_pb2.RoomStatus]:
        engine = self._engines.get(request.engine_id)
        return [self.status(engine, room) for room in request.rooms]

    async def watch(self, request: transfer_pb2.WatchRoomsRequest) -> AsyncIterator[common_pb2.RoomStatus]:
        """The current state of each watched room (every open one if none named), then every change."""
        engine = self._engines.get(request.engine_id)
        rooms = frozenset(request.rooms) or None
        sub = self._hub.subscribe(engine.engine_id, rooms)
        try:
            for room in sorted(rooms or self._open_rooms(engine)):
                yield self.status(engine, room)
            while True:
                status = await sub.queue.get()
                if status is None:
                    return
                yield status
        finally:
            self._hub.unsubscribe(engine.engine_id, sub)

    def status(self, engine: Engine, room: int) -> common_pb2.RoomStatus:
        """The status of ``engine``'s side of ``room`` (FAILED UNKNOWN_ROOM if it has none)."""
        side = side_of(self._rooms, engine, room)
        if side is None:
            return common_pb2.RoomStatus(
                room=room,
                state=common_pb2.ROOM_STATE_FAILED,
                cause=cause(
                    common_pb2.FAILURE_KIND_UNKNOWN_ROOM,
                    f"engine {engine.engine_id} has no room {room} here (never opened, or evicted)",
                    self._broker_id,
                ),
            )
        return side.status()

    def _open_rooms(self, engine: Engine) -> list[int]:
        return [s.room for s in sides(self._rooms) if s.engine is engine and not s.terminal]


# -- the GPUs an engine's memory is on -----------------------------------------------
async def open_gpus(pools: StagingPools, lanes: Lanes, cuda_driver: cudavmm.Driver | None, table: DescriptorTable) -> None:
    """Open the transfer buffers and the copy lane of each GPU a rank with this
    descriptor table has memory on, before its registration is published.

    The engine's VRAM moves only through this broker's transfer buffers on its
    GPUs (without them, the engine is refused), copied by each GPU's lane: both
    exist before peers can learn of the engine, and stay until the broker stops
    (``StagingPools.ensure_device``)."""
    for device in sorted(table_vram_devices(table)):
        await pools.ensure_device(device, cuda_driver)
        await lanes.open(device)


def table_vram_devices(table: DescriptorTable) -> set[int]:
    """The GPUs holding some of the regions of a rank with this descriptor table."""
    return {device for kind, device in zip(table.region_kind, table.region_device) if kind == common_pb2.MEMORY_KIND_VRAM}

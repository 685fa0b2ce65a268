"""One broker: its parts, and starting and stopping them.

``servicer -> the call route (engine calls, session streams, peer requests,
operators) -> state machine -> effects -> executor``. :func:`build_broker`
(``_build``) makes every part; a :class:`Broker` holds them, final from then
on, and starts and stops them in order. Each route decodes its request,
checks the caller and calls the sender or receiver state machine in a turn
(``execution.Turn``, of the ``Machines`` bundle every route is handed): the
effects are carried out when the turn ends, before the route answers:

- ``engine_calls``: engines on this host (register, open rooms, send chunks, abort, poll, watch);
- ``sessions``: the engines' session streams, which carry the same room commands;
- ``peer_requests``: other brokers (handshake, room registrations, staging, completion, aborts);
- ``peer_loss``: a peer broker lost (silent, restarted, or gone from etcd);
- ``operators``: drain, abort a room, the counts Admin reads;
- ``housekeeping``: timeouts, eviction and the metric gauges, while nobody calls.

Threads (docs/architecture.md): everything here runs on the control loop
(the asyncio thread that serves gRPC). NIXL runs on the data-plane thread,
staging copies and buffer mappings on the worker threads; the loop awaits
them and never blocks on them.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from kvbroker import __version__
from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Agent, DataPlane, Workers
from kvbroker.broker.device import ArrayViews, Lanes
from kvbroker.broker.execution import Executor, Machines, TaskSet
from kvbroker.broker.memory import EngineTable, FdSocketServer, StagingPools
from kvbroker.broker.peers import FleetRecord, FleetView, PeerClient, PeerMonitor, PeerTable
from kvbroker.broker.rooms import ReceiverCore, RoomTables, SenderCore, WatchHub, cause
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._housekeeping import Housekeeping
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._peer_loss import PeerLoss
from kvbroker.broker.runtime._peer_requests import PeerRequests
from kvbroker.broker.runtime._room_sides import wait_settled
from kvbroker.broker.runtime._sessions import Sessions
from kvbroker.broker.telemetry import BrokerMetrics, Counters
from kvbroker.errors import Unavailable
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, transfer_pb2

__all__ = ["Broker", "Endpoints"]


@dataclass(frozen=True)
class Endpoints:
    """Where a broker is reached: only the server knows, once it has bound its listeners."""

    #: The gRPC address peers (and operators, and TCP engines) reach.
    address: str
    #: The unix socket engines on this host reach the gRPC server on.
    engine_socket_path: str
    #: The unix socket engines upload their buffers' fds on.
    fd_socket_path: str


@dataclass(frozen=True, eq=False, kw_only=True, repr=False)
class Broker:
    """One broker: its tables, state machines, executor, threads and call routes.

    Made by :func:`build_broker`; every attribute is final. Control loop only.
    """

    config: BrokerConfig
    broker_id: str
    agent: Agent
    endpoints: Endpoints
    # -- the tables and the machinery -----------------------------------------------
    counters: Counters
    metrics: BrokerMetrics
    rooms: RoomTables
    tasks: TaskSet
    hub: WatchHub
    workers: Workers
    views: ArrayViews
    lanes: Lanes
    dataplane: DataPlane
    engines: EngineTable
    pools: StagingPools
    peers: PeerTable
    peer_client: PeerClient
    sender: SenderCore
    machines: Machines
    receiver: ReceiverCore
    executor: Executor
    monitor: PeerMonitor
    fd_server: FdSocketServer
    #: The fleet in etcd (``serve --etcd``; None without): this broker's
    #: record, and its view of every broker's.
    fleet_record: FleetRecord | None
    fleet_view: FleetView | None
    # -- the call routes -------------------------------------------------------------
    operators: Operators
    engine_calls: EngineCalls
    sessions: Sessions
    peer_requests: PeerRequests
    peer_loss: PeerLoss
    housekeeping: Housekeeping
    started_at: float = field(default_factory=time.monotonic)
    _running: list[asyncio.Task[None]] = field(default_factory=list, init=False, repr=False)

    @property
    def address(self) -> str:
        """Where peers reach this broker."""
        return self.endpoints.address

    def broker_info(self) -> transfer_pb2.BrokerInfo:
        return transfer_pb2.BrokerInfo(
            broker_id=self.broker_id,
            protocol_version=PROTOCOL_VERSION,
            version=__version__,
            fd_socket_path=self.fd_server.path,
            engine_socket_path=self.endpoints.engine_socket_path,
            listen_address=self.address,
            nixl_agent_name=self.agent.name,
        )

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Open the fd socket; start the data plane, staging, housekeeping, the peer monitor; join the fleet."""
        self.fd_server.start()
        self.dataplane.start()
        await self.pools.start()
        self.housekeeping.start()
        self._running.append(asyncio.get_running_loop().create_task(self.monitor.run(), name="peer-monitor"))
        if self.fleet_record is not None:
            await self.fleet_record.start()
        if self.fleet_view is not None:
            await self.fleet_view.start()

    async def stop(self) -> None:
        """Leave the fleet, fail open rooms, let in-flight transfers settle, release everything in reverse order."""
        # Out of the fleet first: peers stop choosing this broker.
        if self.fleet_record is not None:
            await self.fleet_record.stop()
        if self.fleet_view is not None:
            await self.fleet_view.stop()
        why = cause(common_pb2.FAILURE_KIND_SHUTDOWN, "the broker is shutting down", self.broker_id)
        for engine in self.engines.by_id.values():
            if engine.session is not None:
                # An error, not a clean end: the engine's session reconnects
                # and registers again with the next process at this address.
                engine.session.end(Unavailable("the broker is shutting down"))
        with self.machines.turn:
            for source in list(self.rooms.all_sources()):
                self.sender.fail(source, why)
            for rank in list(self.rooms.all_receivers()):
                self.receiver.fail(rank, why)
        await wait_settled(self.rooms, list(self.engines.by_id.values()), self.config.unregister_settle_timeout_seconds)
        await self.tasks.finish(timeout_seconds=2.0)
        await self.housekeeping.stop()
        await cancel_and_wait(self._running)
        for engine in list(self.engines.by_id.values()):
            self.hub.close(engine.engine_id)
            await self.engine_calls.release_engine(engine)
        await self.pools.close()
        for peer in self.peers.peers():
            self.peers.drop(peer)
        await self.peer_client.close()
        await self.dataplane.stop()
        self.agent.close()
        await asyncio.get_running_loop().run_in_executor(None, self.workers.shutdown)
        self.lanes.close()
        self.fd_server.close()

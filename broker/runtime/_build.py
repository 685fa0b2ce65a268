"""Building a broker: every part, made once, in one place.

:func:`build_broker` makes a :class:`Broker` from its configuration, its
NIXL agent and what only the server knows (where it listens, and what to do
when draining starts or stops), and hands it its parts in frozen bundles
(``Machines``, ``Transport``, ``Copying``, ``Telemetry``, ``Routes``,
``Services``). Nothing is set on a broker afterwards.

A few parts call back into parts made after them (the data plane reports
events to the executor, the peer table and the fleet view report lost peers,
the fd socket reports closed connections): those callbacks are closures over
the later part, which exists by the time anything calls them (nothing runs
before :meth:`Broker.start`). Bundling does not remove them: each is a real
cycle (the executor needs the data plane that reports to it, the peer loss
route the peer table that reports to it, the engine calls the fd socket that
reports to them, the fleet record the operators whose draining it reports).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable

from kvbroker import cudavmm
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Agent, DataPlane, Event, Workers
from kvbroker.broker.device import ArrayViews, Lanes, Streams
from kvbroker.broker.execution import (
    Copying,
    Executor,
    Machines,
    TaskSet,
    Telemetry,
    Transport,
    Turn,
)
from kvbroker.broker.memory import (
    CreditLedger,
    EngineTable,
    FdConnection,
    FdSocketServer,
    StagingPools,
)
from kvbroker.broker.peers import (
    FleetRecord,
    FleetView,
    Member,
    Peer,
    PeerClient,
    PeerMonitor,
    PeerTable,
    groups_of,
)
from kvbroker.broker.rooms import ReceiverCore, RoomTables, SenderCore, WatchHub
from kvbroker.broker.runtime._broker import Broker, Endpoints
from kvbroker.broker.runtime._bundles import Routes, Services
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._housekeeping import Housekeeping
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._peer_loss import PeerLoss
from kvbroker.broker.runtime._peer_requests import PeerRequests, handshake_message
from kvbroker.broker.runtime._sessions import Sessions
from kvbroker.broker.telemetry import BrokerMetrics, Counters
from kvbroker.broker.tls import channel_credentials

__all__ = ["build_broker"]


def build_broker(
    config: BrokerConfig,
    agent: Agent,
    *,
    endpoints: Endpoints,
    broker_id: str | None = None,
    on_draining: Callable[[bool], Awaitable[None]] | None = None,
    cuda_driver: cudavmm.Driver | None = None,
    device_as_host: bool = False,
    device_streams: Streams | None = None,
) -> Broker:
    """A broker, not started (:meth:`Broker.start`).

    ``endpoints``: where it listens (the server binds first). ``on_draining``:
    awaited with the draining flag whenever an operator sets it (the server's
    health service follows). ``cuda_driver``: the CUDA driver VRAM imports
    use (None: libcuda.so.1, loaded on first use); ``device_as_host``: view
    "VRAM" as host memory (tests with the fake CUDA driver); ``device_streams``:
    how the GPU lanes launch and wait (None: CUDA's; tests and benchmarks pass
    a modelled GPU's, ``kvbroker.testing.gpu_model``).
    """
    broker_id = broker_id or uuid.uuid4().hex
    counters = Counters()
    metrics = BrokerMetrics()
    metrics.queues = counters.queues
    rooms = RoomTables()
    tasks = TaskSet()
    hub = WatchHub()
    workers = Workers(queues=counters.queues)
    views = ArrayViews(device_as_host=device_as_host)

    def on_events(events: list[Event]) -> None:
        executor.on_events(events)

    def peer_lost(peer: Peer, what: str, silent: bool = False) -> None:
        peer_loss.peer_lost(peer, what, silent)

    def broker_left(member: Member) -> None:
        peer_loss.broker_left(member)

    def fd_connection_closed(connection: FdConnection) -> None:
        engine_calls.fd_connection_closed(connection)

    dataplane = DataPlane(
        agent, on_events=on_events, transfer_timeout_seconds=config.transfer_timeout_seconds, queues=counters.queues
    )
    lanes = Lanes(workers, views, dataplane, device_streams)
    engines = EngineTable(dataplane, workers, cuda_driver)
    pools = StagingPools(
        send_bytes=config.staging_send_bytes,
        receive_bytes=config.staging_receive_bytes,
        dataplane=dataplane,
        workers=workers,
        device_send_bytes=config.device_send_bytes,
        device_receive_bytes=config.device_receive_bytes,
        queues=counters.queues,
        bulk_keep=config.device_part_bytes if config.priorities else 0,
    )
    peers = PeerTable(
        broker_id=broker_id, agent_name=agent.name, address=endpoints.address, dataplane=dataplane, on_restart=peer_lost
    )
    peer_client = PeerClient(
        peers=peers,
        config=config,
        handshake_message=functools.partial(handshake_message, engines, dataplane, pools),
        epoch=lambda: engines.epoch,
        credentials=channel_credentials(config) if config.tls else None,
    )
    sender = SenderCore(
        broker_id=broker_id,
        rooms=rooms,
        counters=counters,
        peers=peers,
        send_staging_bytes=pools.send_bytes,
        part_bytes=config.device_part_bytes,
        host_part_bytes=config.part_bytes,
    )
    ledger = CreditLedger()
    receiver = ReceiverCore(
        broker_id=broker_id,
        rooms=rooms,
        counters=counters,
        credits=ledger,
        on_bytes=functools.partial(metrics.count_bytes, "received"),
    )
    fleet_record: FleetRecord | None = None
    fleet_view: FleetView | None = None
    if config.etcd_url:
        fleet_record = FleetRecord(
            config.etcd_url,
            config.etcd_prefix,
            config.etcd_ttl_seconds,
            broker_id=broker_id,
            address=endpoints.address,
            groups=lambda: groups_of(engines),
            draining=lambda: operators.draining,
        )
        engines.on_change.append(fleet_record.changed)
        fleet_view = FleetView(config.etcd_url, config.etcd_prefix, self_id=broker_id, on_left=broker_left)
    turn = Turn()
    machines = Machines(broker_id=broker_id, rooms=rooms, sender=sender, receiver=receiver, hub=hub, turn=turn)
    transport = Transport(dataplane=dataplane, peers=peers, client=peer_client, pools=pools)
    telemetry = Telemetry(counters=counters, metrics=metrics)
    copying = Copying(workers=workers, views=views, lanes=lanes)
    executor = Executor(
        config=config,
        machines=machines,
        transport=transport,
        copying=copying,
        telemetry=telemetry,
        tasks=tasks,
        ledger=ledger,
        fleet=fleet_view,
    )
    operators = Operators(machines=machines, fleet_record=fleet_record, fleet_view=fleet_view, on_draining=on_draining)
    fd_server = FdSocketServer(endpoints.fd_socket_path, on_close=fd_connection_closed)
    engine_calls = EngineCalls(
        config=config,
        machines=machines,
        engines=engines,
        fd_server=fd_server,
        pools=pools,
        lanes=lanes,
        tasks=tasks,
        operators=operators,
    )
    engines.on_unbacked.append(engine_calls.memory_unbacked)
    peer_loss = PeerLoss(machines=machines, transport=transport, credits=executor.credits)
    monitor = PeerMonitor(
        peers,
        peer_client,
        interval_seconds=config.peer_heartbeat_seconds,
        dead_after_seconds=config.peer_dead_after_seconds,
        has_business=peer_loss.has_business,
        on_lost=peer_loss.peer_lost,
        on_back=peer_loss.peer_back,
    )
    routes = Routes(
        engine_calls=engine_calls,
        sessions=Sessions(machines=machines, engines=engines, engine_calls=engine_calls),
        peer_requests=PeerRequests(
            config=config,
            machines=machines,
            engines=engines,
            transport=transport,
            credits=executor.credits,
            operators=operators,
        ),
        peer_loss=peer_loss,
        operators=operators,
        housekeeping=Housekeeping(config=config, machines=machines, engines=engines, transport=transport, metrics=metrics),
        probes=executor.probes,
    )
    services = Services(
        agent=agent,
        engines=engines,
        tasks=tasks,
        executor=executor,
        monitor=monitor,
        fd_server=fd_server,
        fleet_record=fleet_record,
        fleet_view=fleet_view,
    )
    return Broker(
        config=config,
        endpoints=endpoints,
        machines=machines,
        transport=transport,
        copying=copying,
        telemetry=telemetry,
        routes=routes,
        services=services,
    )

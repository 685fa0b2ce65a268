"""Building a broker: every part, made once, in one place.

:func:`build_broker` makes a :class:`Broker` from its configuration, its
NIXL agent and what only the server knows (where it listens, and what to do
when draining starts or stops), and hands it its parts in frozen bundles
(``Machines``, ``Transport``, ``Copying``, ``Telemetry``, ``Routes``,
``Services``). Every part is made here and handed what it uses: no part
makes a collaborator that another part then takes out of it, and no
constructor fills in one left out (where None stands for CUDA's own driver
or streams, the caller says so). Nothing is set on a broker afterwards.

In order: the queue statistics, counters and metrics; the data plane, copy
lanes, engine table, transfer buffers, peer table and peer client; the room
state machines (the receiver's credit ledger is the one ``Credits`` keeps)
and the bundles; receive credits and the transport probes; the peer loss
route, the fleet in etcd (with ``--etcd``) and the peer monitor; what
carries out each kind of effect (``execution.Handlers``: parts in flight,
landed parts, the device copies, calls to peers, registrations) and the
executor they are handed to; then the operators, the fd socket, the engine
calls and the other routes.

Five callbacks close a cycle: the part that calls one is needed to make the
part it calls, so it is handed a :class:`~kvbroker.broker.runtime.Late`
(``_late``), set once the called part exists; :meth:`Broker.start` refuses
to start while one is not set (nothing runs before it):

- ``on_events``: the data plane reports settled transfers and notifications
  to the executor, whose handlers post to the data plane;
- ``take_notice``: the data plane hands each notification it reads to the
  receiving parts first (a packed part's is taken off the loop), which
  post to the data plane;
- ``peer_restarted``: the peer table reports a peer that came back as
  another process to the peer loss route, which drops peers from the table;
- ``fd_closed``: the fd socket reports an engine's closed connection to the
  engine calls, which claim the fds uploaded on it;
- ``draining``: the fleet record reads the operators' draining flag, and the
  operators tell the fleet record when they change it.

The fleet view's departures need no late callback: the peer loss route is
made before it. Two observer lists are appended to once their listener
exists (the engine table's ``on_change`` and ``on_unbacked``).
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Awaitable, Callable

from kvbroker import cudavmm
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Agent, DataPlane, Workers
from kvbroker.broker.device import ArrayViews, Lanes, Streams
from kvbroker.broker.execution import (
    CallsToPeers,
    Copying,
    Credits,
    DeviceCopies,
    Executor,
    Handlers,
    Machines,
    PartsInFlight,
    ReceivingParts,
    Registrations,
    TaskSet,
    Telemetry,
    Transport,
    TransportProbes,
    Turn,
)
from kvbroker.broker.memory import CreditLedger, EngineTable, FdSocketServer, StagingPools
from kvbroker.broker.peers import (
    FleetRecord,
    FleetView,
    PeerClient,
    PeerMonitor,
    PeerTable,
    groups_of,
)
from kvbroker.broker.rooms import ReceiverCore, RoomTables, SenderCore, WatchHub
from kvbroker.broker.runtime._broker import Broker, Endpoints
from kvbroker.broker.runtime._bundles import Routes, Services
from kvbroker.broker.runtime._engine_calls import EngineCalls, open_gpus
from kvbroker.broker.runtime._housekeeping import Housekeeping
from kvbroker.broker.runtime._late import Late, LateCalls
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._peer_loss import PeerLoss
from kvbroker.broker.runtime._peer_requests import PeerRequests, handshake_message
from kvbroker.broker.runtime._sessions import Sessions
from kvbroker.broker.telemetry import BrokerMetrics, Counters, QueueStats
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
    queues = QueueStats()
    counters = Counters(queues=queues)
    metrics = BrokerMetrics(queues)
    tasks = TaskSet()
    workers = Workers(queues=queues)
    views = ArrayViews(device_as_host=device_as_host)
    late = LateCalls(
        on_events=Late("Executor.on_events"),
        take_notice=Late("ReceivingParts.take"),
        peer_restarted=Late("PeerLoss.peer_lost"),
        fd_closed=Late("EngineCalls.fd_connection_closed"),
        draining=Late("Operators.draining"),
    )

    # The data path, and the peers: nothing here needs a part made below but
    # through the late callbacks (the data plane's events, a restarted peer).
    dataplane = DataPlane(
        agent,
        on_events=late.on_events,
        take_notice=late.take_notice,
        transfer_timeout_seconds=config.transfer_timeout_seconds,
        queues=queues,
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
        queues=queues,
        bulk_keep=config.device_part_bytes if config.priorities else 0,
    )
    peers = PeerTable(
        broker_id=broker_id, agent_name=agent.name, address=endpoints.address, dataplane=dataplane, on_restart=late.peer_restarted
    )
    peer_client = PeerClient(
        peers=peers,
        config=config,
        handshake_message=functools.partial(handshake_message, engines, dataplane, pools),
        epoch=lambda: engines.epoch,
        credentials=channel_credentials(config) if config.tls else None,
    )

    # The room state machines; the receiver's credit ledger is the one ``Credits`` keeps.
    rooms = RoomTables()
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
    machines = Machines(broker_id=broker_id, rooms=rooms, sender=sender, receiver=receiver, hub=WatchHub(), turn=Turn())
    transport = Transport(dataplane=dataplane, peers=peers, client=peer_client, pools=pools)
    telemetry = Telemetry(counters=counters, metrics=metrics)
    copying = Copying(workers=workers, views=views, lanes=lanes)
    credits = Credits(broker_id=broker_id, config=config, transport=transport, tasks=tasks, ledger=ledger)
    probes = TransportProbes(broker_id=broker_id, config=config, transport=transport, tasks=tasks, metrics=metrics)

    # A lost peer: the peer table's restarts (late), the fleet's departures, the monitor's silences.
    peer_loss = PeerLoss(machines=machines, transport=transport, credits=credits)
    late.peer_restarted.set(peer_loss.peer_lost)
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
            draining=late.draining,
        )
        engines.on_change.append(fleet_record.changed)
        fleet_view = FleetView(config.etcd_url, config.etcd_prefix, self_id=broker_id, on_left=peer_loss.broker_left)
    monitor = PeerMonitor(
        peers,
        peer_client,
        interval_seconds=config.peer_heartbeat_seconds,
        dead_after_seconds=config.peer_dead_after_seconds,
        has_business=peer_loss.has_business,
        on_lost=peer_loss.peer_lost,
        on_back=peer_loss.peer_back,
    )

    # The executor, handed what carries out each effect (the data plane's events to it: late).
    handlers = _handlers(config, machines, transport, copying, telemetry, tasks, credits, probes, fleet_view)
    executor = Executor(machines=machines, transport=transport, telemetry=telemetry, tasks=tasks, handlers=handlers)
    late.on_events.set(executor.on_events)
    late.take_notice.set(handlers.receiving.take)

    # The routes (the fd socket's closed connections to the engine calls, the draining flag to the fleet: late).
    operators = Operators(machines=machines, fleet_record=fleet_record, fleet_view=fleet_view, on_draining=on_draining)
    late.draining.set(lambda: operators.draining)
    fd_server = FdSocketServer(endpoints.fd_socket_path, on_close=late.fd_closed)
    engine_calls = EngineCalls(
        config=config,
        machines=machines,
        engines=engines,
        fd_server=fd_server,
        open_gpus=functools.partial(open_gpus, pools, lanes, cuda_driver),
        tasks=tasks,
        operators=operators,
    )
    late.fd_closed.set(engine_calls.fd_connection_closed)
    engines.on_unbacked.append(engine_calls.memory_unbacked)
    routes = Routes(
        engine_calls=engine_calls,
        sessions=Sessions(machines=machines, engines=engines, engine_calls=engine_calls),
        peer_requests=PeerRequests(
            config=config, machines=machines, engines=engines, transport=transport, credits=credits, operators=operators
        ),
        peer_loss=peer_loss,
        operators=operators,
        housekeeping=Housekeeping(config=config, machines=machines, engines=engines, transport=transport, metrics=metrics),
        probes=probes,
    )
    services = Services(
        agent=agent,
        engines=engines,
        tasks=tasks,
        executor=executor,
        credits=credits,
        monitor=monitor,
        fd_server=fd_server,
        fleet_record=fleet_record,
        fleet_view=fleet_view,
        late=late,
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


def _handlers(
    config: BrokerConfig,
    machines: Machines,
    transport: Transport,
    copying: Copying,
    telemetry: Telemetry,
    tasks: TaskSet,
    credits: Credits,
    probes: TransportProbes,
    fleet_view: FleetView | None,
) -> Handlers:
    """What carries out each effect the executor hands on (the data plane's
    thread hands the notices it reads to the receiving parts first: late)."""
    copies = DeviceCopies(
        pools=transport.pools, views=copying.views, lanes=copying.lanes, workers=copying.workers, priorities=config.priorities
    )
    parts = PartsInFlight(
        config=config,
        machines=machines,
        transport=transport,
        credits=credits,
        probes=probes,
        copies=copies,
        tasks=tasks,
        telemetry=telemetry,
    )
    receiving = ReceivingParts(machines=machines, transport=transport, copies=copies, credits=credits, counters=telemetry.counters)
    calls = CallsToPeers(
        broker_id=machines.broker_id,
        client=transport.client,
        peers=transport.peers,
        receiver=machines.receiver,
        turn=machines.turn,
        fleet=fleet_view,
    )
    registrations = Registrations(
        peers=transport.peers,
        client=transport.client,
        receiver=machines.receiver,
        dataplane=transport.dataplane,
        tasks=tasks,
        turn=machines.turn,
    )
    return Handlers(
        parts=parts, receiving=receiving, copies=copies, credits=credits, calls=calls, registrations=registrations
    )

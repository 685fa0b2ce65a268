"""One broker: its call routes, its queries, and starting and stopping its parts.

``servicer -> the call route (engine calls, session streams, peer requests,
operators) -> state machine -> effects -> executor``. :func:`build_broker`
(``_build``) makes every part and hands a :class:`Broker` a few frozen
bundles (``Machines``, ``Transport``, ``Copying``, ``Telemetry``, and
``Routes`` and ``Services`` of ``_bundles``), private and final from then
on; it starts and stops them in order. Its public surface: who it is
(``broker_id``, ``address``, ``config``, ``endpoints``, ``broker_info()``),
``start()``/``stop()``, ``routes`` (each servicer gets its route),
``queries`` (read-only: Admin, metrics, tests) and ``internals`` (every
part, for tests that inject faults; broker code never reads it).

Each route decodes its request, checks the caller and calls the sender or
receiver state machine in a turn (``execution.Turn``, of the ``Machines``
bundle every route is handed): the effects are carried out when the turn
ends, before the route answers:

- ``engine_calls``: engines on this host (register, open rooms, send chunks, abort, poll, watch);
- ``sessions``: the engines' session streams, which carry the same room commands;
- ``peer_requests``: other brokers (handshake, room registrations, staging, completion, aborts);
- ``peer_loss``: a peer broker lost (silent, restarted, or gone from etcd);
- ``operators``: drain, abort a room, the fleet's status;
- ``probes``: the transport self-test operators ask for;
- ``housekeeping``: timeouts, eviction and the metric gauges, while nobody calls.

Threads (docs/architecture.md): everything here runs on the control loop
(the asyncio thread that serves gRPC). NIXL runs on the data-plane thread,
device copies on their lanes (GPU streams, the copy thread), buffer mappings
on the worker threads; the loop awaits them and never blocks on them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvbroker import __version__
from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.execution import Copying, Machines, Telemetry, Transport
from kvbroker.broker.rooms import cause
from kvbroker.broker.runtime._bundles import Internals, Routes, Services
from kvbroker.broker.runtime._queries import Queries
from kvbroker.broker.runtime._room_sides import wait_settled
from kvbroker.errors import Internal, Unavailable
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


class Broker:
    """One broker: its call routes, the read-only queries about it, and
    starting and stopping its parts in order.

    Made by :func:`build_broker` from a few frozen bundles, kept private and
    final. The server hands each servicer its route (:attr:`routes`); Admin
    and metrics read through :attr:`queries`; tests that inject faults reach
    every part through :attr:`internals` (broker code never does). Control
    loop only.
    """

    __slots__ = ("_config", "_endpoints", "_machines", "_transport", "_copying", "_routes", "_services", "_queries", "_internals", "_running")

    def __init__(
        self,
        *,
        config: BrokerConfig,
        endpoints: Endpoints,
        machines: Machines,
        transport: Transport,
        copying: Copying,
        telemetry: Telemetry,
        routes: Routes,
        services: Services,
    ) -> None:
        self._config = config
        self._endpoints = endpoints
        self._machines = machines
        self._transport = transport
        self._copying = copying
        self._routes = routes
        self._services = services
        self._queries = Queries(
            config=config,
            machines=machines,
            transport=transport,
            copying=copying,
            telemetry=telemetry,
            services=services,
            operators=routes.operators,
        )
        self._internals = Internals(
            machines=machines, transport=transport, copying=copying, telemetry=telemetry, routes=routes, services=services
        )
        self._running: list[asyncio.Task[None]] = []

    @property
    def broker_id(self) -> str:
        return self._machines.broker_id

    @property
    def config(self) -> BrokerConfig:
        return self._config

    @property
    def endpoints(self) -> Endpoints:
        return self._endpoints

    @property
    def address(self) -> str:
        """Where peers reach this broker."""
        return self._endpoints.address

    @property
    def routes(self) -> Routes:
        """The call routes the servicers hand calls to."""
        return self._routes

    @property
    def queries(self) -> Queries:
        """Read-only questions about this broker (Admin, metrics, tests)."""
        return self._queries

    @property
    def internals(self) -> Internals:
        """Every part, for tests that inject faults or drive a part directly.

        The one deliberate seam into a broker's parts: nothing under broker/,
        client/, adapters/ or demo/ reads it (tests/test_code_quality.py);
        a test that only reads uses :attr:`queries`.
        """
        return self._internals

    def broker_info(self) -> transfer_pb2.BrokerInfo:
        return transfer_pb2.BrokerInfo(
            broker_id=self.broker_id,
            protocol_version=PROTOCOL_VERSION,
            version=__version__,
            fd_socket_path=self._services.fd_server.path,
            engine_socket_path=self._endpoints.engine_socket_path,
            listen_address=self.address,
            nixl_agent_name=self._services.agent.name,
        )

    # -- lifecycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Open the fd socket; start the data plane, staging, housekeeping, the peer monitor; join the fleet.
        Refused (:class:`~kvbroker.errors.Internal`) while a late callback is not set: a wiring mistake."""
        svc = self._services
        unset = svc.late.unset()
        if unset:
            raise Internal(f"the broker is not wired whole: late callbacks not set: {', '.join(unset)}")
        svc.fd_server.start()
        self._transport.dataplane.start()
        await self._transport.pools.start()
        self._routes.housekeeping.start()
        self._running.append(asyncio.get_running_loop().create_task(svc.monitor.run(), name="peer-monitor"))
        if svc.fleet_record is not None:
            await svc.fleet_record.start()
        if svc.fleet_view is not None:
            await svc.fleet_view.start()

    async def stop(self) -> None:
        """Leave the fleet, fail open rooms, let in-flight transfers settle, release everything in reverse order."""
        svc, m, t = self._services, self._machines, self._transport
        # Out of the fleet first: peers stop choosing this broker.
        if svc.fleet_record is not None:
            await svc.fleet_record.stop()
        if svc.fleet_view is not None:
            await svc.fleet_view.stop()
        why = cause(common_pb2.FAILURE_KIND_SHUTDOWN, "the broker is shutting down", self.broker_id)
        for engine in svc.engines.by_id.values():
            if engine.session is not None:
                # An error, not a clean end: the engine's session reconnects
                # and registers again with the next process at this address.
                engine.session.end(Unavailable("the broker is shutting down"))
        with m.turn:
            for source in list(m.rooms.all_sources()):
                m.sender.fail(source, why)
            for rank in list(m.rooms.all_receivers()):
                m.receiver.fail(rank, why)
        await wait_settled(m.rooms, list(svc.engines.by_id.values()), self._config.unregister_settle_timeout_seconds)
        await svc.tasks.finish(timeout_seconds=2.0)
        await self._routes.housekeeping.stop()
        await cancel_and_wait(self._running)
        for engine in list(svc.engines.by_id.values()):
            m.hub.close(engine.engine_id)
            await svc.engines.release(engine)
        await t.pools.close()
        for peer in t.peers.peers():
            t.peers.drop(peer)
        await t.client.close()
        await t.dataplane.stop()
        svc.agent.close()
        await asyncio.get_running_loop().run_in_executor(None, self._copying.workers.shutdown)
        self._copying.lanes.close()
        svc.fd_server.close()

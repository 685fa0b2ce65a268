"""Server wiring: one gRPC server with every service, its listeners, and the broker built for them.

The same gRPC server listens on TCP (peers, operators, engines that prefer
TCP) and on the engine unix socket. It exposes ``kvbroker.v1.TransferBroker``,
``kvbroker.v1.PeerBroker``, ``kvbroker.v1.Admin``, the standard
``grpc.health.v1.Health`` and server reflection, so ``grpcurl -plaintext
HOST:PORT list`` works with no proto files. The server binds its listeners
first, then builds the broker (``runtime.build_broker``) with the addresses
they got, and starts it.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

from kvbroker import cudavmm
from kvbroker.broker.aio import cancel_and_wait
from kvbroker.broker.api._admin import Admin
from kvbroker.broker.api._peer_calls import PeerAnswers
from kvbroker.broker.api._servicers import AdminService, PeerService, TransferService
from kvbroker.broker.config import BrokerConfig, default_socket_dir
from kvbroker.broker.dataplane import Agent, AgentConfig, UcxAgent
from kvbroker.broker.device import Streams
from kvbroker.broker.peers import handlers_of, server_options
from kvbroker.broker.runtime import Broker, Endpoints, build_broker
from kvbroker.broker.tls import server_credentials
from kvbroker.errors import InvalidArgument, Unavailable
from kvbroker.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    peer_pb2,
    peer_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

__all__ = ["BrokerServer"]

log = structlog.get_logger(__name__)

#: TransferBroker calls that make no RPC span (hot paths, and the Session
#: stream, which lives as long as its engine: each command it carries joins
#: the engine's trace or starts its own; see BrokerServer.start).
_UNTRACED = ("SendChunk", "Poll", "Session")

SERVICE_NAMES = (
    transfer_pb2.DESCRIPTOR.services_by_name["TransferBroker"].full_name,
    peer_pb2.DESCRIPTOR.services_by_name["PeerBroker"].full_name,
    admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name,
)


#: The gRPC health service name that says whether the broker is in etcd (Stats.etcd).
ETCD_HEALTH = "kvbroker.etcd"


class BrokerServer:
    """A running broker: ``await start()``, then ``await stop()``.

    ``agent`` defaults to the real UCX agent; tests pass a fake, the fake
    CUDA driver as ``cuda_driver`` with ``device_as_host``, and a modelled
    GPU's ``device_streams`` (see :func:`~kvbroker.broker.runtime.build_broker`).
    The broker is built in :meth:`start`, once the listeners are bound (its
    address is known then).
    """

    def __init__(
        self,
        config: BrokerConfig,
        agent: Agent | None = None,
        *,
        cuda_driver: cudavmm.Driver | None = None,
        device_as_host: bool = False,
        device_streams: Streams | None = None,
    ) -> None:
        self.config = config
        self._broker_id = uuid.uuid4().hex
        if agent is None:
            agent = UcxAgent(
                AgentConfig(name=f"{config.agent_name_prefix}-{self._broker_id[:12]}", ucx_error_mode=config.ucx_error_mode)
            )
        self._agent = agent
        self._cuda_driver = cuda_driver
        self._device_as_host = device_as_host
        self._device_streams = device_streams
        self._broker: Broker | None = None
        self._server: grpc.aio.Server | None = None
        self._health: health_aio.HealthServicer | None = None
        self._peer_service: PeerService | None = None
        self._engine_socket = ""
        self.port = 0
        self._etcd_health: asyncio.Task[None] | None = None

    @property
    def broker(self) -> Broker:
        """The broker this server serves (built by :meth:`start`)."""
        if self._broker is None:
            raise RuntimeError("the broker server is not started")
        return self._broker

    @property
    def address(self) -> str:
        return self.broker.address

    async def start(self) -> None:
        cfg = self.config
        # The gRPC instrumentation makes the RPC spans and carries trace
        # context in (from engines and peers) and out (to peers). The calls an
        # engine makes per chunk and per poll make none: the room span's
        # transfer children cover them, and a span per call costs the control
        # loop about a tenth of a millisecond each.
        untraced = filters.any_of(
            # Full method names start with "/" (without it nothing matched,
            # and every call made a span).
            *(filters.full_method_name(f"/{SERVICE_NAMES[0]}/{m}") for m in _UNTRACED),
            # A batch of room registrations: each carries its room's trace.
            filters.full_method_name(f"/{SERVICE_NAMES[1]}/RegisterRooms"),
            # The peer stream lives as long as the pair of brokers: each of
            # its calls carries the trace context it was made in.
            filters.full_method_name(f"/{SERVICE_NAMES[1]}/Stream"),
        )
        server = grpc.aio.server(
            options=server_options(cfg), interceptors=[aio_server_interceptor(filter_=filters.negate(untraced))]
        )
        if cfg.tls:
            self.port = server.add_secure_port(cfg.listen_address, server_credentials(cfg))
        elif cfg.tls_cert_file or cfg.tls_key_file or cfg.tls_ca_file:
            raise InvalidArgument("mutual TLS needs all of the certificate, key and CA files")
        else:
            self.port = server.add_insecure_port(cfg.listen_address)
        if not self.port:
            raise Unavailable(f"cannot listen on {cfg.listen_address}")
        host = cfg.listen_address.rsplit(":", 1)[0]
        if cfg.advertise_address:
            address = cfg.advertise_address
        elif host in ("0.0.0.0", "[::]", ""):
            address = f"{socket.getfqdn()}:{self.port}"
        else:
            address = f"{host}:{self.port}"
        socket_dir = default_socket_dir()
        engine_socket = cfg.engine_socket_path or os.path.join(socket_dir, f"kvbroker-{self.port}.sock")
        if os.path.exists(engine_socket):
            os.unlink(engine_socket)
        old_umask = os.umask(0o117)
        try:
            if not server.add_insecure_port(f"unix:{engine_socket}"):
                raise Unavailable(f"cannot listen on unix:{engine_socket}")
        finally:
            os.umask(old_umask)
        self._engine_socket = engine_socket
        fd_path = cfg.fd_socket_path or f"{engine_socket.removesuffix('.sock')}.fds"
        broker = self._broker = build_broker(
            cfg,
            self._agent,
            broker_id=self._broker_id,
            endpoints=Endpoints(address=address, engine_socket_path=engine_socket, fd_socket_path=fd_path),
            on_draining=self._drain_health,
            cuda_driver=self._cuda_driver,
            device_as_host=self._device_as_host,
            device_streams=self._device_streams,
        )
        routes, queries = broker.routes, broker.queries
        transfer_pb2_grpc.add_TransferBrokerServicer_to_server(
            TransferService(routes.engine_calls, routes.sessions, broker.broker_info), server
        )
        answers = PeerAnswers(handlers_of(routes.peer_requests), queries.counters)
        self._peer_service = PeerService(answers, broker.broker_id, queries.counters)
        peer_pb2_grpc.add_PeerBrokerServicer_to_server(self._peer_service, server)
        admin_pb2_grpc.add_AdminServicer_to_server(AdminService(Admin(queries, routes.operators, routes.probes, routes.peer_loss)), server)
        self._health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection((*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        await server.start()
        os.chmod(engine_socket, 0o660)
        await broker.start()
        for name in ("", *SERVICE_NAMES):
            await self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._server = server
        if cfg.etcd_url:
            self._etcd_health = asyncio.create_task(self._follow_etcd(), name="kvbroker-etcd-health")
        log.info(
            "broker_started",
            broker=broker.broker_id,
            address=address,
            engine_socket=engine_socket,
            fd_socket=fd_path,
            agent=broker.broker_info().nixl_agent_name,
        )

    async def _follow_etcd(self) -> None:
        """The health service "kvbroker.etcd" follows Stats.etcd (SERVING when "ok")."""
        assert self._health is not None
        said = None
        while True:
            status = self.broker.queries.etcd_status()
            if status != said:
                serving = health_pb2.HealthCheckResponse.SERVING if status == "ok" else health_pb2.HealthCheckResponse.NOT_SERVING
                await self._health.set(ETCD_HEALTH, serving)
                said = status
            await asyncio.sleep(0.2)

    async def _drain_health(self, draining: bool) -> None:
        """While draining, the engine service reports NOT_SERVING (no new rooms)."""
        assert self._health is not None
        status = health_pb2.HealthCheckResponse.NOT_SERVING if draining else health_pb2.HealthCheckResponse.SERVING
        await self._health.set(SERVICE_NAMES[0], status)

    async def stop(self, grace_seconds: float = 2.0) -> None:
        """Stop serving, fail open rooms, release every resource."""
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._etcd_health is not None:
            await cancel_and_wait([self._etcd_health])
        if self._broker is not None:
            # It leaves the fleet first (peers stop choosing it), and closes the fd socket last.
            await self._broker.stop()
        if self._peer_service is not None:
            self._peer_service.end_streams()  # before the server cancels them
        if self._server is not None:
            await self._server.stop(grace_seconds)
            self._server = None
        if self._engine_socket and os.path.exists(self._engine_socket):
            os.unlink(self._engine_socket)
        log.info("broker_stopped", broker=self._broker_id)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()

"""Peer brokers: handshakes, remote engines and their prepared descriptor lists.

A peer is another broker (or this one: when both ends of a room sit on one
host, the broker is its own peer and NIXL writes loopback). The handshake
exchanges NIXL agent metadata and engine layouts; a broker repeats it when
its own engines changed since the peer last saw them (``EngineTable.epoch``),
because a peer can only address memory that was registered when it loaded
our metadata. Remote descriptor lists are prepared once per (remote engine
generation, memory kind), on first use, and released when the engine
changes or the peer goes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
from opentelemetry.instrumentation.grpc import aio_client_interceptors

from kvbroker.broker import telemetry
from kvbroker.broker.descriptors import BufferPlacement, DescriptorTable, build_descriptor_table
from kvbroker.broker.engines import EngineTable
from kvbroker.broker.layout import Layout, RankKey, rank_key
from kvbroker.broker.nixl_agent import Agent
from kvbroker.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvBrokerError,
    Unavailable,
    from_rpc_error,
)
from kvbroker.v1 import peer_pb2, peer_pb2_grpc

__all__ = ["PROTOCOL_VERSION", "Peer", "PeerTable", "RemoteEngine"]

#: Version of the broker-to-broker protocol (peer.proto and the notices).
#: History: 1 — first release.
PROTOCOL_VERSION = 1

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(eq=False)
class RemoteEngine:
    """An engine rank of a peer, as its last handshake described it."""

    key: RankKey
    generation: int
    layout: Layout
    table: DescriptorTable
    #: Prepared remote descriptor lists by memory kind (lazily built).
    dlists: dict[int, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Peer:
    """Another broker (or this one)."""

    address: str
    broker_id: str | None = None
    agent_name: str | None = None
    is_self: bool = False
    engines: dict[RankKey, RemoteEngine] = field(default_factory=dict)
    #: Our EngineTable.epoch when this peer last received our handshake.
    announced_epoch: int = -1
    #: The peer's staging buffer, if it stages.
    staging: peer_pb2.RemoteBuffer | None = None
    #: When the peer last answered (or called) us: liveness.
    last_seen: float = field(default_factory=time.monotonic)
    #: Bytes this broker wrote to the peer, and the moving average of the
    #: observed write throughput (bytes/s; 0 until measured).
    bytes_sent: int = 0
    throughput_bps: float = 0.0
    #: Memory kinds (local -> remote, e.g. "DRAM->VRAM") written to the peer.
    kinds: set[str] = field(default_factory=set)
    #: When the broker last warned that this peer is slow for its memory.
    slow_warned_at: float = 0.0
    channel: grpc.aio.Channel | None = None
    stub: peer_pb2_grpc.PeerBrokerStub | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def group_layouts(self, group: str) -> list[Layout]:
        return [e.layout for k, e in sorted(self.engines.items()) if k.group == group]


class PeerTable:
    """Peers by address and by broker id. Event-loop thread only."""

    def __init__(
        self,
        *,
        agent: Agent,
        engines: EngineTable,
        broker_id: str,
        rpc_timeout_seconds: float,
        channel_options: list[tuple[str, Any]],
        staging: peer_pb2.RemoteBuffer | None = None,
        on_restart: Callable[[Peer, str], None] | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ) -> None:
        self._credentials = credentials
        self._agent = agent
        self._staging = staging
        self._on_restart = on_restart
        self._engines = engines
        self.broker_id = broker_id
        self.address = ""
        self._timeout = rpc_timeout_seconds
        self._options = channel_options
        self.by_address: dict[str, Peer] = {}
        self.by_id: dict[str, Peer] = {}

    def identity(self) -> peer_pb2.BrokerIdentity:
        return peer_pb2.BrokerIdentity(broker_id=self.broker_id, nixl_agent_name=self._agent.name, address=self.address)

    def _handshake_message(self) -> tuple[bytes, list[peer_pb2.EngineDescriptor]]:
        return self._agent.metadata(), [e.descriptor() for e in self._engines.by_id.values()]

    # -- the caller side ------------------------------------------------
    async def connect(self, address: str) -> Peer:
        """The peer at ``address``, handshaken with our current engines."""
        address = address or self.address
        peer = self.by_address.get(address)
        if peer is None:
            peer = Peer(address=address)
            self.by_address[address] = peer
        if peer.announced_epoch != self._engines.epoch or peer.broker_id is None:
            await self.handshake(peer)
        return peer

    async def handshake(self, peer: Peer) -> None:
        """(Re)do the handshake with ``peer``; raises ``Unavailable`` if it fails."""
        async with peer.lock:
            with telemetry.tracer().start_as_current_span("kvbroker.handshake", attributes={"kvbroker.peer": peer.address}):
                await self._handshake_locked(peer)

    async def _handshake_locked(self, peer: Peer) -> None:
        epoch = self._engines.epoch
        metadata, engines = self._handshake_message()
        request = peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION,
            caller=self.identity(),
            nixl_agent_metadata=metadata,
            engines=engines,
            staging=self._staging,
        )
        try:
            response = await self._stub(peer).Handshake(request, timeout=self._timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            raise Unavailable(f"handshake with the broker at {peer.address} failed: {err.message}") from exc
        if response.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"the broker at {peer.address} speaks protocol {response.protocol_version}, we speak {PROTOCOL_VERSION}"
            )
        self._apply(peer, response.callee, response.nixl_agent_metadata, response.engines, response.staging)
        peer.announced_epoch = epoch
        log.info("peer_handshaken", peer=peer.address, broker=peer.broker_id, engines=len(peer.engines), side="caller")

    def stub(self, peer: Peer) -> peer_pb2_grpc.PeerBrokerStub:
        """A stub for calls to ``peer`` (deadline: use :attr:`timeout`)."""
        return self._stub(peer)

    @property
    def timeout(self) -> float:
        return self._timeout

    async def deliver(
        self,
        broker_id: str,
        what: str,
        call: Callable[[peer_pb2_grpc.PeerBrokerStub], Awaitable[T]],
        attempts: int = 4,
        on_unreachable: Callable[[], None] | None = None,
    ) -> T | None:
        """Make a one-way call (a report, an abort) to peer ``broker_id``, retrying
        while it is unreachable. The response, or None (logged) if it could not
        be delivered; a peer that stays unreachable is handled by the liveness
        monitor. ``on_unreachable`` is called when the peer is gone or did not
        answer (not when it answered with an error)."""
        delay = 0.05
        for attempt in range(attempts):
            try:
                return await call(self.stub(self.get(broker_id)))
            except KvBrokerError as exc:
                log.warning("peer_call_undeliverable", call=what, peer=broker_id, error=exc.message)
                unreachable = True
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                unreachable = isinstance(err, (Unavailable, DeadlineExceeded))
                if unreachable and attempt + 1 < attempts:
                    await asyncio.sleep(delay)
                    delay *= 4
                    continue
                log.warning("peer_call_failed", call=what, peer=broker_id, error=err.message)
            if unreachable and on_unreachable is not None:
                on_unreachable()
            return None
        return None

    # -- the callee side ------------------------------------------------
    def on_handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        """Serve a peer's handshake: load its metadata and engines, answer with ours."""
        if request.protocol_version != PROTOCOL_VERSION:
            raise FailedPrecondition(
                f"protocol version {request.protocol_version} is not supported; this broker speaks {PROTOCOL_VERSION}"
            )
        caller = request.caller
        peer = self.by_id.get(caller.broker_id) or self.by_address.get(caller.address)
        if peer is None:
            peer = Peer(address=caller.address)
            if caller.address:
                self.by_address.setdefault(caller.address, peer)
        self._apply(peer, caller, request.nixl_agent_metadata, request.engines, request.staging)
        log.info("peer_handshaken", peer=peer.address, broker=peer.broker_id, engines=len(peer.engines), side="callee")
        metadata, engines = self._handshake_message()
        return peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            callee=self.identity(),
            nixl_agent_metadata=metadata,
            engines=engines,
            staging=self._staging,
        )

    def get(self, broker_id: str) -> Peer:
        """The handshaken peer ``broker_id``; ``Aborted`` (handshake again) if unknown."""
        peer = self.by_id.get(broker_id)
        if peer is None:
            raise Aborted(f"broker {broker_id} has not handshaken with this broker; handshake again")
        return peer

    # -- remote descriptor lists ---------------------------------------
    def remote_dlist(self, peer: Peer, engine: RemoteEngine, kind: int) -> Any:
        """The prepared list of ``engine``'s items of memory ``kind`` (built once)."""
        dlist = engine.dlists.get(kind)
        if dlist is None:
            assert peer.agent_name is not None
            dlist = self._agent.prep_dlist(peer.agent_name, engine.table.descs[kind], kind)
            engine.dlists[kind] = dlist
        return dlist

    def drop(self, peer: Peer) -> None:
        """Forget ``peer``: its remote agent, engines and descriptor lists."""
        for engine in peer.engines.values():
            self._release_engine(engine)
        peer.engines.clear()
        if peer.agent_name and not peer.is_self:
            self._agent.remove_remote(peer.agent_name)
        if peer.broker_id:
            self.by_id.pop(peer.broker_id, None)
        peer.broker_id = None
        peer.agent_name = None
        peer.announced_epoch = -1

    async def close(self) -> None:
        for peer in list(self.by_address.values()) + list(self.by_id.values()):
            self.drop(peer)
            if peer.channel is not None:
                await peer.channel.close()
                peer.channel = None
        self.by_address.clear()
        self.by_id.clear()

    # -- internals ------------------------------------------------------
    def _stub(self, peer: Peer) -> peer_pb2_grpc.PeerBrokerStub:
        if peer.stub is None:
            if not peer.address:
                raise Unavailable(f"broker {peer.broker_id} did not say where it listens")
            interceptors = aio_client_interceptors()
            if self._credentials is not None:
                peer.channel = grpc.aio.secure_channel(
                    peer.address, self._credentials, options=self._options, interceptors=interceptors
                )
            else:
                peer.channel = grpc.aio.insecure_channel(peer.address, options=self._options, interceptors=interceptors)
            peer.stub = peer_pb2_grpc.PeerBrokerStub(peer.channel)
        return peer.stub

    def _apply(
        self,
        peer: Peer,
        identity: peer_pb2.BrokerIdentity,
        metadata: bytes,
        descriptors: Any,
        staging: peer_pb2.RemoteBuffer,
    ) -> None:
        if peer.broker_id is not None and peer.broker_id != identity.broker_id:
            log.warning("peer_restarted", peer=peer.address, old=peer.broker_id, new=identity.broker_id)
            if self._on_restart is not None:
                # Fails the rooms with the old process and drops its state.
                self._on_restart(peer, f"restarted (it is now broker {identity.broker_id})")
            self.drop(peer)
        peer.last_seen = time.monotonic()
        is_self = identity.broker_id == self.broker_id
        if is_self:
            agent_name = self._agent.name
        else:
            agent_name = self._agent.add_remote(metadata)
            if agent_name != identity.nixl_agent_name:
                raise FailedPrecondition(
                    f"broker {identity.broker_id} announced agent {identity.nixl_agent_name!r} but its metadata "
                    f"names {agent_name!r}"
                )
        peer.broker_id = identity.broker_id
        peer.agent_name = agent_name
        peer.is_self = is_self
        peer.staging = staging if staging.size_bytes else None
        if identity.address:
            peer.address = peer.address or identity.address
        self.by_id[identity.broker_id] = peer
        seen: set[RankKey] = set()
        for desc in descriptors:
            key = rank_key(desc.rank)
            seen.add(key)
            current = peer.engines.get(key)
            if current is not None and current.generation == desc.generation:
                continue
            if current is not None:
                self._release_engine(current)
            try:
                peer.engines[key] = _remote_engine(key, desc)
            except (KvBrokerError, MemoryError, OverflowError, ValueError) as exc:
                peer.engines.pop(key, None)
                message = exc.message if isinstance(exc, KvBrokerError) else repr(exc)
                log.warning("peer_engine_rejected", peer=identity.broker_id, rank=str(key), error=message)
        for key in [k for k in peer.engines if k not in seen]:
            self._release_engine(peer.engines.pop(key))

    def _release_engine(self, engine: RemoteEngine) -> None:
        for dlist in engine.dlists.values():
            self._agent.release_dlist(dlist)
        engine.dlists.clear()


def _remote_engine(key: RankKey, desc: peer_pb2.EngineDescriptor) -> RemoteEngine:
    for i, b in enumerate(desc.buffers):
        if b.address + b.size_bytes >= 1 << 64:
            raise InvalidArgument(f"buffer {i} of {key} does not fit a 64-bit address space")
    layout = Layout.from_proto(desc.layout, rank=key, buffer_sizes=[b.size_bytes for b in desc.buffers])
    table = build_descriptor_table(
        layout, [BufferPlacement(b.address, b.size_bytes, b.kind, b.device_id) for b in desc.buffers]
    )
    return RemoteEngine(key=key, generation=desc.generation, layout=layout, table=table)

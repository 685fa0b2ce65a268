"""Peer brokers as this broker knows them: identities, remote engines, staging.

A peer is another broker (or this one: when both ends of a room sit on one
host, the broker is its own peer and NIXL writes loopback). A handshake
(``peer_client.PeerClient.handshake`` as the caller, :meth:`PeerTable.answer`
as the callee) exchanges NIXL agent metadata, engine layouts and staging
buffers; a broker repeats it when its own engines changed since the peer
last saw them (``EngineTable.epoch``), because a peer can only address
memory that was registered when it loaded our metadata.

The table lives on the control loop. What it holds of NIXL (a peer's agent
metadata, the prepared descriptor lists of its engines) is created and
released on the data-plane thread: :meth:`PeerTable.apply` awaits the
metadata load there, :meth:`PeerTable.drop` queues the releases.
Remote descriptor lists are prepared on first use (by the data plane, when
it posts) and released when the engine changes or the peer goes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from kvbroker.broker.dataplane import Agent, DataPlane
from kvbroker.broker.peers._caller import PeerCaller
from kvbroker.broker.peers._life import PeerState, transition
from kvbroker.broker.peers._stream import PeerStream
from kvbroker.errors import Aborted, FailedPrecondition, InvalidArgument, KvBrokerError
from kvbroker.plan import (
    BufferPlacement,
    DescriptorTable,
    Layout,
    RankKey,
    build_descriptor_table,
    rank_key,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["Peer", "PeerTable", "RemoteEngine", "announced_staging"]

log = structlog.get_logger(__name__)


@dataclass(eq=False)
class RemoteEngine:
    """An engine rank of a peer, as its last handshake described it."""

    key: RankKey
    generation: int
    layout: Layout
    table: DescriptorTable
    #: Prepared remote descriptor lists by memory kind. Data-plane thread only:
    #: made on first use, released (and ``released`` set) when dropped.
    dlists: dict[int, Any] = field(default_factory=dict)
    released: bool = False

    def dlist(self, agent: Agent, agent_name: str, kind: int) -> Any:
        """The prepared list of this engine's items of memory ``kind`` (data plane)."""
        if self.released:
            raise FailedPrecondition(f"receiver {self.key} generation {self.generation} is gone")
        dlist = self.dlists.get(kind)
        if dlist is None:
            dlist = self.dlists[kind] = agent.prep_dlist(agent_name, self.table.rows[kind], kind)
        return dlist

    def release(self, agent: Agent) -> None:
        """Release the prepared lists (data plane)."""
        self.released = True
        for dlist in self.dlists.values():
            agent.release_dlist(dlist)
        self.dlists.clear()


#: A transfer buffer by (memory kind, device): ``(VRAM, 0)``, ``(DRAM, 0)``.
PoolKey = tuple[int, int]


@dataclass(frozen=True)
class TransportVerdict:
    """The transport self-test of one pair: this broker's send buffer
    ``local`` written into the peer's receive buffer ``remote``."""

    local: PoolKey
    remote: PoolKey
    #: The peer's buffer probed (a new buffer there is probed again).
    remote_address: int
    #: "device speed", "host fallback", or "failed: <why>".
    verdict: str
    gbps: float
    floor_gbps: float
    #: Bytes per write, and writes timed.
    nbytes: int
    writes: int
    at: float = field(default_factory=time.monotonic)

    @property
    def fell_back(self) -> bool:
        return self.verdict == HOST_FALLBACK

    def text(self) -> str:
        """``"VRAM:0->VRAM:1 device speed 312.4 GB/s"``: for spans and logs."""
        figure = f" {self.gbps:.1f} GB/s" if self.gbps else ""
        return f"{pool_name(self.local)}->{pool_name(self.remote)} {self.verdict}{figure}"


DEVICE_SPEED = "device speed"
HOST_FALLBACK = "host fallback"


def pool_name(key: PoolKey) -> str:
    """``"VRAM:0"`` for GPU 0's transfer buffer, ``"DRAM"`` for host staging."""
    return f"VRAM:{key[1]}" if key[0] == common_pb2.MEMORY_KIND_VRAM else "DRAM"


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
    #: The NIXL metadata last loaded for the peer (loading it again is
    #: skipped when a handshake brings the same bytes: it costs about 15 ms
    #: of the data-plane thread).
    metadata: bytes = b""
    #: The peer's receive staging buffers by (memory kind, device).
    receive_staging: dict[tuple[int, int], peer_pb2.RemoteBuffer] = field(default_factory=dict)
    #: When the peer last answered (or called) us: liveness.
    last_seen: float = field(default_factory=time.monotonic)
    #: Where it is in its life (``peers._life``); changed only by ``transition``.
    state: PeerState = PeerState.HANDSHAKING
    #: Bytes this broker wrote to the peer, and the moving average of the
    #: observed write throughput (bytes/s; 0 until measured).
    bytes_sent: int = 0
    throughput_bps: float = 0.0
    #: Memory kinds (local -> remote, e.g. "DRAM->VRAM") written to the peer.
    kinds: set[str] = field(default_factory=set)
    #: The transport self-test of each pair of our send buffer and its
    #: receive buffer that was probed (``execution.TransportProbes``).
    transports: dict[tuple[PoolKey, PoolKey], TransportVerdict] = field(default_factory=dict)
    channel: grpc.aio.Channel | None = None
    #: The channel of ``stream`` (no interceptors).
    stream_channel: grpc.aio.Channel | None = None
    #: The calls to the peer: the room calls on ``stream``, the others unary.
    caller: PeerCaller | None = None
    #: This broker's stream to the peer (``peers._stream``).
    stream: PeerStream | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def group_layouts(self, group: str) -> list[Layout]:
        return [e.layout for k, e in sorted(self.engines.items()) if k.group == group]

    def seen(self) -> None:
        """The peer answered (or called) us just now."""
        self.last_seen = time.monotonic()

    def wrote(self, nbytes: int, elapsed: float, kinds: str, *, min_bytes: int) -> float | None:
        """Count a write of ``nbytes`` to the peer (memory ``kinds``, e.g.
        "DRAM->VRAM") that took ``elapsed`` seconds; its rate (bytes/s) goes
        into the moving average when it is at least ``min_bytes`` (smaller
        ones measure latency). The rate, or None when not measured."""
        self.bytes_sent += nbytes
        self.kinds.add(kinds)
        if nbytes < min_bytes or elapsed <= 0:
            return None
        rate = nbytes / elapsed
        self.throughput_bps = rate if not self.throughput_bps else 0.8 * self.throughput_bps + 0.2 * rate
        return rate

    def staging_bytes(self, kind: int, device: int) -> int:
        """Size of the receive staging buffer the peer announced for memory
        ``kind`` on GPU ``device`` (ignored for host memory); 0: none."""
        buffer = self.receive_staging.get((kind, device if kind == common_pb2.MEMORY_KIND_VRAM else 0))
        return buffer.size_bytes if buffer is not None else 0


class PeerTable:
    """Peers by address and by broker id. Control loop only."""

    def __init__(
        self,
        *,
        broker_id: str,
        agent_name: str,
        address: str,
        dataplane: DataPlane,
        on_restart: Callable[[Peer, str], None],
    ) -> None:
        self.broker_id = broker_id
        self.agent_name = agent_name
        #: Where peers reach this broker (its handshakes say so).
        self.address = address
        self._dataplane = dataplane
        self._on_restart = on_restart
        self.by_address: dict[str, Peer] = {}
        self.by_id: dict[str, Peer] = {}

    def identity(self) -> peer_pb2.BrokerIdentity:
        return peer_pb2.BrokerIdentity(broker_id=self.broker_id, nixl_agent_name=self.agent_name, address=self.address)

    def at(self, address: str) -> Peer:
        """The peer record for ``address`` ("" means this broker), made if new."""
        address = address or self.address
        peer = self.by_address.get(address)
        if peer is None:
            peer = self.by_address[address] = Peer(address=address)
        return peer

    def get(self, broker_id: str) -> Peer:
        """The handshaken peer ``broker_id``; ``Aborted`` (handshake again) if unknown."""
        peer = self.by_id.get(broker_id)
        if peer is None:
            raise Aborted(f"broker {broker_id} has not handshaken with this broker; handshake again")
        return peer

    def peers(self) -> list[Peer]:
        """Every peer record once (by address and by id)."""
        return list({id(p): p for p in (*self.by_address.values(), *self.by_id.values())}.values())

    # -- what the sender's state machine reads (sender.PeerView) --------------
    def remote_engine(self, broker_id: str, rank: RankKey) -> RemoteEngine | None:
        peer = self.by_id.get(broker_id)
        return peer.engines.get(rank) if peer is not None else None

    def receive_staging_bytes(self, broker_id: str, kind: int, device: int) -> int:
        peer = self.by_id.get(broker_id)
        return peer.staging_bytes(kind, device) if peer is not None else 0

    def address_of(self, broker_id: str) -> str:
        peer = self.by_id.get(broker_id)
        return peer.address if peer is not None else ""

    # -- handshakes -----------------------------------------------------------
    async def answer(
        self,
        request: peer_pb2.HandshakeRequest,
        ours: tuple[bytes, list[peer_pb2.EngineDescriptor], list[peer_pb2.RemoteBuffer], int],
    ) -> peer_pb2.HandshakeResponse:
        """Serve a peer's handshake: load its metadata and engines, answer with
        ``ours`` (our metadata, engines, receive staging buffers, engine epoch)."""
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
        await self.apply(peer, caller, request.nixl_agent_metadata, request.engines, announced_staging(request))
        log.info("peer_handshaken", peer=peer.address, broker=peer.broker_id, engines=len(peer.engines), side="callee")
        metadata, engines, staging, _epoch = ours
        host = next((b for b in staging if b.kind == common_pb2.MEMORY_KIND_DRAM), None)
        return peer_pb2.HandshakeResponse(
            protocol_version=PROTOCOL_VERSION,
            callee=self.identity(),
            nixl_agent_metadata=metadata,
            engines=engines,
            staging=host,
            receive_staging=staging,
        )

    async def apply(
        self,
        peer: Peer,
        identity: peer_pb2.BrokerIdentity,
        metadata: bytes,
        descriptors: Iterable[peer_pb2.EngineDescriptor],
        staging: Iterable[peer_pb2.RemoteBuffer],
    ) -> None:
        """Take what a handshake said of ``peer``. A peer that answers as another
        broker than before restarted: its rooms fail and its state goes first."""
        if peer.broker_id is not None and peer.broker_id != identity.broker_id:
            log.warning("peer_restarted", peer=peer.address, old=peer.broker_id, new=identity.broker_id)
            # Fails the rooms with the old process and drops its state.
            self._on_restart(peer, f"restarted (it is now broker {identity.broker_id})")
            self.drop(peer)
        peer.seen()
        is_self = identity.broker_id == self.broker_id
        if is_self:
            agent_name = self.agent_name
        elif metadata == peer.metadata and peer.agent_name is not None:
            agent_name = peer.agent_name
        else:
            agent_name = await self._load(peer, metadata)
            peer.metadata = metadata
            if agent_name != identity.nixl_agent_name:
                raise FailedPrecondition(
                    f"broker {identity.broker_id} announced agent {identity.nixl_agent_name!r} but its metadata "
                    f"names {agent_name!r}"
                )
        peer.broker_id = identity.broker_id
        if not peer.state.handshaken:
            transition(peer, PeerState.LIVE, f"handshaken as broker {identity.broker_id}")
        peer.agent_name = agent_name
        peer.is_self = is_self
        peer.receive_staging = {(b.kind, b.device_id): b for b in staging if b.size_bytes}
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
                self._release(current)
            try:
                peer.engines[key] = _remote_engine(key, desc)
            except (KvBrokerError, MemoryError, OverflowError, ValueError) as exc:
                peer.engines.pop(key, None)
                message = exc.message if isinstance(exc, KvBrokerError) else repr(exc)
                log.warning("peer_engine_rejected", peer=identity.broker_id, rank=str(key), error=message)
        for key in [k for k in peer.engines if k not in seen]:
            self._release(peer.engines.pop(key))

    async def _load(self, peer: Peer, metadata: bytes) -> str:
        """Load ``peer``'s NIXL metadata; its agent's name.

        NIXL (1.5) adds what a peer's metadata holds to what it loaded
        before, and cannot change a loaded memory's keys: memory the peer
        freed and registered again at the same place with new keys (a
        cudaMalloc at a freed address; host memory over RDMA) is refused
        with NIXL_ERR_NOT_ALLOWED. Then the peer is treated as restarted:
        its rooms here fail, its transfers are cancelled and its metadata is
        loaded afresh."""
        try:
            return await self._dataplane.call(lambda agent: agent.add_remote(metadata))
        except InvalidArgument as exc:
            if peer.agent_name is None or "NIXL_ERR_NOT_ALLOWED" not in exc.message:
                raise
            log.warning("peer_metadata_reloaded", peer=peer.address, broker=peer.broker_id, error=exc.message)
        self._on_restart(peer, "changed the NIXL keys of memory this broker had loaded; its metadata is loaded afresh")
        self.drop(peer)
        return await self._dataplane.call(lambda agent: agent.add_remote(metadata))

    def drop(self, peer: Peer) -> None:
        """Forget ``peer``: its remote agent, engines and descriptor lists. Its
        state is the caller's to move (``PeerLoss`` makes it GONE or FORGOTTEN first)."""
        for engine in peer.engines.values():
            self._release(engine)
        peer.engines.clear()
        if peer.agent_name and not peer.is_self:
            name = peer.agent_name
            self._dataplane.call(lambda agent: agent.remove_remote(name))
        if peer.broker_id:
            self.by_id.pop(peer.broker_id, None)
        if peer.stream is not None:
            peer.stream.close()  # calls on it fail UNAVAILABLE; the next call opens a new one
        peer.broker_id = None
        peer.agent_name = None
        peer.metadata = b""
        peer.announced_epoch = -1
        peer.receive_staging = {}
        peer.transports = {}

    def _release(self, engine: RemoteEngine) -> None:
        self._dataplane.call(engine.release)


def announced_staging(message: peer_pb2.HandshakeRequest | peer_pb2.HandshakeResponse) -> list[peer_pb2.RemoteBuffer]:
    """The receive staging buffers a handshake announces (older builds: only ``staging``)."""
    return list(message.receive_staging) or ([message.staging] if message.staging.size_bytes else [])


def _remote_engine(key: RankKey, desc: peer_pb2.EngineDescriptor) -> RemoteEngine:
    for i, b in enumerate(desc.buffers):
        if b.address + b.size_bytes >= 1 << 64:
            raise InvalidArgument(f"buffer {i} of {key} does not fit a 64-bit address space")
    layout = Layout.from_proto(desc.layout, rank=key, buffer_sizes=[b.size_bytes for b in desc.buffers])
    table = build_descriptor_table(
        layout, [BufferPlacement(b.address, b.size_bytes, b.kind, b.device_id) for b in desc.buffers]
    )
    return RemoteEngine(key=key, generation=desc.generation, layout=layout, table=table)


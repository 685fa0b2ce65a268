"""The operator surface (``kvbroker.v1.Admin``): reading the broker (through
``queries``), aborting a room, draining. Every call works from grpcurl
(docs/operations.md)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.peers import Peer, PeerState, pool_name
from kvbroker.broker.rooms import Receiver, Side, Source
from kvbroker.errors import NotFound
from kvbroker.v1 import admin_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.execution import TransportProbes
    from kvbroker.broker.runtime import Operators, PeerLoss, Queries

__all__ = ["Admin"]


def _mode(mode: int) -> str:
    return peer_pb2.SourceMode.Name(mode).removeprefix("SOURCE_MODE_")


class Admin:
    """Admin operations over one broker: it reads through ``queries``, acts
    through ``operators`` and the transport self-test (``probes``). Control
    loop only."""

    def __init__(self, queries: Queries, operators: Operators, probes: TransportProbes, peer_loss: PeerLoss) -> None:
        self._q = queries
        self._operators = operators
        self._probes = probes
        self._peer_loss = peer_loss

    def forget_peer(self, peer: str, reason: str) -> admin_pb2.ForgetPeerResponse:
        address, broker_id = self._peer_loss.forget(peer, reason)
        return admin_pb2.ForgetPeerResponse(address=address, broker_id=broker_id)

    # -- reading -------------------------------------------------------------
    def stats(self) -> admin_pb2.Stats:
        q = self._q
        c = q.counters
        return admin_pb2.Stats(
            broker_id=q.broker_id,
            per_room_state=q.rooms.table_sizes(),
            engines=len(q.engines()),
            peers=q.handshaken_peers(),
            rooms_succeeded=c.rooms_succeeded,
            rooms_failed=c.rooms_failed,
            bytes_sent=c.bytes_sent,
            bytes_received=c.bytes_received,
            transfers_posted=c.transfers_posted,
            descriptors_transferred=c.descriptors_transferred,
            transfers_staged=c.transfers_staged,
            transfers_per_token=c.transfers_per_token,
            transfers_token_runs=c.transfers_token_runs,
            transfers_packed=c.transfers_packed,
            device_launches=q.device_launches(),
            peer_calls_answered=dict(c.peer_calls_answered),
            staging_send_bytes_in_use=q.traffic.staging_in_use("send"),
            staging_receive_bytes_in_use=q.traffic.staging_in_use("receive"),
            late_notices=c.late_notices,
            bad_notices=c.bad_notices,
            checksum_mismatches=c.checksum_mismatches,
            packed_checksums_checked=c.packed_checksums_checked,
            packed_parts_taken_off_loop=c.parts_taken_off_loop,
            uptime_seconds=int(q.uptime_seconds()),
            draining=q.draining,
            open_rooms=q.rooms.open_rooms(),
            etcd=q.etcd_status(),
            queues=[
                admin_pb2.QueueStats(
                    queue=r.queue,
                    priority=r.priority,  # type: ignore[arg-type]
                    engine=r.engine,
                    waiting=max(0, r.waiting),
                    served=r.served,
                    bytes=r.bytes,
                    waited_seconds=r.waited_seconds,
                )
                for r in c.queues.rows()
            ],
        )

    def list_engines(self) -> list[admin_pb2.EngineInfo]:
        config = self._q.config
        out = []
        for engine in self._q.engines():
            open_rooms = sum(1 for p in self._q.rooms.sides() if p.engine is engine and not p.terminal)
            out.append(
                admin_pb2.EngineInfo(
                    engine_label=engine.label,
                    rank=engine.key.to_proto(),
                    role=engine.role,  # type: ignore[arg-type]
                    buffers=len(engine.buffers),
                    registered_bytes=engine.registered_bytes,
                    regions=len(engine.layout.regions),
                    open_rooms=open_rooms,
                    timeouts=engine.timeouts.effective(
                        sender_info=config.sender_info_timeout_seconds,
                        bootstrap=config.bootstrap_timeout_seconds,
                        receiver_data=config.receiver_data_timeout_seconds,
                    ),
                    memory_warming=engine.warming is not None,
                )
            )
        return out

    def list_peers(self) -> list[admin_pb2.PeerInfo]:
        now = time.monotonic()
        out = []
        for peer in self._q.peers():
            open_rooms = sum(1 for p in self._q.rooms.sides() if not p.terminal and peer.broker_id in self._q.rooms.peer_of(p).split(","))
            out.append(
                admin_pb2.PeerInfo(
                    address=peer.address,
                    broker_id=peer.broker_id or "",
                    nixl_agent_name=peer.agent_name or "",
                    handshaken=peer.broker_id is not None,
                    engines=len(peer.engines),
                    open_rooms=open_rooms,
                    transport=self._q.transport(),
                    memory=sorted(peer.kinds),
                    bytes_sent=peer.bytes_sent,
                    throughput_gbps=peer.throughput_bps / 1e9,
                    last_seen_seconds=now - peer.last_seen,
                    transports=transports(peer, now),
                    stream_open=peer.stream is not None and peer.stream.broker_id is not None,
                    stream_calls=peer.stream.calls_written if peer.stream is not None else 0,
                    stream_frames=peer.stream.frames_written if peer.stream is not None else 0,
                    silent=peer.state is PeerState.SILENT,
                    state=peer.state.value,
                )
            )
        return out

    async def fleet(self) -> list[admin_pb2.FleetBroker]:
        """The fleet in etcd as this broker's watch last saw it (empty without
        --etcd), with this broker's transport self-test of each member."""
        view = self._q.fleet
        if view is None:
            return []
        members = await view.describe()
        now = time.monotonic()
        for member in members:
            peer = self._q.peer(member.broker_id)
            if peer is not None:
                member.transports.extend(transports(peer, now))
        return members

    async def probe_transport(self, address: str) -> list[admin_pb2.PeerInfo]:
        """The transport self-test of the peer at ``address`` (every handshaken
        peer if empty), now; the peers' records with the verdicts."""
        peers = [p for p in self._q.peers() if p.broker_id is not None and not p.is_self]
        if address:
            peers = [p for p in peers if p.address == address]
            if not peers:
                raise NotFound(f"no handshaken peer at {address} (ListPeers lists them)")
        await self._probes.probe(peers)
        return [info for info in self.list_peers() if any(info.broker_id == p.broker_id for p in peers)]

    def fleet_groups(self) -> list[admin_pb2.FleetGroup]:
        view = self._q.fleet
        if view is None:
            return []
        return [g for m in sorted(view.members.values(), key=lambda m: m.address) for g in view.groups(m)]

    def list_rooms(self, request: admin_pb2.ListRoomsRequest) -> list[admin_pb2.RoomInfo]:
        state = request.state if request.HasField("state") else None
        out = []
        for p in self._q.rooms.sides():
            if state is not None and p.state != state:
                continue
            if request.engine and not p.engine.label.startswith(request.engine):
                continue
            peer = self._q.rooms.peer_of(p)
            if request.peer and request.peer not in peer.split(",") and not self._address_matches(request.peer, peer):
                continue
            out.append(self._info(p))
        return out

    def get_room(self, room: int) -> admin_pb2.GetRoomResponse:
        sides = [self._detail(p) for p in self._q.rooms.sides_of(room)]
        if not sides:
            raise NotFound(f"this broker has no side of room {room} (never had it, or evicted it)")
        return admin_pb2.GetRoomResponse(sides=sides)

    # -- acting ----------------------------------------------------------------
    def abort_room(self, room: int, reason: str) -> int:
        """Fail every open local side of ``room``; the peers hear of it."""
        return self._operators.admin_abort(room, reason)

    async def drain(self, request: admin_pb2.DrainRequest) -> admin_pb2.DrainResponse:
        await self._operators.set_draining(not request.resume)
        if request.wait and not request.resume:
            deadline = time.monotonic() + (request.timeout_seconds or 60.0)
            while self._q.rooms.open_rooms() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        open_rooms = self._q.rooms.open_rooms()
        return admin_pb2.DrainResponse(draining=self._q.draining, open_rooms=open_rooms, drained=open_rooms == 0)

    # -- internals ---------------------------------------------------------------
    def _address_matches(self, wanted: str, peer_ids: str) -> bool:
        peer = self._q.peer_at(wanted)
        return peer is not None and peer.broker_id is not None and peer.broker_id in peer_ids.split(",")

    def _info(self, p: Side) -> admin_pb2.RoomInfo:
        sender = isinstance(p, Source)
        pages = p.cursor if isinstance(p, Source) else int(p.pages.size) if isinstance(p, Receiver) else 0
        info = admin_pb2.RoomInfo(
            room=p.room,
            side="sender" if sender else "receiver",
            engine=p.key.to_proto(),
            state=p.state,  # type: ignore[arg-type]
            peer=self._q.rooms.peer_of(p),
            pages=pages,
            chunks=p.chunks,
            bytes=p.bytes,
            age_seconds=time.monotonic() - p.opened_at,
        )
        if p.cause is not None:
            info.cause.CopyFrom(p.cause)
        return info

    def _detail(self, p: Side) -> admin_pb2.RoomDetail:
        detail = admin_pb2.RoomDetail(
            info=self._info(p),
            pages_settled=p.pages_settled,
            timeline=[admin_pb2.TimelineEvent(event=name, at=at) for name, at in p.timeline],
            trace_id=telemetry.span_ids(p.span).get("trace_id", ""),
        )
        if isinstance(p, Source):
            for dest in p.destinations.values():
                detail.destinations.add(
                    receiver=dest.info.receiver.to_proto(),
                    receiver_broker_id=dest.info.receiver_broker_id,
                    mode=_mode(dest.plan.mode),
                    chunks_posted=dest.posted_chunks,
                    inflight=dest.inflight,
                    complete=dest.complete,
                )
        elif isinstance(p, Receiver):
            detail.waiting_for = p.waiting_for
            for key, exp in (p.expected or {}).items():
                detail.sources.add(
                    source=key.to_proto(),
                    mode=_mode(exp.plan.mode),
                    chunks_landed=exp.chunks_landed(),
                    total_chunks=exp.total_chunks or 0,
                    complete=exp.complete,
                    settled=exp.settled,
                )
        return detail


def transports(peer: Peer, now: float) -> list[admin_pb2.TransportProbe]:
    """The peer's transport self-test verdicts, as the operator sees them."""
    return [
        admin_pb2.TransportProbe(
            local=pool_name(v.local),
            remote=pool_name(v.remote),
            verdict=v.verdict,
            gbps=v.gbps,
            floor_gbps=v.floor_gbps,
            bytes=v.nbytes,
            writes=v.writes,
            age_seconds=now - v.at,
        )
        for v in sorted(peer.transports.values(), key=lambda v: (v.local, v.remote))
    ]

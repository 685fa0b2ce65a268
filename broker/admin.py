"""The operator surface (``kvbroker.v1.Admin``): reading the broker's tables,
aborting a room, draining. Every call works from grpcurl (README)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from kvbroker.broker import telemetry
from kvbroker.broker.rooms import Progress, ReceiverProgress, SourceProgress, cause
from kvbroker.broker.runtime import BrokerRuntime
from kvbroker.errors import NotFound
from kvbroker.v1 import admin_pb2, common_pb2, peer_pb2

__all__ = ["Admin"]


def _mode(mode: int) -> str:
    return peer_pb2.SourceMode.Name(mode).removeprefix("SOURCE_MODE_")


class Admin:
    """Admin operations over one broker's runtime. Event-loop thread only."""

    def __init__(self, runtime: BrokerRuntime) -> None:
        self._rt = runtime

    # -- reading -------------------------------------------------------------
    def stats(self) -> admin_pb2.Stats:
        rt = self._rt
        c = rt.counters
        return admin_pb2.Stats(
            broker_id=rt.broker_id,
            per_room_state=rt.rooms.sizes(),
            engines=len(rt.engines.by_id),
            peers=len(rt.peers.by_id),
            rooms_succeeded=c.rooms_succeeded,
            rooms_failed=c.rooms_failed,
            bytes_sent=c.bytes_sent,
            bytes_received=c.bytes_received,
            transfers_posted=c.transfers_posted,
            descriptors_transferred=c.descriptors_transferred,
            transfers_staged=c.transfers_staged,
            transfers_per_token=c.transfers_per_token,
            staging_send_bytes_in_use=rt.send_staging.in_use_bytes if rt.send_staging else 0,
            staging_receive_bytes_in_use=rt.receive_staging.in_use_bytes if rt.receive_staging else 0,
            late_notices=c.late_notices,
            bad_notices=c.bad_notices,
            uptime_seconds=int(time.monotonic() - rt.started_at),
            draining=rt.draining,
            open_rooms=rt.open_rooms(),
        )

    def list_engines(self) -> list[admin_pb2.EngineInfo]:
        out = []
        for engine in self._rt.engines.by_id.values():
            open_rooms = sum(1 for p in self._records() if p.engine is engine and not p.terminal)
            out.append(
                admin_pb2.EngineInfo(
                    engine_label=engine.label,
                    rank=engine.key.to_proto(),
                    role=engine.role,  # type: ignore[arg-type]
                    buffers=len(engine.buffers),
                    registered_bytes=engine.registered_bytes,
                    regions=len(engine.layout.regions),
                    open_rooms=open_rooms,
                )
            )
        return out

    def list_peers(self) -> list[admin_pb2.PeerInfo]:
        rt = self._rt
        peers = {id(p): p for p in (*rt.peers.by_address.values(), *rt.peers.by_id.values())}
        now = time.monotonic()
        out = []
        for peer in peers.values():
            open_rooms = sum(1 for p in self._records() if not p.terminal and peer.broker_id in self._peer_of(p).split(","))
            out.append(
                admin_pb2.PeerInfo(
                    address=peer.address,
                    broker_id=peer.broker_id or "",
                    nixl_agent_name=peer.agent_name or "",
                    handshaken=peer.broker_id is not None,
                    engines=len(peer.engines),
                    open_rooms=open_rooms,
                    transport=rt.transport,
                    memory=sorted(peer.kinds),
                    bytes_sent=peer.bytes_sent,
                    throughput_gbps=peer.throughput_bps / 1e9,
                    last_seen_seconds=now - peer.last_seen,
                )
            )
        return out

    def list_rooms(self, request: admin_pb2.ListRoomsRequest) -> list[admin_pb2.RoomInfo]:
        state = request.state if request.HasField("state") else None
        out = []
        for p in self._records():
            if state is not None and p.state != state:
                continue
            if request.engine and not p.engine.label.startswith(request.engine):
                continue
            peer = self._peer_of(p)
            if request.peer and request.peer not in peer.split(",") and not self._address_matches(request.peer, peer):
                continue
            out.append(self._info(p))
        return out

    def get_room(self, room: int) -> admin_pb2.GetRoomResponse:
        sides = [self._detail(p) for p in self._records() if p.room == room]
        if not sides:
            raise NotFound(f"this broker has no side of room {room} (never had it, or evicted it)")
        return admin_pb2.GetRoomResponse(sides=sides)

    # -- acting ----------------------------------------------------------------
    def abort_room(self, room: int, reason: str) -> int:
        """Fail every open local side of ``room``; the peers hear of it."""
        rt = self._rt
        why = cause(common_pb2.FAILURE_KIND_ABORTED, f"aborted by the operator: {reason or 'no reason given'}", rt.broker_id)
        sides = [p for p in self._records() if p.room == room]
        if not sides:
            raise NotFound(f"this broker has no side of room {room}")
        aborted = 0
        for p in sides:
            if p.terminal:
                continue
            telemetry.child_done(p.span, "kvbroker.abort", {"kvbroker.reason": why.message, "kvbroker.by": "operator"})
            if isinstance(p, SourceProgress):
                rt.sender.fail(p, why)
            else:
                assert isinstance(p, ReceiverProgress)
                rt.receiver.fail(p, why)
            aborted += 1
        return aborted

    async def drain(self, request: admin_pb2.DrainRequest) -> admin_pb2.DrainResponse:
        rt = self._rt
        await rt.set_draining(not request.resume)
        if request.wait and not request.resume:
            deadline = time.monotonic() + (request.timeout_seconds or 60.0)
            while rt.open_rooms() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        open_rooms = rt.open_rooms()
        return admin_pb2.DrainResponse(draining=rt.draining, open_rooms=open_rooms, drained=open_rooms == 0)

    # -- internals ---------------------------------------------------------------
    def _records(self) -> Iterator[Progress]:
        yield from self._rt.rooms.all_sources()
        yield from self._rt.rooms.all_receivers()

    @staticmethod
    def _peer_of(p: Progress) -> str:
        if isinstance(p, SourceProgress):
            return ",".join(sorted({d.info.receiver_broker_id for d in p.destinations.values()}))
        assert isinstance(p, ReceiverProgress)
        return p.peer_broker_id or p.sender_address

    def _address_matches(self, wanted: str, peer_ids: str) -> bool:
        peer = self._rt.peers.by_address.get(wanted)
        return peer is not None and peer.broker_id is not None and peer.broker_id in peer_ids.split(",")

    def _info(self, p: Progress) -> admin_pb2.RoomInfo:
        sender = isinstance(p, SourceProgress)
        pages = p.cursor if isinstance(p, SourceProgress) else int(p.pages.size) if isinstance(p, ReceiverProgress) else 0
        info = admin_pb2.RoomInfo(
            room=p.room,
            side="sender" if sender else "receiver",
            engine=p.key.to_proto(),
            state=p.state,  # type: ignore[arg-type]
            peer=self._peer_of(p),
            pages=pages,
            chunks=p.chunks,
            bytes=p.bytes,
            age_seconds=time.monotonic() - p.opened_at,
        )
        if p.cause is not None:
            info.cause.CopyFrom(p.cause)
        return info

    def _detail(self, p: Progress) -> admin_pb2.RoomDetail:
        detail = admin_pb2.RoomDetail(
            info=self._info(p),
            pages_settled=p.pages_settled,
            timeline=[admin_pb2.TimelineEvent(event=name, at=at) for name, at in p.timeline],
            trace_id=telemetry.span_ids(p.span).get("trace_id", ""),
        )
        if isinstance(p, SourceProgress):
            for dest in p.destinations.values():
                detail.destinations.add(
                    receiver=dest.info.receiver.to_proto(),
                    receiver_broker_id=dest.info.receiver_broker_id,
                    mode=_mode(dest.plan.mode),
                    chunks_posted=dest.posted_chunks,
                    inflight=dest.inflight,
                    complete=dest.complete,
                )
        elif isinstance(p, ReceiverProgress):
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

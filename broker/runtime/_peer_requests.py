"""What other brokers ask of this one (``kvbroker.v1.PeerBroker``): the
handshake, a receiver's room registrations (RegisterRooms), room in a receive
staging buffer (ReserveStaging), a source's completion report, aborts
(AbortRooms), and lease renewals for rooms a decode announced
(RenewLeases), the transport self-test's probe slots, credits, and pings.
A registration or abort call carries the rooms its caller made in one loop
pass (on the peer stream, up to 512); each item succeeds or fails on its own.

Each handler is marked with the peer call it answers (``peers.answers``);
the servicer answers every call through one chain (``api._peer_calls``)
that counts it, checks the request's protocol version and types its
errors, so a handler checks only what is its own (a batch's items).
"""

from __future__ import annotations

import asyncio
import secrets
import sys
import time

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import DataPlane
from kvbroker.broker.execution import (
    Credits,
    Machines,
    Transport,
    in_turn,
    receive_wait_owner,
    side_ticket,
)
from kvbroker.broker.memory import EngineTable, StagingPool, StagingPools, TransferSlot
from kvbroker.broker.peers import HandshakeMessage, answers, pool_name, reach_back
from kvbroker.broker.rooms import TransferInfo, cause
from kvbroker.broker.runtime._commands import checked_priority
from kvbroker.broker.runtime._operators import Operators
from kvbroker.broker.runtime._requests import NO_TRACE, check_version, decode_state
from kvbroker.broker.scheduling import deadline_in
from kvbroker.errors import Aborted, FailedPrecondition, InvalidArgument, KvBrokerError, Unavailable
from kvbroker.plan import SourcePlan, decode_indices, rank_key
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["PeerRequests", "handshake_message"]


async def handshake_message(engines: EngineTable, dataplane: DataPlane, pools: StagingPools) -> HandshakeMessage:
    """What this broker tells a peer in a handshake: its NIXL metadata, its
    engines, its receive staging buffers, and the engine epoch they are of."""
    epoch = engines.epoch
    metadata = await dataplane.call(lambda agent: agent.metadata())
    descriptors = [e.descriptor() for e in engines.by_id.values()]
    return metadata, descriptors, pools.receive_buffers(), epoch


class PeerRequests:
    """The peer API of one broker. Control loop only."""

    def __init__(
        self,
        *,
        config: BrokerConfig,
        machines: Machines,
        engines: EngineTable,
        transport: Transport,
        credits: Credits,
        operators: Operators,
    ) -> None:
        self._broker_id = machines.broker_id
        self._config = config
        self._engines = engines
        self._dataplane = transport.dataplane
        self._pools = transport.pools
        self._peers = transport.peers
        self._client = transport.client
        self._rooms = machines.rooms
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._credits = credits
        self._operators = operators
        #: Probe slots held for peers' transport self-tests, by probe id.
        self._probes: dict[str, tuple[StagingPool, TransferSlot, asyncio.TimerHandle]] = {}

    @answers("Handshake")
    async def handshake(self, request: peer_pb2.HandshakeRequest) -> peer_pb2.HandshakeResponse:
        """A peer introduces itself (its agent, its engines); the answer introduces this broker,
        once this broker reached the peer where it says it listens."""
        await reach_back(self._client, request.caller)
        return await self._peers.answer(request, await handshake_message(self._engines, self._dataplane, self._pools))

    @answers("Ping")
    def ping(self, request: peer_pb2.PingRequest) -> peer_pb2.PingResponse:
        """Who answers at this address (a peer's heartbeat, or its check that we listen where we say)."""
        return peer_pb2.PingResponse(broker_id=self._broker_id)

    # -- a receiver registers rooms ---------------------------------------------------
    @answers("RegisterRooms")
    def register_rooms(self, request: peer_pb2.RegisterRoomsRequest) -> peer_pb2.RegisterRoomsResponse:
        """A receiver's broker registers rooms with this sender's broker: each
        succeeds or fails on its own, in its room's trace."""
        response = peer_pb2.RegisterRoomsResponse()
        for item in request.rooms:
            item.protocol_version = item.protocol_version or request.protocol_version
            token = otel_context.attach(propagate.extract(item.trace_context) if item.trace_context else NO_TRACE)
            try:
                self._register_room(item)
                response.results.add()
            except KvBrokerError as exc:
                response.results.add(code=exc.status_number, message=exc.message)
            finally:
                otel_context.detach(token)
        return response

    @in_turn
    def _register_room(self, request: peer_pb2.RegisterRoomRequest) -> None:
        """One receiver rank's transfer info for one room."""
        check_version(request.protocol_version, "RegisterRooms")
        if request.sender_broker_id and request.sender_broker_id != self._broker_id:
            raise Aborted(
                f"room {request.room} was meant for broker {request.sender_broker_id}; this is broker "
                f"{self._broker_id} (a restart): handshake again"
            )
        self._peers.get(request.receiver_broker_id)
        room = self._rooms.sender.get(request.room)
        if self._operators.draining and (room is None or not room.sources):
            raise Unavailable("this broker is draining: it accepts no new rooms")
        if not request.sources:
            raise InvalidArgument("a room registration must list its sources")
        remote = self._peers.remote_engine(request.receiver_broker_id, rank_key(request.receiver))
        info = TransferInfo(
            trace_context=trace.get_current_span(),
            room=request.room,
            receiver_broker_id=sys.intern(request.receiver_broker_id),
            receiver=rank_key(request.receiver),
            receiver_generation=request.receiver_generation,
            sender_group=sys.intern(request.sender_group),
            pages=decode_indices(request.pages),
            aux_row=request.aux_row if request.HasField("aux_row") else None,
            state=decode_state(request.state),
            sources=tuple(SourcePlan.from_proto(s) for s in request.sources),
            prefix_pages=request.prefix_pages,
            verify_checksum=request.verify_checksum,
            priority=checked_priority(request.priority),
            deadline=deadline_in(request.deadline_ms),
            page_size=remote.layout.page_size_tokens if remote is not None else 0,
        )
        self._sender.transfer_info(info)

    # -- while data moves ---------------------------------------------------------------
    @answers("ReserveStaging")
    async def reserve_staging(self, request: peer_pb2.ReserveStagingRequest) -> peer_pb2.ReserveStagingResponse:
        """Room in a receive staging buffer for one staged part (the prefetch). Idempotent."""
        pool_key, held = self._receiver.landing.staging_wanted(request)
        pool = self._pools.pool("receive", *pool_key)
        if pool is None:
            raise FailedPrecondition("this broker has no receive staging buffer for that memory (--no-staging?)")
        if held is None:
            # Its wait ends early if the room ends meanwhile (RoomEnded: the executor abandons it).
            owner = receive_wait_owner(request.room, rank_key(request.receiver))
            ticket = side_ticket(self._receiver.landing.staging_rank(request), request.bytes, self._config.priorities)
            reservation = await pool.reserve(request.bytes, self._config.staging_wait_seconds, owner=owner, ticket=ticket)
            with self._turn:
                try:
                    held = self._receiver.landing.staging_granted(request, pool_key, reservation)
                except BaseException:
                    pool.release(reservation)
                    raise
        return peer_pb2.ReserveStagingResponse(offset=held.offset, bytes=held.nbytes, buffer=pool.buffer.descriptor())

    @answers("ReserveProbe")
    async def reserve_probe(self, request: peer_pb2.ReserveProbeRequest) -> peer_pb2.ReserveProbeResponse:
        """A slot of a receive transfer buffer for a peer's transport self-test,
        tied to no room: held until ReleaseProbe, or the lease's end."""
        self._peers.get(request.sender_broker_id)
        pool = self._pools.pool("receive", request.kind, request.device_id)
        if pool is None:
            raise FailedPrecondition(f"this broker has no receive buffer for {pool_name((request.kind, request.device_id))}")
        reservation = await pool.reserve_slot(request.bytes, self._config.staging_wait_seconds)
        probe_id = secrets.token_hex(8)
        # Past the sender's transfer timeout nothing of its probe can still be
        # landing (it cancels its writes by then).
        lease = self._config.transfer_timeout_seconds + self._config.peer_rpc_timeout_seconds
        timer = asyncio.get_running_loop().call_later(lease, self._end_probe, probe_id)
        self._probes[probe_id] = (pool, reservation, timer)
        return peer_pb2.ReserveProbeResponse(
            probe_id=probe_id, offset=reservation.offset, bytes=reservation.nbytes, buffer=pool.buffer.descriptor(), lease_seconds=lease
        )

    @answers("ReleaseProbe")
    def release_probe(self, request: peer_pb2.ReleaseProbeRequest) -> peer_pb2.ReleaseProbeResponse:
        """The sender's probe writes settled: the slot goes back. Idempotent."""
        self._end_probe(request.probe_id)
        return peer_pb2.ReleaseProbeResponse()

    def _end_probe(self, probe_id: str) -> None:
        held = self._probes.pop(probe_id, None)
        if held is not None:
            pool, reservation, timer = held
            timer.cancel()
            pool.release(reservation)

    @answers("GrantCredits")
    async def grant_credits(self, request: peer_pb2.GrantCreditsRequest) -> peer_pb2.GrantCreditsResponse:
        """Room in a receive buffer for a sending peer's packed parts (its credits)."""
        return await self._credits.grant(request)

    @answers("ReturnCredits")
    def return_credits(self, request: peer_pb2.ReturnCreditsRequest) -> peer_pb2.ReturnCreditsResponse:
        """A sending peer gives whole grants back."""
        self._credits.take_back(request)
        return peer_pb2.ReturnCreditsResponse()

    @answers("ReportCompletion")
    @in_turn
    def completion_report(self, request: peer_pb2.CompletionReport) -> peer_pb2.CompletionAck:
        """A source finished without a transfer to carry the news (it failed, or owed no data)."""
        self._receiver.landing.completion_report(request)
        return peer_pb2.CompletionAck()

    # -- leases -------------------------------------------------------------------------
    @answers("RenewLeases")
    @in_turn
    def renew_leases(self, request: peer_pb2.RenewLeasesRequest) -> peer_pb2.RenewLeasesResponse:
        """A receiver's broker renews the leases of rooms its decode engines
        announced: each listed room's sources in its group that still wait
        for transfer infos wait from now again (rooms not here: nothing).
        Answers the shortest lease of the listed groups' ranks here."""
        self._peers.get(request.receiver_broker_id)  # a handshaken peer (else ABORTED: handshake again)
        now = time.monotonic()
        renewed = sum(len(self._sender.renew_lease(item.room, item.sender_group, now)) for item in request.rooms)
        flag = self._config.sender_info_timeout_seconds
        groups = {item.sender_group for item in request.rooms}
        leases = [
            e.timeouts.limit("sender_info_seconds", flag).seconds
            for e in self._engines.by_id.values()
            if e.key.group in groups and e.role != common_pb2.ROLE_DECODE
        ]
        return peer_pb2.RenewLeasesResponse(lease_seconds=min(leases, default=flag), renewed=renewed)

    # -- aborts ---------------------------------------------------------------------------
    @answers("AbortRooms")
    def peer_aborts(self, request: peer_pb2.PeerAbortRoomsRequest) -> peer_pb2.PeerAbortRoomsResponse:
        """A peer aborts rooms: each succeeds or fails on its own."""
        response = peer_pb2.PeerAbortRoomsResponse()
        for item in request.aborts:
            item.protocol_version = item.protocol_version or request.protocol_version
            try:
                response.results.add(settled=self._peer_abort(item))
            except KvBrokerError as exc:
                response.results.add(code=exc.status_number, message=exc.message)
        return response

    @in_turn
    def _peer_abort(self, request: peer_pb2.PeerAbortRequest) -> bool:
        """Fail this broker's sides of one room; whether its transfers into the peer have settled."""
        check_version(request.protocol_version, "AbortRooms")
        why = request.cause if request.HasField("cause") else cause(
            common_pb2.FAILURE_KIND_ABORTED, "aborted by the peer broker", request.from_broker_id
        )
        if request.from_broker_id not in self._peers.by_id:
            raise Aborted(
                f"broker {request.from_broker_id!r} is not a handshaken peer of this broker (it took it for lost, "
                "or restarted): handshake again"
            )
        settled = self._sender.peer_abort(request.room, why, request.from_broker_id)
        self._receiver.peer_abort(request.room, why, request.from_broker_id)
        return settled

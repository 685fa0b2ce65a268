"""Calls to other brokers that the room state machines ask for (room
registration aside: ``_registration``).

Each runs in a task of its own, through the peer client (``peers.PeerClient``:
the transport and its delivery retries); its answer comes back as a call on
the receiver's state machine:

- finding a receiving room's sender: the broker at its address, or, for a
  group named without an address, the brokers the fleet in etcd says hold
  its sources (``sender_found``, ``still_looking``, ``bootstrap_failed``);
- completion reports to a receiver's broker;
- aborting a room at a sender's broker (``peer_settled``, or
  ``abort_undelivered`` when it cannot be reached and the broker that next
  answers at its address must be told);
- telling that successor what its predecessor's rooms became
  (``successor_notices``, ``successor_done``);
- renewing the sources' leases of announced rooms at a sender's broker
  (``leases_renewed``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import structlog
from opentelemetry import trace

from kvbroker.broker.execution._turn import Turn
from kvbroker.broker.peers import FleetView, PeerClient, PeerTable, find_in_fleet
from kvbroker.broker.rooms import (
    AbortAtPeer,
    Receiver,
    ReceiverCore,
    RenewLeases,
    SenderLeg,
    SendReport,
    cause,
)
from kvbroker.errors import Aborted, KvBrokerError
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = ["CallsToPeers", "in_span"]

log = structlog.get_logger(__name__)


class CallsToPeers:
    """The calls to other brokers, and what their answers tell the receiver. Control loop only."""

    def __init__(
        self,
        *,
        broker_id: str,
        client: PeerClient,
        peers: PeerTable,
        receiver: ReceiverCore,
        turn: Turn,
        fleet: FleetView | None,
    ) -> None:
        self._id = broker_id
        self._client = client
        self._peers = peers
        self._receiver = receiver
        #: Each answer to the receiver's state machine is a turn.
        self._turn = turn
        #: The fleet in etcd (``serve --etcd``; None without): resolves senders named by group alone.
        self._fleet = fleet

    async def find_sender(self, rank: Receiver) -> None:
        """Find the broker(s) holding ``rank``'s sources, retried until the bootstrap timeout (its engine's, else the flag)."""

        def missed(error: KvBrokerError) -> None:
            with self._turn:
                self._receiver.bootstrap.still_looking(rank, error.message)

        try:
            found: str | list[SenderLeg]
            with in_span(rank.span):
                if rank.sender_address or self._fleet is None:
                    peer, layouts = await self._client.find_sender(
                        rank.sender_address, rank.sender_group, stop=lambda: rank.terminal, missed=missed, timeouts=rank.engine.timeouts
                    )
                    found = peer.broker_id or ""
                else:
                    # A group and no address: the broker(s) etcd says hold its sources.
                    placed, layouts = await find_in_fleet(
                        self._client,
                        self._fleet,
                        rank.sender_group,
                        rank.engine.layout,
                        rank.key,
                        stop=lambda: rank.terminal,
                        missed=missed,
                        timeouts=rank.engine.timeouts,
                    )
                    found = [SenderLeg(p.broker_id or "", p.address, ranks) for p, ranks in placed]
        except KvBrokerError as exc:
            with self._turn:
                self._receiver.bootstrap.bootstrap_failed(rank, exc)
        else:
            with self._turn:
                self._receiver.bootstrap.sender_found(rank, found, layouts)

    async def report(self, effect: SendReport) -> None:
        """A source's completion report to its receiver's broker (delivered or logged)."""
        effect.report.protocol_version = PROTOCOL_VERSION
        await self._client.report_completion(effect.broker_id, effect.report)

    async def abort_at_peer(self, effect: AbortAtPeer) -> None:
        """Abort a room at a sender's broker."""
        request = peer_pb2.PeerAbortRequest(
            protocol_version=PROTOCOL_VERSION, room=effect.room, from_broker_id=self._id, cause=effect.cause
        )
        unreachable: Callable[[], None] | None = None
        if effect.remember:

            def unreachable() -> None:
                with self._turn:
                    self._receiver.abort_undelivered(effect.broker_id, effect.room, effect.cause)

        response = await self._client.abort_room(effect.broker_id, request, on_unreachable=unreachable)
        if response is not None and response.settled:
            # Nothing of the room is in flight from that broker (its sources
            # may even be evicted already, so no report would come).
            with self._turn:
                self._receiver.peer_settled(effect.broker_id, effect.room)

    async def renew_leases(self, effect: RenewLeases) -> None:
        """Renew the leases of announced rooms at the sender's broker at
        ``effect.address`` (handshaking first, as a room's bootstrap does); an
        unreachable one is tried again at the next pass, the announcements
        stay."""
        lease: float | None = None
        try:
            peer = await self._client.connect(effect.address)
            try:
                response = await self._client.renew_leases(peer, effect.rooms)
            except Aborted:
                # It does not know us (it restarted, or took us for lost): introduce ourselves again.
                await self._client.handshake(peer)
                response = await self._client.renew_leases(peer, effect.rooms)
            lease = response.lease_seconds
            log.debug("leases_renewed", peer=effect.address, rooms=len(effect.rooms), renewed=response.renewed, lease_seconds=lease)
        except KvBrokerError as exc:
            log.info("lease_renewal_failed", peer=effect.address, rooms=len(effect.rooms), error=exc.message)
        finally:
            with self._turn:
                self._receiver.announcements.renewed(effect.address, lease)

    async def tell_successor(self, address: str) -> None:
        """Tell the broker now at ``address`` which rooms of its predecessor failed here."""
        try:
            try:
                peer = self._peers.by_address.get(address)
                if peer is None or peer.broker_id is None:
                    peer = await self._client.connect(address)
                else:
                    # Is the process we know still the one there? (A restart
                    # found here fails what we had with the old one.)
                    await self._client.handshake(peer)
            except KvBrokerError as exc:
                log.debug("successor_unreachable", peer=address, error=exc.message)
                return
            broker_id = peer.broker_id or ""
            for room, why in self._receiver.successors.take(address):
                told = cause(
                    common_pb2.FAILURE_KIND_PEER, f"the receiving broker {self._id} failed the room: {why.message}", self._id
                )
                request = peer_pb2.PeerAbortRequest(
                    protocol_version=PROTOCOL_VERSION, room=room, from_broker_id=self._id, cause=told
                )
                await self._client.abort_room(broker_id, request)
                log.info("successor_told", room=room, peer=address, broker=broker_id)
        finally:
            with self._turn:
                self._receiver.successors.done(address)


def in_span(span: trace.Span | None) -> contextlib.AbstractContextManager[object]:
    """Run a block with ``span`` current (calls it makes carry its trace), if there is one."""
    return trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext()

"""A peer broker lost: it stopped answering pings (``PeerMonitor``), came back
as another process at the same address (``PeerTable``), or its key left etcd
(``FleetView``). Either way its rooms here fail, transfers to it are
cancelled, and it is dropped until it handshakes again.
"""

from __future__ import annotations

import structlog

from kvbroker.broker.execution import Credits, Machines, Transport, in_turn
from kvbroker.broker.peers import Member, Peer
from kvbroker.broker.rooms import cause
from kvbroker.errors import NixlError, Unavailable
from kvbroker.v1 import common_pb2

__all__ = ["PeerLoss"]

log = structlog.get_logger(__name__)


class PeerLoss:
    """What this broker does when a peer is gone. Control loop only."""

    def __init__(self, *, machines: Machines, transport: Transport, credits: Credits) -> None:
        self._broker_id = machines.broker_id
        self._dataplane = transport.dataplane
        self._peers = transport.peers
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._credits = credits

    @in_turn
    def peer_lost(self, peer: Peer, what: str) -> None:
        """``peer`` died or restarted: fail its rooms, cancel transfers to it, drop it."""
        broker_id = peer.broker_id
        if broker_id is None or peer.is_self:
            return
        why = cause(common_pb2.FAILURE_KIND_PEER, f"peer broker {peer.address} ({broker_id}) {what}", self._broker_id)
        log.warning("peer_lost", peer=peer.address, broker=broker_id, reason=what)
        sources = self._sender.peer_lost(broker_id, why)
        ranks = self._receiver.peer_lost(broker_id, why)
        self._credits.peer_gone(broker_id, lambda: Unavailable(f"peer broker {peer.address} {what}"))
        if peer.agent_name:
            address = peer.address
            self._dataplane.cancel(peer.agent_name, lambda: NixlError(f"transfer to lost peer {address} cancelled"))
        self._peers.drop(peer)
        log.info("peer_dropped", peer=peer.address, broker=broker_id, sources_failed=sources, receivers_failed=ranks)

    def broker_left(self, member: Member) -> None:
        """A broker's key left etcd (its lease expired or was revoked): lost, as a silent peer is."""
        peer = self._peers.by_id.get(member.broker_id)
        if peer is not None:
            self.peer_lost(peer, "left the fleet: its etcd lease expired or was revoked")

    def has_business(self, peer: Peer) -> bool:
        """Whether some room here involves ``peer`` (the monitor pings only those)."""
        broker_id = peer.broker_id or ""
        return (
            self._sender.has_business(broker_id)
            or self._receiver.has_business(broker_id)
            or self._credits.has_business(broker_id)
        )

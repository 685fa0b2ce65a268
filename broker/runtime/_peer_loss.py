"""A peer broker lost: it stopped answering pings (``PeerMonitor``), came back
as another process at the same address (``PeerTable``), or an operator
forgot it (``Admin.ForgetPeer``). Either way its rooms here fail at once.
Its key leaving etcd (``FleetView``) only makes it LEASE_LAPSED: the next
heartbeat decides. Each change of its state is a ``peers.transition``
(``peers._life``, docs/architecture.md "Peer states").

What else goes depends on whether it is known gone. A restarted peer, or one
whose host refuses connections, writes nothing more: it is GONE (FORGOTTEN,
when an operator says so), transfers to it are cancelled, its grants go,
its receiving rooms here are settled, and it is dropped until it handshakes
again. A SILENT one (no answer, no reset: a partition, a stopped process, a
lease that lapsed) may still be writing: a write queued in a cut link lands
once the link returns, whatever NIXL was told meanwhile (seen with UCX over
TCP). So its posted transfers stay until NIXL finishes them, its grants and
remote agent stay, and its rooms' pages here settle only once it answers
again and says nothing of them is in flight (or it is found gone).
"""

from __future__ import annotations

import structlog

from kvbroker.broker.execution import Credits, Machines, Transport, in_turn
from kvbroker.broker.peers import Member, Peer, PeerState, transition
from kvbroker.broker.rooms import cause
from kvbroker.errors import NixlError, NotFound, Unavailable
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

    def peer_lost(self, peer: Peer, what: str, silent: bool = False) -> None:
        """``peer`` is lost: fail its rooms. Known gone (not ``silent``): GONE, its
        transfers cancelled, its rooms' pages settled and it dropped. Silent:
        SILENT, what it may still write kept until it answers or is found gone."""
        self._lose(peer, what, PeerState.SILENT if silent else PeerState.GONE)

    @in_turn
    def _lose(self, peer: Peer, what: str, to: PeerState) -> None:
        """Lose ``peer`` into state ``to``: SILENT, GONE or FORGOTTEN (in a turn: its rooms' effects run as it ends)."""
        broker_id = peer.broker_id
        if broker_id is None or peer.is_self:
            return
        why = cause(common_pb2.FAILURE_KIND_PEER, f"peer broker {peer.address} ({broker_id}) {what}", self._broker_id)
        was_silent = peer.state is PeerState.SILENT
        if not was_silent:
            log.warning("peer_lost", peer=peer.address, broker=broker_id, reason=what, silent=to is PeerState.SILENT)
        sources = self._sender.peer_lost(broker_id, why)
        ranks = self._receiver.peer_lost(broker_id, why, settled=to is not PeerState.SILENT)
        if to is PeerState.SILENT:
            if not was_silent:  # silent already: its new rooms failed, nothing else changes
                if peer.agent_name:
                    self._dataplane.hold(peer.agent_name, True)
                transition(peer, PeerState.SILENT, what)
            return
        transition(peer, to, what)
        self._credits.peer_gone(broker_id, lambda: Unavailable(f"peer broker {peer.address} {what}"))
        if peer.agent_name:
            address = peer.address
            self._dataplane.hold(peer.agent_name, False)
            self._dataplane.cancel(peer.agent_name, lambda: NixlError(f"transfer to lost peer {address} cancelled"))
        self._peers.drop(peer)
        log.info("peer_dropped", peer=peer.address, broker=broker_id, sources_failed=sources, receivers_failed=ranks)

    @in_turn
    def peer_back(self, peer: Peer) -> None:
        """A SILENT peer answers again, as the same process: LIVE. What it had in
        flight may finish now; ask it about the rooms whose pages wait for its word."""
        transition(peer, PeerState.LIVE, "answered again as the same process")
        if peer.agent_name:
            self._dataplane.hold(peer.agent_name, False)
        asked = self._receiver.peer_back(peer.broker_id or "")
        log.info("peer_answers_again", peer=peer.address, broker=peer.broker_id, rooms_asked=asked)

    def forget(self, wanted: str, reason: str) -> tuple[str, str]:
        """An operator says the peer ``wanted`` (its address or broker id) is gone
        (``Admin.ForgetPeer``): FORGOTTEN, lost as a restarted one is. Its (address,
        broker id); ``NotFound`` if no handshaken peer matches."""
        peer = self._peers.by_id.get(wanted) or self._peers.by_address.get(wanted)
        if peer is None or peer.broker_id is None or peer.is_self:
            raise NotFound(f"no handshaken peer broker {wanted!r} here (Admin.ListPeers lists them)")
        address, broker_id = peer.address, peer.broker_id
        what = f"was forgotten by the operator: {reason or 'no reason given'}"
        log.warning("peer_forgotten", peer=address, broker=broker_id, reason=what, was=peer.state.value)
        self._lose(peer, what, PeerState.FORGOTTEN)
        return address, broker_id

    def broker_left(self, member: Member) -> None:
        """A broker's key left etcd (its lease expired or was revoked): a LIVE peer is
        LEASE_LAPSED, lost at the next heartbeat unless it answers then (``PeerMonitor``).
        A SILENT one stays so: it is lost already, and its writes are held either way."""
        peer = self._peers.by_id.get(member.broker_id)
        if peer is not None and not peer.is_self and peer.state is PeerState.LIVE:
            # Its lease may have lapsed while etcd (or this broker's way to it) was away: the
            # next heartbeat decides. Lost then if it does not answer (silent, as a
            # partitioned broker may still be writing; gone if its host refuses connections).
            transition(peer, PeerState.LEASE_LAPSED, "its etcd key left the fleet (lease expired or revoked)")

    def has_business(self, peer: Peer) -> bool:
        """Whether some room here involves ``peer`` (the monitor pings only those)."""
        broker_id = peer.broker_id or ""
        return (
            self._sender.has_business(broker_id)
            or self._receiver.has_business(broker_id)
            or self._credits.has_business(broker_id)
        )

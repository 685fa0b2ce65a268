"""A peer's life: the states a peer broker is in here, and the one way between them.

A peer record (``Peer``) is made HANDSHAKING, when this broker first dials
an address or is first called from one, and is LIVE once a handshake has
told it who the peer is. A live peer that stops answering the heartbeat
for ``--peer-dead-after`` is SILENT: its rooms here failed, but it may still
be writing (a partition), so its transfers are held until it answers again
(LIVE) or is found gone. Its etcd key leaving the fleet makes a live peer
LEASE_LAPSED: the next heartbeat decides (it answers: LIVE; it does not:
SILENT; its host refuses the connection: GONE). A peer known gone (it
answered as another process, its host refuses connections) is GONE, and one
an operator forgot (``Admin.ForgetPeer``) is FORGOTTEN: either way its
handshake, transfers and remote agent are dropped, and the next handshake
with its address makes it LIVE again.

:func:`transition` is the only way a peer's state changes: it refuses a
move the table :data:`TRANSITIONS` does not hold (``Internal``: a bug) and
logs each one (``peer_state``). docs/architecture.md ("Peer states") says
who makes each move.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import structlog

from kvbroker.errors import Internal

if TYPE_CHECKING:
    from kvbroker.broker.peers._table import Peer

__all__ = ["TRANSITIONS", "PeerState", "transition"]

log = structlog.get_logger(__name__)


class PeerState(enum.Enum):
    """Where a peer broker is in its life, as this broker sees it."""

    #: Known by address only: no handshake with it has finished yet.
    HANDSHAKING = "handshaking"
    #: Handshaken, and answering (or with no business to be pinged for).
    LIVE = "live"
    #: Lost by silence: its rooms failed, what it may still write is held.
    SILENT = "silent"
    #: Its etcd lease lapsed: lost at the next heartbeat unless it answers.
    LEASE_LAPSED = "lease_lapsed"
    #: Known gone (restarted, refused connections): dropped until it handshakes again.
    GONE = "gone"
    #: Forgotten by an operator: dropped until it handshakes again.
    FORGOTTEN = "forgotten"

    @property
    def handshaken(self) -> bool:
        """Whether a handshake told this broker who the peer is, and holds (its engines, its agent)."""
        return self in (PeerState.LIVE, PeerState.SILENT, PeerState.LEASE_LAPSED)

    @property
    def in_doubt(self) -> bool:
        """Whether the heartbeat is to ask it, rooms or none: SILENT or LEASE_LAPSED."""
        return self in (PeerState.SILENT, PeerState.LEASE_LAPSED)


#: The moves a peer's state may make, from each state.
TRANSITIONS: dict[PeerState, frozenset[PeerState]] = {
    PeerState.HANDSHAKING: frozenset({PeerState.LIVE}),
    PeerState.LIVE: frozenset({PeerState.SILENT, PeerState.LEASE_LAPSED, PeerState.GONE, PeerState.FORGOTTEN}),
    PeerState.SILENT: frozenset({PeerState.LIVE, PeerState.GONE, PeerState.FORGOTTEN}),
    PeerState.LEASE_LAPSED: frozenset({PeerState.LIVE, PeerState.SILENT, PeerState.GONE, PeerState.FORGOTTEN}),
    PeerState.GONE: frozenset({PeerState.LIVE}),
    PeerState.FORGOTTEN: frozenset({PeerState.LIVE}),
}


def transition(peer: Peer, to: PeerState, why: str) -> None:
    """Move ``peer`` to state ``to`` because ``why``, and log it; ``Internal``
    (and no change) if the table has no such move."""
    was = peer.state
    if to not in TRANSITIONS[was]:
        raise Internal(
            f"peer broker {peer.address} ({peer.broker_id or 'not handshaken'}) cannot go from "
            f"{was.value} to {to.value} ({why})"
        )
    peer.state = to
    log.info("peer_state", peer=peer.address, broker=peer.broker_id, why=why, **{"from": was.value, "to": to.value})

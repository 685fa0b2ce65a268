"""Peer liveness: ping the peers this broker has business with.

Every ``peer_heartbeat_seconds`` the monitor pings each handshaken peer that
has open rooms or transfers in flight with this broker, and every SILENT or
LEASE_LAPSED one whatever its business (``PeerState.in_doubt``). A peer
that answers as a different broker (it restarted) is lost at once; one that
has not answered for ``peer_dead_after_seconds`` is lost then, and one whose
lease lapsed at the first heartbeat it misses. Losing a peer is the
runtime's business (``PeerLoss.peer_lost``): fail its rooms with a cause
naming it; a peer known gone (restarted, or its host refuses connections:
nothing listens there) is GONE: its transfers are cancelled and its
handshake and NIXL remote agent dropped, and a restarted one is handshaken
afresh by the next room that needs it. One that is only SILENT (a
partition: it may still be writing) is kept and pinged until it answers
again (``on_back``: LIVE) or is found gone. A LEASE_LAPSED peer that
answers is LIVE again here: its lease lapsed while etcd was away.

UCX's "peer" error mode reports a dead peer on the data path too (a failed
transfer fails its room); the heartbeat also covers rooms with nothing in
flight, such as a decode room waiting for a prefill host that died.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from kvbroker.broker.peers._client import PeerClient
from kvbroker.broker.peers._life import PeerState, transition
from kvbroker.broker.peers._table import Peer, PeerTable
from kvbroker.errors import KvBrokerError, Unavailable

__all__ = ["PeerMonitor"]

log = structlog.get_logger(__name__)


class PeerMonitor:
    """Pings peers with business; reports the lost ones."""

    def __init__(
        self,
        peers: PeerTable,
        client: PeerClient,
        *,
        interval_seconds: float,
        dead_after_seconds: float,
        has_business: Callable[[Peer], bool],
        on_lost: Callable[[Peer, str, bool], None],
        on_back: Callable[[Peer], None],
    ) -> None:
        self._peers = peers
        self._client = client
        self._interval = interval_seconds
        self._dead_after = dead_after_seconds
        self._has_business = has_business
        self._on_lost = on_lost
        self._on_back = on_back

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            watched = [
                p
                for p in {id(p): p for p in self._peers.by_id.values()}.values()
                if not p.is_self and p.broker_id is not None and (p.state.in_doubt or self._has_business(p))
            ]
            if watched:
                await asyncio.gather(*(self._check(p) for p in watched))

    async def _check(self, peer: Peer) -> None:
        known = peer.broker_id
        try:
            answered_by = await self._client.ping(peer, timeout_seconds=self._interval)
        except KvBrokerError as exc:
            quiet = time.monotonic() - peer.last_seen
            lapsed = peer.state is PeerState.LEASE_LAPSED
            if peer.broker_id == known and (quiet > self._dead_after or lapsed or (peer.state is PeerState.SILENT and _refused(exc))):
                # Refused: nothing listens at its address, so its process is gone. Anything else
                # (no answer in time) may be a partition: it may still be writing.
                why = f"has not answered for {quiet:.1f} s ({exc.message})"
                if lapsed:
                    why = f"left the fleet: its etcd lease expired or was revoked, and it {why}"
                self._on_lost(peer, why, not _refused(exc))
            return
        if peer.broker_id != known:
            return  # lost and dropped meanwhile
        if answered_by != known:
            self._on_lost(peer, f"restarted (it is now broker {answered_by})", False)
            return
        peer.seen()
        if peer.state is PeerState.LEASE_LAPSED:
            # Its lease lapsed while etcd (or our way to it) was away, not because it went.
            log.info("etcd_lease_lapsed_peer_answers", peer=peer.address, broker=known)
            transition(peer, PeerState.LIVE, "answered the heartbeat after its etcd lease lapsed")
        elif peer.state is PeerState.SILENT:
            self._on_back(peer)


def _refused(exc: KvBrokerError) -> bool:
    """Whether a call failed because the peer's host refused the connection (nothing listens)."""
    return isinstance(exc, Unavailable) and "connection refused" in exc.message.lower()

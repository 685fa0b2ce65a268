"""The liveness monitor's verdicts (``peers.PeerMonitor``), with a real gRPC call's failure."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import grpc

from kvbroker.broker.peers import PEER_METHODS, Peer, PeerMonitor, call_unary
from kvbroker.v1 import peer_pb2

PING = PEER_METHODS["Ping"]


class _Client:
    """Pings the peer's address for real: nothing listens there."""

    async def ping(self, peer: Peer, timeout_seconds: float) -> str:
        async with grpc.aio.insecure_channel(peer.address) as channel:
            reply = await call_unary(channel, PING, peer_pb2.PingRequest(), timeout=timeout_seconds)
        return str(reply.broker_id)


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_silent_peer_whose_host_refuses_connections_is_dropped_as_gone_not_kept_silent() -> None:
    """A silent peer's address refuses the connection (gRPC says "Connection refused", capital C):
    nothing listens there, so its process is gone; the monitor loses it at once, as one that can no
    longer write (not as a partition that may), without waiting for the dead-after bound."""
    lost: list[tuple[str, bool]] = []

    def on_lost(peer: Peer, why: str, may_write: bool) -> None:
        lost.append((why, may_write))

    monitor = PeerMonitor(
        peers=SimpleNamespace(by_id={}),  # type: ignore[arg-type]  # (only run() reads the table)
        client=_Client(),  # type: ignore[arg-type]
        interval_seconds=2.0,
        dead_after_seconds=60.0,
        has_business=lambda _p: True,
        on_lost=on_lost,
        on_back=lambda _p: None,
    )
    peer = Peer(address=_closed_port(), broker_id="gone", silent=True)
    asyncio.run(monitor._check(peer))
    assert len(lost) == 1, lost
    why, may_write = lost[0]
    assert may_write is False and "has not answered" in why

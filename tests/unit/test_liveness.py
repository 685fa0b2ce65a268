"""The liveness monitor's verdicts (``peers.PeerMonitor``), with a real gRPC call's failure."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

import grpc

from kvbroker.broker.peers import PEER_METHODS, Peer, PeerMonitor, PeerState, call_unary
from kvbroker.errors import DeadlineExceeded, KvBrokerError
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
    peer = Peer(address=_closed_port(), broker_id="gone", state=PeerState.SILENT)
    asyncio.run(monitor._check(peer))
    assert len(lost) == 1, lost
    why, may_write = lost[0]
    assert may_write is False and "has not answered" in why


class _Answers:
    """Answers every ping as ``broker_id``, or fails it with ``error``."""

    def __init__(self, broker_id: str = "", error: KvBrokerError | None = None) -> None:
        self._broker_id, self._error = broker_id, error

    async def ping(self, peer: Peer, timeout_seconds: float) -> str:
        if self._error is not None:
            raise self._error
        return self._broker_id


def _monitor(client: object, lost: list[tuple[str, bool]], back: list[Peer]) -> PeerMonitor:
    return PeerMonitor(
        peers=SimpleNamespace(by_id={}),  # type: ignore[arg-type]  # (only run() reads the table)
        client=client,  # type: ignore[arg-type]
        interval_seconds=2.0,
        dead_after_seconds=60.0,
        has_business=lambda _p: True,
        on_lost=lambda _peer, why, may_write: lost.append((why, may_write)),
        on_back=back.append,
    )


def test_a_peer_whose_lease_lapsed_and_that_answers_is_live_again() -> None:
    """Its etcd key left while etcd was away, but the peer answers the heartbeat as the same broker:
    it is LIVE again here, neither lost nor handed back as a silent one."""
    lost: list[tuple[str, bool]] = []
    back: list[Peer] = []
    peer = Peer(address="10.0.0.2:50051", broker_id="b-2", state=PeerState.LEASE_LAPSED)
    asyncio.run(_monitor(_Answers("b-2"), lost, back)._check(peer))
    assert peer.state is PeerState.LIVE and lost == [] and back == []


def test_a_silent_peer_that_answers_is_handed_back() -> None:
    """A SILENT peer that answers as the same broker goes to ``on_back`` (the runtime makes it
    LIVE and asks it about the rooms whose pages wait for its word); a LIVE one that answers does not."""
    lost: list[tuple[str, bool]] = []
    back: list[Peer] = []
    silent = Peer(address="10.0.0.2:50051", broker_id="b-2", state=PeerState.SILENT)
    live = Peer(address="10.0.0.3:50051", broker_id="b-2", state=PeerState.LIVE)
    monitor = _monitor(_Answers("b-2"), lost, back)
    asyncio.run(monitor._check(silent))
    asyncio.run(monitor._check(live))
    assert back == [silent] and lost == []


def test_a_peer_whose_lease_lapsed_and_that_does_not_answer_is_lost_as_one_that_may_write() -> None:
    """No answer in time (not refused) at the first heartbeat after its lease lapsed: lost at once,
    without waiting for the dead-after bound, as a partitioned peer that may still be writing."""
    lost: list[tuple[str, bool]] = []
    timeout = DeadlineExceeded("Deadline Exceeded")
    peer = Peer(address="10.0.0.2:50051", broker_id="b-2", state=PeerState.LEASE_LAPSED)
    asyncio.run(_monitor(_Answers(error=timeout), lost, [])._check(peer))
    assert len(lost) == 1, lost
    why, may_write = lost[0]
    assert may_write is True and why.startswith("left the fleet")

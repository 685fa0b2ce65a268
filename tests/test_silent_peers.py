"""A peer lost by silence (docs/failures.md, "Silent partitions"), in process with the fake agent.

A silent peer may still be writing: its rooms fail at once, but the pages of the
receiving rooms it fed settle only on its word once it answers again, or when
an operator forgets it (``Admin.ForgetPeer``). (Found gone because its address
refuses connections: the killed brokers of ``test_faults.py``.) What a real cut link does to a queued write is
shown between hosts of their own (``test_hosts.py``); here each way out of
silence is checked on host memory and on the device path (fake VRAM).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import FakeBroker, eventually
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

from .conftest import Engine

MEMORY_KINDS = ("dram", "vram")
SRC, DST = np.array([3, 4, 5, 6]), np.array([10, 11, 12, 13])
#: No heartbeat during the test unless it asks for one: the test decides when a peer goes silent.
QUIET = {"peer_heartbeat_seconds": 60.0, "peer_dead_after_seconds": 600.0}


def _half_room(p: FakeBroker, pe: Engine, de: Engine, room: int) -> tuple[Any, Any]:
    receiver = de.handle.receiver(room, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=0)
    sender = pe.handle.sender(room)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC[:2], is_last=False)
    eventually(lambda: receiver.status().chunks == 1, 10)
    return receiver, sender


def _silent(broker: FakeBroker, other: FakeBroker) -> None:
    """``broker`` takes ``other`` for silent, as its heartbeat would after --peer-dead-after."""
    internals = broker.broker.internals
    broker.loop.call(
        lambda: internals.routes.peer_loss.peer_lost(
            internals.transport.peers.by_id[other.broker.broker_id], "has not answered for 9.9 s (test)", True
        )
    )


def _peer_info(broker: FakeBroker, other: FakeBroker) -> admin_pb2.PeerInfo:
    with grpc.insecure_channel(broker.address) as channel:
        peers = admin_pb2_grpc.AdminStub(channel).ListPeers(admin_pb2.ListPeersRequest(), timeout=10).peers
    (info,) = [x for x in peers if x.address == other.address]
    return info


def _silent_pair(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine], **config: object
) -> tuple[FakeBroker, FakeBroker, Engine, Engine, Any, Any]:
    """A room half landed, then the decode's broker takes the prefill's for silent: its room
    fails PEER naming it, its pages do not settle, ListPeers says silent (its state by name too). (Only that side: here
    the prefill's broker is in fact reachable, and its own word, once its side failed, would
    settle the room as it should.)"""
    p, d = fake_brokers("p", **QUIET, **config), fake_brokers("d", **QUIET, **config)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver, sender = _half_room(p, pe, de, 1)
    _silent(d, p)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_PEER, status
    assert p.broker.broker_id in status.cause.message, status
    assert not receiver.status().pages_settled, "settled while the sender may still write"
    assert sender.status().state != RoomState.FAILED, "the prefill's broker was told (it is silent)"
    assert _peer_info(d, p).silent and not _peer_info(p, d).silent
    assert (_peer_info(d, p).state, _peer_info(p, d).state) == ("silent", "live")
    return p, d, pe, de, receiver, sender


def test_a_silent_peer_that_answers_again_settles_the_rooms_it_fed(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine]
) -> None:
    """The silent sender answers the receiver's heartbeat again, as the same process: the receiver
    asks it about the room (an abort, which fails the sender's side), it says nothing is in
    flight, and the pages settle; the peer is no longer silent (live again) and a new room moves,
    with no new handshake needed."""
    p, d, pe, de, receiver, sender = _silent_pair(fake_brokers, make_engine)
    d.loop.call(lambda: d.broker.internals.routes.peer_loss.peer_back(d.broker.internals.transport.peers.by_id[p.broker.broker_id]))
    eventually(lambda: receiver.status().pages_settled, 10)
    assert sender.wait(10).state == RoomState.FAILED
    assert not _peer_info(d, p).silent and _peer_info(d, p).state == "live"
    receiver2 = de.handle.receiver(2, SenderRef(p.address, "prefill-group"))
    receiver2.init(DST, aux_row=0)
    sender2 = pe.handle.sender(2)
    sender2.init(len(SRC), aux_row=1)
    sender2.send(SRC)
    assert receiver2.wait(10).state == RoomState.SUCCESS


def test_the_heartbeat_finds_a_silent_peer_back_by_itself(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine]
) -> None:
    """With a heartbeat running, a silent peer that answers is found back without anyone's help
    (the monitor pings silent peers even with no room open), and the rooms it fed settle."""
    p, d = fake_brokers("p", **QUIET), fake_brokers("d", peer_heartbeat_seconds=0.1, peer_dead_after_seconds=600.0)
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver, _sender = _half_room(p, pe, de, 1)
    _silent(d, p)
    assert receiver.wait(10).state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled, 10)
    assert not _peer_info(d, p).silent


def test_an_operator_forgets_a_silent_peer_and_its_rooms_settle(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Engine]
) -> None:
    """ForgetPeer, by broker id: the silent peer is dropped as a restarted one would be (ListPeers
    says forgotten), the receiving room's pages settle at once, grants to it go; an unknown peer is
    NOT_FOUND."""
    p, d, _pe, _de, receiver, sender = _silent_pair(fake_brokers, make_engine)
    with grpc.insecure_channel(d.address) as channel:
        admin = admin_pb2_grpc.AdminStub(channel)
        forgotten = admin.ForgetPeer(admin_pb2.ForgetPeerRequest(peer=p.broker.broker_id, reason="host fenced"), timeout=10)
        assert (forgotten.address, forgotten.broker_id) == (p.address, p.broker.broker_id)
        try:
            admin.ForgetPeer(admin_pb2.ForgetPeerRequest(peer="nobody"), timeout=10)
            raise AssertionError("an unknown peer was forgotten")
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.NOT_FOUND and "'nobody'" in (exc.details() or "")
    # Settled in the ForgetPeer call; the engine hears it on its session stream, a moment later.
    eventually(lambda: receiver.status().pages_settled, 2)
    assert not _peer_info(d, p).handshaken and _peer_info(d, p).state == "forgotten"
    assert d.loop.call(lambda: d.broker.queries.traffic.granted_credit_bytes()) == 0
    # The sender's side, which heard nothing, ends as its operator forgets the receiver's broker.
    p.loop.call(lambda: p.broker.internals.routes.peer_loss.forget(d.broker.broker_id, "test over"))
    assert sender.wait(10).state == RoomState.FAILED

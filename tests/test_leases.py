"""Leases a waiting decode renews (issue 30 item 3): ``KVReceiver.announce``.

A decode rank that still wants a room but cannot open it yet (the request
waits in its queue for pages) announces it; its broker renews the sending
sources' leases at the prefill's broker (``PeerBroker.RenewLeases``) while
that engine lives and the room is wanted. ``init`` ends the announcement;
when the engine goes away the renewals stop and the prefill's room fails
TIMEOUT within one lease, its pages settled. In-process brokers with the
fake NIXL agent; the prefill's lease is its engine's own
``RoomTimeouts.sender_info_seconds`` (1 s), the broker flag stays 120 s.
"""

from __future__ import annotations

import time

import grpc
import pytest

from kvbroker import errors
from kvbroker.client import RoomState, RoomTimeouts, SenderRef
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.testing import eventually
from kvbroker.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    common_pb2,
    peer_pb2,
    peer_pb2_grpc,
    transfer_pb2,
    transfer_pb2_grpc,
)

from .test_service import DST, SRC, _assert_moved, _wait_tables_empty

FAST = {"housekeeping_interval_seconds": 0.05}
LEASE = 1.0


def _renewals(broker) -> int:
    """RenewLeases calls the (prefill's) broker answered."""
    with grpc.insecure_channel(broker.address) as channel:
        stats = admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=10)
    return int(stats.peer_calls_answered.get("RenewLeases", 0))


def _setup(fake_brokers, make_engine):
    p, d = fake_brokers("p", **FAST), fake_brokers("d", **FAST)
    pe = make_engine(p.address, "prefill", timeouts=RoomTimeouts(sender_info_seconds=LEASE))
    de = make_engine(d.address, "decode")
    return p, d, pe, de


def _open_sender(pe, room: int):
    sender = pe.handle.sender(room)
    sender.init(len(SRC), aux_row=1)
    sender.send(SRC)
    return sender


def test_an_announced_room_opened_after_three_leases_still_gets_every_byte(fake_brokers, make_engine) -> None:
    """The decode announces the room and opens it (``init``) only after 3x the prefill's lease:
    the renewals kept the prefill's room waiting, and every byte arrives, SUCCESS on both sides."""
    p, d, pe, de = _setup(fake_brokers, make_engine)
    receiver = de.handle.receiver(1, SenderRef(p.address, "prefill-group"))
    receiver.announce()
    sender = _open_sender(pe, 1)
    receiver.announce()  # again: harmless
    time.sleep(3 * LEASE)
    assert sender.poll() == RoomState.BOOTSTRAPPING, sender.status()
    assert _renewals(p) >= 6  # about every third of the lease
    receiver.init(DST, aux_row=2)
    assert receiver.wait(10).state == RoomState.SUCCESS, receiver.status()
    assert sender.wait(10).state == RoomState.SUCCESS, sender.status()
    _assert_moved(pe, de, SRC, DST)
    # ExpectRoom ended the announcement: no renewals any more, nor for announcing the finished room again.
    receiver.announce()
    de.handle.flush()
    time.sleep(0.2)  # a renewal that went before ExpectRoom has come back
    count = _renewals(p)
    time.sleep(LEASE)
    assert _renewals(p) == count
    _wait_tables_empty(p, d)


def test_without_an_announcement_the_same_wait_fails_the_sender_timeout(fake_brokers, make_engine) -> None:
    """The guarantee the lease gives: a decode that neither opens nor announces the room within
    the prefill's lease leaves the prefill's room FAILED TIMEOUT, its pages settled."""
    p, d, pe, de = _setup(fake_brokers, make_engine)
    started = time.monotonic()
    sender = _open_sender(pe, 2)
    status = sender.wait(10)
    assert LEASE <= time.monotonic() - started < 3 * LEASE
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT, status
    assert "renewal" not in status.cause.message and status.pages_settled
    receiver = de.handle.receiver(2, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2)
    assert receiver.wait(10).state == RoomState.FAILED
    _wait_tables_empty(p, d)


@pytest.mark.parametrize("how", ["dies", "unregisters", "aborts"])
def test_when_the_announcing_decode_goes_away_the_prefills_room_fails_within_a_lease(fake_brokers, make_engine, how: str) -> None:
    """The decode announced the room, and renewals kept the prefill's room waiting past its lease;
    then the decode engine dies (its fd connection drops), unregisters, or gives the room up: the
    renewals stop, and the prefill's room fails TIMEOUT within about one lease, its pages settled."""
    p, d, pe, de = _setup(fake_brokers, make_engine)
    receiver = de.handle.receiver(3, SenderRef(p.address, "prefill-group"))
    receiver.announce()
    sender = _open_sender(pe, 3)
    time.sleep(1.5 * LEASE)
    assert sender.poll() == RoomState.BOOTSTRAPPING, sender.status()
    gone = time.monotonic()
    if how == "dies":
        de.die()
    elif how == "unregisters":
        de.handle.close()
    else:
        receiver.abort("the request was preempted")
    status = sender.wait(10)
    waited = time.monotonic() - gone
    # The last renewal was at most a third of the lease before; the pass that fails it comes soon after.
    assert LEASE / 2 <= waited < LEASE + 0.75, waited
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_TIMEOUT, status
    assert "since the last lease renewal" in status.cause.message, status.cause.message
    assert status.pages_settled
    count = _renewals(p)
    time.sleep(0.3)
    assert _renewals(p) == count
    _wait_tables_empty(p, d)


def test_announce_room_over_the_unary_call_and_who_may(fake_brokers, make_engine) -> None:
    """``TransferBroker.AnnounceRoom`` (grpcurl, ops) renews as the session command does; a prefill
    engine may not announce; a sender's broker that does not answer never fails the announcement."""
    p, d, pe, de = _setup(fake_brokers, make_engine)
    sender = _open_sender(pe, 4)
    with grpc.insecure_channel(d.address) as channel:
        stub = transfer_pb2_grpc.TransferBrokerStub(channel)
        stub.AnnounceRoom(
            transfer_pb2.AnnounceRoomRequest(engine_id=de.handle.engine_id, room=4, sender=transfer_pb2.SenderRef(broker_address=p.address, group="prefill-group")),
            timeout=10,
        )
        stub.AnnounceRoom(
            transfer_pb2.AnnounceRoomRequest(engine_id=de.handle.engine_id, room=5, sender=transfer_pb2.SenderRef(broker_address="127.0.0.1:1", group="prefill-group")),
            timeout=10,
        )
    with pytest.raises(errors.FailedPrecondition, match="cannot announce rooms"):
        pe.handle.receiver(6, SenderRef(p.address, "prefill-group")).announce()
    time.sleep(2 * LEASE)
    assert sender.poll() == RoomState.BOOTSTRAPPING, sender.status()
    sender.abort("test over")
    eventually(lambda: sender.status().pages_settled)
    de.handle.receiver(4, SenderRef(p.address, "prefill-group")).abort("test over")
    de.handle.receiver(5, SenderRef(p.address, "prefill-group")).abort("test over")
    _wait_tables_empty(p, d)


def test_a_sender_broker_that_forgot_the_decodes_broker_is_introduced_again(fake_brokers, make_engine) -> None:
    """The prefill's broker took the decode's for lost (dropped its handshake): the next renewal is
    refused ABORTED, the decode's broker handshakes again and renews, and the room still succeeds."""
    p, d, pe, de = _setup(fake_brokers, make_engine)
    receiver = de.handle.receiver(7, SenderRef(p.address, "prefill-group"))
    receiver.announce()
    sender = _open_sender(pe, 7)
    eventually(lambda: _renewals(p) >= 2)
    peers = p.broker.internals.transport.peers
    p.loop.call(lambda: p.broker.internals.routes.peer_loss.peer_lost(peers.by_id[d.broker.broker_id], "stopped answering (test)"))
    time.sleep(2 * LEASE)
    assert sender.poll() == RoomState.BOOTSTRAPPING, sender.status()
    assert p.loop.call(lambda: d.broker.broker_id in peers.by_id)
    receiver.init(DST, aux_row=2)
    assert receiver.wait(10).state == RoomState.SUCCESS, receiver.status()
    assert sender.wait(10).state == RoomState.SUCCESS, sender.status()
    _assert_moved(pe, de, SRC, DST)
    _wait_tables_empty(p, d)


def test_a_renewal_answers_the_shortest_lease_of_the_groups_ranks(fake_brokers, make_engine) -> None:
    """The prefill group's two ranks have leases of 1 s and 3 s: a renewal answers 1 s, so the
    decode renews often enough for the rank that gives up first (the longest would let it lapse)."""
    p, d = fake_brokers("p", **FAST), fake_brokers("d", **FAST)
    make_engine(p.address, "prefill", tp_size=2, tp_rank=0, timeouts=RoomTimeouts(sender_info_seconds=3 * LEASE))
    make_engine(p.address, "prefill", tp_size=2, tp_rank=1, timeouts=RoomTimeouts(sender_info_seconds=LEASE))
    de = make_engine(d.address, "decode")
    receiver = de.handle.receiver(4, SenderRef(p.address, "prefill-group"))
    receiver.announce()  # d handshakes with p, and renews
    eventually(lambda: _renewals(p) >= 1)
    request = peer_pb2.RenewLeasesRequest(
        protocol_version=PROTOCOL_VERSION,
        receiver_broker_id=d.broker.broker_id,
        rooms=[peer_pb2.LeasedRoom(room=4, sender_group="prefill-group")],
    )
    with grpc.insecure_channel(p.address) as channel:
        answer = peer_pb2_grpc.PeerBrokerStub(channel).RenewLeases(request, timeout=10)
    assert answer.lease_seconds == pytest.approx(LEASE)
    receiver.abort("done")

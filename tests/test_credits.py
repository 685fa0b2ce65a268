"""Receive credits (issue 28, finding 2), on the fake CUDA driver and the fake NIXL agent.

Each packed part used to ask the receiver for its slot (``PeerBroker.ReserveStaging``) before its
write: a gRPC round trip per part on both brokers, most of a part's cost. Now the receiver grants a
sending broker room in its transfer buffer in bulk (``GrantCredits``), the sender places its parts
there itself, and the receiver hands each part's range back once it scattered or dropped it (a
``CreditReturn`` notification). These tests show: no call per part in steady state; a failed
write, an aborted room and a lost peer give every range and grant back on both sides; two senders
into one small buffer both move (a receiver with others waiting makes holders give grants back);
and a part written outside the writer's credits fails its room.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvbroker.client import RoomState, SenderRef
from kvbroker.testing import FakeBroker, eventually
from kvbroker.testing.fake_nixl import XferScript
from kvbroker.testing.scenario import Scenario, run_scenario

from .conftest import page_bytes

MEMORY_KINDS = ("vram",)


def _calls(broker: FakeBroker) -> dict[str, int]:
    return dict(broker.broker.queries.counters.peer_calls_answered)


def _room(pe: Any, de: Any, p: FakeBroker, room: int, src: list[int], dst: list[int]) -> Any:
    receiver = de.handle.receiver(room, SenderRef(p.address, "prefill-group"))
    receiver.init(dst, aux_row=0)
    sender = pe.handle.sender(room)
    sender.init(len(src), aux_row=1)
    sender.send(src)
    return receiver


def test_packed_parts_take_no_call_to_the_receiver_in_steady_state(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]
) -> None:
    """40 rooms of packed parts: the receiver answers a handful of GrantCredits (its window grows
    to fit what is in flight) and no ReserveStaging; every byte lands; once idle the grants go back
    and both buffers are empty."""
    p, d = fake_brokers("p"), fake_brokers("d")
    # Each room its own destination pages, as an engine's concurrent requests have: two rooms in
    # flight to the same pages land in no defined order (this test once assumed they did).
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode", num_pages=80)
    receivers = [_room(pe, de, p, room, [room % 32, (room + 7) % 32], [2 * room, 2 * room + 1]) for room in range(40)]
    for receiver in receivers:
        assert receiver.wait(20).state == RoomState.SUCCESS
    for room in range(40):
        got = page_bytes(de.memory, 1, [2 * room, 2 * room + 1])
        sent = page_bytes(pe.memory, 1, [room % 32, (room + 7) % 32])
        assert all(torch.equal(a, b) for a, b in zip(got, sent)), room
    calls = _calls(d)
    assert p.broker.queries.counters.transfers_packed >= 40
    assert calls.get("ReserveStaging", 0) == 0, calls
    assert 1 <= calls.get("GrantCredits", 0) <= 4, calls
    eventually(lambda: p.pools_in_use() == d.pools_in_use() == (0, 0), 5)
    assert d.loop.call(lambda: d.broker.queries.traffic.granted_credit_bytes()) == 0


def test_a_failed_write_gives_its_range_back_and_later_rooms_move(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]
) -> None:
    """A packed part's write fails (NIXL ERR): the sender frees its range in its credits itself
    (the receiver never saw it); the room fails, the next rooms move, nothing is left."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    assert _room(pe, de, p, 1, [1], [1]).wait(10).state == RoomState.SUCCESS
    p.agent.script(XferScript(outcome="ERR"))
    assert _room(pe, de, p, 2, [2], [2]).wait(10).state == RoomState.FAILED
    eventually(lambda: p.loop.call(lambda: p.broker.queries.traffic.awaiting_credit_returns()) is False, 5)
    for room in (3, 4):
        assert _room(pe, de, p, room, [room], [room]).wait(10).state == RoomState.SUCCESS
    eventually(lambda: p.pools_in_use() == d.pools_in_use() == (0, 0), 5)


def test_an_aborted_rooms_landed_ranges_go_back_to_their_sender(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]
) -> None:
    """The decode aborts a room while one of its packed parts hangs in NIXL: once the write is
    cancelled (the transfer timeout) both sides settle, and every range and grant comes back."""
    p = fake_brokers("p", transfer_timeout_seconds=1.0)
    d = fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver = de.handle.receiver(7, SenderRef(p.address, "prefill-group"))
    receiver.init([1, 2, 3, 4], aux_row=0)
    sender = pe.handle.sender(7)
    sender.init(4, aux_row=1)
    sender.send([4, 5])
    eventually(lambda: receiver.status().chunks == 1, 10)
    p.agent.script(XferScript(outcome="HANG"))
    sender.send([6, 7])
    eventually(lambda: p.loop.call(p.broker.queries.traffic.inflight) == 1, 10)
    receiver.abort("decode preempted")
    assert receiver.wait(10).state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled, 10)
    assert sender.wait(10).state == RoomState.FAILED
    eventually(lambda: p.pools_in_use() == d.pools_in_use() == (0, 0), 10)
    assert p.loop.call(lambda: p.broker.queries.traffic.awaiting_credit_returns()) is False


def test_a_lost_peers_grants_and_windows_go(fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any]) -> None:
    """A peer taken for lost: the receiver's grants to it go back to its pool, and the sender's
    window at it goes, at once (not after the idle second)."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    assert _room(pe, de, p, 1, [1], [1]).wait(10).state == RoomState.SUCCESS
    assert d.loop.call(lambda: d.broker.queries.traffic.granted_credit_bytes()) > 0
    d.loop.call(lambda: d.broker.internals.routes.peer_loss.peer_lost(d.broker.internals.transport.peers.by_id[p.broker.broker_id], "stopped answering (test)"))
    p.loop.call(lambda: p.broker.internals.routes.peer_loss.peer_lost(p.broker.internals.transport.peers.by_id[d.broker.broker_id], "stopped answering (test)"))
    assert d.loop.call(lambda: d.broker.queries.traffic.granted_credit_bytes()) == 0
    assert d.pools_in_use() == (0, 0)
    assert p.loop.call(lambda: p.broker.queries.traffic.credit_business_with(d.broker.broker_id)) is False


def test_two_senders_into_one_small_buffer_both_move(fake_brokers: Callable[..., FakeBroker]) -> None:
    """Two prefill brokers send packed parts to one decode broker whose receive buffer holds
    eight: each sender's window may grow to the whole buffer, and the receiver, with the other
    waiting, makes the holder give its grants back as they empty; every room of both moves."""
    config = {"device_send_bytes": 512 << 10, "device_receive_bytes": 512 << 10, "device_part_bytes": 64 << 10}
    p1, p2, d = fake_brokers("p1", **config), fake_brokers("p2", **config), fake_brokers("d", **config)
    scenario = Scenario(rooms=12, pages=8, chunks=2, layers=4, kv_heads=8, head_dim=64, page_size=8)
    from kvbroker.testing.fake_cuda import as_fake_vram

    fake = p1.agent.cuda
    assert fake is not None

    def prepare(memory: Any, spec: Any) -> None:
        as_fake_vram(memory, fake, device=0)

    import threading

    results: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda p=p: results.__setitem__(p.address, run_scenario(p.address, d.address, scenario, timeout_seconds=60, prepare=prepare)))
        for p in (p1, p2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert all(r.ok for r in results.values()), [r.problems[:3] for r in results.values()]
    assert p1.broker.queries.counters.transfers_packed >= 24 and p2.broker.queries.counters.transfers_packed >= 24
    for broker in (p1, p2, d):
        eventually(lambda b=broker: b.pools_in_use() == (0, 0), 5)


@pytest.mark.parametrize("inside", [True, False], ids=["inside", "outside"])
def test_a_part_written_outside_its_senders_credits_fails_its_room(
    fake_brokers: Callable[..., FakeBroker], make_engine: Callable[..., Any], inside: bool
) -> None:
    """The receiver checks each packed part's range against the grants of the broker that wrote
    it: a range outside them fails the room (MISMATCH) and is never scattered."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    if not inside:
        holds = d.broker.internals.services.credits.ledger.holds
        d.broker.internals.services.credits.ledger.holds = lambda *args: False  # type: ignore[method-assign]
    status = _room(pe, de, p, 1, [3], [4]).wait(10)
    if inside:
        assert status.state == RoomState.SUCCESS
    else:
        assert status.state == RoomState.FAILED and "outside the credits this broker granted it" in status.cause.message
        d.broker.internals.services.credits.ledger.holds = holds  # type: ignore[method-assign]

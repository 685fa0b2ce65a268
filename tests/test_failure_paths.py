"""What a failure leaves behind: every slot of every staging and transfer buffer comes back.

Seed #27011's kind of bug is state left behind after a failure: a room that
failed, whose slot, reservation or pages are never given back. Each test here
drives one failure path whose release was once found missing by a mutant
that nothing else caught, and ends by checking that both brokers' buffers
are back to zero and their room tables empty. Each runs on host memory
(staging buffers) and on fake VRAM (the device path's transfer buffers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from kvbroker.broker.rooms import Abort
from kvbroker.client import KVReceiver, KVSender, RoomState, SenderRef
from kvbroker.testing import FakeBroker, XferScript, eventually
from kvbroker.v1 import common_pb2

MEMORY_KINDS = ("dram", "vram")
SRC = np.array([3, 4, 5, 9, 10, 20], dtype=np.int32)
DST = np.array([0, 1, 2, 7, 8, 30], dtype=np.int32)
#: Every write hangs until the prefill broker's transfer timeout cancels it.
HANG = XferScript(outcome="HANG")


def small(direction: str) -> dict[str, Any]:
    """Broker settings: its ``direction`` buffers hold fewer parts than a room sends at once
    (slots are 4 KiB aligned; these parts are smaller): its staging buffer one, its transfer
    buffer two (the least that can still be probed); a hung write is cancelled after 1 s."""
    return {f"staging_{direction}_bytes": 4096, f"device_{direction}_bytes": 8192, "transfer_timeout_seconds": 1.0}


def open_room(sender_address: str, prefill: list[Any], decode: list[Any], room: int) -> tuple[list[KVSender], list[KVReceiver]]:
    """``room`` opened on every decode and prefill rank, SRC sent to DST in two chunks (each a
    part per pair of ranks)."""
    receivers = []
    for de in decode:
        receiver = de.handle.receiver(room, SenderRef(sender_address, "prefill-group"))
        receiver.init(DST, aux_row=2)
        receivers.append(receiver)
    senders = []
    for pe in prefill:
        sender = pe.handle.sender(room)
        sender.init(len(SRC), aux_row=1)
        sender.send(SRC[:3])
        sender.send(SRC[3:])
        senders.append(sender)
    return senders, receivers


def warm_up(sender_address: str, prefill: list[Any], decode: list[Any]) -> None:
    """One room that succeeds: the pairs' transport probes are done before any write hangs."""
    senders, receivers = open_room(sender_address, prefill, decode, 1)
    for side in (*senders, *receivers):
        assert side.wait(10).state == RoomState.SUCCESS


def waiting(broker: FakeBroker, direction: str) -> int:
    """Reservations waiting for room in the broker's ``direction`` buffers."""
    result: int = broker.loop.call(broker.broker.queries.traffic.waiting_reservations, direction)
    return result


def assert_nothing_left(*brokers: FakeBroker) -> None:
    """Both buffers of every broker back to zero, and every room table empty."""
    for broker in brokers:
        broker.wait_buffers_free()
        broker.evict_now()
        assert not any(broker.tables().values()), broker.tables()


def test_a_part_waiting_for_its_send_slot_when_its_room_fails_gives_the_slot_back(fake_brokers, make_engine) -> None:
    """Prefill tp 1 -> decode tp 2: each decode rank takes one head of every page, which the prefill
    packs into a slot of its send buffer. The buffer is smaller than the room's parts, so a part
    waits for a slot; the writes hang, the room is aborted, and the transfer timeout fails them.
    The waiting part then gets a slot, finds its room failed, and must give the slot back."""
    p = fake_brokers("p", **small("send"))
    d = fake_brokers("d")
    prefill = [make_engine(p.address, "prefill")]
    decode = [make_engine(d.address, "decode", tp_size=2, tp_rank=r) for r in range(2)]
    warm_up(p.address, prefill, decode)
    p.agent.script(*[HANG] * 8)
    (sender,), receivers = open_room(p.address, prefill, decode, 700)
    eventually(lambda: waiting(p, "send") >= 1, 10, describe=lambda: f"posted {p.agent.posted}, in use {p.pools_in_use()}")
    sender.abort("the engine gave up")
    assert sender.wait(10).state == RoomState.FAILED
    for receiver in receivers:
        assert receiver.wait(10).state == RoomState.FAILED
        eventually(lambda r=receiver: r.status().pages_settled, 10)
    assert_nothing_left(p, d)


def test_a_receive_slot_granted_after_its_room_ended_is_given_back(fake_brokers, make_engine) -> None:
    """Prefill tp 2 -> decode tp 1: the two prefill ranks' head slices meet in one decode page, so
    each writes its part into the decode broker's receive buffer, in room reserved there first
    (on host memory a ReserveStaging per part; on the device path the sender's credits). The
    buffer is smaller than the room's parts, so a reservation waits. The writes hang and the
    decode aborts the room; once the transfer timeout fails them, their slots go back (their
    sources write no more), and the waiting reservation is granted when the room has ended: it
    must be given back at once. (The first slot used to wait for the whole rank to
    settle, which waited for the second source, which waited for the slot: both stalled until
    the reservation's wait ran out.)"""
    p = fake_brokers("p", transfer_timeout_seconds=1.0)
    d = fake_brokers("d", **small("receive"))
    prefill = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=30 + r) for r in range(2)]
    decode = [make_engine(d.address, "decode")]
    warm_up(p.address, prefill, decode)
    p.agent.script(*[HANG] * 8)
    senders, (receiver,) = open_room(p.address, prefill, decode, 701)
    # A part waits for room at the decode: in its staging buffer (ReserveStaging), or in the
    # prefill broker's credits there (the device path).
    eventually(
        lambda: waiting(d, "receive") + p.loop.call(p.broker.queries.traffic.parts_waiting_for_credits) >= 1,
        10,
        describe=lambda: f"posted {p.agent.posted}, in use {d.pools_in_use()}",
    )
    receiver.abort("the decode engine gave up")
    assert receiver.wait(10).state == RoomState.FAILED
    for sender in senders:
        assert sender.wait(10).state == RoomState.FAILED
    eventually(lambda: receiver.status().pages_settled, 10)
    assert_nothing_left(p, d)


def test_a_receive_slot_granted_as_its_room_ends_is_given_back(fake_brokers, make_engine, memory_kind) -> None:
    """The race the wait's early end leaves: a queued ReserveStaging is granted a slot (its room
    still open) and its room ends before the call resumes. The grant is then refused, and its slot
    must go back at once."""
    if memory_kind == "vram":
        pytest.skip("the device path reserves receive room per peer (credits), not per part")
    p = fake_brokers("p")
    d = fake_brokers("d", staging_receive_bytes=4096)
    prefill = [make_engine(p.address, "prefill", tp_size=2, tp_rank=r, seed=30 + r) for r in range(2)]
    decode = [make_engine(d.address, "decode")]
    parts = d.broker.internals  # a reservation held, and a room aborted inside a turn: faults injected
    pool = parts.transport.pools.pool("receive", common_pb2.MEMORY_KIND_DRAM, 0)
    assert pool is not None
    held = d.loop.call(lambda: pool.try_reserve(4096))  # the buffer is full
    assert held is not None
    open_room(p.address, prefill, decode, 702)
    eventually(lambda: waiting(d, "receive") >= 1, 10, describe=lambda: f"in use {d.pools_in_use()}")

    def grant_then_end() -> None:
        pool.release(held)  # the first queued reservation is granted: its room is open
        engine = parts.services.engines.get(decode[0].handle.engine_id)
        with parts.machines.turn:  # the room ends (its effects run) before the granted call resumes
            parts.machines.receiver.abort(Abort(engine=engine, room=702, reason="the decode engine gave up"))

    d.loop.call(grant_then_end)
    assert_nothing_left(p, d)

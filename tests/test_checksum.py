"""End-to-end checksums: a receiver that asks for them gets every chunk verified against what the
sending broker read; a transport that corrupts bytes fails the room with MISMATCH before SUCCESS."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch

from kvbroker.client import ModelSpec, RoomState, SenderRef
from kvbroker.testing.fake_nixl import FakeAgent
from kvbroker.v1 import admin_pb2, admin_pb2_grpc, common_pb2

from .conftest import SMALL_MODEL, page_bytes

# Every test with engines runs on host memory and on the device path (fake VRAM).
MEMORY_KINDS = ("dram", "vram")

SRC = np.array([3, 4, 5, 9, 10, 20], dtype=np.int32)
DST = np.array([0, 1, 2, 7, 8, 30], dtype=np.int32)


@pytest.fixture
def corrupt(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """While ``corrupt[0]`` is true, the fake transport flips one bit of the first byte of every write."""
    on = [False]
    copy = FakeAgent._copy

    def corrupting(pairs: list[tuple[int, int, int]]) -> None:
        copy(pairs)
        if on[0] and pairs:
            byte = ctypes.c_uint8.from_address(pairs[0][1])
            byte.value ^= 0x01

    monkeypatch.setattr(FakeAgent, "_copy", staticmethod(corrupting))
    yield on


def _stats(broker) -> admin_pb2.GetStatsResponse:  # type: ignore[no-untyped-def]
    import grpc

    with grpc.insecure_channel(broker.address) as channel:
        return admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=10)


def _room(pe, de, p, room: int, *, verify: bool, chunks=(2, 4)):  # type: ignore[no-untyped-def]
    receiver = de.handle.receiver(room, SenderRef(p.address, "prefill-group"))
    receiver.init(DST, aux_row=2, verify_checksum=verify)
    sender = pe.handle.sender(room)
    sender.init(len(SRC), aux_row=1)
    offset = 0
    for n in chunks:
        sender.send(SRC[offset : offset + n])
        offset += n
    return receiver, sender


def test_verified_rooms_arrive_and_a_corrupting_transport_fails_them(fake_brokers, make_engine, corrupt) -> None:
    """Clean: SUCCESS, byte-exact. One flipped bit in transit: FAILED MISMATCH naming the chunk,
    counted in GetStats; the same corruption without verification goes unnoticed (the control)."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver, _ = _room(pe, de, p, 70, verify=True)
    assert receiver.wait(10).state == RoomState.SUCCESS
    for layer in range(SMALL_MODEL.num_layers):
        for a, b in zip(page_bytes(pe.memory, layer, SRC), page_bytes(de.memory, layer, DST)):
            assert torch.equal(a, b)
    corrupt[0] = True
    receiver, sender = _room(pe, de, p, 71, verify=True)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status
    assert "checksum" in status.cause.message and "corrupted" in status.cause.message
    assert _stats(d).checksum_mismatches >= 1
    unverified, _ = _room(pe, de, p, 72, verify=False)
    assert unverified.wait(10).state == RoomState.SUCCESS  # nobody looked
    corrupt[0] = False


def test_the_aux_row_is_covered(fake_brokers, make_engine, corrupt) -> None:
    """A room with no pages, only the aux row: a corrupted row fails it too."""
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    corrupt[0] = True
    receiver = de.handle.receiver(73, SenderRef(p.address, "prefill-group"))
    receiver.init([], aux_row=2, verify_checksum=True)
    sender = pe.handle.sender(73)
    sender.init(0, aux_row=1)
    sender.send([], is_last=True)
    status = receiver.wait(10)
    assert status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_MISMATCH, status


@pytest.mark.parametrize(
    ("ptp", "dtp", "model"),
    [(1, 2, SMALL_MODEL), (2, 1, SMALL_MODEL), (2, 1, replace(SMALL_MODEL, kv_layout="hnd_fused"))],
    ids=["gathered", "staged", "fused"],
)
def test_head_slices_verify_on_both_sides_and_a_broker_flag_verifies_every_room(
    fake_brokers, make_engine, corrupt, ptp: int, dtp: int, model: ModelSpec
) -> None:
    """Different tp sizes: each source checksums the heads it sends, the receiver the same heads of its
    pages (of fused pages too: a head's part of each page); a decode broker started with
    verify_checksums checks rooms that did not ask (and catches a corrupted one)."""
    p, d = fake_brokers("p"), fake_brokers("d", verify_checksums=True)
    pes = [make_engine(p.address, "prefill", tp_size=ptp, tp_rank=r, seed=r + 1, model=model) for r in range(ptp)]
    des = [make_engine(d.address, "decode", tp_size=dtp, tp_rank=r, model=model) for r in range(dtp)]

    def room(room_id: int) -> list[common_pb2.RoomStatus]:
        receivers = [e.handle.receiver(room_id, SenderRef(p.address, "prefill-group")) for e in des]
        for r in receivers:
            r.init(DST, aux_row=2)
        for e in pes:
            sender = e.handle.sender(room_id)
            sender.init(len(SRC), aux_row=1)
            sender.send(SRC[:3])
            sender.send(SRC[3:])
        return [r.wait(10) for r in receivers]

    assert all(s.state == RoomState.SUCCESS for s in room(74))
    assert _stats(d).checksum_mismatches == 0
    corrupt[0] = True
    statuses = room(75)
    corrupt[0] = False
    assert any(s.state == RoomState.FAILED and s.cause.kind == common_pb2.FAILURE_KIND_MISMATCH for s in statuses), statuses


def test_checksums_are_computed_on_the_copy_thread_never_on_the_control_loop(
    fake_brokers, make_engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides read the engine's pages for a chunk checksum on the broker's copy thread: the
    control loop (which serves every engine's calls) never hashes engine memory."""
    import threading

    from kvbroker.broker.execution import _device_copies

    threads: list[str] = []
    real = _device_copies.chunk_checksum

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(_device_copies, "chunk_checksum", recording)
    p, d = fake_brokers("p"), fake_brokers("d")
    pe, de = make_engine(p.address, "prefill"), make_engine(d.address, "decode")
    receiver, _ = _room(pe, de, p, 73, verify=True)
    assert receiver.wait(10).state == RoomState.SUCCESS
    # Two chunks, hashed once by the sender and once by the receiver (packed
    # chunks hash nothing directly, and are checked part by part instead).
    assert threads and set(threads) <= {"kvbroker-copy"}, threads

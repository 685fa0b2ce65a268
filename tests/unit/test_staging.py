"""Staging pools and transfer buffers (``kvbroker.broker.memory``) and ``parts.page_blocks``."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from kvbroker import cudavmm
from kvbroker.broker.memory import (
    StagingBuffer,
    StagingPool,
    StagingPools,
    StagingReservation,
    TransferSlot,
)
from kvbroker.broker.scheduling import Priority, Ticket
from kvbroker.errors import DeadlineExceeded, FailedPrecondition, ResourceExhausted
from kvbroker.plan import BufferPlacement, Layout, build_descriptor_table, page_blocks
from kvbroker.testing.fake_cuda import FakeCudaLib
from kvbroker.v1 import common_pb2


def test_page_blocks_pair_pages_with_packed_blocks_and_merge_runs(layout_proto) -> None:  # type: ignore[no-untyped-def]
    """One descriptor per run of pages adjacent in memory, paired with consecutive packed blocks."""
    layout: Layout = layout_proto(num_layers=1, num_pages=16, aux_row_bytes=()).build()
    table = build_descriptor_table(layout, [BufferPlacement(1 << 20, 1 << 20, 1, 0)])
    page = layout.kv_page_bytes
    regions = tuple(layout.kv_regions.values())  # K and V of layer 0
    pages_side, blocks = page_blocks(table, regions, np.array([3, 4, 9], dtype=np.int32), page, 5000, 7)
    k, v = (table.region_address[r] for r in regions)
    assert pages_side.tolist() == [[k + 3 * page, 2 * page, 0], [k + 9 * page, page, 0], [v + 3 * page, 2 * page, 0], [v + 9 * page, page, 0]]
    assert blocks.tolist() == [[5000, 2 * page, 7], [5000 + 2 * page, page, 7], [5000 + 3 * page, 2 * page, 7], [5000 + 5 * page, page, 7]]


def test_pool_waiters_are_served_in_the_order_they_came() -> None:
    """A large reservation waiting is not passed over by smaller ones that came after it; one that
    times out or is cancelled leaves the queue and lets the next in."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=4 * 4096, kind=1, device_id=0))
        held = [pool.try_reserve(4096) for _ in range(4)]
        order: list[str] = []

        async def want(name: str, nbytes: int, timeout: float = 5.0) -> None:
            reservation = await pool.reserve(nbytes, timeout)
            order.append(name)
            await asyncio.sleep(0.01)
            pool.release(reservation)

        big = asyncio.create_task(want("big", 3 * 4096))
        await asyncio.sleep(0)
        small = asyncio.create_task(want("small", 4096))
        gone = asyncio.create_task(want("gone", 4096, timeout=0.02))
        await asyncio.sleep(0)
        pool.release(held[0])  # one slot free: the small ones wait behind the big one
        await asyncio.sleep(0.05)
        assert order == [] and gone.done() and isinstance(gone.exception(), DeadlineExceeded)
        cancelled = asyncio.create_task(want("cancelled", 4096))
        await asyncio.sleep(0)
        cancelled.cancel()
        for reservation in held[1:3]:
            pool.release(reservation)
        await asyncio.gather(big, small)
        assert order == ["big", "small"] and cancelled.cancelled()
        pool.release(held[3])  # type: ignore[arg-type]
        assert pool.in_use_bytes == 0 and pool.reservations == 0

    asyncio.run(run())


def test_pool_waiters_are_served_by_class_then_deadline_then_fairly_and_an_abandoned_one_leaves() -> None:
    """Behind a full pool, an interactive part that came last is served first, then a bulk part with a
    deadline before the bulk parts without one; between two bulk engines the bytes alternate; a room
    that ends takes its waiter out of the queue (abandon) and it is never served."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=4096, kind=1, device_id=0))
        held = pool.try_reserve(4096)
        order: list[str] = []
        now = time.monotonic()

        async def want(name: str, ticket: Ticket | None, owner: object = None) -> None:
            reservation = await pool.reserve(4096, 5.0, owner=owner, ticket=ticket)
            order.append(name)
            await asyncio.sleep(0)
            pool.release(reservation)

        bulk = [
            ("a1", Ticket(Priority.BULK, "a", 4096)),
            ("a2", Ticket(Priority.BULK, "a", 4096)),
            ("a3", Ticket(Priority.BULK, "a", 4096)),
            ("b1", Ticket(Priority.BULK, "b", 4096)),
            ("b2", Ticket(Priority.BULK, "b", 4096)),
            ("late", Ticket(Priority.BULK, "c", 4096, deadline=now + 1)),
            ("chat", Ticket(Priority.INTERACTIVE, "c", 4096)),
        ]
        tasks = [asyncio.create_task(want(name, ticket)) for name, ticket in bulk]
        gone = asyncio.create_task(want("gone", Ticket(Priority.INTERACTIVE, "d", 4096), owner="room-9"))
        await asyncio.sleep(0)
        pool.abandon("room-9", FailedPrecondition("the room ended"))
        pool.release(held)  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        assert isinstance(gone.exception(), FailedPrecondition)
        assert order[:2] == ["chat", "late"], order
        assert order[2:] in (["a1", "b1", "a2", "b2", "a3"], ["b1", "a1", "b2", "a2", "a3"]), order
        assert pool.in_use_bytes == 0 and pool.waiting == 0

    asyncio.run(run())


def test_pool_waiters_without_tickets_are_first_come_first_served() -> None:
    """--no-priorities gives no tickets: the order of arrival, whatever the rooms' classes."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=4096, kind=1, device_id=0))
        held = pool.try_reserve(4096)
        order: list[int] = []

        async def want(i: int) -> None:
            reservation = await pool.reserve(4096, 5.0)
            order.append(i)
            pool.release(reservation)

        tasks = [asyncio.create_task(want(i)) for i in range(6)]
        await asyncio.sleep(0)
        pool.release(held)  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        assert order == list(range(6))

    asyncio.run(run())


def test_pool_reservations_are_first_fit_aligned_and_merge_back() -> None:
    """Reservations are 4 KiB aligned; released neighbours merge; a full pool waits, then times out."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=16384, kind=1, device_id=0))
        a = pool.try_reserve(100)
        b = pool.try_reserve(5000)
        assert a == StagingReservation(0, 4096) and b == StagingReservation(4096, 8192)
        assert pool.try_reserve(8192) is None and pool.in_use_bytes == 12288
        pool.release(a)
        pool.release(b)
        assert pool.try_reserve(16384) == StagingReservation(0, 16384)
        with pytest.raises(DeadlineExceeded):
            await pool.reserve(4096, 0.05)
        with pytest.raises(ResourceExhausted):
            await pool.reserve(1 << 20, 1.0)

    asyncio.run(run())


def test_a_pool_hands_out_what_it_is_asked_for_and_serves_waiters_in_turn_whatever_they_asked() -> None:
    """One pool, two things by role: a staging reservation (a head-sliced part)
    and a transfer slot (a packed part's send slot, credits, a probe), never
    equal; a waiter gets the kind it asked for, in its turn; either goes back
    alike (the pool never touches the memory)."""

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=1 << 20, size_bytes=16384, kind=common_pb2.MEMORY_KIND_DRAM, device_id=0))
        staged, slot = pool.try_reserve(100), await pool.reserve_slot(5000, 1.0)
        assert type(staged) is StagingReservation and staged == StagingReservation(0, 4096)
        assert type(slot) is TransferSlot and slot == TransferSlot(4096, 8192)
        assert StagingReservation(0, 4096) != TransferSlot(0, 4096), "two kinds of range, never equal"
        first = asyncio.create_task(pool.reserve_slot(8192, 5.0))
        second = asyncio.create_task(pool.reserve(4096, 5.0))
        await asyncio.sleep(0)
        assert not second.done(), "it would fit, but it does not pass the slot waiting before it"
        pool.release(slot)
        granted_first = await first
        assert type(granted_first) is TransferSlot
        pool.release(staged)
        granted_second = await second
        assert type(granted_second) is StagingReservation
        pool.release(granted_first)
        pool.release(granted_second)
        assert pool.in_use_bytes == 0 and pool.reservations == 0

    asyncio.run(run())


class _Plane:
    """The data plane and memory thread as the pools use them: inline, registrations counted."""

    def __init__(self) -> None:
        self.registered: dict[int, tuple[int, int, int, int]] = {}
        self._next = 0

    async def call(self, fn):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)  # a real call awaits the data-plane thread
        return fn(self)

    async def memory(self, fn):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0)
        return fn()

    def register(self, address: int, size: int, kind: int, device: int) -> int:
        self._next += 1
        self.registered[self._next] = (address, size, kind, device)
        return self._next

    def deregister(self, handle: int) -> None:
        del self.registered[handle]


def _pools(plane: _Plane, **sizes: int) -> StagingPools:
    return StagingPools(send_bytes=0, receive_bytes=0, dataplane=plane, workers=plane, **sizes)


def test_a_gpus_transfer_buffers_are_cudamalloc_memory_registered_once() -> None:
    """Send and receive transfer buffers per GPU: cuMemAlloc (never VMM), registered as VRAM on that
    device, made once however many engines ask together, freed with the primary context."""
    fake = FakeCudaLib(devices=2, granularity=4096)
    driver = cudavmm.Driver(fake)
    plane = _Plane()

    async def run() -> None:
        pools = _pools(plane, device_send_bytes=1 << 20, device_receive_bytes=2 << 20)
        await asyncio.gather(*(pools.ensure_device(1, driver) for _ in range(3)))
        assert sorted(plane.registered.values(), key=lambda r: r[1]) == [
            (pools.pool("send", common_pb2.MEMORY_KIND_VRAM, 1).buffer.address, 1 << 20, common_pb2.MEMORY_KIND_VRAM, 1),  # type: ignore[union-attr]
            (pools.pool("receive", common_pb2.MEMORY_KIND_VRAM, 1).buffer.address, 2 << 20, common_pb2.MEMORY_KIND_VRAM, 1),  # type: ignore[union-attr]
        ]
        assert all(fake.memory_kind(a, n) == "cudaMalloc" for a, n, _, _ in plane.registered.values())
        assert "cuMemCreate" not in fake.calls
        await pools.close()
        assert plane.registered == {} and fake.leaks() == []

    asyncio.run(run())


def test_a_gpu_without_room_for_its_buffers_is_refused_by_name_and_keeps_nothing() -> None:
    """A GPU without memory for its transfer buffers is FAILED_PRECONDITION naming the GPU and the CUDA error, with
    nothing registered or leaked; with device buffers off (0) it names --device-buffer-mib 0."""
    fake = FakeCudaLib(devices=1, granularity=4096)
    fake.fail["cuMemAlloc_v2"] = 2  # CUDA_ERROR_OUT_OF_MEMORY
    plane = _Plane()

    async def run() -> None:
        pools = _pools(plane, device_send_bytes=1 << 20, device_receive_bytes=1 << 20)
        with pytest.raises(FailedPrecondition, match="transfer buffers on GPU 0.*OUT_OF_MEMORY"):
            await pools.ensure_device(0, cudavmm.Driver(fake))
        assert plane.registered == {} and fake.leaks() == []
        with pytest.raises(FailedPrecondition, match="--device-buffer-mib 0"):
            await _pools(plane, device_send_bytes=0).ensure_device(0, cudavmm.Driver(fake))

    asyncio.run(run())


def test_a_gpus_transfer_buffers_take_at_most_their_share_of_its_memory() -> None:
    """Each transfer buffer is as configured (the defaults: 1 GiB, eight 128 MiB parts) where
    the GPU has room, and at most DEVICE_SHARE of the GPU's memory where it has not."""
    from kvbroker.broker import BrokerConfig
    from kvbroker.broker.memory import DEVICE_SHARE

    config = BrokerConfig()
    assert config.device_send_bytes == config.device_receive_bytes == 8 * config.device_part_bytes == 1 << 30
    fake = FakeCudaLib(devices=1, granularity=4096)
    driver = cudavmm.Driver(fake)
    plane = _Plane()

    def sizes() -> list[int]:
        return sorted(size for _, size, _, _ in plane.registered.values())

    async def run() -> None:
        pools = _pools(plane, device_send_bytes=8 << 20, device_receive_bytes=16 << 20)
        fake.total_bytes = 80 << 30  # an H100: the configured sizes stand
        await pools.ensure_device(0, driver)
        assert sizes() == [8 << 20, 16 << 20]
        await pools.close()
        fake.total_bytes = 256 << 20  # a small GPU: 1/32 of it each
        pools = _pools(plane, device_send_bytes=8 << 20, device_receive_bytes=16 << 20)
        await pools.ensure_device(0, driver)
        assert sizes() == [int((256 << 20) * DEVICE_SHARE)] * 2 == [8 << 20] * 2
        await pools.close()
        assert fake.leaks() == []

    asyncio.run(run())


def test_a_gpus_send_buffer_keeps_a_slot_that_bulk_parts_never_take() -> None:
    """A send transfer buffer with ``bulk_keep`` leaves that much free of BULK reservations: with
    bulk parts holding every other slot, a part of a class above bulk still gets one at once; a
    bulk waiter first in line that only the kept slot would fit lets a waiting interactive part have
    it; and a bulk part gets a slot only while one more stays free."""
    bulk, chat = Ticket(Priority.BULK, "bulk", 4096), Ticket(Priority.INTERACTIVE, "chat", 4096)

    async def run() -> None:
        pool = StagingPool(StagingBuffer(address=0, size_bytes=4 * 4096, kind=2, device_id=0), bulk_keep=4096)
        held = [pool.try_reserve(4096, bulk) for _ in range(3)]
        assert all(held) and pool.try_reserve(4096, bulk) is None, "bulk leaves the last slot"
        assert (mine := pool.try_reserve(4096, chat)) is not None, "a class above bulk takes it"
        pool.release(mine)
        waiting_bulk = asyncio.create_task(pool.reserve(4096, 5.0, ticket=bulk))
        await asyncio.sleep(0)
        assert not waiting_bulk.done(), "it would take the kept slot"
        waiting_chat = asyncio.create_task(pool.reserve(4096, 5.0, ticket=chat))
        got = await asyncio.wait_for(waiting_chat, 1.0)
        assert got is not None and not waiting_bulk.done()
        pool.release(held[0])  # type: ignore[arg-type]
        await asyncio.sleep(0)
        assert not waiting_bulk.done(), "the slot freed is the one kept free now"
        pool.release(got)
        await asyncio.wait_for(waiting_bulk, 1.0)
        unkept = StagingPool(StagingBuffer(address=0, size_bytes=4 * 4096, kind=2, device_id=0))
        assert all(unkept.try_reserve(4096, bulk) for _ in range(4)), "no keep: bulk takes every slot"

    asyncio.run(run())

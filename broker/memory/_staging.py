"""Staging and transfer buffers: broker-owned memory registered with NIXL, and reservations in it.

Every broker has a host (DRAM) send and receive staging buffer, registered
with NIXL at start, for head-sliced KV between DRAM ranks (docs/design.md
section 6): GATHERED (the receiver holds fewer heads) packs the receiver's
heads of a chunk into a reservation of the send buffer and writes each
packed page straight into the receiver's page; STAGED (the sender holds
fewer heads) writes the sender's whole pages into a reservation the
receiving broker made in its receive buffer (the prefetch,
``PeerBroker.ReserveStaging``), and the receiving broker scatters them.

Per GPU an engine's KV lives on, the broker also allocates a send and a
receive **transfer buffer** (``--device-buffer-mib`` each, at most
``DEVICE_SHARE`` of the GPU's memory) with ``cuMemAlloc`` (``cudavmm.alloc_device``:
legacy, CUDA-IPC capable memory; never a VMM allocation, which a NIXL write
reaches only through a host fallback) and registers them with NIXL as VRAM,
once: they are the only device memory that touches NIXL. The device path
(``packing``) gathers whatever of a chunk lies in VRAM into a slot of the
send buffer, writes it in one descriptor into a slot of the peer's receive
buffer on the target GPU, which scatters it (a side whose KV is in host
memory uses its host staging buffer instead). A GPU's pair is made when the
first engine with KV on it registers (its registration fails if the pair
cannot be made: without it nothing of that engine could move) and freed
when the last one goes.

A pool (:class:`StagingPool`) hands out two things, named by what they
hold: a :class:`StagingReservation` a head-sliced part in host staging, a
:class:`TransferSlot` packed parts (a send slot, a peer's credits, a
probe), in a GPU's transfer buffer or in host staging. Both are first-fit,
4 KiB aligned; one that does not fit waits until another is released:
they bound how many parts are in flight. (A range of a sending peer's
credits, as the receiver holds it, is a ``CreditRange``: it goes back to
that peer, not to the pool.) Pools belong to the control loop; buffers are
allocated on the memory thread and registered on the data-plane thread.
The copies themselves are ``execution._device_copies``, on ``device``'s
lanes.
"""

from __future__ import annotations

import asyncio
import bisect
import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog

from kvbroker import cudavmm
from kvbroker.broker.aio import await_grant
from kvbroker.broker.memory._importers import map_anonymous, unmap
from kvbroker.broker.scheduling import FairQueue, Priority, Ticket, Waiter
from kvbroker.broker.telemetry import QueueObserver, QueueStats
from kvbroker.errors import DeadlineExceeded, FailedPrecondition, KvBrokerError, ResourceExhausted
from kvbroker.v1 import common_pb2, peer_pb2

__all__ = [
    "DEVICE_SHARE",
    "BufferRange",
    "FreeList",
    "StagingBuffer",
    "StagingPool",
    "StagingPools",
    "StagingReservation",
    "TransferSlot",
    "kept_for_classes",
]

DRAM = common_pb2.MEMORY_KIND_DRAM
VRAM = common_pb2.MEMORY_KIND_VRAM
_ALIGN = 4096
#: The most of a GPU's memory each of its transfer buffers (send, receive) may take.
DEVICE_SHARE = 1 / 32

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class StagingReservation:
    """Room for one head-sliced part (GATHERED, STAGED) in a host staging
    buffer: ``nbytes`` at ``offset``, until released to its pool."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class TransferSlot:
    """Room for packed parts (the device path) in a transfer buffer: a part's
    send slot, a range granted to a sending peer as credits, or a transport
    probe's slot: ``nbytes`` at ``offset``, until released to its pool. It lies
    in a GPU's transfer buffer, or in host staging where that side's KV is in
    host memory."""

    offset: int
    nbytes: int


#: Either: what a pool takes back.
BufferRange = StagingReservation | TransferSlot
R = TypeVar("R", bound=BufferRange)


@dataclass(eq=False)
class _RangeWaiter(Waiter[BufferRange]):
    #: What the waiter is granted: a staging reservation or a transfer slot.
    kind: Callable[..., BufferRange] = StagingReservation


class FreeList:
    """Free spans of a buffer, first fit, 4 KiB aligned, merged when adjacent."""

    def __init__(self, spans: list[tuple[int, int]] | None = None) -> None:
        self._free: list[tuple[int, int]] = sorted(spans or [])
        #: The free bytes (kept: summing the spans per part was quadratic in the parts in flight).
        self._bytes = sum(span for _, span in self._free)

    @staticmethod
    def aligned(nbytes: int) -> int:
        return max(_ALIGN, -(-nbytes // _ALIGN) * _ALIGN)

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` (aligned) taken from the first span that fits, or None."""
        size = self.aligned(nbytes)
        for i, (offset, span) in enumerate(self._free):
            if span >= size:
                if span == size:
                    del self._free[i]
                else:
                    self._free[i] = (offset + size, span - size)
                self._bytes -= size
                return offset
        return None

    def give(self, offset: int, nbytes: int) -> None:
        """Free ``nbytes`` (aligned) at ``offset``, merging with its neighbours
        (found by bisection: hundreds of small parts in flight fragment the list)."""
        free, size = self._free, self.aligned(nbytes)
        self._bytes += size
        i = bisect.bisect_left(free, (offset, 0))
        if i > 0 and free[i - 1][0] + free[i - 1][1] == offset:
            i -= 1
            offset, size = free[i][0], free[i][1] + size
            del free[i]
        if i < len(free) and offset + size == free[i][0]:
            size += free[i][1]
            del free[i]
        free.insert(i, (offset, size))

    def free_bytes(self) -> int:
        return self._bytes


@dataclass(eq=False)
class StagingBuffer:
    """A broker-owned buffer registered with NIXL (host memory, or a GPU's)."""

    address: int
    size_bytes: int
    kind: int
    device_id: int
    #: The NIXL registration; set once the data plane registered it.
    registration: Any = None
    #: Unmaps (or frees) the memory; called after deregistration.
    release_memory: Callable[[], None] | None = None
    #: GPU memory: makes its device's primary context current on the calling
    #: thread (the data-plane thread, before it registers the buffer: UCX's
    #: CUDA transports then find a context there, as in a process that
    #: initialised CUDA on its main thread).
    make_current: Callable[[], None] | None = None

    @classmethod
    def host(cls, size_bytes: int) -> StagingBuffer:
        """Zeroed, populated host memory (not yet registered)."""
        address = map_anonymous(size_bytes)
        return cls(address, size_bytes, DRAM, 0, release_memory=lambda: unmap(address, size_bytes))

    @classmethod
    def device(cls, size_bytes: int, ordinal: int, driver: cudavmm.Driver | None) -> StagingBuffer:
        """A transfer buffer on GPU ``ordinal``: ``cuMemAlloc`` memory (not yet registered)."""
        allocation = cudavmm.alloc_device(ordinal, size_bytes, driver)
        return cls(
            allocation.address,
            allocation.size_bytes,
            VRAM,
            allocation.device,
            release_memory=allocation.release,
            make_current=allocation.make_current,
        )

    def descriptor(self) -> peer_pb2.RemoteBuffer:
        """How peers address this buffer."""
        return peer_pb2.RemoteBuffer(
            address=self.address, size_bytes=self.size_bytes, kind=self.kind, device_id=self.device_id  # type: ignore[arg-type]
        )


def kept_for_classes(part_bytes: int, buffer_bytes: int) -> int:
    """The room a GPU's send buffer, or a credit window in a peer's receive buffer
    of ``buffer_bytes``, keeps free of bulk parts for the classes above them: one
    part (``part_bytes``), at most half the buffer, in whole 4 KiB pages."""
    return min(FreeList.aligned(part_bytes), buffer_bytes // 2 // _ALIGN * _ALIGN)


class StagingPool:
    """Room in one buffer (staging reservations and transfer slots), served in the order of their tickets (``scheduling.FairQueue``: class,
    deadline, fair shares between engines, arrival). ``bulk_keep``: the bytes
    a BULK reservation must leave free (a GPU's send transfer buffer keeps a
    part's slot for the classes above bulk, so that an interactive part never
    waits behind bulk parts that hold every slot). Control loop only."""

    def __init__(self, buffer: StagingBuffer, observer: QueueObserver | None = None, bulk_keep: int = 0) -> None:
        self.buffer = buffer
        self.size_bytes = buffer.size_bytes
        self.bulk_keep = bulk_keep
        self._free = FreeList([(0, buffer.size_bytes)])
        #: Reservations waiting for room, in the order they will be served.
        self._waiting: FairQueue[_RangeWaiter] = FairQueue(observer=observer)
        self.in_use_bytes = 0
        self.reservations = 0

    def keep(self, ticket: Ticket | None) -> int:
        """The bytes a reservation with ``ticket`` must leave free."""
        return self.bulk_keep if ticket is not None and ticket.priority == Priority.BULK else 0

    def try_reserve(self, nbytes: int, ticket: Ticket | None = None) -> StagingReservation | None:
        """A staging reservation of ``nbytes`` now, or None if no free span fits (or,
        for a BULK ``ticket``, if it would leave less than ``bulk_keep`` free)."""
        return self._take(nbytes, ticket, StagingReservation)

    def try_reserve_slot(self, nbytes: int, ticket: Ticket | None = None) -> TransferSlot | None:
        """:meth:`try_reserve`, for a transfer slot."""
        return self._take(nbytes, ticket, TransferSlot)

    def _take(self, nbytes: int, ticket: Ticket | None, kind: Callable[..., R]) -> R | None:
        size = FreeList.aligned(nbytes)
        if self.size_bytes - self.in_use_bytes - size < self.keep(ticket):
            return None
        offset = self._free.take(size)
        if offset is None:
            return None
        self.in_use_bytes += size
        self.reservations += 1
        return kind(offset=offset, nbytes=size)

    async def reserve(
        self, nbytes: int, timeout_seconds: float, *, owner: object = None, ticket: Ticket | None = None
    ) -> StagingReservation:
        """A staging reservation of ``nbytes``, waiting for releases up to the timeout (:meth:`_wait`)."""
        return await self._wait(nbytes, timeout_seconds, owner, ticket, StagingReservation)

    async def reserve_slot(
        self, nbytes: int, timeout_seconds: float, *, owner: object = None, ticket: Ticket | None = None
    ) -> TransferSlot:
        """:meth:`reserve`, for a transfer slot."""
        return await self._wait(nbytes, timeout_seconds, owner, ticket, TransferSlot)

    async def _wait(self, nbytes: int, timeout_seconds: float, owner: object, ticket: Ticket | None, kind: type[R]) -> R:
        """``kind`` of ``nbytes``, waiting for releases up to the timeout.

        Waiters are served in the order of their ``ticket`` (none: STANDARD,
        one engine, so first come first served): the next one waits until it
        fits, and no later one passes it meanwhile (a large one is not passed
        over for ever by smaller ones). ``ResourceExhausted`` if it can never
        fit; ``DeadlineExceeded`` if the pool stayed too full; the error given
        to :meth:`abandon` if the wait was for ``owner`` (a room), which no
        longer wants it.
        """
        if nbytes > self.size_bytes:
            raise ResourceExhausted(f"{nbytes} bytes can never fit in the {self.size_bytes}-byte staging buffer")
        if not self._waiting:
            reservation = self._take(nbytes, ticket, kind)
            if reservation is not None:
                return reservation
        future: asyncio.Future[BufferRange] = asyncio.get_running_loop().create_future()
        waiter = _RangeWaiter(nbytes, future, owner, kind)
        self._waiting.push(waiter, ticket or Ticket(Priority.STANDARD, "", nbytes))
        self._grant()  # it may come before those waiting now, and fit
        granted = await await_grant(future, timeout_seconds, give_up=lambda: self._give_up(waiter), undo=self.release)
        if granted is None:
            raise DeadlineExceeded(
                f"the staging buffer stayed full for {timeout_seconds:g} s "
                f"({self.in_use_bytes} of {self.size_bytes} bytes reserved)"
            )
        assert isinstance(granted, kind)
        return granted

    @property
    def waiting(self) -> int:
        """Reservations waiting for room now."""
        return len(self._waiting)

    def abandon(self, owner: object, error: KvBrokerError) -> None:
        """Fail the waits made for ``owner`` with ``error`` (its room ended:
        a slot granted now would only be given back, and the slots it waits
        for may be held by its own room until it settles)."""
        abandoned = [waiter for waiter in self._waiting if waiter.owner == owner]
        for waiter in abandoned:
            self._waiting.remove(waiter)
            if not waiter.future.done():
                waiter.future.set_exception(error)
        if abandoned:
            self._grant()  # the ones behind them may fit now

    def _give_up(self, waiter: _RangeWaiter) -> None:
        if not self._waiting.remove(waiter):
            return
        waiter.future.cancel()
        self._grant()  # the ones behind it may fit now

    def release(self, reservation: BufferRange) -> None:
        """Give ``reservation`` (one of this pool's) back, merging free neighbours,
        and serve the waiters it lets in."""
        self._free.give(reservation.offset, reservation.nbytes)
        self.in_use_bytes -= reservation.nbytes
        self.reservations -= 1
        self._grant()

    def _grant(self) -> None:
        """Reserve for the next waiters while they fit (a BULK one first in line
        that only the kept room would fit lets a waiter of a class above it have it)."""
        while (waiter := self._waiting.peek()) is not None:
            ticket = self._waiting.ticket(waiter)
            reservation: BufferRange | None = self._take(waiter.nbytes, ticket, waiter.kind)
            if reservation is None and self.keep(ticket):
                above = next((w for w in self._waiting if not self.keep(self._waiting.ticket(w))), None)
                if above is not None and (reservation := self._take(above.nbytes, None, above.kind)) is not None:
                    self._waiting.remove(above)
                    above.future.set_result(reservation)
                    continue
            if reservation is None:
                return
            self._waiting.pop()
            waiter.future.set_result(reservation)


class StagingPools:
    """The broker's staging pools and transfer buffers, by direction and (memory kind, device).

    The host send and receive pools exist from :meth:`start` (unless staging
    is off); a GPU's pair (its transfer buffers) is made by
    :meth:`ensure_device` when the first engine with KV on that GPU
    registers, and kept until the broker stops: a buffer freed and made
    again lands at the same address with new NIXL keys, which a peer that
    loaded the old ones cannot take (NIXL 1.5 refuses changed keys of loaded
    memory with NIXL_ERR_NOT_ALLOWED; seen on an H200 when the last engine
    left and the next one came). Buffers are allocated on the memory thread
    and registered on the data-plane thread.
    """

    def __init__(
        self,
        *,
        send_bytes: int,
        receive_bytes: int,
        dataplane: Any,
        workers: Any,
        device_send_bytes: int = 512 << 20,
        device_receive_bytes: int = 512 << 20,
        queues: QueueStats | None = None,
        bulk_keep: int = 0,
    ) -> None:
        self._queues = queues
        self._sizes = {"send": send_bytes, "receive": receive_bytes}
        self._device_sizes = {"send": device_send_bytes, "receive": device_receive_bytes}
        #: What a GPU's send buffer keeps free of bulk parts (at most half of it): a part's slot.
        self._bulk_keep = bulk_keep
        self._dataplane = dataplane
        self._workers = workers
        self._pools: dict[tuple[str, int, int], StagingPool] = {}
        #: GPUs whose pair is being made: later callers wait for it.
        self._busy: dict[int, asyncio.Future[None]] = {}

    @property
    def enabled(self) -> bool:
        return all(self._sizes.values())

    async def start(self) -> None:
        """Make and register the host pools."""
        if self.enabled:
            for direction, size in self._sizes.items():
                buffer = await self._workers.memory(lambda size=size: StagingBuffer.host(size))
                await self._register(direction, buffer)

    async def ensure_device(self, device: int, driver: cudavmm.Driver | None) -> None:
        """Make GPU ``device``'s transfer buffers if they do not exist yet.
        ``FailedPrecondition`` (nothing kept) if the GPU cannot give them."""
        await self._wait_for(device)
        if ("send", VRAM, device) in self._pools:
            return
        if not all(self._device_sizes.values()):
            raise FailedPrecondition("the device transfer buffers are off (--device-buffer-mib 0): VRAM cannot move")
        with self._claim(device):
            made: list[tuple[str, StagingBuffer]] = []
            try:
                sizes = await self._workers.memory(lambda: self._bounded_sizes(device, driver))
                for direction, size in sizes.items():
                    buffer = await self._workers.memory(lambda size=size: StagingBuffer.device(size, device, driver))
                    made.append((direction, buffer))
                    await self._register(direction, buffer)
            except Exception as exc:
                for direction, buffer in made:
                    self._pools.pop((direction, VRAM, device), None)
                    await self._release(buffer)
                log.warning("device_buffers_unavailable", device=device, error=repr(exc))
                if isinstance(exc, KvBrokerError):
                    raise FailedPrecondition(f"cannot make the transfer buffers on GPU {device}: {exc.message}") from exc
                raise FailedPrecondition(f"cannot make the transfer buffers on GPU {device}: {exc!r}") from exc

    def _bounded_sizes(self, device: int, driver: cudavmm.Driver | None) -> dict[str, int]:
        """Each transfer buffer's size on GPU ``device``: as configured, but at
        most ``DEVICE_SHARE`` of the GPU's memory (memory thread)."""
        drv = driver or cudavmm.default_driver()
        total_bytes = ctypes.c_size_t()
        drv.call("cuDeviceTotalMem_v2", ctypes.byref(total_bytes), drv.device(device))
        total = total_bytes.value
        cap = max(_ALIGN, int(total * DEVICE_SHARE) // _ALIGN * _ALIGN)
        sizes = {direction: min(size, cap) for direction, size in self._device_sizes.items()}
        if sizes != self._device_sizes:
            log.info(
                "device_buffers_bounded",
                device=device,
                gpu_bytes=total,
                share=DEVICE_SHARE,
                asked=self._device_sizes,
                made=sizes,
            )
        return sizes

    async def _wait_for(self, device: int) -> None:
        while (busy := self._busy.get(device)) is not None:
            await asyncio.shield(busy)

    def _claim(self, device: int) -> _Claim:
        return _Claim(self._busy, device)

    def queue_observer(self, queue: str) -> QueueObserver | None:
        """What a queue for room in these pools, or in a peer's (``credits``), reports to (GetStats)."""
        return self._queues.observer(queue) if self._queues is not None else None

    def pool(self, direction: str, kind: int, device: int) -> StagingPool | None:
        """The ``"send"`` or ``"receive"`` pool for memory ``kind`` on ``device``."""
        return self._pools.get((direction, kind, 0 if kind == DRAM else device))

    def keys(self, direction: str) -> list[tuple[int, int]]:
        """The (memory kind, device) of every ``"send"`` or ``"receive"`` pool."""
        return [(kind, device) for d, kind, device in self._pools if d == direction]

    def send_bytes(self, kind: int, device: int) -> int:
        """Size of the send pool for this memory (0: none: no staging)."""
        pool = self.pool("send", kind, device)
        return pool.size_bytes if pool is not None else 0

    def receive_buffers(self) -> list[peer_pb2.RemoteBuffer]:
        """The receive buffers peers may write into (handshake)."""
        return [p.buffer.descriptor() for (d, _, _), p in self._pools.items() if d == "receive"]

    def abandon(self, direction: str, owner: object, error: KvBrokerError) -> None:
        """Fail the waits for room made for ``owner`` in every ``direction`` pool (:meth:`StagingPool.abandon`)."""
        for (d, _, _), pool in self._pools.items():
            if d == direction and pool.waiting:
                pool.abandon(owner, error)

    def in_use_bytes(self, direction: str) -> int:
        return sum(p.in_use_bytes for (d, _, _), p in self._pools.items() if d == direction)

    def buffers(self) -> list[StagingBuffer]:
        """Every buffer here (registered with NIXL)."""
        return [p.buffer for p in self._pools.values()]

    async def close(self) -> None:
        for key in list(self._pools):
            pool = self._pools.pop(key)
            await self._release(pool.buffer)

    async def _register(self, direction: str, buffer: StagingBuffer) -> None:
        def register(agent: Any) -> Any:
            if buffer.make_current is not None:
                buffer.make_current()
            return agent.register(buffer.address, buffer.size_bytes, buffer.kind, buffer.device_id)

        try:
            buffer.registration = await self._dataplane.call(register)
        except BaseException:
            await self._release(buffer)
            raise
        device_send = direction == "send" and buffer.kind == VRAM
        keep = kept_for_classes(self._bulk_keep, buffer.size_bytes) if device_send and self._bulk_keep else 0
        self._pools[(direction, buffer.kind, buffer.device_id)] = StagingPool(buffer, self.queue_observer(f"{direction}_slots"), keep)

    async def _release(self, buffer: StagingBuffer) -> None:
        if buffer.registration is not None:
            registration, buffer.registration = buffer.registration, None
            await self._dataplane.call(lambda agent: agent.deregister(registration))
        if buffer.release_memory is not None:
            release, buffer.release_memory = buffer.release_memory, None
            await self._workers.memory(release)


class _Claim:
    """Marks a GPU's pair as being made or freed for the duration of a ``with``."""

    def __init__(self, busy: dict[int, asyncio.Future[None]], device: int) -> None:
        self._busy, self._device = busy, device

    def __enter__(self) -> None:
        self._busy[self._device] = asyncio.get_running_loop().create_future()

    def __exit__(self, *_: object) -> None:
        self._busy.pop(self._device).set_result(None)

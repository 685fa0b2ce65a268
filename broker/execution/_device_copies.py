"""Device copies: between engines' pages (VRAM, or host memory) and the slots
of the transfer buffers, each on its memory's lane.

A chunk's checksum (when its receiver verifies) is computed over the
engine's pages on the copy thread, on both sides. A staged or packed part is gathered from the source's pages into its slot of
the local send buffer before it is posted (a packed part with its CRC-32, when
its receiver asked to verify it); a landed one is scattered from its receive
slot into the receiving rank's pages, its checksum checked first: a part that
arrived corrupted is never scattered. Each copy runs on its memory's lane
(``device.Lanes``: a GPU's stream, or the copy thread for host memory), never
on the control loop.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import structlog
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import Workers, settle_later
from kvbroker.broker.device import (
    ArrayViews,
    Extent,
    Lanes,
    Work,
    checksum,
    gather,
    scatter,
)
from kvbroker.broker.execution._tickets import side_ticket
from kvbroker.broker.memory import (
    BufferRange,
    CreditRange,
    Engine,
    StagingBuffer,
    StagingPool,
    StagingPools,
    array_at,
)
from kvbroker.broker.scheduling import Ticket
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError, Unimplemented
from kvbroker.plan import Block, ChunkSum, chunk_checksum
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.execution._receiving_parts import ReceivingPart

__all__ = ["DeviceCopies", "as_broker_error", "extents", "host_region", "slot_of"]

log = structlog.get_logger(__name__)


class DeviceCopies:
    """The device copies: gathers parts from engines' pages into send slots, scatters
    landed ones into pages, checksums chunks. Control loop only."""

    def __init__(
        self, *, pools: StagingPools, views: ArrayViews, lanes: Lanes, workers: Workers, priorities: bool = True
    ) -> None:
        self._pools = pools
        #: Copies queue by their rooms' tickets (``scheduling``); off: in order.
        self._priorities = priorities
        self._workers = workers
        self._views = views
        self._lanes = lanes

    async def gather(
        self,
        engine: Engine,
        blocks: Sequence[Block],
        buffer: StagingBuffer,
        slot: Extent,
        parent: Span,
        *,
        with_checksum: bool,
        ticket: Ticket | None = None,
    ) -> int | None:
        """Gather ``blocks`` of ``engine``'s pages into ``slot`` of ``buffer`` (in a
        span of its own under ``parent``); the slot's CRC-32 when
        ``with_checksum``. ``ticket``: its place among the copies waiting."""
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self.gather_then(engine, blocks, buffer, slot, parent, with_checksum=with_checksum, then=settle_later(future), ticket=ticket)
        return await future

    def gather_then(
        self,
        engine: Engine,
        blocks: Sequence[Block],
        buffer: StagingBuffer,
        slot: Extent,
        parent: Span,
        *,
        with_checksum: bool,
        then: Callable[[int | None, BaseException | None], None],
        ticket: Ticket | None = None,
        times: dict[str, float] | None = None,
    ) -> None:
        """:meth:`gather` as a job of its own on its lane, with an event of its own:
        ``then(checksum, error)`` hears how it went on the lane's thread as soon as
        it is done (``times["gather_start"]``: when it was launched)."""
        span = telemetry.start_span("kvbroker.staging.gather", parent=parent, attributes={"kvbroker.bytes": slot.nbytes})
        regions = [extents(engine, block) for block in blocks]
        views = self._views

        def job() -> Callable[[], int | None]:
            gather(views, blocks, regions, slot)
            crc = checksum(views, slot) if with_checksum else None
            return lambda: None if crc is None else int(crc)

        def done(result: int | None, error: BaseException | None) -> None:
            span.end()
            then(result, error)

        def started() -> None:
            if times is not None:
                times["gather_start"] = time.monotonic()

        self._lanes.launch(slot, job, done, ticket if self._priorities else None, Work("gather", slot.nbytes), started)

    async def chunk_checksum(self, engine: Engine, what: ChunkSum) -> tuple[int | None, KvBrokerError | None]:
        """The CRC-32 of ``what`` in ``engine``'s pages, read on the copy
        thread (host memory only: a chunk's direct bytes); or why it could not be."""
        try:
            return await self._workers.copy(partial(chunk_checksum, engine.layout, partial(host_region, engine), what)), None
        except Exception as exc:
            return None, as_broker_error(exc, "checksumming a chunk")

    def scatter_then(self, part: ReceivingPart, then: Callable[[ReceivingPart], None]) -> None:
        """Unpack one landed staged or packed part into its rank's pages, as a job
        of its own on its lane; a packed part's checksum, when its sender sent one,
        first, in a job before it (a part that arrived corrupted is never
        scattered). ``then(part)`` hears of it on the lane's thread as soon as it
        is done (or here, if it could not start), ``part`` saying how it went."""
        rank, landing = part.rank, part.landing

        def done(error: KvBrokerError | None) -> None:
            part.done(error)
            then(part)

        pool = self._pools.pool("receive", *landing.pool)
        if pool is None:
            done(FailedPrecondition("the receive staging pool of this part is gone"))
            return
        slot = slot_of(pool, landing.held, landing.nbytes)
        blocks, regions = landing.blocks, [extents(rank.engine, block) for block in landing.blocks]
        ticket = side_ticket(rank, landing.nbytes, self._priorities)
        notice, views, lanes = landing.notice, self._views, self._lanes

        def scatter_job() -> Callable[[], None]:
            scatter(views, slot, blocks, regions)
            return lambda: None

        def scattered(_: None, error: BaseException | None) -> None:
            done(as_broker_error(error, "scattering a staged part") if error is not None else None)

        if not notice.HasField("packed_checksum"):
            lanes.launch(slot, scatter_job, scattered, ticket, Work("scatter", landing.nbytes), part.scatter_started)
            return

        def check_job() -> Callable[[], int]:
            crc = checksum(views, slot)
            return lambda: int(crc)

        def checked(crc: int | None, error: BaseException | None) -> None:
            part.checked_crc(error is None and crc != notice.packed_checksum)
            if error is not None:
                done(as_broker_error(error, "checksumming a packed part"))
            elif part.mismatch:
                done(FailedPrecondition(
                    f"packed part {notice.part} of chunk {notice.chunk_index} from source {landing.key[0]} arrived "
                    f"with checksum {crc:08x}, the sender wrote {notice.packed_checksum:08x}: the transport corrupted it"
                ))
            else:  # (from the lane's thread: the scatter queues behind the check on the same lane)
                lanes.launch(slot, scatter_job, scattered, ticket, Work("scatter", landing.nbytes), part.scatter_started)

        lanes.launch(slot, check_job, checked, ticket, Work("checksum", landing.nbytes))


def extents(engine: Engine, block: Block) -> list[Extent]:
    """Where ``block``'s regions lie in this broker (kept per engine
    registration and set of regions: every part of a room names the same)."""
    key = (engine.engine_id, block.regions)
    found = _EXTENTS.get(key)
    if found is None:
        found = [Extent(*engine.region_address(region)) for region in block.regions]
        with _EXTENTS_LOCK:
            if len(_EXTENTS) >= _EXTENTS_KEPT:
                _EXTENTS.pop(next(iter(_EXTENTS)))
            _EXTENTS[key] = found
    return found


#: extents() of recent (engine, regions), oldest first. An engine id is never
#: reused, so an entry can only go stale, never wrong. The loop and the
#: data-plane thread (packed notices it takes itself) both fill it.
_EXTENTS: dict[tuple[str, tuple[int, ...]], list[Extent]] = {}
_EXTENTS_KEPT = 4096
_EXTENTS_LOCK = threading.Lock()


def host_region(engine: Engine, region: int) -> np.ndarray:
    """Region ``region`` of ``engine`` as a flat uint8 array over the broker's mapping."""
    address, length, kind, _ = engine.region_address(region)
    if kind != common_pb2.MEMORY_KIND_DRAM:
        raise Unimplemented(
            f"checksums read host memory only; region {region} of {engine.label} is in VRAM: turn verify_checksum off"
        )
    return array_at(address, length)


def slot_of(pool: StagingPool, held: BufferRange | CreditRange, nbytes: int) -> Extent:
    """The first ``nbytes`` of ``held`` (a staging reservation or transfer slot of
    ``pool``, or a range of a sender's credits in it) in ``pool``'s buffer."""
    buffer = pool.buffer
    return Extent(buffer.address + held.offset, nbytes, buffer.kind, buffer.device_id)


def as_broker_error(exc: BaseException, doing: str) -> KvBrokerError:
    """``exc`` as it fails a room (a bug inside the broker is logged with its traceback)."""
    if isinstance(exc, KvBrokerError):
        return exc
    log.error("copy_failed", doing=doing, error=repr(exc), exc_info=exc)
    return Internal(f"{doing} failed inside the broker: {exc!r}")

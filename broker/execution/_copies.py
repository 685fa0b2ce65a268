"""Staging copies: between engines' pages and staging slots, on the device lanes.

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

from collections.abc import Callable, Sequence
from functools import partial

import numpy as np
import structlog
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import Workers
from kvbroker.broker.device import ArrayViews, Extent, Lanes, checksum, gather, scatter
from kvbroker.broker.memory import Engine, Reservation, StagingPool, StagingPools, array_at
from kvbroker.broker.rooms import Scatter
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError, Unimplemented
from kvbroker.plan import Block, ChunkSum, chunk_checksum
from kvbroker.v1 import common_pb2

__all__ = ["StagingCopies", "as_broker_error", "extents", "host_region", "slot_of"]

log = structlog.get_logger(__name__)


class StagingCopies:
    """Gathers parts into send slots and scatters landed ones into pages. Control loop only."""

    def __init__(self, *, pools: StagingPools, views: ArrayViews, lanes: Lanes, workers: Workers, counters: Counters) -> None:
        self._pools = pools
        self._workers = workers
        self._views = views
        self._lanes = lanes
        self._counters = counters

    async def gather(self, engine: Engine, blocks: Sequence[Block], slot: Extent, parent: Span, *, with_checksum: bool) -> int | None:
        """Gather ``blocks`` of ``engine``'s pages into ``slot`` (in a span of
        its own under ``parent``); the slot's CRC-32 when ``with_checksum``."""
        regions = [extents(engine, block) for block in blocks]
        gathering = telemetry.start_span("kvbroker.staging.gather", parent=parent, attributes={"kvbroker.bytes": slot.nbytes})

        def job() -> Callable[[], int | None]:
            gather(self._views, blocks, regions, slot)
            crc = checksum(self._views, slot) if with_checksum else None
            return lambda: None if crc is None else int(crc)

        try:
            return await self._lanes.run(slot, job)
        finally:
            gathering.end()

    async def chunk_checksum(self, engine: Engine, what: ChunkSum) -> tuple[int | None, KvBrokerError | None]:
        """The CRC-32 of ``what`` in ``engine``'s pages, read on the copy
        thread (host memory only: a chunk's direct bytes); or why it could not be."""
        try:
            return await self._workers.copy(partial(chunk_checksum, engine.layout, partial(host_region, engine), what)), None
        except Exception as exc:
            return None, as_broker_error(exc, "checksumming a chunk")

    async def scatter(self, effect: Scatter) -> KvBrokerError | None:
        """Unpack a landed staged or packed part into the rank's pages (a packed
        part's checksum, when the sender sent one, is checked first: a part that
        arrived corrupted is never scattered). Why it could not, or None."""
        rank, landing = effect.receiver, effect.landing
        error: KvBrokerError | None = None
        pool = self._pools.pool("receive", *landing.pool)
        span = telemetry.start_span(
            "kvbroker.staging.scatter",
            parent=rank.span,
            attributes={"kvbroker.bytes": landing.nbytes, "kvbroker.chunk": landing.key[1], "kvbroker.source": str(landing.key[0])},
        )
        try:
            if pool is None:
                raise FailedPrecondition("the receive staging pool of this part is gone")
            slot = slot_of(pool, landing.reservation, landing.nbytes)
            notice = landing.notice
            if notice.HasField("packed_checksum"):

                def crc_job() -> Callable[[], int]:
                    crc = checksum(self._views, slot)
                    return lambda: int(crc)

                got = await self._lanes.run(slot, crc_job)
                self._counters.packed_checksums_checked += 1
                if got != notice.packed_checksum:
                    self._counters.checksum_mismatches += 1
                    raise FailedPrecondition(
                        f"packed part {notice.part} of chunk {notice.chunk_index} from source {landing.key[0]} arrived "
                        f"with checksum {got:08x}, the sender wrote {notice.packed_checksum:08x}: the transport corrupted it"
                    )
            regions = [extents(rank.engine, block) for block in landing.blocks]

            def job() -> Callable[[], None]:
                scatter(self._views, slot, landing.blocks, regions)
                return lambda: None

            await self._lanes.run(slot, job)
        except Exception as exc:
            error = as_broker_error(exc, "scattering a staged part")
        finally:
            span.end()
        return error


def extents(engine: Engine, block: Block) -> list[Extent]:
    """Where ``block``'s regions lie in this broker (kept per engine
    registration and set of regions: every part of a room names the same)."""
    key = (engine.engine_id, block.regions)
    found = _EXTENTS.get(key)
    if found is None:
        found = [Extent(*engine.region_address(region)) for region in block.regions]
        if len(_EXTENTS) >= _EXTENTS_KEPT:
            _EXTENTS.pop(next(iter(_EXTENTS)))
        _EXTENTS[key] = found
    return found


#: extents() of recent (engine, regions), oldest first. An engine id is never
#: reused, so an entry can only go stale, never wrong. Control loop only.
_EXTENTS: dict[tuple[str, tuple[int, ...]], list[Extent]] = {}
_EXTENTS_KEPT = 4096


def host_region(engine: Engine, region: int) -> np.ndarray:
    """Region ``region`` of ``engine`` as a flat uint8 array over the broker's mapping."""
    address, length, kind, _ = engine.region_address(region)
    if kind != common_pb2.MEMORY_KIND_DRAM:
        raise Unimplemented(
            f"checksums read host memory only; region {region} of {engine.label} is in VRAM: turn verify_checksum off"
        )
    return array_at(address, length)


def slot_of(pool: StagingPool, reservation: Reservation, nbytes: int) -> Extent:
    """The first ``nbytes`` of ``reservation`` in ``pool``'s buffer."""
    buffer = pool.buffer
    return Extent(buffer.address + reservation.offset, nbytes, buffer.kind, buffer.device_id)


def as_broker_error(exc: Exception, doing: str) -> KvBrokerError:
    """``exc`` as it fails a room (a bug inside the broker is logged with its traceback)."""
    if isinstance(exc, KvBrokerError):
        return exc
    log.error("copy_failed", doing=doing, error=repr(exc), exc_info=exc)
    return Internal(f"{doing} failed inside the broker: {exc!r}")

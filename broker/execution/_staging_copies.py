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

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import structlog
from opentelemetry.trace import Span

from kvbroker.broker import telemetry
from kvbroker.broker.dataplane import Workers
from kvbroker.broker.device import (
    ArrayViews,
    Extent,
    Lanes,
    Work,
    checksum,
    gather_all,
    scatter_all,
)
from kvbroker.broker.execution._tickets import side_ticket
from kvbroker.broker.memory import (
    Engine,
    Reservation,
    StagingBuffer,
    StagingPool,
    StagingPools,
    array_at,
)
from kvbroker.broker.rooms import Scatter
from kvbroker.broker.scheduling import Ticket, joint_ticket
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError, Unimplemented
from kvbroker.plan import Block, ChunkSum, chunk_checksum
from kvbroker.v1 import common_pb2

__all__ = ["StagingCopies", "as_broker_error", "extents", "host_region", "slot_of"]

log = structlog.get_logger(__name__)


class StagingCopies:
    """Gathers parts into send slots and scatters landed ones into pages. Control loop only."""

    def __init__(
        self, *, pools: StagingPools, views: ArrayViews, lanes: Lanes, workers: Workers, counters: Counters, priorities: bool = True
    ) -> None:
        self._pools = pools
        #: Copies queue by their rooms' tickets (``scheduling``); off: in order.
        self._priorities = priorities
        self._workers = workers
        self._views = views
        self._lanes = lanes
        self._counters = counters
        #: Gathers asked for in this pass of the loop: handed to their lanes at its end.
        self._gathering: list[_Gather] = []

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
        span of its own under ``parent``), on its own (a staged head slice: not
        batched); the slot's CRC-32 when ``with_checksum``. ``ticket``: its
        place among the copies waiting."""
        asked = self._ask(engine, blocks, buffer, slot, parent, with_checksum, None, ticket)
        self._submit([asked])
        return await asked.future

    def gather_soon(
        self,
        engine: Engine,
        blocks: Sequence[Block],
        buffer: StagingBuffer,
        slot: Extent,
        parent: Span,
        *,
        with_checksum: bool,
        then: Callable[[asyncio.Future[int | None]], None] | None = None,
        ticket: Ticket | None = None,
    ) -> asyncio.Future[int | None]:
        """:meth:`gather`, its outcome in a future (``then``: called with it once
        done). The gathers asked for in one pass of the loop go to their lanes
        together, one job a buffer and priority class (``device.gather_all``:
        two index ops per shape of block for all of them)."""
        asked = self._ask(engine, blocks, buffer, slot, parent, with_checksum, then, ticket)
        self._gathering.append(asked)
        if len(self._gathering) == 1:
            asyncio.get_running_loop().call_soon(self._gather_batch)
        return asked.future

    def _ask(
        self,
        engine: Engine,
        blocks: Sequence[Block],
        buffer: StagingBuffer,
        slot: Extent,
        parent: Span,
        with_checksum: bool,
        then: Callable[[asyncio.Future[int | None]], None] | None,
        ticket: Ticket | None,
    ) -> _Gather:
        span = telemetry.start_span("kvbroker.staging.gather", parent=parent, attributes={"kvbroker.bytes": slot.nbytes})
        whole = Extent(buffer.address, buffer.size_bytes, buffer.kind, buffer.device_id)
        future: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        ticket = ticket if self._priorities else None
        return _Gather(slot, blocks, [extents(engine, block) for block in blocks], whole, with_checksum, span, future, then, ticket)

    def _submit(self, gathers: list[_Gather]) -> None:
        """Hand ``gathers`` (slots of one buffer) to their lane as one job."""
        ticket = joint_ticket(g.ticket for g in gathers)
        work = Work("gather", sum(g.slot.nbytes for g in gathers))
        self._lanes.submit(gathers[0].slot, partial(self._gather_job, gathers), ticket, work).add_done_callback(partial(_gathered, gathers))

    def _gather_batch(self) -> None:
        batch, self._gathering = self._gathering, []
        by_buffer: dict[tuple[int, int], list[_Gather]] = {}
        for asked in batch:
            by_buffer.setdefault((asked.buffer.address, asked.ticket.priority if asked.ticket else 0), []).append(asked)
        for gathers in by_buffer.values():
            self._submit(gathers)

    def _gather_job(self, gathers: list[_Gather]) -> Callable[[], list[int | None | Exception]]:
        """On the lane's thread: gather them all, then each one's checksum if asked for."""
        failed = gather_all(self._views, gathers[0].buffer, [(g.slot, g.blocks, g.regions) for g in gathers])
        sums: list[Any] = []
        for k, asked in enumerate(gathers):
            if k in failed or not asked.with_checksum:
                sums.append(failed.get(k))
                continue
            try:
                sums.append(checksum(self._views, asked.slot))
            except Exception as exc:  # this part fails, the others go on
                sums.append(exc)
        return lambda: [c if c is None or isinstance(c, Exception) else int(c) for c in sums]

    async def chunk_checksum(self, engine: Engine, what: ChunkSum) -> tuple[int | None, KvBrokerError | None]:
        """The CRC-32 of ``what`` in ``engine``'s pages, read on the copy
        thread (host memory only: a chunk's direct bytes); or why it could not be."""
        try:
            return await self._workers.copy(partial(chunk_checksum, engine.layout, partial(host_region, engine), what)), None
        except Exception as exc:
            return None, as_broker_error(exc, "checksumming a chunk")

    async def scatter(self, effects: Sequence[Scatter]) -> list[KvBrokerError | None]:
        """Unpack landed staged or packed parts into their ranks' pages: those
        that landed together go to their lane as one job (a notification
        batch lands several parts; one job each made the copy thread and the
        loop trade the GIL per part). A packed part's checksum, when its
        sender sent one, is checked first: a part that arrived corrupted is
        never scattered. Why each could not, or None, in order."""
        errors: list[KvBrokerError | None] = [None] * len(effects)
        slots: list[Extent | None] = []
        spans = []
        for i, effect in enumerate(effects):
            rank, landing = effect.receiver, effect.landing
            if rank.span is not None and not telemetry.records_children(rank.span):
                spans.append(rank.span)  # an untraced room: no span (nor its attributes) to make
            else:
                spans.append(
                    telemetry.start_span(
                        "kvbroker.staging.scatter",
                        parent=rank.span,
                        attributes={"kvbroker.bytes": landing.nbytes, "kvbroker.chunk": landing.key[1], "kvbroker.source": str(landing.key[0])},
                    )
                )
            pool = self._pools.pool("receive", *landing.pool)
            if pool is None:
                errors[i] = FailedPrecondition("the receive staging pool of this part is gone")
                slots.append(None)
            else:
                slots.append(slot_of(pool, landing.reservation, landing.nbytes))
        try:
            summed = [i for i, effect in enumerate(effects) if slots[i] is not None and effect.landing.notice.HasField("packed_checksum")]
            tickets = [side_ticket(effect.receiver, effect.landing.nbytes, self._priorities) for effect in effects]
            for lane in _by_lane(summed, slots, tickets):
                await self._check(lane, effects, slots, errors, joint_ticket(tickets[i] for i in lane))
            for lane in _by_lane([i for i in range(len(effects)) if errors[i] is None], slots, tickets):
                await self._scatter(lane, effects, slots, errors, joint_ticket(tickets[i] for i in lane))
        finally:
            for span in spans:
                span.end()
        return errors

    async def _check(
        self,
        lane: list[int],
        effects: Sequence[Scatter],
        slots: Sequence[Extent | None],
        errors: list[KvBrokerError | None],
        ticket: Ticket | None,
    ) -> None:
        """The checksums of the packed parts ``lane`` (indices, one lane's) against their senders'."""

        def job() -> Callable[[], list[int]]:
            crcs = [checksum(self._views, _slot(slots, i)) for i in lane]
            return lambda: [int(crc) for crc in crcs]

        try:
            got = await self._lanes.run(_slot(slots, lane[0]), job, ticket, Work("checksum", sum(_slot(slots, i).nbytes for i in lane)))
        except Exception as exc:
            error = as_broker_error(exc, "checksumming a packed part")
            for i in lane:
                errors[i] = error
            return
        for i, crc in zip(lane, got):
            notice = effects[i].landing.notice
            self._counters.packed_checksums_checked += 1
            if crc != notice.packed_checksum:
                self._counters.checksum_mismatches += 1
                errors[i] = FailedPrecondition(
                    f"packed part {notice.part} of chunk {notice.chunk_index} from source {effects[i].landing.key[0]} arrived "
                    f"with checksum {crc:08x}, the sender wrote {notice.packed_checksum:08x}: the transport corrupted it"
                )

    async def _scatter(
        self,
        lane: list[int],
        effects: Sequence[Scatter],
        slots: Sequence[Extent | None],
        errors: list[KvBrokerError | None],
        ticket: Ticket | None,
    ) -> None:
        """Scatter the parts ``lane`` (indices, one lane's) in one job; a part whose copy raised fails alone."""
        parts = [(_slot(slots, i), effects[i].landing.blocks, [extents(effects[i].receiver.engine, b) for b in effects[i].landing.blocks]) for i in lane]
        pool = self._pools.pool("receive", *effects[lane[0]].landing.pool)
        assert pool is not None  # (slots were found in it)
        buffer = Extent(pool.buffer.address, pool.buffer.size_bytes, pool.buffer.kind, pool.buffer.device_id)

        def job() -> Callable[[], dict[int, Exception]]:
            failed = scatter_all(self._views, buffer, parts)
            return lambda: failed

        try:
            failed = await self._lanes.run(_slot(slots, lane[0]), job, ticket, Work("scatter", sum(slot.nbytes for slot, _, _ in parts)))
        except Exception as exc:
            failed = dict.fromkeys(range(len(lane)), exc)
        for k, raised in failed.items():
            errors[lane[k]] = as_broker_error(raised, "scattering a staged part")


@dataclass(eq=False, slots=True)
class _Gather:
    """A gather asked for in this pass of the loop."""

    slot: Extent
    blocks: Sequence[Block]
    regions: list[list[Extent]]
    #: The transfer or staging buffer the slot lies in.
    buffer: Extent
    with_checksum: bool
    span: Span
    future: asyncio.Future[int | None]
    then: Callable[[asyncio.Future[int | None]], None] | None
    ticket: Ticket | None = None


def _gathered(gathers: list[_Gather], done: asyncio.Future[list[int | None | Exception]]) -> None:
    """A batch of gathers is done (or failed as one): each one's outcome, span and continuation."""
    outcomes: list[int | None | Exception]
    if done.cancelled():
        outcomes = [Internal("a batch of gathers was cancelled")] * len(gathers)
    elif (error := done.exception()) is not None:
        outcomes = [error if isinstance(error, Exception) else Internal(repr(error))] * len(gathers)
    else:
        outcomes = done.result()
    for asked, outcome in zip(gathers, outcomes):
        asked.span.end()
        if asked.future.done():  # its awaiter gave up (the broker is stopping): it stays cancelled
            pass
        elif isinstance(outcome, Exception):
            asked.future.set_exception(outcome)
        else:
            asked.future.set_result(outcome)
        if asked.then is not None:  # (which gives the slot back, whatever the outcome)
            asked.then(asked.future)


def _slot(slots: Sequence[Extent | None], i: int) -> Extent:
    slot = slots[i]
    assert slot is not None
    return slot


def _by_lane(indices: Sequence[int], slots: Sequence[Extent | None], tickets: Sequence[Ticket | None]) -> list[list[int]]:
    """``indices`` grouped by the memory of their slots (one lane each) and
    their class, the higher classes first; in order within a group."""
    lanes: dict[tuple[int, int, int], list[int]] = {}
    for i in indices:
        slot, ticket = _slot(slots, i), tickets[i]
        lanes.setdefault((-(ticket.priority if ticket else 0), slot.kind, slot.device), []).append(i)
    return [lanes[key] for key in sorted(lanes)]


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

"""What every call route asks of a room side: which side an engine holds,
whether its pages may still be written, and the few request checks they share."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog
from opentelemetry import context as otel_context

from kvbroker.broker.memory import Engine
from kvbroker.broker.rooms import RoomTables, Side, Source
from kvbroker.errors import FailedPrecondition, InvalidArgument
from kvbroker.plan import DescriptorTable, IndexArray, decode_indices
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2

__all__ = [
    "NO_TRACE",
    "check_version",
    "decode_state",
    "settled",
    "side_of",
    "sides",
    "table_vram_devices",
    "vram_devices",
    "wait_settled",
]

log = structlog.get_logger(__name__)

#: The context of a command or registration that carries none: no parent span.
NO_TRACE = otel_context.Context()


def sides(rooms: RoomTables) -> Iterable[Side]:
    """Every room side held (sources, then receivers)."""
    return (*rooms.all_sources(), *rooms.all_receivers())


def side_of(rooms: RoomTables, engine: Engine, room: int) -> Side | None:
    """``engine``'s side of ``room``, if it has one here."""
    if engine.role == common_pb2.ROLE_PREFILL:
        sroom = rooms.sender.get(room)
        return sroom.sources.get(engine.key) if sroom is not None else None
    rroom = rooms.receiver.get(room)
    return rroom.ranks.get(engine.key) if rroom is not None else None


def settled(side: Side) -> bool:
    """No transfer can still write into this side's pages (a source's are only read)."""
    return isinstance(side, Source) or side.pages_settled


def _unsettled(side: Side) -> bool:
    """A source with parts in flight, or a receiver whose pages may still be written."""
    if isinstance(side, Source):
        return side.inflight > 0
    return not side.pages_settled


async def wait_settled(rooms: RoomTables, engines: list[Engine], timeout_seconds: float) -> None:
    """Until no side of ``engines`` has a transfer that may still touch its pages (or the timeout)."""
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if not any(_unsettled(s) for s in sides(rooms) if s.engine in engines):
            return
        await asyncio.sleep(0.01)
    log.warning("settle_timeout", engines=[e.label for e in engines], timeout_seconds=timeout_seconds)


def vram_devices(engine: Engine) -> set[int]:
    """The GPUs holding some of ``engine``'s regions (where transfer buffers serve it)."""
    return table_vram_devices(engine.table)


def table_vram_devices(table: DescriptorTable) -> set[int]:
    """The GPUs holding some of the regions of a rank with this descriptor table."""
    return {device for kind, device in zip(table.region_kind, table.region_device) if kind == common_pb2.MEMORY_KIND_VRAM}


def decode_state(entries: Iterable[common_pb2.StateIndices]) -> dict[str, IndexArray]:
    """A request's state indices, by component (each listed once)."""
    out: dict[str, IndexArray] = {}
    for entry in entries:
        if entry.component in out:
            raise InvalidArgument(f"state component {entry.component!r} listed twice")
        out[entry.component] = decode_indices(entry.indices, what=f"state {entry.component!r}")
    return out


def check_version(version: int, call: str) -> None:
    """Refuse a message of another protocol version (FAILED_PRECONDITION)."""
    if version != PROTOCOL_VERSION:
        raise FailedPrecondition(f"{call} speaks protocol version {version}; this broker speaks {PROTOCOL_VERSION}")

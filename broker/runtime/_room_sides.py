"""The room sides the call routes ask about: every side held, the side an
engine holds of a room, and whether a side's pages may still be written
(waiting until no transfer can touch an engine's pages)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

import structlog

from kvbroker.broker.memory import Engine
from kvbroker.broker.rooms import RoomTables, Side, Source
from kvbroker.v1 import common_pb2

__all__ = ["settled", "side_of", "sides", "wait_settled"]

log = structlog.get_logger(__name__)


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

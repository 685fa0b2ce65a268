"""Room state change streams (``TransferBroker.WatchRooms``)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from kvbroker.v1 import common_pb2

__all__ = ["Subscription", "WatchHub"]


@dataclass(eq=False)
class Subscription:
    """One WatchRooms stream: statuses queue here; None ends the stream."""

    rooms: frozenset[int] | None
    queue: asyncio.Queue[common_pb2.RoomStatus | None] = field(default_factory=asyncio.Queue)


class WatchHub:
    """Fans room state changes out to the streams of the engine that owns them."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscription]] = {}

    def subscribe(self, engine_id: str, rooms: frozenset[int] | None) -> Subscription:
        sub = Subscription(rooms=rooms)
        self._subs.setdefault(engine_id, set()).add(sub)
        return sub

    def unsubscribe(self, engine_id: str, sub: Subscription) -> None:
        subs = self._subs.get(engine_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[engine_id]

    def publish(self, engine_id: str, status: common_pb2.RoomStatus) -> None:
        for sub in self._subs.get(engine_id, ()):
            if sub.rooms is None or status.room in sub.rooms:
                sub.queue.put_nowait(status)

    def close(self, engine_id: str) -> None:
        """End every stream of ``engine_id`` (it unregistered)."""
        for sub in self._subs.pop(engine_id, set()):
            sub.queue.put_nowait(None)

    def __len__(self) -> int:
        return sum(len(s) for s in self._subs.values())

"""Who hears of room state changes: WatchRooms streams and engine sessions."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Protocol

from kvbroker.v1 import common_pb2

__all__ = ["Subscriber", "Subscription", "WatchHub"]


class Subscriber(Protocol):
    """Anything that hears of an engine's room statuses."""

    def offer(self, status: common_pb2.RoomStatus) -> None: ...

    def close(self) -> None: ...


@dataclass(eq=False)
class Subscription:
    """One WatchRooms stream: every change of its rooms queues here; None ends the stream."""

    rooms: frozenset[int] | None
    queue: asyncio.Queue[common_pb2.RoomStatus | None] = field(default_factory=asyncio.Queue)

    def offer(self, status: common_pb2.RoomStatus) -> None:
        if self.rooms is None or status.room in self.rooms:
            self.queue.put_nowait(status)

    def close(self) -> None:
        self.queue.put_nowait(None)


class WatchHub:
    """Fans room state changes out to the subscribers of the engine that owns them."""

    def __init__(self) -> None:
        self._subs: dict[str, set[Subscriber]] = {}

    def subscribe(self, engine_id: str, rooms: frozenset[int] | None) -> Subscription:
        sub = Subscription(rooms=rooms)
        self.add(engine_id, sub)
        return sub

    def add(self, engine_id: str, sub: Subscriber) -> None:
        self._subs.setdefault(engine_id, set()).add(sub)

    def unsubscribe(self, engine_id: str, sub: Subscriber) -> None:
        subs = self._subs.get(engine_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[engine_id]

    def publish(self, engine_id: str, status: common_pb2.RoomStatus) -> None:
        for sub in self._subs.get(engine_id, ()):
            sub.offer(status)

    def close(self, engine_id: str) -> None:
        """End every stream of ``engine_id`` (it unregistered)."""
        for sub in self._subs.pop(engine_id, set()):
            sub.close()

    def __len__(self) -> int:
        return sum(len(s) for s in self._subs.values())

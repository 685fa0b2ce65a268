"""Engine session streams (``TransferBroker.Session``): what each one owes its engine.

An engine's session stream carries its room commands in and its room states
out (the client side is ``client/session.py``). This module holds the
outgoing side of one stream, :class:`SessionStream`: between two messages it
collects

- the seq of the last command applied,
- the commands refused (each with the room, the status code and the message),
- the latest status of every room of the engine whose state changed, one per
  room: a newer status replaces an older one not yet sent.

So what a slow engine is owed is bounded by its number of rooms, not by the
number of changes (the WatchRooms stream, by contrast, sends every change).
The dispatcher applies the commands (``Broker.apply_commands``); the hub
(``watch.WatchHub``) offers the statuses.
"""

from __future__ import annotations

import asyncio

from kvbroker.errors import KvBrokerError
from kvbroker.v1 import common_pb2, transfer_pb2

__all__ = ["SessionStream"]


class SessionStream:
    """The outgoing half of one engine's Session stream. Control loop only."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._statuses: dict[int, common_pb2.RoomStatus] = {}
        self._refused: list[transfer_pb2.CommandRefused] = []
        self._applied = 0
        self._sent_applied = -1
        self._wake = asyncio.Event()
        self._ended = False
        self._error: KvBrokerError | None = None

    # -- what the broker owes the engine -------------------------------------
    def offer(self, status: common_pb2.RoomStatus) -> None:
        """A room's state changed (``WatchHub.publish``)."""
        self._statuses[status.room] = status
        self._wake.set()

    def applied(self, seq: int) -> None:
        self._applied = seq
        self._wake.set()

    def refuse(self, seq: int, room: int, error: KvBrokerError, *, room_failed: bool, pages_settled: bool) -> None:
        """Command ``seq`` of ``room`` was refused with ``error``."""
        self._refused.append(
            transfer_pb2.CommandRefused(
                seq=seq,
                room=room,
                code=error.status_number,
                message=f"{error.code.name}: {error.message}",
                room_failed=room_failed,
                pages_settled=pages_settled,
            )
        )
        self._wake.set()

    def end(self, error: KvBrokerError | None = None) -> None:
        """End the stream once what is owed is sent (``error``: with that status)."""
        self._ended = True
        if error is not None and self._error is None:
            self._error = error
        self._wake.set()

    # -- the stream -----------------------------------------------------------
    async def next_event(self) -> transfer_pb2.SessionEvent | None:
        """The next message (everything owed so far), or None when the stream ends."""
        while True:
            if self._statuses or self._refused or self._applied != self._sent_applied:
                event = transfer_pb2.SessionEvent(
                    applied=self._applied, statuses=self._statuses.values(), refused=self._refused
                )
                self._statuses = {}
                self._refused = []
                self._sent_applied = self._applied
                return event
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._wake.clear()
            await self._wake.wait()

    # The hub ends every stream of an engine that unregistered.
    close = end

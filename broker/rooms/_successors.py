"""Rooms that failed here without their sender broker hearing of it, kept for whichever broker answers at its address next.

A receiver rank that fails tells its sender brokers (``AbortAtPeer``). When
one cannot be told, because its process went away or its address never
answered, the failure is remembered under that address
(``RoomTables.successor_notices``), and the broker that answers there next
is told (``TellSuccessor``), so a source opened there does not wait for a
transfer info that will never come. :class:`SuccessorNotices` keeps those
notices and which addresses are being told, and when each was last tried;
``RankSettling`` (``_receive_settling``) turns its answers into
``TellSuccessor`` effects.
"""

from __future__ import annotations

import time

from kvbroker.broker.rooms._records import RoomTables
from kvbroker.v1 import common_pb2

__all__ = ["SuccessorNotices"]


class SuccessorNotices:
    """The rooms to tell the next broker at an address, and the tellings under way."""

    def __init__(self, rooms: RoomTables) -> None:
        self._rooms = rooms
        #: Addresses being told of lost rooms (TellSuccessor), and when last tried.
        self._telling: set[str] = set()
        self._told_at: dict[str, float] = {}

    def remember(self, address: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """The broker at ``address`` has not heard that ``room_id`` failed here: tell the next one that answers there."""
        if address:
            self._rooms.successor_notices.setdefault((address, room_id), (why, time.monotonic()))

    def remembered(self, address: str, room_id: int) -> bool:
        """Whether ``room_id``'s failure waits to be told to the broker at ``address``."""
        return (address, room_id) in self._rooms.successor_notices

    def start(self, address: str, now: float | None = None) -> bool:
        """Whether to tell the broker at ``address`` now (a TellSuccessor): not
        while one is under way. ``now``: the time of the try (default: now)."""
        if address in self._telling:
            return False
        self._telling.add(address)
        self._told_at[address] = time.monotonic() if now is None else now
        return True

    def due(self, now: float, retry_seconds: float) -> list[str]:
        """The addresses with rooms to tell, not tried in the last ``retry_seconds``."""
        return [
            address
            for address in {a for a, _ in self._rooms.successor_notices}
            if now - self._told_at.get(address, -1e9) >= retry_seconds
        ]

    def forget_old_tries(self, now: float, retry_seconds: float) -> None:
        """Drop when addresses were last tried, for those not tried in ten retry periods."""
        for address in [a for a in self._told_at if now - self._told_at[a] > 10 * retry_seconds]:
            del self._told_at[address]

    def take(self, address: str) -> list[tuple[int, common_pb2.FailureCause]]:
        """Take the rooms to tell the broker now at ``address`` (they leave the table)."""
        out = []
        for key in [k for k in self._rooms.successor_notices if k[0] == address]:
            notice = self._rooms.successor_notices.pop(key)
            out.append((key[1], notice[0]))
        return out

    def done(self, address: str) -> None:
        """A TellSuccessor finished (told, or unreachable: tried again later)."""
        self._telling.discard(address)

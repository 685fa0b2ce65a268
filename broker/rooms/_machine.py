"""What every part of one room state machine shares: the room tables, the counters, the broker id and the outbox.

``SenderCore`` (``_sender``) and ``ReceiverCore`` (``_receiver``) are each
made of collaborators that own their own state (the source bootstrap, the
parts in flight; the rank bootstrap, the landing, the settling, ...). What
they all read or write is one :class:`MachineCore`, built by the facade and
passed to each: the room tables, the counters, this broker's id, and the
outbox where every call leaves its effects (``_effects``) in order, for the
executor to take (:meth:`MachineCore.take`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvbroker.broker.rooms._effects import Effect
from kvbroker.broker.rooms._records import RoomTables
from kvbroker.broker.telemetry import Counters

__all__ = ["MachineCore"]


class MachineCore:
    """The room tables, counters, broker id and outbox one state machine's collaborators share."""

    __slots__ = ("_effects", "broker_id", "counters", "emit", "rooms")

    def __init__(self, *, broker_id: str, rooms: RoomTables, counters: Counters) -> None:
        self.broker_id = broker_id
        self.rooms = rooms
        self.counters = counters
        self._effects: list[Effect] = []
        #: Leave an effect in the outbox (bound once: collaborators keep it,
        #: so :meth:`take` empties the one list rather than replacing it).
        self.emit: Callable[[Effect], None] = self._effects.append

    def take(self) -> list[Effect]:
        """The effects of the calls so far, in order; the outbox is emptied."""
        out = self._effects.copy()
        self._effects.clear()
        return out

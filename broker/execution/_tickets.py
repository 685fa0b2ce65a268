"""Where a room's work waits in a queue, its place: the :class:`Ticket` of a part."""

from __future__ import annotations

from kvbroker.broker.rooms import Part, Side
from kvbroker.broker.scheduling import Ticket, priority_of

__all__ = ["part_ticket", "side_ticket"]


def side_ticket(side: Side, nbytes: int, priorities: bool) -> Ticket | None:
    """The ticket of ``nbytes`` of ``side``'s room: its class and deadline, its
    engine (engine group: the unit of fair shares); None with ``priorities``
    off (the queue's default: first come, first served)."""
    if not priorities:
        return None
    return Ticket(priority_of(side.priority), side.engine.key.group, nbytes, side.deadline)


def part_ticket(part: Part, priorities: bool) -> Ticket | None:
    """The ticket of a sender's part (:func:`side_ticket` of its source)."""
    return side_ticket(part.source, part.nbytes, priorities)

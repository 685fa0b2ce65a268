"""What operators do to a broker (``kvbroker.v1.Admin``): drain it, abort a
room, ask how many rooms are open and whether it is in etcd.

Draining is broker-wide: while it lasts, engines open no new rooms here
(:meth:`Operators.refuse_if_draining`) and peers register none; the fleet
record in etcd says so, and the server's health service follows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog

from kvbroker.broker.execution import Machines, in_turn
from kvbroker.broker.peers import FleetRecord, FleetView
from kvbroker.broker.rooms import (
    Receiver,
    Side,
    Source,
    cause,
)
from kvbroker.broker.runtime._room_sides import sides
from kvbroker.broker.telemetry import child_done
from kvbroker.errors import NotFound, Unavailable
from kvbroker.v1 import common_pb2

__all__ = ["Operators"]

log = structlog.get_logger(__name__)


class Operators:
    """Operator actions and the draining flag. Control loop only."""

    def __init__(
        self,
        *,
        machines: Machines,
        fleet_record: FleetRecord | None,
        fleet_view: FleetView | None,
        on_draining: Callable[[bool], Awaitable[None]] | None,
    ) -> None:
        self._broker_id = machines.broker_id
        self._rooms = machines.rooms
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._fleet_record = fleet_record
        self._fleet_view = fleet_view
        #: Called with the flag whenever it is set (the server's health service follows).
        self._on_draining = on_draining
        self.draining = False

    # -- draining ---------------------------------------------------------------
    async def set_draining(self, draining: bool) -> None:
        """Refuse (or accept again) new rooms; the engine service's health and the fleet record follow."""
        if draining != self.draining:
            log.warning("broker_draining" if draining else "broker_resumed", open_rooms=self.open_rooms())
        self.draining = draining
        if self._on_draining is not None:
            await self._on_draining(draining)
        if self._fleet_record is not None:
            self._fleet_record.changed()  # the record says so: receivers stop choosing this broker

    def refuse_if_draining(self) -> None:
        """An engine opens a room: UNAVAILABLE while draining."""
        if self.draining:
            raise Unavailable("this broker is draining: it accepts no new rooms (Admin.Drain)")

    # -- rooms ------------------------------------------------------------------
    @in_turn
    def admin_abort(self, room: int, reason: str) -> int:
        """Fail every open local side of ``room``; the peers hear of it."""
        why = cause(common_pb2.FAILURE_KIND_ABORTED, f"aborted by the operator: {reason or 'no reason given'}", self._broker_id)
        held = self.sides_of(room)
        if not held:
            raise NotFound(f"this broker has no side of room {room}")
        aborted = 0
        for side in held:
            if side.terminal:
                continue
            child_done(side.span, "kvbroker.abort", {"kvbroker.reason": why.message, "kvbroker.by": "operator"})
            if isinstance(side, Source):
                self._sender.fail(side, why)
            else:
                assert isinstance(side, Receiver)
                self._receiver.fail(side, why)
            aborted += 1
        return aborted

    def sides_of(self, room: int) -> list[Side]:
        """This broker's sides of ``room`` (its sources, then its receivers)."""
        sroom, rroom = self._rooms.sender.get(room), self._rooms.receiver.get(room)
        return [*(sroom.sources.values() if sroom else ()), *(rroom.ranks.values() if rroom else ())]

    def open_rooms(self) -> int:
        """Room sides not yet SUCCESS or FAILED."""
        return sum(1 for s in sides(self._rooms) if not s.terminal)

    # -- the fleet --------------------------------------------------------------
    def etcd_status(self) -> str:
        """"off" (no --etcd), "ok" (registered and watching) or "unreachable"."""
        if self._fleet_record is None or self._fleet_view is None:
            return "off"
        return "ok" if self._fleet_record.registered and self._fleet_view.watching else "unreachable"

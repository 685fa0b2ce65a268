"""Rooms a decode rank announced and has not opened yet: the leases its broker renews.

A decode engine may say that it still wants a room before it has pages for
it (``AnnounceRoom``): the request waits in its queue. While the engine's
registration lives and the room is wanted, its broker renews the leases of
the room's sources at the sender's broker (``RenewLeases``), so the prefill
keeps its pages; when the engine goes away the renewals stop and the lease
runs out there (``--sender-info-timeout``, or the prefill engine's own).

:class:`Announcements` holds them per engine rank and, per sender broker
address, when it last renewed there and the lease that broker answered. Each
pass (``ReceiverCore.tick``) leaves one :class:`RenewLeases` per address
whose renewal is due: at once before the first answer (once a second while
that broker cannot be reached), then every third of the shortest lease
answered, at most every ``max_every`` seconds; one call per address at a
time. ExpectRoom (the room's own registration takes over),
Abort and the engine going away end an announcement.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbroker.broker.rooms._commands import AnnounceRoom
from kvbroker.broker.rooms._effects import RenewLeases
from kvbroker.broker.rooms._machine import MachineCore

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["Announcements"]

#: Before a sender's broker first answered, a failed renewal is tried again this much later.
_RETRY_SECONDS = 1.0


@dataclass(slots=True)
class _Renewals:
    """The renewals at one sender broker address."""

    #: When the last renewal went (-inf: never).
    sent_at: float = float("-inf")
    #: The lease the broker answered last (None: no answer yet).
    lease_seconds: float | None = None
    in_flight: bool = False
    #: The last renewal failed (the broker did not answer, or refused).
    failed: bool = False

    def due(self, now: float, max_every: float) -> bool:
        if self.in_flight:
            return False
        if self.lease_seconds is not None:
            every = min(self.lease_seconds / 3, max_every)
        else:
            # Before the first answer: at once, then once a second while unreachable.
            every = min(_RETRY_SECONDS, max_every) if self.failed else 0.0
        return now - self.sent_at >= every


class Announcements:
    """The announced rooms of this broker's decode ranks, and their renewals. No I/O."""

    def __init__(self, core: MachineCore) -> None:
        self._emit = core.emit
        #: engine id -> room -> (sender address, sender group).
        self._by_engine: dict[str, dict[int, tuple[str, str]]] = {}
        self._renewals: dict[str, _Renewals] = {}

    def announce(self, command: AnnounceRoom) -> None:
        """The engine still wants ``command.room``. Idempotent (the newest sender named counts)."""
        rooms = self._by_engine.setdefault(command.engine.engine_id, {})
        rooms[command.room] = (command.sender_address, command.sender_group)
        self._renewals.setdefault(command.sender_address, _Renewals())

    def withdraw(self, engine: Engine, room: int) -> None:
        """The engine opened the room, or gave it up: no more renewals for it."""
        rooms = self._by_engine.get(engine.engine_id)
        if rooms is not None:
            rooms.pop(room, None)
            if not rooms:
                del self._by_engine[engine.engine_id]

    def engine_gone(self, engine: Engine) -> int:
        """The engine went away: its announcements end. Returns how many."""
        return len(self._by_engine.pop(engine.engine_id, {}))

    def announced(self, engine: Engine) -> dict[int, tuple[str, str]]:
        """The rooms ``engine`` announced: room -> (sender address, sender group)."""
        return dict(self._by_engine.get(engine.engine_id, {}))

    def renew(self, now: float, max_every: float) -> None:
        """Leave a :class:`RenewLeases` for every sender address whose renewal is due."""
        wanted: dict[str, set[tuple[int, str]]] = {}
        for rooms in self._by_engine.values():
            for room, (address, group) in rooms.items():
                wanted.setdefault(address, set()).add((room, group))
        for address in [a for a in self._renewals if a not in wanted]:
            if not self._renewals[address].in_flight:
                del self._renewals[address]
        for address, pairs in wanted.items():
            renewals = self._renewals.setdefault(address, _Renewals())
            if renewals.due(now, max_every):
                renewals.in_flight = True
                renewals.sent_at = now
                self._emit(RenewLeases(address, tuple(sorted(pairs))))

    def renewed(self, address: str, lease_seconds: float | None) -> None:
        """The renewal at ``address`` came back: the lease its broker answered
        (None: it failed; the next pass tries again)."""
        renewals = self._renewals.get(address)
        if renewals is None:
            return
        renewals.in_flight = False
        renewals.failed = lease_seconds is None
        if lease_seconds is not None and lease_seconds > 0:
            renewals.lease_seconds = lease_seconds

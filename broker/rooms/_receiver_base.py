"""The ground floor of ``ReceiverCore``: its state and outbox, failing a rank, and settling its pages.

:class:`ReceiverBase` holds what every part of the receiver state machine
shares: the room tables, the counters, the outbox of effects, the ranks still
open, and the rooms kept for a lost sender broker's successor
(``_successors``). Failing a rank (:meth:`~ReceiverBase.fail`) keeps the
first cause and tells its sender brokers (``AbortAtPeer``; not the one that
told it, or is gone), or, if one went away, whichever broker answers at its
address next. A failed rank's pages are settled only when nothing can land
in them any more (:func:`nothing_in_flight`); then its staging reservations
go back. ``ReceiverBootstrap`` (``_receive_bootstrap``), ``ReceiverLanding``
(``_receive_landing``) and ``ReceiverCore`` (``_receiver``) build on it.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from kvbroker.broker import telemetry
from kvbroker.broker.memory import CreditLedger
from kvbroker.broker.rooms._effects import (
    AbortAtPeer,
    Effect,
    Publish,
    ReleaseStaging,
    RoomEnded,
    TellSuccessor,
)
from kvbroker.broker.rooms._receiver_records import Receiver, SenderLeg, StagingKey
from kvbroker.broker.rooms._records import RoomTables
from kvbroker.broker.rooms._sides import FAILED, Side
from kvbroker.broker.rooms._successors import SuccessorNotices
from kvbroker.broker.telemetry import Counters
from kvbroker.plan import RankKey
from kvbroker.v1 import common_pb2

__all__ = ["ReceiverBase", "nothing_in_flight"]

log = structlog.get_logger(__name__)


class ReceiverBase:
    """The receiver state machine's state and outbox, its failures and settling."""

    def __init__(
        self,
        *,
        broker_id: str,
        rooms: RoomTables,
        counters: Counters,
        on_bytes: Callable[[int], None] = lambda _n: None,
        credits: CreditLedger | None = None,
    ) -> None:
        self._id = broker_id
        self._rooms = rooms
        self._counters = counters
        #: The grants this broker gave sending peers (a packed part's range must lie in one).
        self._credits = credits if credits is not None else CreditLedger()
        self._on_bytes = on_bytes
        self._out: list[Effect] = []
        self._open: set[Receiver] = set()
        self._successors = SuccessorNotices(rooms)

    def take(self) -> list[Effect]:
        """The effects of the calls so far, in order; the outbox is emptied."""
        out, self._out = self._out, []
        return out

    def awaiting_data(self) -> bool:
        """Whether a rank still waits for notices (the data plane polls for them
        then): an open one, or a failed one whose pages may still be written
        (the notice of a write in flight settles them). Ranks leave ``_open``
        as they settle (``_changed``), or in ``tick`` once evicted unsettled:
        this is called after every batch of events and must not scan."""
        return bool(self._open)

    def _recorded(self, rank: Receiver) -> bool:
        """Whether ``rank`` is still in the room table (not evicted)."""
        room = self._rooms.receiver.get(rank.room)
        return room is not None and room.ranks.get(rank.key) is rank

    def fail(self, rank: Receiver, why: common_pb2.FailureCause, *, told_by: str | None = None) -> None:
        """Fail ``rank`` (first cause wins); tell its sender brokers, but
        ``told_by`` (the one that told us, or that is gone)."""
        if not rank.fail(why, settled=nothing_in_flight(rank)):
            return
        if rank.pages_settled:
            self._release_staging(rank)
        self._counters.rooms_failed += 1
        log.info(
            "receive_failed",
            room=rank.room,
            engine=rank.engine.label,
            peer=rank.peer_broker_id or rank.sender_address,
            cause=why.message,
            **telemetry.span_ids(rank.span),
        )
        for leg in rank.legs:
            # Also when the room never reached the sender's broker (a plan it
            # cannot do): its engine must not wait for a transfer info.
            if leg.broker_id != told_by:
                self._out.append(AbortAtPeer(leg.broker_id, rank.room, why))
        if not rank.legs and told_by is None:
            # Its sender's broker was never reached (down, or restarting):
            # whoever answers at that address next is told.
            self._successors.remember(rank.sender_address, rank.room, why)

    def _lose_sender(self, rank: Receiver, why: common_pb2.FailureCause, leg: SenderLeg) -> None:
        """Fail ``rank``: its sender broker ``leg``'s process is gone, so
        nothing more can come from it (its other sender brokers are told). If
        it had the room, the broker that answers at its address next is told."""
        if not rank.terminal and leg.registered:
            self._successors.remember(leg.address, rank.room, why)
        self.fail(rank, why, told_by=leg.broker_id)
        self._settle_sources(rank, leg.broker_id)

    def _settle_sources(self, rank: Receiver, broker_id: str) -> None:
        """Nothing of the room is in flight from sender broker ``broker_id`` any more."""
        for exp in (rank.expected or {}).values():
            if exp.leg.broker_id == broker_id:
                exp.settled = True
        self._maybe_settled(rank)

    def _maybe_settled(self, rank: Receiver) -> None:
        if not rank.pages_settled and rank.state == FAILED and nothing_in_flight(rank):
            rank.mark_settled()
        if rank.pages_settled:
            self._release_staging(rank)
        elif rank.state == FAILED and rank.staging and rank.expected is not None:
            # A failed rank's sources that write no more: the slots reserved for
            # their parts go now. Another source of the same rank may be waiting
            # for one of them (ReserveStaging), and that source settles only once
            # it is answered: holding them until the whole rank settled stalled
            # both until the reservation's wait ran out.
            done = {source for source, exp in rank.expected.items() if exp.settled or exp.complete}
            if done:
                self._release_staging(rank, sources=done)

    def _release_staging(self, rank: Receiver, *, sources: set[RankKey] | None = None) -> None:
        """The one release routine for a rank's staging reservations (room
        ended, settled; or only those of ``sources``, which write no more).
        A slot being scattered from stays until its scatter is done."""

        def releasable(key: StagingKey) -> bool:
            return key not in rank.scattering and (sources is None or key[0] in sources)

        held = [(*pool, reservation) for key, (pool, reservation) in rank.staging.items() if releasable(key)]
        if held:
            self._out.append(ReleaseStaging(tuple(held)))
            rank.staging = {k: v for k, v in rank.staging.items() if not releasable(k)}

    def _tell_successor_now(self, address: str, now: float | None = None) -> None:
        """Tell the broker at ``address`` now of the rooms kept for it (unless that is under way)."""
        if self._successors.start(address, now):
            self._out.append(TellSuccessor(address))

    def _changed(self, side: Side) -> None:
        if side.terminal and side.pages_settled:
            self._open.discard(side)
        self._out.append(Publish(side.engine.engine_id, side.status()))
        if side.terminal and not side.ended:
            side.ended = True
            self._out.append(RoomEnded(side))


def nothing_in_flight(rank: Receiver) -> bool:
    """No source can still write into the rank's pages: the sender never had
    the room, or every source completed, settled, or owes no data; and no
    staged part is being unpacked into them."""
    if rank.scattering or rank.verifying:
        return False
    if rank.expected is None:
        return True
    return all(e.complete or e.settled or not e.plan.writes_data or not e.leg.registered for e in rank.expected.values())

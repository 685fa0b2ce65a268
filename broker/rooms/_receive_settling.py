"""The receiver ranks not settled yet: failing a rank, settling its pages, releasing its staging.

:class:`RankSettling` holds the ranks that may still be written (open, or
failed with writes in flight; the data plane polls for notices while there
are any, :meth:`~RankSettling.ranks_awaiting_data`, and their data timeout runs,
:meth:`~RankSettling.time_out`). Failing a rank (:meth:`~RankSettling.fail`)
keeps the first cause and tells its sender brokers (``AbortAtPeer``; not the
one that told it, or is gone), or, if one went away, whichever broker
answers at its address next (``SuccessorNotices``, ``_successors``, given at
construction). A failed rank's pages are settled only when nothing can land
in them any more (:func:`nothing_in_flight`); then its staging reservations
and the ranges of its senders' credits go back (:meth:`~RankSettling.release_held`). It is every ``Receiver``'s
listener (:meth:`~RankSettling.changed`). ``RankBootstrap``
(``_receive_bootstrap``) and ``RankLanding`` (``_receive_landing``) fail and
settle ranks through it.
"""

from __future__ import annotations

import structlog

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._effects import (
    AbortAtPeer,
    HandBackCredits,
    Publish,
    ReleaseStaging,
    RoomEnded,
    TellSuccessor,
)
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._receiver_records import (
    LandingGate,
    Receiver,
    SenderLeg,
    StagingKey,
    receive_pool,
)
from kvbroker.broker.rooms._sides import FAILED, Side, cause
from kvbroker.broker.rooms._successors import SuccessorNotices
from kvbroker.plan import RankKey
from kvbroker.v1 import common_pb2

__all__ = ["RankSettling", "nothing_in_flight"]

log = structlog.get_logger(__name__)


class RankSettling:
    """The ranks not settled yet; failing ranks and settling their pages."""

    def __init__(self, core: MachineCore, successors: SuccessorNotices) -> None:
        self._id = core.broker_id
        self._rooms = core.rooms
        self._counters = core.counters
        self._emit = core.emit
        self._successors = successors
        #: Ranks open, or failed with pages not settled yet (``changed`` drops
        #: them as they settle, ``time_out`` once evicted unsettled).
        self._open: set[Receiver] = set()

    def track(self, rank: Receiver) -> None:
        """``rank`` just opened: it waits for data from now on."""
        self._open.add(rank)

    def ranks_awaiting_data(self) -> int:
        """How many ranks still wait for notices (the data plane polls for them
        while any do): open ones, and failed ones whose pages may still be
        written (the notice of a write in flight settles them). Ranks leave
        ``_open`` as they settle (``changed``), or in ``time_out`` once evicted
        unsettled: this is called after every batch of events and must not scan."""
        return len(self._open)

    def _recorded(self, rank: Receiver) -> bool:
        """Whether ``rank`` is still in the room table (not evicted)."""
        room = self._rooms.receiver.get(rank.room)
        return room is not None and room.ranks.get(rank.key) is rank

    def fail(self, rank: Receiver, why: common_pb2.FailureCause, *, told_by: str | None = None) -> None:
        """Fail ``rank`` (first cause wins); tell its sender brokers, but
        ``told_by`` (the one that told us, or that is gone)."""
        self.close_gate(rank)  # (first: no part is taken off the loop once the rank's pages may settle)
        if not rank.fail(why, settled=nothing_in_flight(rank)):
            return
        if rank.pages_settled:
            self.release_held(rank)
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
                self._emit(AbortAtPeer(leg.broker_id, rank.room, why))
        if not rank.legs and told_by is None:
            # Its sender's broker was never reached (down, or restarting):
            # whoever answers at that address next is told.
            self._successors.remember(rank.sender_address, rank.room, why)

    def lose_sender(self, rank: Receiver, why: common_pb2.FailureCause, leg: SenderLeg, *, settled: bool = True) -> None:
        """Fail ``rank``: its sender broker ``leg`` is lost (its other sender
        brokers are told). If it had the room, the broker that answers at its
        address next is told. ``settled``: its process is gone, so nothing
        more can come from it."""
        if not rank.terminal and leg.registered:
            self._successors.remember(leg.address, rank.room, why)
        self.fail(rank, why, told_by=leg.broker_id)
        if settled:
            self.settle_sources(rank, leg.broker_id)

    def ask(self, rank: Receiver, broker_id: str) -> None:
        """Ask sender broker ``broker_id`` whether anything of failed ``rank``'s room is
        still in flight from it: an abort, answered "settled" or followed by a
        report once it drains (either settles its sources)."""
        assert rank.cause is not None
        self._emit(AbortAtPeer(broker_id, rank.room, rank.cause, remember=False))

    def settle_sources(self, rank: Receiver, broker_id: str) -> None:
        """Nothing of the room is in flight from sender broker ``broker_id`` any more."""
        for exp in (rank.expected or {}).values():
            if exp.leg.broker_id == broker_id:
                exp.settled = True
        self.maybe_settled(rank)

    def maybe_settled(self, rank: Receiver) -> None:
        """Settle a failed rank's pages once nothing can land in them any more,
        and give back the staging of those of its sources that write no more."""
        if not rank.pages_settled and rank.state == FAILED and nothing_in_flight(rank):
            rank.mark_settled()
        if rank.pages_settled:
            self.release_held(rank)
        elif rank.state == FAILED and (rank.staging or rank.credits) and rank.expected is not None:
            # A failed rank's sources that write no more: the slots reserved for
            # their parts go now. Another source of the same rank may be waiting
            # for one of them (ReserveStaging), and that source settles only once
            # it is answered: holding them until the whole rank settled stalled
            # both until the reservation's wait ran out.
            done = {source for source, exp in rank.expected.items() if exp.settled or exp.complete}
            if done:
                self.release_held(rank, sources=done)

    def release_held(self, rank: Receiver, *, sources: set[RankKey] | None = None) -> None:
        """The one release routine for what a rank holds in receive buffers
        (room ended, settled; or only what ``sources``, which write no more,
        wrote): its staging reservations go back to their pools, the ranges of
        senders' credits to their senders. One being scattered from stays until
        its scatter is done."""

        def releasable(key: StagingKey) -> bool:
            return key not in rank.scattering and (sources is None or key[0] in sources)

        staged = [(*pool, reservation) for key, (pool, reservation) in rank.staging.items() if releasable(key)]
        if staged:
            self._emit(ReleaseStaging(tuple(staged)))
            rank.staging = {k: v for k, v in rank.staging.items() if not releasable(k)}
        credits = [(*pool, credit) for key, (pool, credit) in rank.credits.items() if releasable(key)]
        if credits:
            self._emit(HandBackCredits(tuple(credits)))
            rank.credits = {k: v for k, v in rank.credits.items() if not releasable(k)}

    def open_gate(self, rank: Receiver) -> None:
        """The rank's plan is made: its packed parts may land without the control
        loop from now on (``LandingGate``), until it ends."""
        if rank.gate is None and rank.expected is not None and not rank.terminal:
            sources = {key: (exp.plan, exp.leg.broker_id) for key, exp in rank.expected.items()}
            rank.gate = LandingGate(rank, receive_pool(rank), sources)
            self._rooms.gates[(rank.room, rank.key)] = rank.gate

    def close_gate(self, rank: Receiver) -> None:
        """The rank ended: nothing more lands without the loop (those taken already still count)."""
        if rank.gate is not None:
            rank.gate.shut()
            self._rooms.gates.pop((rank.room, rank.key), None)

    def tell_successor_now(self, address: str, now: float | None = None) -> None:
        """Tell the broker at ``address`` now of the rooms kept for it (unless that is under way)."""
        if self._successors.start(address, now):
            self._emit(TellSuccessor(address))

    def time_out(self, now: float, data_timeout_seconds: float) -> None:
        """Fail the ranks that waited too long for data (each engine's own
        bound, else ``data_timeout_seconds``)."""
        for rank in list(self._open):
            if rank.terminal and not self._recorded(rank):
                self._open.discard(rank)  # evicted before its pages settled
                continue
            own = rank.engine.timeouts.receiver_data_seconds
            if rank.terminal or rank.registered_at is None or now - rank.registered_at <= (own or data_timeout_seconds):
                continue
            limit = rank.engine.timeouts.limit("receiver_data_seconds", data_timeout_seconds)
            pending = [str(k) for k, e in (rank.expected or {}).items() if not e.complete]
            self.fail(
                rank,
                cause(
                    common_pb2.FAILURE_KIND_TIMEOUT,
                    f"waited {limit} for data from the sender's broker; sources not complete: {pending}",
                    self._id,
                ),
            )

    def changed(self, side: Side) -> None:
        """Every rank's listener: publish its status; hand on its end once."""
        if side.terminal and side.pages_settled:
            self._open.discard(side)
        self._emit(Publish(side.engine.engine_id, side.status()))
        if side.terminal and not side.ended:
            side.ended = True
            self._emit(RoomEnded(side))


def nothing_in_flight(rank: Receiver) -> bool:
    """No source can still write into the rank's pages: the sender never had
    the room, or every source completed, settled, or owes no data; and no
    staged or packed part is being unpacked into them (on the loop's word, or
    taken off the loop through its gate)."""
    if rank.scattering or rank.verifying or (rank.gate is not None and rank.gate.busy()):
        return False
    if rank.expected is None:
        return True
    return all(e.complete or e.settled or not e.plan.writes_data or not e.leg.registered for e in rank.expected.values())

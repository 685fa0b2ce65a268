"""The receiver side of rooms, as a state machine without I/O.

A **receiver** is one decode engine rank's side of one room. Its life:

1. ``expect`` (ExpectRoom) validates the destination indices, records the
   room (BOOTSTRAPPING) and asks for the sender's broker to be found
   (``FindSender``: handshake, retried up to the bootstrap timeout;
   ``_receive_bootstrap``).
2. ``sender_found``: it computes which sources owe it what
   (``mapping.plan_sources``), records that plan and only then registers the
   room with the sender's broker (``RegisterRoom``), since the sender may
   start writing the moment it has the transfer info. A rank whose sources
   live on several brokers (a sender group spread over hosts, found through
   etcd) has one ``SenderLeg`` per broker and registers with each, for the
   sources it holds. ``room_registered`` from every one: WAITING_FOR_INPUT;
   the data timeout runs from here.
3. ``notices``: each NIXL notification says one part of one chunk of one
   source landed (``_receive_landing``). A staged part is scattered from the
   receive staging buffer into the pages first (``Scatter`` ->
   ``scattered``). TRANSFERRING.
4. SUCCESS when every source it expects, counted by unique (group, tp rank,
   pp rank) (lesson 2), is complete: every part of every chunk of its last
   notice's count landed, the aux row if it asked for one, and every state
   component it listed with indices (lesson 1).
5. Failure (abort from the engine, the operator or the sender's broker; a
   source's report; a timeout; a lost peer or engine; a mismatch) keeps the
   first cause and tells its sender brokers (``AbortAtPeer``; not the one
   that told it, or is gone), or, if one went away, whichever broker answers
   at its address next (``TellSuccessor``; ``_successors``). The pages are
   settled (``pages_settled``) only when nothing can land in them any more:
   every source completed, settled, owes no data, or its broker is gone —
   and no scatter is running (``_receive_settling``).

Notices for rooms that are not here are counted and dropped; they never
create a room (lesson 6).

Before step 1, a decode rank may announce a room it still wants but cannot
open yet (``announce``): each ``tick`` renews the sources' leases at the
sender's broker (``RenewLeases`` -> ``announcements.renewed``; ``_announcements``)
until ExpectRoom, an abort or the engine going away ends the announcement.

:class:`ReceiverCore` is a facade over collaborators that each own their
state, composed at construction around one shared
:class:`~kvbroker.broker.rooms._machine.MachineCore` (room tables, counters,
broker id, outbox):

- ``RankSettling`` (``_receive_settling``): the ranks not settled yet;
  failing a rank, settling its pages, releasing its staging, the data
  timeout.
- ``RankBootstrap`` (``_receive_bootstrap``): ExpectRoom, finding the
  sender, registering the room and the registrations' outcomes.
- ``RankLanding`` (``_receive_landing``): notices, scatters, checksums,
  completion reports, staging grants, the credits granted to senders.
- ``SuccessorNotices`` (``_successors``): rooms to tell the next broker at
  a lost sender's address.
- ``Announcements`` (``_announcements``): rooms announced before ExpectRoom
  and their leases.

The calls that only one collaborator answers are made on it
(``receiver.bootstrap.sender_found(...)``, ``receiver.landing.notices(...)``);
the facade's own methods are the events that cross them (aborts, lost engines
and peers, timers), and it binds the few calls many callers make (``take``,
``fail``). Every call leaves effects (``_effects``) in the outbox;
:meth:`ReceiverCore.take` hands them to the executor. The records are in
``_receiver_records``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.memory import CreditLedger
from kvbroker.broker.rooms._announcements import Announcements
from kvbroker.broker.rooms._commands import Abort, ExpectRoom
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._receive_bootstrap import RankBootstrap
from kvbroker.broker.rooms._receive_landing import RankLanding
from kvbroker.broker.rooms._receive_settling import RankSettling
from kvbroker.broker.rooms._receiver_records import Receiver
from kvbroker.broker.rooms._records import RoomTables
from kvbroker.broker.rooms._sides import FAILED, cause
from kvbroker.broker.rooms._successors import SuccessorNotices
from kvbroker.broker.telemetry import Counters
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["ReceiverCore"]


class ReceiverCore:
    """Every receiver rank of this broker. No I/O: calls leave effects (:meth:`take`).

    The facade over the receiver's collaborators, which callers reach by name
    for the calls only one of them answers: ``bootstrap``
    (:class:`~kvbroker.broker.rooms._receive_bootstrap.RankBootstrap`: the sender
    found or not, the registrations' outcomes), ``landing``
    (:class:`~kvbroker.broker.rooms._receive_landing.RankLanding`: notices,
    scatters, checksums, staging, completion reports), ``successors``
    (:class:`~kvbroker.broker.rooms._successors.SuccessorNotices`: ``take`` and
    ``done``) and ``announcements``
    (:class:`~kvbroker.broker.rooms._announcements.Announcements`: ``announce``,
    ``announced``, ``renewed``). Bound here: ``take``, the shared outbox's;
    ``fail`` and ``ranks_awaiting_data``,
    :class:`~kvbroker.broker.rooms._receive_settling.RankSettling`'s; and the
    landing's calls the peer requests make (``staging_wanted``,
    ``staging_granted``, ``staging_rank``, ``completion_report``). ``expect`` is
    the bootstrap's, ending the room's announcement first.
    """

    def __init__(
        self,
        *,
        broker_id: str,
        rooms: RoomTables,
        counters: Counters,
        credits: CreditLedger,
        on_bytes: Callable[[int], None],
    ) -> None:
        core = MachineCore(broker_id=broker_id, rooms=rooms, counters=counters)
        successors = SuccessorNotices(rooms)
        settling = RankSettling(core, successors)
        bootstrap = RankBootstrap(core, settling, successors)
        landing = RankLanding(core, settling, credits=credits, on_bytes=on_bytes)
        self._id = broker_id
        self._rooms = rooms
        self._settling = settling
        # -- the collaborators whose calls only they answer ------------------
        self.bootstrap = bootstrap
        self.landing = landing
        self.successors = successors
        self.announcements = Announcements(core)
        # -- the calls bound here (no hop) -----------------------------------
        self.take = core.take
        self.fail = settling.fail
        self.ranks_awaiting_data = settling.ranks_awaiting_data

    # -- engine calls ----------------------------------------------------
    def expect(self, command: ExpectRoom) -> Receiver:
        """Open a receiving room (ExpectRoom); it ends the room's announcement
        (its own registration holds the sender's lease from now on)."""
        self.announcements.withdraw(command.engine, command.room)
        return self.bootstrap.expect(command)

    def abort(self, command: Abort) -> Receiver | None:
        """Fail the engine's side of the room and tell the sender's broker
        (an announced room is no longer wanted). Idempotent."""
        engine, room_id, reason, by = command.engine, command.room, command.reason, command.by
        self.announcements.withdraw(engine, room_id)
        room = self._rooms.receiver.get(room_id)
        rank = room.ranks.get(engine.key) if room is not None else None
        if rank is not None:
            why = reason or "aborted by the receiving engine"
            telemetry.child_done(rank.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self._settling.fail(rank, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return rank

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its ranks, end its announcements. Returns how many failed."""
        self.announcements.engine_gone(engine)
        ranks = [r for r in self._rooms.all_receivers() if r.engine is engine]
        for rank in ranks:
            self._settling.fail(rank, why)
        return sum(1 for r in ranks if r.cause is why)

    # -- peers -----------------------------------------------------------------
    def peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str) -> int:
        """The sender's broker aborted the room: fail our ranks that it serves."""
        room = self._rooms.receiver.get(room_id)
        if room is None:
            return 0
        ranks = [r for r in room.ranks.values() if r.leg(from_broker) is not None]
        for rank in ranks:
            self._settling.fail(rank, why, told_by=from_broker)
        return len(ranks)

    def peer_settled(self, broker_id: str, room_id: int) -> None:
        """The sender's broker answered an abort with "nothing of the room is in
        flight from here" (its sources may even be evicted already, so no report
        would come): the failed ranks it fed are settled as far as it goes."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            if rank.leg(broker_id) is not None and rank.state == FAILED:
                self._settling.settle_sources(rank, broker_id)

    def abort_undelivered(self, broker_id: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """An abort could not reach ``broker_id`` (it went away): tell the broker
        that answers at its address next."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            leg = rank.leg(broker_id)
            if leg is not None:
                self.successors.remember(leg.address, room_id, why)

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause, *, settled: bool = True) -> int:
        """The sender's broker ``broker_id`` is lost: fail our ranks it feeds.

        A broker known gone writes nothing more, so their pages are settled
        (``settled``); a silent one may, so they wait for its word
        (:meth:`peer_back`, :meth:`peer_settled`) or for it to be found gone. A rank
        whose registration is out learns where it landed when the call returns
        (:meth:`room_registered`); one still bootstrapping registers with
        whoever answers at the address now.
        """
        lost = [
            (r, leg)
            for r in self._rooms.all_receivers()
            if (leg := r.leg(broker_id)) is not None and (leg.registered or r.terminal) and not leg.registering
        ]
        for rank, leg in lost:
            self._settling.lose_sender(rank, why, leg, settled=settled)
        return len(lost)

    def peer_back(self, broker_id: str) -> int:
        """A silent sender's broker answers again: ask it (an abort, which it answers
        with whether anything of the room is still in flight from it) about every
        failed rank whose pages wait for its word. The number asked."""
        waiting = [
            r
            for r in self._rooms.all_receivers()
            if r.state == FAILED
            and not r.pages_settled
            and r.leg(broker_id) is not None
            and any(e.leg.broker_id == broker_id and not e.settled for e in (r.expected or {}).values())
        ]
        for rank in waiting:
            self._settling.ask(rank, broker_id)
        return len(waiting)

    def has_business(self, broker_id: str) -> bool:
        """Whether a rank still waits on (or may still be written by) ``broker_id``."""
        return any(
            r.leg(broker_id) is not None and (not r.terminal or not r.pages_settled)
            for r in self._rooms.unfinished_receivers()
        )

    # -- timers ----------------------------------------------------------------
    def tick(self, now: float, *, data_timeout_seconds: float, retry_seconds: float, lease_renew_max_seconds: float = 5.0) -> None:
        """Time out ranks waiting for data (each engine's own bound, else
        ``data_timeout_seconds``); tell successors of lost rooms (every
        ``retry_seconds``); renew the leases of announced rooms that are due
        (at most every ``lease_renew_max_seconds``)."""
        self._settling.time_out(now, data_timeout_seconds)
        self.announcements.renew(now, lease_renew_max_seconds)
        for address in self.successors.due(now, retry_seconds):
            self._settling.tell_successor_now(address, now)
        self.successors.forget_old_tries(now, retry_seconds)

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
   and no scatter is running (``_receiver_base``).

Notices for rooms that are not here are counted and dropped; they never
create a room (lesson 6). Every method leaves effects (``_effects``) in the
outbox; :meth:`ReceiverCore.take` hands them to the executor. The records
are in ``_receiver_records``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._receive_bootstrap import ReceiverBootstrap
from kvbroker.broker.rooms._receive_landing import ReceiverLanding
from kvbroker.broker.rooms._receiver_records import Receiver
from kvbroker.broker.rooms._sides import FAILED, cause
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import Engine

__all__ = ["ReceiverCore"]


class ReceiverCore(ReceiverBootstrap, ReceiverLanding):
    """Every receiver rank of this broker. No I/O: calls leave effects (:meth:`take`).

    Its state, ``fail`` and ``awaiting_data`` are
    :class:`~kvbroker.broker.rooms._receiver_base.ReceiverBase`'s; ``expect``
    and the registration outcomes are
    :class:`~kvbroker.broker.rooms._receive_bootstrap.ReceiverBootstrap`'s;
    notices, scatters, staging and completion reports are
    :class:`~kvbroker.broker.rooms._receive_landing.ReceiverLanding`'s.
    """

    # -- engine calls ----------------------------------------------------
    def abort(self, engine: Engine, room_id: int, reason: str, *, by: str = "engine") -> Receiver | None:
        """Fail the engine's side of the room and tell the sender's broker. Idempotent."""
        room = self._rooms.receiver.get(room_id)
        rank = room.ranks.get(engine.key) if room is not None else None
        if rank is not None:
            why = reason or "aborted by the receiving engine"
            telemetry.child_done(rank.span, "kvbroker.abort", {"kvbroker.reason": why, "kvbroker.by": by})
            self.fail(rank, cause(common_pb2.FAILURE_KIND_ABORTED, why, self._id))
        return rank

    def engine_gone(self, engine: Engine, why: common_pb2.FailureCause) -> int:
        """``engine`` unregistered or died: fail its ranks. Returns how many failed."""
        ranks = [r for r in self._rooms.all_receivers() if r.engine is engine]
        for rank in ranks:
            self.fail(rank, why)
        return sum(1 for r in ranks if r.cause is why)

    # -- peers -----------------------------------------------------------------
    def peer_abort(self, room_id: int, why: common_pb2.FailureCause, from_broker: str) -> int:
        """The sender's broker aborted the room: fail our ranks that it serves."""
        room = self._rooms.receiver.get(room_id)
        if room is None:
            return 0
        ranks = [r for r in room.ranks.values() if r.leg(from_broker) is not None]
        for rank in ranks:
            self.fail(rank, why, told_by=from_broker)
        return len(ranks)

    def peer_settled(self, broker_id: str, room_id: int) -> None:
        """The sender's broker answered an abort with "nothing of the room is in
        flight from here" (its sources may even be evicted already, so no report
        would come): the failed ranks it fed are settled as far as it goes."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            if rank.leg(broker_id) is not None and rank.state == FAILED:
                self._settle_sources(rank, broker_id)

    def abort_undelivered(self, broker_id: str, room_id: int, why: common_pb2.FailureCause) -> None:
        """An abort could not reach ``broker_id`` (it went away): tell the broker
        that answers at its address next."""
        room = self._rooms.receiver.get(room_id)
        for rank in room.ranks.values() if room is not None else ():
            leg = rank.leg(broker_id)
            if leg is not None:
                self._successors.remember(leg.address, room_id, why)

    def peer_lost(self, broker_id: str, why: common_pb2.FailureCause) -> int:
        """The sender's broker ``broker_id`` is gone: fail our ranks it feeds.

        A dead broker writes nothing more, so their pages are settled. A rank
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
            self._lose_sender(rank, why, leg)
        return len(lost)

    def has_business(self, broker_id: str) -> bool:
        """Whether a rank still waits on (or may still be written by) ``broker_id``."""
        return any(
            r.leg(broker_id) is not None and (not r.terminal or not r.pages_settled) for r in self._rooms.all_receivers()
        )

    # -- timers ----------------------------------------------------------------
    def tick(self, now: float, *, data_timeout_seconds: float, retry_seconds: float) -> None:
        """Time out ranks waiting for data (each engine's own bound, else
        ``data_timeout_seconds``); tell successors of lost rooms (every ``retry_seconds``)."""
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
        for address in self._successors.due(now, retry_seconds):
            self._tell_successor_now(address, now)
        self._successors.forget_old_tries(now, retry_seconds)

    def successor_notices(self, address: str) -> list[tuple[int, common_pb2.FailureCause]]:
        """Take the rooms to tell the broker now at ``address`` (they leave the table)."""
        return self._successors.take(address)

    def successor_done(self, address: str) -> None:
        """A TellSuccessor finished (told, or unreachable: tried again later)."""
        self._successors.done(address)

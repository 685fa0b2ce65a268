"""A receiver rank finds its sender and registers the room there: ExpectRoom up to WAITING_FOR_INPUT.

:class:`RankBootstrap` opens a rank (:meth:`~RankBootstrap.expect`,
BOOTSTRAPPING) and asks for its sender's broker to be found (``FindSender``:
handshake, retried up to the bootstrap timeout). When it is
(:meth:`~RankBootstrap.sender_found`), the rank plans which sources owe
it what (``plan_sources``), records that plan, and only then registers the
room with the sender's broker (``RegisterRoom``), since the sender may start
writing the moment it has the transfer info. A rank whose sources live on
several brokers (a sender group spread over hosts, found through etcd) has
one ``SenderLeg`` per broker and registers with each, for the sources it
holds. The outcomes of the registrations come back here: accepted by every
one (:meth:`~RankBootstrap.room_registered`: WAITING_FOR_INPUT, and the
data timeout runs from here), refused as stale (registered again after a
fresh handshake), or failed. It keeps no state of its own beyond the
records: a rank it opens is tracked, failed and settled by ``RankSettling``
(``_receive_settling``), given at construction.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvbroker.broker import telemetry
from kvbroker.broker.rooms._commands import ExpectRoom
from kvbroker.broker.rooms._effects import AbortAtPeer, FindSender, Publish, RegisterRoom
from kvbroker.broker.rooms._machine import MachineCore
from kvbroker.broker.rooms._receive_settling import RankSettling
from kvbroker.broker.rooms._receiver_records import (
    NO_COMPONENTS,
    Receiver,
    SenderLeg,
    SourceExpectation,
)
from kvbroker.broker.rooms._records import ReceiverRoom
from kvbroker.broker.rooms._sides import BOOTSTRAPPING, WAITING_FOR_INPUT, cause, cause_of
from kvbroker.broker.rooms._smallmap import SmallMap
from kvbroker.broker.rooms._successors import SuccessorNotices
from kvbroker.broker.scheduling import deadline_ms
from kvbroker.errors import AlreadyExists, FailedPrecondition, InvalidArgument, KvBrokerError
from kvbroker.plan import (
    GroupShape,
    Layout,
    RankKey,
    SourcePlan,
    check_room_indices,
    check_state_supported,
    encode_indices,
    plan_sources,
    state_regions,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    pass

__all__ = ["RankBootstrap", "expectation", "leg_of", "register_request"]


class RankBootstrap:
    """Opening receiver ranks, finding their senders and registering their rooms there."""

    def __init__(self, core: MachineCore, settling: RankSettling, successors: SuccessorNotices) -> None:
        self._id = core.broker_id
        self._rooms = core.rooms
        self._emit = core.emit
        self._settling = settling
        self._successors = successors

    def expect(self, command: ExpectRoom) -> Receiver:
        """Open the command's room for receiving into its engine (ExpectRoom)
        and start bootstrapping; ``prefix_pages``: the leading pages of the
        room the rank holds."""
        engine, room_id, pages, aux_row, state = command.engine, command.room, command.pages, command.aux_row, command.state
        sender_address, sender_group = command.sender_address, command.sender_group
        prefix_pages, verify_checksum = command.prefix_pages, command.verify_checksum
        if not sender_group:
            raise InvalidArgument("sender.group must name the prefill engine group")
        if self._rooms.is_tombstoned("receiver", room_id):
            raise AlreadyExists(f"room {room_id} already ended on this broker; room ids must be unique")
        check_room_indices(engine.layout, pages=pages, aux_row=aux_row, state=state)
        room = self._rooms.receiver.get(room_id)
        if room is not None and engine.key in room.ranks:
            raise AlreadyExists(f"engine rank {engine.key} already expects room {room_id}")
        if room is None:
            room = self._rooms.receiver[room_id] = ReceiverRoom(room_id)
        rank = Receiver(
            room=room_id,
            engine=engine,
            listener=self._settling.changed,
            sender_address=sender_address,
            sender_group=sender_group,
            pages=pages,
            aux_row=aux_row,
            prefix_pages=prefix_pages,
            verify_checksum=verify_checksum,
            priority=command.priority,
            deadline=command.deadline,
            # Lesson 1: a component listed with no indices is not expected.
            state_indices={name: indices for name, indices in state.items() if indices.size},
        )
        self._rooms.add_receiver(room, rank)
        self._settling.track(rank)
        # The room span continues the engine's trace (the context its
        # ExpectRoom came with) or starts one; the bootstrap runs in it, so
        # the handshake and the registration (and, through the registration,
        # the sender's side) join the trace.
        telemetry.open_room_span(rank, "receiver", None)
        self._emit(FindSender(rank))
        return rank

    def sender_found(self, rank: Receiver, found: str | list[SenderLeg], layouts: list[Layout]) -> None:
        """The sender's broker answered and has the group: plan, then register
        the room. ``found``: that broker's id, or (a group whose ranks live on
        several hosts, found through etcd) one leg per broker holding some of
        this rank's sources: the room is registered with each, for its sources."""
        rank.mark("handshaken")
        rank.waiting_for = ""
        rank.legs = (SenderLeg(found, rank.sender_address),) if isinstance(found, str) else tuple(found)
        if not rank.sender_address and rank.legs:  # found through etcd: the first leg's broker answers for the group
            rank.sender_address = rank.legs[0].address
        if rank.terminal:
            # Failed while we looked for the sender: its engine may have
            # opened the room there already; tell it (the way a broker that
            # was not there when the room failed is told, when it was
            # remembered for it).
            for leg in rank.legs:
                if self._successors.remembered(leg.address, rank.room):
                    self._settling.tell_successor_now(leg.address)
                elif rank.cause is not None:
                    self._emit(AbortAtPeer(leg.broker_id, rank.room, rank.cause))
            return
        try:
            sender_shape, receiver_shape = GroupShape.of(layouts[0]), GroupShape.of(rank.engine.layout)
            if rank.state_indices:
                check_state_supported(sender_shape, receiver_shape)
            plans = plan_sources(sender_shape, rank.sender_group, receiver_shape, rank.key.tp_rank, rank.key.pp_rank)
            placed = [(p, leg_of(rank, p.rank)) for p in plans]
        except KvBrokerError as exc:
            self._settling.fail(rank, cause_of(exc, self._id))
            return
        rank.expected = SmallMap((p.rank, expectation(rank, p, leg)) for p, leg in placed)
        self._settling.open_gate(rank)
        for leg in rank.legs:
            mine = [p for p, at in placed if at is leg]
            if not mine:
                continue  # (a leg the plan does not need: nothing to register there)
            request = register_request(self._id, rank, leg, mine)
            leg.registered = leg.registering = True
            self._emit(RegisterRoom(rank, leg, request))

    def still_looking(self, rank: Receiver, why: str) -> None:
        """Its sender was looked for and not found yet (retried until the
        bootstrap timeout): the engine's status says why, when that changes."""
        if rank.state == BOOTSTRAPPING and why != rank.waiting_for:
            rank.waiting_for = why
            self._emit(Publish(rank.engine.engine_id, rank.status()))

    def bootstrap_failed(self, rank: Receiver, error: KvBrokerError) -> None:
        """The sender's broker or group could not be found within the bootstrap timeout."""
        self._settling.fail(rank, cause_of(error, self._id))

    def registration_stale(self, rank: Receiver, leg: SenderLeg) -> None:
        """The sender broker ``leg`` refused the registration as stale
        (ABORTED: its view of us is old, or it restarted and never met us): it
        did not take the room. The executor handshakes again, then calls
        :meth:`register_again`."""
        leg.registering = leg.registered = False

    def register_again(self, rank: Receiver, leg: SenderLeg, now: str) -> bool:
        """After a fresh handshake, register with ``now``, the process found at
        ``leg``'s address (maybe a restarted one). False: the rank ended
        meanwhile, do not."""
        if rank.terminal:
            return False
        leg.broker_id = now
        leg.registered = leg.registering = True
        return True

    def registration_error(self, rank: Receiver, leg: SenderLeg, error: KvBrokerError) -> None:
        """Registering with ``leg`` ended in ``error`` before the room reached it."""
        leg.registering = False
        self.bootstrap_failed(rank, error)

    def room_registered(self, rank: Receiver, leg: SenderLeg, broker_id: str, *, still_known: bool) -> None:
        """The sender broker process ``broker_id`` (at ``leg``'s address)
        accepted the room. ``still_known``: that process is still the one we
        track (it was not lost meanwhile)."""
        leg.registering = False
        leg.broker_id = broker_id  # the process that has the room writes it
        if not still_known:
            # The process that took the room died or restarted while the call
            # was out (peer_lost left this rank to us).
            why = cause(
                common_pb2.FAILURE_KIND_PEER,
                f"peer broker {leg.address} ({broker_id}) went away while room {rank.room} registered there",
                self._id,
            )
            self._settling.lose_sender(rank, why, leg)
            return
        if rank.terminal:
            # Aborted while we registered: the sender has the info now.
            if rank.cause is not None:
                self._emit(AbortAtPeer(broker_id, rank.room, rank.cause))
            return
        if rank.registering:
            return  # another sender broker has not answered yet
        rank.registered_at = time.monotonic()
        rank.mark("registered")
        rank.wait_span = telemetry.start_span("kvbroker.wait_for_data", parent=rank.span)
        rank.advance(WAITING_FOR_INPUT)

    def registration_failed(self, rank: Receiver, leg: SenderLeg, error: KvBrokerError, *, maybe_delivered: bool) -> None:
        """RegisterRoom with ``leg`` failed. ``maybe_delivered``: it may still
        have reached the sender (a timeout, a broken connection), so the sender
        may write: the pages are not settled until it says so or is lost."""
        leg.registering = False
        leg.registered = leg.registered and maybe_delivered
        self._settling.fail(rank, cause_of(type(error)(f"the sender's broker refused room {rank.room}: {error.message}"), self._id))


def leg_of(rank: Receiver, source: RankKey) -> SenderLeg:
    """The sender broker of ``source``; ``FailedPrecondition`` if none holds it."""
    for leg in rank.legs:
        if leg.holds(source):
            return leg
    raise FailedPrecondition(f"no sender broker found for source {source} of room {rank.room}")


def expectation(rank: Receiver, plan: SourcePlan, leg: SenderLeg) -> SourceExpectation:
    """What ``rank`` waits for from the source of ``plan``, at ``leg``."""
    return SourceExpectation(
        plan=plan,
        leg=leg,
        expects_aux=plan.sends_aux and rank.aux_row is not None,
        expected_components=frozenset(
            name
            for name in rank.state_indices
            if plan.sends_state and state_regions(rank.engine.layout, name, plan.layer_begin, plan.layer_end)
        )
        or NO_COMPONENTS,
    )


def register_request(broker_id: str, rank: Receiver, leg: SenderLeg, plans: list[SourcePlan]) -> peer_pb2.RegisterRoomRequest:
    """``rank``'s registration of its room with sender broker ``leg``, for the
    sources of ``plans`` it holds, from this broker (``broker_id``)."""
    request = peer_pb2.RegisterRoomRequest(
        protocol_version=PROTOCOL_VERSION,
        room=rank.room,
        receiver_broker_id=broker_id,
        receiver=rank.key.to_proto(),
        receiver_generation=rank.engine.generation,
        sender_group=rank.sender_group,
        pages=encode_indices(rank.pages),
        state=[common_pb2.StateIndices(component=n, indices=encode_indices(i)) for n, i in rank.state_indices.items()],
        sources=[p.to_proto() for p in plans],
        sender_broker_id=leg.broker_id,
        prefix_pages=rank.prefix_pages,
        verify_checksum=rank.verify_checksum,
        priority=rank.priority,  # type: ignore[arg-type]
        deadline_ms=deadline_ms(rank.deadline),
    )
    if rank.aux_row is not None:
        request.aux_row = rank.aux_row
    return request

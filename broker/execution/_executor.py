"""The effect executor: carries out what the room state machines decided.

The sender and receiver state machines (``rooms``) leave effects;
the executor's effect loop takes them, when a turn ends (``_turn``: every
entry into the state machines is one), and hands each one to the part of
this package that carries it out, without blocking the control loop:

- parts to write (``_parts``): posted to the data-plane thread, after room
  is reserved and they are gathered where they need it; each settles there
  and comes back through :meth:`Executor.on_events` as
  ``SenderCore.part_settled``; notifications come back the same way, as
  ``ReceiverCore.landing.notices``;
- device copies (``_device_copies``): a staged part is gathered on its
  memory's lane before it is posted, a landed one scattered before it counts;
- calls to other brokers (``_calls_to_peers``; room registration and its
  retry policy: ``_registration``), each in a task of its own; their answers
  come back as calls on the state machines;
- statuses go to the engines' watch streams; a room's end closes its span,
  records its metrics and writes its one canonical log line (``_room_end``).

Every answer that reaches a state machine (a data-plane event, a task's
outcome) is given in a turn, so the effects it causes are carried out when
the turn ends.

The executor makes none of these parts: ``runtime/_build.py`` makes them,
hands them in (:class:`Handlers`), and hands the receive credits to the
parts that share them (peer requests, peer loss, the queries) itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from kvbroker.broker.config import BrokerConfig
from kvbroker.broker.dataplane import Event, Notices, Settled
from kvbroker.broker.execution._bundles import Machines, Telemetry, Transport
from kvbroker.broker.execution._calls_to_peers import CallsToPeers
from kvbroker.broker.execution._credits import CREDIT_RETURN, Credits
from kvbroker.broker.execution._device_copies import DeviceCopies
from kvbroker.broker.execution._parts import PartsInFlight
from kvbroker.broker.execution._receiving_parts import ReceivingParts
from kvbroker.broker.execution._registration import Registrations
from kvbroker.broker.execution._room_end import end_receive_waits, record_room_end
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._turn import in_turn
from kvbroker.broker.rooms import (
    AbortAtPeer,
    Effect,
    FindSender,
    HandBackCredits,
    PostPart,
    Publish,
    RegisterRoom,
    ReleaseStaging,
    RenewLeases,
    ReserveStaging,
    RoomEnded,
    Scatter,
    SendReport,
    Side,
    Source,
    TellSuccessor,
    VerifyChunk,
)

__all__ = ["Executor", "Handlers", "transport_text"]

log = structlog.get_logger(__name__)


@dataclass(frozen=True, eq=False)
class Handlers:
    """The parts that carry out the effects the executor hands on (made by
    ``runtime/_build.py``, which hands some of them to other parts too)."""

    #: Parts in flight: reserving room, posting, settling.
    parts: PartsInFlight
    #: Landed parts: noticed, checked, scattered.
    receiving: ReceivingParts
    #: The device copies (a chunk's checksum, for ``VerifyChunk``).
    copies: DeviceCopies
    #: Receive credits, both sides (returned ones come in the data plane's notices).
    credits: Credits
    #: The calls this broker makes to peers.
    calls: CallsToPeers
    #: Receiving rooms registered with their sender brokers.
    registrations: Registrations


class Executor:
    """Carries out effects. Control loop only."""

    def __init__(self, *, machines: Machines, transport: Transport, telemetry: Telemetry, tasks: TaskSet, handlers: Handlers) -> None:
        self._turn = machines.turn
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._hub = machines.hub
        self._dataplane = transport.dataplane
        self._pools = transport.pools
        self._tasks = tasks
        self._metrics = telemetry.metrics
        self._parts = handlers.parts
        self._receiving = handlers.receiving
        self._copies = handlers.copies
        self._credits = handlers.credits
        self._calls = handlers.calls
        self._registrations = handlers.registrations
        #: When the notifications being taken now were read (a scatter's first hop).
        self._notices_at = 0.0
        self._handlers = self._effect_handlers()
        machines.turn.bind(self._run_effects)

    # -- the loop -------------------------------------------------------------
    def _run_effects(self) -> None:
        """The effect loop: carry out every effect the state machines left,
        until none is left. Run by the turn (``_turn``) when it ends; called
        nowhere else."""
        while True:
            effects = self._sender.take() + self._receiver.take()
            if not effects:
                break
            for effect in effects:
                try:
                    self._run(effect)
                except Exception:
                    log.exception("effect_failed", effect=type(effect).__name__)
        # Poll for notifications while rooms wait for data, or credits for their return;
        # closely while packed parts are in flight (ours in a peer's credits, a peer's in ours).
        pacing, returns = self._dataplane.pacing, self._credits.awaiting_returns()
        pacing.listening = returns or self._receiver.ranks_awaiting_data() > 0
        pacing.busy = returns or self._credits.ledger.any_granted()

    @in_turn
    def on_events(self, events: list[Event]) -> None:
        """What the data plane reports (on the loop): settled parts, notifications."""
        for event in events:
            if isinstance(event, Settled):
                self._parts.settled(event)
            elif isinstance(event, Notices):
                notices = []
                for agent, payload in event.items:
                    if payload[:1] == CREDIT_RETURN:
                        self._credits.returned(agent, payload)
                    else:
                        notices.append((agent, payload))
                if notices:
                    self._notices_at = event.at
                    self._receiver.landing.notices(notices)

    def _run(self, effect: Effect) -> None:
        handler = self._handlers.get(type(effect))
        if handler is None:  # pragma: no cover - a new effect without a handler is a bug
            raise AssertionError(f"no handler for {effect!r}")
        handler(effect)

    def _room_ended(self, side: Side) -> None:
        record_room_end(side, self._metrics)
        end_receive_waits(side, self._pools)
        if isinstance(side, Source):
            self._parts.room_ended(side)

    def _effect_handlers(self) -> dict[type[Any], Callable[[Any], object]]:
        """What carries out each kind of effect (found by its type: a chain of
        isinstance checks cost a landed part a dozen of them)."""
        spawn = self._tasks.spawn
        return {
            Publish: lambda e: self._hub.publish(e.engine_id, e.status),
            RoomEnded: lambda e: self._room_ended(e.side),
            PostPart: lambda e: self._parts.post(e.part),
            ReserveStaging: lambda e: self._parts.reserve_slots(e.part),
            SendReport: lambda e: spawn(self._calls.report(e), name=f"report-{e.report.room}"),
            FindSender: lambda e: spawn(self._calls.find_sender(e.receiver), name=f"bootstrap-{e.receiver.room}"),
            RegisterRoom: lambda e: self._registrations.start(e),
            AbortAtPeer: lambda e: spawn(self._calls.abort_at_peer(e), name=f"abort-{e.room}"),
            Scatter: lambda e: self._receiving.scatter(e, self._notices_at),
            VerifyChunk: lambda e: spawn(self._verify(e), name=f"verify-{e.receiver.room}"),
            ReleaseStaging: self._release_staging,
            HandBackCredits: self._hand_back_credits,
            TellSuccessor: lambda e: spawn(self._calls.tell_successor(e.address), name=f"tell-successor-{e.address}"),
            RenewLeases: lambda e: spawn(self._calls.renew_leases(e), name=f"renew-leases-{e.address}"),
        }

    def _release_staging(self, effect: ReleaseStaging) -> None:
        for kind, device, reservation in effect.reservations:
            pool = self._pools.pool("receive", kind, device)
            if pool is not None:
                pool.release(reservation)

    def _hand_back_credits(self, effect: HandBackCredits) -> None:
        for kind, device, credit in effect.credits:
            self._credits.hand_back(kind, device, credit)

    async def _verify(self, effect: VerifyChunk) -> None:
        """Checksum a landed chunk in its rank's pages; the receiver compares."""
        got, error = await self._copies.chunk_checksum(effect.receiver.engine, effect.what)
        with self._turn:
            self._receiver.landing.chunk_verified(effect, got, error)


def transport_text(config: BrokerConfig) -> str:
    """What carries the bytes, as far as the broker can tell (NIXL does not
    report the UCX lane it picked; UCX_PROTO_INFO=y in the broker's
    environment makes UCX print it)."""
    env = os.environ
    return (
        f"NIXL UCX (error mode {config.ucx_error_mode}, UCX_TLS={env.get('UCX_TLS', 'auto')}, "
        f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES', 'auto')})"
    )

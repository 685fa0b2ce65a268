"""Registering a receiving room with a sender's broker, and the one table of its retry policy.

Once a receiving rank's plan is made, the room is registered with each
sender broker that holds some of its sources (the ``RegisterRoom`` effect).
An attempt goes out on that peer's stream in the next frame
(``PeerClient.submit_registration``, the transport: it waits for the peer's
address to answer up to the peer RPC timeout, ``wait_for_ready``), and the
data plane looks for the room's notices promptly from then (``hurry``). What
follows each attempt is :data:`POLICY`'s, keyed by the status the attempt
ended with; :class:`Registrations` walks it and tells the receiver's state
machine (``ReceiverCore``) where the registration ended:

| status of an attempt | after the first attempt | after the retry |
| --- | --- | --- |
| OK | done (``room_registered``) | done |
| ABORTED: the peer's view of us is stale, or it restarted and never met us | handshake afresh, then try once more | fail, not delivered |
| UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN: it may have reached the sender | fail, maybe delivered | fail, maybe delivered |
| any other: the sender's broker refused the room | fail, not delivered | fail, not delivered |

- handshake afresh: ``registration_stale`` (the peer did not take the room),
  a new handshake (a restart detected by it fails only the rooms the old
  process had), then ``register_again`` with the process found there, unless
  the rank ended meanwhile (then the registration just ends);
- fail: ``registration_failed``; maybe delivered: the sender may still
  write, so the rank's pages are not settled until it says so or is lost;
- a registration that never got to an attempt (its peer has not handshaken,
  or the handshake before the retry failed) ends in ``registration_error``.

Nothing here waits for the bootstrap deadline: finding the sender did that
before the room was planned (``CallsToPeers.find_sender``).

The first attempt of a room takes no task: a task (and its frames) per room
was most of a broker's memory while a burst of rooms registered
(scale_rooms); it waits on the peer's stream as an item of a call, and
its outcome is taken in the call's callback. Only a handshake takes a task.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import grpc
import structlog

from kvbroker.broker.dataplane import DataPlane
from kvbroker.broker.execution._calls_to_peers import in_span
from kvbroker.broker.execution._tasks import TaskSet
from kvbroker.broker.execution._turn import Turn, in_turn
from kvbroker.broker.peers import Peer, PeerClient, PeerTable
from kvbroker.broker.rooms import ReceiverCore, RegisterRoom
from kvbroker.errors import KvBrokerError

__all__ = ["POLICY", "REFUSED", "Registrations", "Rule", "Step", "next_step"]

log = structlog.get_logger(__name__)


class Step(enum.Enum):
    """What follows an attempt to register a room."""

    DONE = "the sender's broker took the room"
    HANDSHAKE_AND_RETRY = "handshake afresh, then try once more"
    FAIL_MAYBE_DELIVERED = "fail the room; the sender may have it and may write"
    FAIL_NOT_DELIVERED = "fail the room; the sender does not have it"


@dataclass(frozen=True)
class Rule:
    """The step after an attempt that ended with one status: after the first attempt, and after the retry."""

    first: Step
    retry: Step


_MAYBE_DELIVERED = Rule(first=Step.FAIL_MAYBE_DELIVERED, retry=Step.FAIL_MAYBE_DELIVERED)

#: The retry policy of room registration: the rule for each status an attempt ends with.
POLICY: Mapping[grpc.StatusCode, Rule] = MappingProxyType(
    {
        grpc.StatusCode.OK: Rule(first=Step.DONE, retry=Step.DONE),
        grpc.StatusCode.ABORTED: Rule(first=Step.HANDSHAKE_AND_RETRY, retry=Step.FAIL_NOT_DELIVERED),
        grpc.StatusCode.UNAVAILABLE: _MAYBE_DELIVERED,
        grpc.StatusCode.DEADLINE_EXCEEDED: _MAYBE_DELIVERED,
        grpc.StatusCode.UNKNOWN: _MAYBE_DELIVERED,
    }
)
#: The rule for any other status: the sender's broker refused the room.
REFUSED = Rule(first=Step.FAIL_NOT_DELIVERED, retry=Step.FAIL_NOT_DELIVERED)


def next_step(error: KvBrokerError | None, *, retried: bool) -> Step:
    """What follows an attempt that ended with ``error`` (None: it succeeded);
    ``retried``: the attempt was the retry."""
    rule = POLICY.get(grpc.StatusCode.OK if error is None else error.code, REFUSED)
    return rule.retry if retried else rule.first


class Registrations:
    """Registers receiving rooms with sender brokers, by :data:`POLICY`. Control loop only."""

    def __init__(
        self,
        *,
        peers: PeerTable,
        client: PeerClient,
        receiver: ReceiverCore,
        dataplane: DataPlane,
        tasks: TaskSet,
        turn: Turn,
    ) -> None:
        self._peers = peers
        self._client = client
        self._receiver = receiver
        self._dataplane = dataplane
        self._tasks = tasks
        #: Each answer to the receiver's state machine is a turn.
        self._turn = turn

    def start(self, effect: RegisterRoom) -> None:
        """Register ``effect``'s room with its sender broker: the first attempt."""
        peer = self._peers.by_id.get(effect.broker_id)
        if peer is None:
            self._tasks.spawn(self._when_handshaken(effect), name=f"register-{effect.receiver.room}")
            return
        self._attempt(effect, peer, retried=False)

    async def _when_handshaken(self, effect: RegisterRoom) -> None:
        """The peer had not handshaken when the room was planned: one under way
        may have finished by now; if not, the room never reaches it."""
        try:
            peer = self._peers.get(effect.broker_id)
        except KvBrokerError as exc:
            with self._turn:
                self._receiver.bootstrap.registration_error(effect.receiver, effect.leg, exc)
            return
        self._attempt(effect, peer, retried=False)

    def _attempt(self, effect: RegisterRoom, peer: Peer, *, retried: bool) -> None:
        """One attempt, written on ``peer``'s stream in the next frame (with the
        room's trace context); its outcome goes to :meth:`_answered`."""
        with in_span(effect.receiver.span):
            self._client.submit_registration(peer, effect.request, lambda error: self._answered(effect, peer, error, retried=retried))
        # The sender may write as soon as it reads the registration, before
        # its answer is back here: look for the notice promptly from now.
        self._dataplane.pacing.hurry(self._receiver.ranks_awaiting_data())

    @in_turn
    def _answered(self, effect: RegisterRoom, peer: Peer, error: KvBrokerError | None, *, retried: bool) -> None:
        """An attempt's outcome: take the step :data:`POLICY` says."""
        step = next_step(error, retried=retried)
        if step is Step.HANDSHAKE_AND_RETRY:
            self._tasks.spawn(self._handshake_and_retry(effect, peer), name=f"register-{effect.receiver.room}")
            return
        rank, leg = effect.receiver, effect.leg
        if step is Step.DONE:
            # The process that took the room: the one the request was addressed to.
            took = effect.request.sender_broker_id
            self._receiver.bootstrap.room_registered(rank, leg, took, still_known=took in self._peers.by_id)
            self._dataplane.pacing.hurry(self._receiver.ranks_awaiting_data())
        else:
            assert error is not None
            self._receiver.bootstrap.registration_failed(rank, leg, error, maybe_delivered=step is Step.FAIL_MAYBE_DELIVERED)

    async def _handshake_and_retry(self, effect: RegisterRoom, peer: Peer) -> None:
        """The peer refused the room as stale: handshake afresh (``peer`` is the
        record the attempt went to: a handshake meanwhile may have found a new
        process at its address and re-keyed it), then try once more with the
        process found there, unless the rank ended meanwhile."""
        rank, leg = effect.receiver, effect.leg
        with self._turn:
            self._receiver.bootstrap.registration_stale(rank, leg)
        try:
            with in_span(rank.span):
                await self._client.handshake(peer)
        except KvBrokerError as exc:
            with self._turn:
                self._receiver.bootstrap.registration_error(rank, leg, exc)
        else:
            with self._turn:
                if self._receiver.bootstrap.register_again(rank, leg, peer.broker_id or ""):
                    self._attempt(effect, peer, retried=True)

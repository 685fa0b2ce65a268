"""What the room state machines ask the world to do.

The sender and receiver state machines (``SenderCore``, ``ReceiverCore``)
do no I/O: every call on them (an engine's request, a peer's message, a transfer
that settled, a notification, a timer) changes their records and returns
effects, which the executor (``executor``) carries out — posting on the
data-plane thread, calling peers, copying on the copy thread, publishing
statuses — and whose outcomes come back to the state machines as further
calls. Effects are plain records; tests read them to see what a state
machine decided.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvbroker.v1 import common_pb2, peer_pb2

if TYPE_CHECKING:
    from kvbroker.broker.memory import CreditRange, StagingReservation
    from kvbroker.broker.rooms._receiver_records import Landing, Receiver, SenderLeg
    from kvbroker.broker.rooms._sender_records import Part
    from kvbroker.broker.rooms._sides import Side
    from kvbroker.plan import ChunkSum, RankKey

__all__ = [
    "AbortAtPeer",
    "Effect",
    "FindSender",
    "RenewLeases",
    "PostPart",
    "Publish",
    "RegisterRoom",
    "ReleaseStaging",
    "ReserveStaging",
    "HandBackCredits",
    "RoomEnded",
    "Scatter",
    "SendReport",
    "TellSuccessor",
    "VerifyChunk",
]


@dataclass(frozen=True)
class Publish:
    """A room's status changed: tell the engine's watchers."""

    engine_id: str
    status: common_pb2.RoomStatus


@dataclass(frozen=True)
class RoomEnded:
    """A side reached SUCCESS or FAILED: close its span, record metrics, write
    the canonical log line."""

    side: Side


# -- sender side ---------------------------------------------------------


@dataclass(frozen=True)
class PostPart:
    """Post one part of a chunk (a NIXL write, or a notification only)."""

    part: Part


@dataclass(frozen=True)
class ReserveStaging:
    """Ask the receiver's broker for room in its staging buffer for a staged part
    (the prefetch); the answer comes back as ``SenderCore.staging_reserved``."""

    part: Part


@dataclass(frozen=True)
class SendReport:
    """Tell a receiver's broker how a source ended (``PeerBroker.ReportCompletion``)."""

    broker_id: str
    report: peer_pb2.CompletionReport


# -- receiver side -------------------------------------------------------


@dataclass(frozen=True)
class FindSender:
    """Handshake with the sender's broker and find the sender group there
    (retrying up to the bootstrap timeout); then ``ReceiverCore.bootstrap.sender_found``."""

    receiver: Receiver


@dataclass(frozen=True)
class RegisterRoom:
    """Register the receiver's room with one of its sender brokers (the transfer info)."""

    receiver: Receiver
    #: Which of the receiver's sender brokers (``Receiver.legs``).
    leg: SenderLeg
    request: peer_pb2.RegisterRoomRequest

    @property
    def broker_id(self) -> str:
        return self.leg.broker_id


@dataclass(frozen=True)
class AbortAtPeer:
    """Tell the sender's broker that the room failed here. ``remember``: if it
    cannot be told, tell the broker that answers at its address next."""

    broker_id: str
    room: int
    cause: common_pb2.FailureCause
    remember: bool = True


@dataclass(frozen=True)
class Scatter:
    """Unpack a staged part that landed in the receive staging buffer into the rank's pages."""

    receiver: Receiver
    landing: Landing


@dataclass(frozen=True)
class VerifyChunk:
    """Compute the CRC-32 of a chunk all of whose parts landed in the rank's
    pages (``what``), off the control loop, and compare it with the sender's
    (``expected``): ``ReceiverCore.landing.chunk_verified``."""

    receiver: Receiver
    source: RankKey
    chunk_index: int
    expected: int
    what: ChunkSum


@dataclass(frozen=True)
class ReleaseStaging:
    """Give staging reservations (kind, device, reservation) back to their receive pools."""

    reservations: tuple[tuple[int, int, StagingReservation], ...]


@dataclass(frozen=True)
class HandBackCredits:
    """Hand ranges of sending peers' credits back to their senders, with the
    next notification to each (a ``CreditReturn``): (kind, device, range) of
    the receive buffer they lie in."""

    credits: tuple[tuple[int, int, CreditRange], ...]


@dataclass(frozen=True)
class RenewLeases:
    """Renew, at the sender's broker at ``address``, the leases of the sources
    of ``rooms`` ((room, sender group) pairs) that announced rooms wait for
    (``PeerBroker.RenewLeases``); the answer goes to ``ReceiverCore.announcements.renewed``."""

    address: str
    rooms: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class TellSuccessor:
    """Tell the broker that answers at ``address`` now which rooms failed here
    without its predecessor hearing of it (``RoomTables.successor_notices``)."""

    address: str


Effect = (
    Publish
    | RoomEnded
    | PostPart
    | ReserveStaging
    | SendReport
    | FindSender
    | RegisterRoom
    | AbortAtPeer
    | Scatter
    | VerifyChunk
    | ReleaseStaging
    | HandBackCredits
    | TellSuccessor
    | RenewLeases
)

"""The room state machines, sender and receiver, with their records, tables and
the effects they return.
"""

from kvbroker.broker.rooms._commands import Abort, AnnounceRoom, BeginSend, ExpectRoom, SendChunk
from kvbroker.broker.rooms._effects import (
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
    TellSuccessor,
    VerifyChunk,
)
from kvbroker.broker.rooms._receiver import ReceiverCore
from kvbroker.broker.rooms._receiver_records import Landing, Receiver, SenderLeg, SourceExpectation
from kvbroker.broker.rooms._records import ReceiverRoom, RoomTables, SenderRoom
from kvbroker.broker.rooms._sender import SenderCore
from kvbroker.broker.rooms._sender_records import (
    Chunk,
    ChunkChecksum,
    Destination,
    Part,
    Source,
    TransferInfo,
)
from kvbroker.broker.rooms._sides import FAILED, Side, cause, cause_of
from kvbroker.broker.rooms._watch import WatchHub

__all__ = [
    "Abort",
    "AnnounceRoom",
    "RenewLeases",
    "BeginSend",
    "ExpectRoom",
    "SendChunk",
    "cause_of",
    "SourceExpectation",
    "SenderRoom",
    "ReceiverRoom",
    "Destination",
    "Chunk",
    "AbortAtPeer",
    "ChunkChecksum",
    "Effect",
    "VerifyChunk",
    "FAILED",
    "FindSender",
    "Part",
    "PostPart",
    "Publish",
    "Landing",
    "Receiver",
    "ReceiverCore",
    "RegisterRoom",
    "ReleaseStaging",
    "HandBackCredits",
    "ReserveStaging",
    "RoomEnded",
    "RoomTables",
    "Scatter",
    "SendReport",
    "SenderCore",
    "SenderLeg",
    "Side",
    "Source",
    "TellSuccessor",
    "TransferInfo",
    "WatchHub",
    "cause",
]

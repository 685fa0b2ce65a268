"""The room state machines, sender and receiver, with their records, tables and
the effects they return.
"""

from kvbroker.broker.rooms._effects import (
    AbortAtPeer,
    Effect,
    FindSender,
    PostPart,
    Publish,
    RegisterRoom,
    ReleaseStaging,
    ReserveStaging,
    RoomEnded,
    Scatter,
    SendReport,
    TellSuccessor,
    VerifyChunk,
)
from kvbroker.broker.rooms._receiver import ReceiverCore
from kvbroker.broker.rooms._receiver_records import Receiver, SenderLeg
from kvbroker.broker.rooms._records import FAILED, RoomTables, Side, cause
from kvbroker.broker.rooms._sender import SenderCore
from kvbroker.broker.rooms._sender_records import ChunkChecksum, Part, Source, TransferInfo
from kvbroker.broker.rooms._watch import WatchHub

__all__ = [
    "AbortAtPeer",
    "ChunkChecksum",
    "Effect",
    "VerifyChunk",
    "FAILED",
    "FindSender",
    "Part",
    "PostPart",
    "Publish",
    "Receiver",
    "ReceiverCore",
    "RegisterRoom",
    "ReleaseStaging",
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

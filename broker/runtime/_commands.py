"""The engines' room commands decoded from their protos into ``rooms``' typed
commands: one decoder each, which the unary calls and the session stream
share (both reach :class:`~kvbroker.broker.runtime._engine_calls.EngineCalls`;
INVALID_ARGUMENT where indices do not decode)."""

from __future__ import annotations

import sys

from kvbroker.broker.memory import Engine
from kvbroker.broker.rooms import Abort, AnnounceRoom, BeginSend, ExpectRoom, SendChunk
from kvbroker.broker.runtime._requests import decode_state
from kvbroker.broker.scheduling import deadline_in, priority_of
from kvbroker.errors import InvalidArgument
from kvbroker.plan import decode_indices
from kvbroker.v1 import transfer_pb2

__all__ = ["checked_priority", "decode_abort", "decode_announce_room", "decode_begin_send", "decode_expect_room", "decode_send_chunk"]


def decode_expect_room(request: transfer_pb2.ExpectRoomRequest, engine: Engine, *, verify_checksums: bool = False) -> ExpectRoom:
    """ExpectRoom; ``verify_checksums``: the broker checks every room's chunks, asked or not."""
    return ExpectRoom(
        engine=engine,
        room=request.room,
        # Interned: every room of a sender group names the same two strings.
        sender_address=sys.intern(request.sender.broker_address),
        sender_group=sys.intern(request.sender.group),
        pages=decode_indices(request.pages),
        aux_row=request.aux_row if request.HasField("aux_row") else None,
        state=decode_state(request.state),
        prefix_pages=request.prefix_pages,
        verify_checksum=request.verify_checksum or verify_checksums,
        priority=checked_priority(request.priority),
        deadline=deadline_in(request.deadline_ms),
    )


def decode_begin_send(request: transfer_pb2.BeginSendRequest, engine: Engine) -> BeginSend:
    return BeginSend(
        engine=engine,
        room=request.room,
        num_pages=request.num_pages,
        priority=checked_priority(request.priority),
        deadline=deadline_in(request.deadline_ms),
    )


def decode_send_chunk(request: transfer_pb2.SendChunkRequest, engine: Engine) -> SendChunk:
    return SendChunk(
        engine=engine,
        room=request.room,
        pages=decode_indices(request.pages),
        is_last=request.is_last,
        aux_row=request.aux_row if request.HasField("aux_row") else None,
        state=decode_state(request.state),
        room_page=request.room_page if request.HasField("room_page") else None,
    )


def decode_abort(request: transfer_pb2.AbortRequest, engine: Engine) -> Abort:
    return Abort(engine=engine, room=request.room, reason=request.reason)


def decode_announce_room(request: transfer_pb2.AnnounceRoomRequest, engine: Engine) -> AnnounceRoom:
    return AnnounceRoom(
        engine=engine,
        room=request.room,
        sender_address=sys.intern(request.sender.broker_address),
        sender_group=sys.intern(request.sender.group),
    )


def checked_priority(value: int) -> int:
    """A room's wire priority (``common_pb2.RoomPriority``), or INVALID_ARGUMENT naming the classes."""
    try:
        priority_of(value)
    except ValueError:
        raise InvalidArgument(f"priority {value} is not a RoomPriority (0 unspecified, 1 bulk, 2 standard, 3 interactive)") from None
    return value

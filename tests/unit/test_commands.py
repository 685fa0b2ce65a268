"""The room commands decoded from their protos (one decoder each, for the unary calls and the session stream)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvbroker.broker.rooms import Abort, AnnounceRoom, BeginSend, ExpectRoom, SendChunk
from kvbroker.broker.runtime._commands import (
    decode_abort,
    decode_announce_room,
    decode_begin_send,
    decode_expect_room,
    decode_send_chunk,
)
from kvbroker.errors import InvalidArgument
from kvbroker.v1 import common_pb2, transfer_pb2

ENGINE = object()  # the decoder carries the engine through; it never reads it


def _indices(*values: int) -> common_pb2.PageIndices:
    return common_pb2.PageIndices(values=list(values))


def test_expect_room_decodes_every_field() -> None:
    """ExpectRoom decodes every field of its request (indices as int32 arrays); the broker's verify_checksums asks for
    checksums too."""
    request = transfer_pb2.ExpectRoomRequest(
        room=7,
        sender=transfer_pb2.SenderRef(broker_address="127.0.0.1:1", group="prefill"),
        pages=_indices(3, 4),
        aux_row=2,
        state=[common_pb2.StateIndices(component="mamba", indices=_indices(5))],
        prefix_pages=1,
    )
    command = decode_expect_room(request, ENGINE)  # type: ignore[arg-type]
    assert isinstance(command, ExpectRoom) and command.engine is ENGINE
    assert (command.room, command.sender_address, command.sender_group) == (7, "127.0.0.1:1", "prefill")
    assert command.pages.tolist() == [3, 4] and command.pages.dtype == np.int32
    assert command.aux_row == 2 and command.state["mamba"].tolist() == [5] and command.prefix_pages == 1
    assert not command.verify_checksum
    assert decode_expect_room(request, ENGINE, verify_checksums=True).verify_checksum  # type: ignore[arg-type]


def test_an_unset_aux_row_or_room_page_is_none_not_zero() -> None:
    """An aux_row or room_page the request leaves unset decodes as None, one set to 0 as 0."""
    expect = decode_expect_room(transfer_pb2.ExpectRoomRequest(room=1, pages=_indices(0)), ENGINE)  # type: ignore[arg-type]
    chunk = decode_send_chunk(transfer_pb2.SendChunkRequest(room=1, pages=_indices(0)), ENGINE)  # type: ignore[arg-type]
    assert expect.aux_row is None and chunk.aux_row is None and chunk.room_page is None
    chunk = decode_send_chunk(
        transfer_pb2.SendChunkRequest(room=1, pages=_indices(0), aux_row=0, room_page=0, is_last=True), ENGINE  # type: ignore[arg-type]
    )
    assert isinstance(chunk, SendChunk) and chunk.aux_row == 0 and chunk.room_page == 0 and chunk.is_last


def test_begin_send_and_abort() -> None:
    """BeginSend decodes its room and page count, Abort its room and reason, asked by the engine."""
    begin = decode_begin_send(transfer_pb2.BeginSendRequest(room=3, num_pages=9), ENGINE)  # type: ignore[arg-type]
    abort = decode_abort(transfer_pb2.AbortRequest(room=3, reason="preempted"), ENGINE)  # type: ignore[arg-type]
    assert isinstance(begin, BeginSend) and (begin.room, begin.num_pages) == (3, 9)
    assert isinstance(abort, Abort) and (abort.room, abort.reason, abort.by) == (3, "preempted", "engine")


def test_announce_room_decodes_the_room_and_its_sender() -> None:
    """AnnounceRoom decodes its room and the sender's broker and group (no address: empty)."""
    request = transfer_pb2.AnnounceRoomRequest(room=11, sender=transfer_pb2.SenderRef(broker_address="10.0.0.1:50051", group="prefill"))
    command = decode_announce_room(request, ENGINE)  # type: ignore[arg-type]
    assert isinstance(command, AnnounceRoom) and command.engine is ENGINE
    assert (command.room, command.sender_address, command.sender_group) == (11, "10.0.0.1:50051", "prefill")
    blank = decode_announce_room(transfer_pb2.AnnounceRoomRequest(room=12, sender=transfer_pb2.SenderRef(group="g")), ENGINE)  # type: ignore[arg-type]
    assert blank.sender_address == ""


def test_bad_indices_are_refused_while_decoding() -> None:
    """Indices both packed and listed, or a state component listed twice, are INVALID_ARGUMENT while decoding."""
    with pytest.raises(InvalidArgument, match="packed or values"):
        decode_send_chunk(
            transfer_pb2.SendChunkRequest(room=1, pages=common_pb2.PageIndices(packed=b"\0\0\0\0", values=[1])), ENGINE  # type: ignore[arg-type]
        )
    twice = [common_pb2.StateIndices(component="c", indices=_indices(1))] * 2
    with pytest.raises(InvalidArgument, match="listed twice"):
        decode_expect_room(transfer_pb2.ExpectRoomRequest(room=1, pages=_indices(0), state=twice), ENGINE)  # type: ignore[arg-type]


def test_commands_are_frozen() -> None:
    """A command's fields cannot be set again."""
    command = decode_begin_send(transfer_pb2.BeginSendRequest(room=3), ENGINE)  # type: ignore[arg-type]
    with pytest.raises(AttributeError):
        command.room = 4  # type: ignore[misc]


def test_a_rooms_priority_and_deadline_decode_and_an_unknown_class_is_refused_by_name() -> None:
    """RoomPriority and deadline_ms (milliseconds from now, 0: none) become the command's class and
    monotonic deadline; a value outside RoomPriority is INVALID_ARGUMENT naming the classes."""
    before = time.monotonic()
    expect = decode_expect_room(
        transfer_pb2.ExpectRoomRequest(room=1, pages=_indices(0), priority=common_pb2.ROOM_PRIORITY_INTERACTIVE, deadline_ms=1500),
        ENGINE,  # type: ignore[arg-type]
    )
    assert expect.priority == common_pb2.ROOM_PRIORITY_INTERACTIVE
    assert expect.deadline is not None and before + 1.5 <= expect.deadline <= time.monotonic() + 1.5
    begin = decode_begin_send(transfer_pb2.BeginSendRequest(room=1, num_pages=1), ENGINE)  # type: ignore[arg-type]
    assert (begin.priority, begin.deadline) == (common_pb2.ROOM_PRIORITY_UNSPECIFIED, None)
    with pytest.raises(InvalidArgument, match="not a RoomPriority.*interactive"):
        decode_begin_send(transfer_pb2.BeginSendRequest(room=1, num_pages=1, priority=7), ENGINE)  # type: ignore[arg-type]


def test_a_commands_indices_are_read_only_however_they_came() -> None:
    """A command's page and state indices cannot be written, packed or listed on the wire or
    built by hand, and its state is a mapping of its own that cannot be changed."""
    packed = decode_send_chunk(transfer_pb2.SendChunkRequest(room=1, pages=common_pb2.PageIndices(packed=b"\1\0\0\0")), ENGINE)  # type: ignore[arg-type]
    listed = decode_expect_room(
        transfer_pb2.ExpectRoomRequest(room=1, pages=_indices(3), state=[common_pb2.StateIndices(component="c", indices=_indices(1))]),
        ENGINE,  # type: ignore[arg-type]
    )
    state = {"c": np.array([2], dtype=np.int32)}
    by_hand = SendChunk(engine=ENGINE, room=1, pages=np.array([4], dtype=np.int32), state=state)  # type: ignore[arg-type]
    state["d"] = np.array([5], dtype=np.int32)
    assert list(by_hand.state) == ["c"]
    for indices in (packed.pages, listed.pages, listed.state["c"], by_hand.pages, by_hand.state["c"]):
        with pytest.raises(ValueError, match="read-only"):
            indices[0] = 9
    with pytest.raises(TypeError):
        by_hand.state["e"] = state["d"]  # type: ignore[index]

"""One room, seen from one engine rank: ``KVSender`` (prefill) and ``KVReceiver`` (decode).

They follow SGLang's KVSender/KVReceiver: construct, ``init``, then
``send`` (sender) or wait (receiver), ``poll`` until SUCCESS or FAILED,
``failure_exception`` to raise the cause, ``abort`` to give up.

Every method is one broker call (none is cached), raises the typed errors of
``kvbroker.errors`` carrying the gRPC status, and may be called from any
thread, though one room should be driven by one.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy.typing as npt

from kvbroker.errors import FailedPrecondition, RoomFailed
from kvbroker.indices import as_index, as_indices, encode_indices
from kvbroker.v1 import common_pb2, transfer_pb2

if TYPE_CHECKING:
    from kvbroker.client.engine import EngineHandle

__all__ = ["KVReceiver", "KVSender", "RoomState", "SenderRef"]


class RoomState(enum.IntEnum):
    """``kvbroker.v1.RoomState``; the order matters (min over a group of ranks)."""

    FAILED = common_pb2.ROOM_STATE_FAILED
    BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
    WAITING_FOR_INPUT = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
    TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
    SUCCESS = common_pb2.ROOM_STATE_SUCCESS


@dataclass(frozen=True)
class SenderRef:
    """Where a room's sender side lives: the prefill host's broker and engine group."""

    #: The prefill broker's gRPC address (its ``serve --listen``); "" means
    #: the receiver's own broker (both ends on one host).
    broker_address: str
    group: str


Pages = npt.ArrayLike


class _Room:
    def __init__(self, engine: EngineHandle, room: int) -> None:
        self.engine = engine
        self.room = room

    def status(self) -> common_pb2.RoomStatus:
        """The broker's status of this room for this engine rank."""
        return self.engine.poll([self.room])[self.room]

    def poll(self) -> RoomState:
        """The room's state (FAILED, BOOTSTRAPPING, ..., SUCCESS)."""
        return RoomState(self.status().state)

    def failure_exception(self) -> None:
        """Raise ``RoomFailed`` with the broker's first cause if the room failed."""
        status = self.status()
        if RoomState(status.state) is RoomState.FAILED:
            raise RoomFailed(self.room, status.cause)

    def abort(self, reason: str = "") -> common_pb2.RoomStatus:
        """Fail the room here and at the peer broker. Idempotent.

        On a receiver, the pages may be reused once ``status().pages_settled``.
        """
        response: transfer_pb2.AbortResponse = self.engine.client.call(
            self.engine.client.stub.Abort,
            transfer_pb2.AbortRequest(engine_id=self.engine.engine_id, room=self.room, reason=reason),
        )
        return response.status

    def wait(self, timeout_seconds: float) -> common_pb2.RoomStatus:
        """Poll until SUCCESS or FAILED; ``DeadlineExceeded`` after the timeout."""
        return self.engine.wait([self.room], timeout_seconds=timeout_seconds)[self.room]


class KVSender(_Room):
    """The sender side of one room on one prefill rank."""

    def __init__(self, engine: EngineHandle, room: int) -> None:
        super().__init__(engine, room)
        self.num_pages = 0
        self.aux_row: int | None = None
        self._sent = 0
        self._last_sent = False

    def init(self, num_pages: int, aux_row: int | None = None) -> common_pb2.RoomStatus:
        """Open the room (BeginSend): ``num_pages`` over all chunks, and the aux
        row sent with the last chunk. ALREADY_EXISTS if the room is open here."""
        if aux_row is not None:
            aux_row = as_index(aux_row, "aux_row")
        response: transfer_pb2.BeginSendResponse = self.engine.client.call(
            self.engine.client.stub.BeginSend,
            transfer_pb2.BeginSendRequest(engine_id=self.engine.engine_id, room=self.room, num_pages=num_pages),
        )
        self.num_pages = num_pages
        self.aux_row = aux_row
        return response.status

    def send(
        self,
        pages: Pages,
        *,
        state: Mapping[str, Pages] | None = None,
        is_last: bool | None = None,
    ) -> int:
        """Send one chunk of source pages; returns its chunk index.

        ``is_last`` defaults to "this chunk reaches ``num_pages``" (SGLang's
        rule). The last chunk carries the aux row given to ``init`` and
        ``state`` (component -> indices). Returns at once; the broker posts
        the transfer as soon as the receiver's transfer info is there.
        """
        if self._last_sent:
            raise FailedPrecondition(f"room {self.room}: the last chunk was already sent")
        array = as_indices(pages, "pages")
        last = (self._sent + array.size >= self.num_pages) if is_last is None else is_last
        request = transfer_pb2.SendChunkRequest(
            engine_id=self.engine.engine_id, room=self.room, pages=encode_indices(array), is_last=last
        )
        if last:
            if self.aux_row is not None:
                request.aux_row = self.aux_row
            for name, indices in (state or {}).items():
                request.state.add(component=name, indices=encode_indices(indices, f"state {name!r}"))
        response: transfer_pb2.SendChunkResponse = self.engine.client.call(self.engine.client.stub.SendChunk, request)
        self._sent += array.size
        self._last_sent = last
        return response.chunk_index


class KVReceiver(_Room):
    """The receiver side of one room on one decode rank."""

    def __init__(self, engine: EngineHandle, room: int, sender: SenderRef) -> None:
        super().__init__(engine, room)
        self.sender = sender

    def init(
        self,
        pages: Pages,
        aux_row: int | None = None,
        state: Mapping[str, Pages] | None = None,
    ) -> common_pb2.RoomStatus:
        """Open the room (ExpectRoom): destination pages in the order the
        sender's chunks fill them, the aux row, and state indices per
        component (components with no indices are not expected).
        Returns at once; the room bootstraps in the background."""
        request = transfer_pb2.ExpectRoomRequest(
            engine_id=self.engine.engine_id,
            room=self.room,
            sender=transfer_pb2.SenderRef(broker_address=self.sender.broker_address, group=self.sender.group),
            pages=encode_indices(pages, "pages"),
        )
        if aux_row is not None:
            request.aux_row = as_index(aux_row, "aux_row")
        for name, indices in (state or {}).items():
            request.state.add(component=name, indices=encode_indices(indices, f"state {name!r}"))
        response: transfer_pb2.ExpectRoomResponse = self.engine.client.call(self.engine.client.stub.ExpectRoom, request)
        return response.status

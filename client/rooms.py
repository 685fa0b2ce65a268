"""One room, seen from one engine rank: ``KVSender`` (prefill) and ``KVReceiver`` (decode).

They follow SGLang's KVSender/KVReceiver: construct, ``init``, then
``send`` (sender) or wait (receiver), ``poll`` until SUCCESS or FAILED,
``failure_exception`` to raise the cause, ``abort`` to give up. A receiver
may ``announce`` the room before ``init``, while its request waits for
pages: the sender's lease on its pages is renewed meanwhile.

``init``, ``send`` and ``abort`` do not wait for the broker: they check what
can be checked here (indices against the engine's own layout, a room opened
twice, pages beyond the declared count, a chunk after the last) and raise
that at once, then queue the command on the engine's session and return. What
the broker refuses later fails the room: ``poll`` says FAILED and
``failure_exception`` raises ``RoomFailed`` with the broker's message
(``FAILURE_KIND_REFUSED``). ``poll``, ``status`` and ``failure_exception`` read
the session's table and make no call. Threading: see ``EngineHandle``; drive
one room from one thread.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy.typing as npt

from kvbroker.client.tracecontext import current_trace_context
from kvbroker.errors import FailedPrecondition, InvalidArgument, NotFound, RoomFailed
from kvbroker.plan import (
    NO_INDICES,
    IndexArray,
    as_index,
    as_indices,
    check_chunk,
    check_declared_pages,
    check_room_indices,
    decode_indices,
    encode_indices,
)
from kvbroker.v1 import common_pb2, transfer_pb2

if TYPE_CHECKING:
    from kvbroker.client.engine import EngineHandle

__all__ = ["KVReceiver", "KVSender", "Priority", "RoomState", "SenderRef", "deadline_value", "priority_value"]

#: Builds a session command from its seq.
MakeCommand = Callable[[int], transfer_pb2.SessionCommand]
#: A room's priority as the client takes it: a class name, a ``RoomPriority`` value, or None (standard).
Priority = str | int | None


class RoomState(enum.IntEnum):
    """``kvbroker.v1.RoomState``; the order matters (min over a group of ranks)."""

    FAILED = common_pb2.ROOM_STATE_FAILED
    BOOTSTRAPPING = common_pb2.ROOM_STATE_BOOTSTRAPPING
    WAITING_FOR_INPUT = common_pb2.ROOM_STATE_WAITING_FOR_INPUT
    TRANSFERRING = common_pb2.ROOM_STATE_TRANSFERRING
    SUCCESS = common_pb2.ROOM_STATE_SUCCESS


@dataclass(frozen=True)
class SenderRef:
    """Where a room's sender side lives: the prefill engine group, and its broker.

    ``SenderRef("host-a:50051", "prefill-0")`` names the broker;
    ``SenderRef(group="prefill-0")`` leaves it to the receiver's broker: one
    started with ``--etcd`` finds the broker that serves the group in etcd
    (per receiving rank when the group spans hosts, and the newest broker
    when the group moved); one without etcd takes itself (both ends on one
    host).
    """

    #: The prefill broker's gRPC address (its ``serve --listen``), or "".
    broker_address: str = ""
    group: str = ""

    def __post_init__(self) -> None:
        if not self.group:
            raise ValueError("SenderRef needs the prefill engine group")


Pages = npt.ArrayLike


class _Room:
    def __init__(self, engine: EngineHandle, room: int) -> None:
        self.engine = engine
        self.room = room

    def status(self) -> common_pb2.RoomStatus:
        """This room's status for this engine rank, as the session knows it."""
        return self.engine.poll([self.room])[self.room]

    def poll(self) -> RoomState:
        """The room's state (FAILED, BOOTSTRAPPING, ..., SUCCESS)."""
        return RoomState(self.status().state)

    def failure_exception(self) -> None:
        """Raise ``RoomFailed`` with the room's first cause if the room failed."""
        status = self.status()
        if RoomState(status.state) is RoomState.FAILED:
            raise RoomFailed(self.room, status.cause)

    def abort(self, reason: str = "") -> None:
        """Fail the room here and at the peer broker (queued; idempotent).

        On a receiver, the pages may be reused once ``status().pages_settled``.
        """
        request = transfer_pb2.AbortRequest(room=self.room, reason=reason)
        self.engine.session.submit_many([(self.room, lambda seq: transfer_pb2.SessionCommand(seq=seq, abort=request))], always=True)

    def wait(self, timeout_seconds: float) -> common_pb2.RoomStatus:
        """Block until SUCCESS or FAILED; ``DeadlineExceeded`` after the timeout."""
        return self.engine.wait([self.room], timeout_seconds=timeout_seconds)[self.room]


@dataclass(frozen=True)
class _Chunk:
    """A checked chunk, ready to queue (``KVSender.prepare``)."""

    size: int
    last: bool
    make: MakeCommand


class KVSender(_Room):
    """The sender side of one room on one prefill rank."""

    def __init__(self, engine: EngineHandle, room: int) -> None:
        super().__init__(engine, room)
        self.num_pages = 0
        self.aux_row: int | None = None
        self._opened = False
        self._sent = 0
        self._chunks = 0
        self._last_sent = False

    def init(
        self, num_pages: int, aux_row: int | None = None, *, priority: Priority = None, deadline_seconds: float | None = None
    ) -> common_pb2.RoomStatus:
        """Open the room (BeginSend): ``num_pages`` over all chunks, and the aux
        row sent with the last chunk. ``AlreadyExists`` if this engine rank
        opened the room before. Returns the room's status as known now.
        ``priority`` (``"interactive"``, ``"standard"``, ``"bulk"``, a
        ``RoomPriority`` value, or None: standard) and ``deadline_seconds``
        (from now) order the room's work on the brokers until the decode
        side's registration arrives: the decode side's values win."""
        self.engine.check_role(common_pb2.ROLE_PREFILL, "send rooms")
        num_pages = _count(num_pages, "num_pages")
        check_declared_pages(self.engine.layout, num_pages)
        if aux_row is not None:
            aux_row = as_index(aux_row, "aux_row")
            check_room_indices(self.engine.layout, pages=NO_INDICES, aux_row=aux_row, state={})
        request = transfer_pb2.BeginSendRequest(
            room=self.room,
            num_pages=num_pages,
            priority=priority_value(priority),  # type: ignore[arg-type]
            deadline_ms=deadline_value(deadline_seconds),
        )
        trace = current_trace_context()
        (status,) = self.engine.session.open_rooms(
            [(self.room, lambda seq: transfer_pb2.SessionCommand(seq=seq, begin_send=request, trace_context=trace))]
        )
        self.num_pages = num_pages
        self.aux_row = aux_row
        self._opened = True
        return status

    def set_aux_row(self, aux_row: int | None) -> None:
        """The aux row the last chunk carries, for an engine that learns it
        after opening the room (SGLang gives it after the handshake). Before
        the last chunk only; checked like ``init``'s."""
        if self._last_sent:
            raise FailedPrecondition(f"room {self.room}: the last chunk was already sent")
        if aux_row is not None:
            aux_row = as_index(aux_row, "aux_row")
            check_room_indices(self.engine.layout, pages=NO_INDICES, aux_row=aux_row, state={})
        self.aux_row = aux_row

    def send(
        self,
        pages: Pages,
        *,
        state: Mapping[str, Pages] | None = None,
        is_last: bool | None = None,
        room_page: int | None = None,
    ) -> int:
        """Send one chunk of source pages; returns its chunk index.

        ``is_last`` defaults to "this chunk reaches ``num_pages``" (SGLang's
        rule). The last chunk carries the aux row given to ``init`` and
        ``state`` (component -> indices). ``room_page``, on the first chunk
        only: the room page it starts at, for a sender that sends only the
        pages after its receivers' prefix (``status().prefix_pages``); by
        default the chunks are the whole room and the broker skips what each
        receiver holds. Returns at once; the broker posts the transfer as
        soon as the receiver's transfer info is there.
        """
        chunk = self.prepare(pages, state=state, is_last=is_last, room_page=room_page)
        self.engine.session.submit_many([(self.room, chunk.make)])
        return self.commit(chunk)

    def prepare(
        self,
        pages: Pages,
        *,
        state: Mapping[str, Pages] | None = None,
        is_last: bool | None = None,
        room_page: int | None = None,
    ) -> _Chunk:
        """Check one chunk and build its command (``send`` without queueing it)."""
        if room_page is not None:
            room_page = _count(room_page, "room_page")
            if self._chunks:
                raise InvalidArgument(f"room {self.room}: only the first chunk may say where in the room it starts")
        if not self._opened:
            raise NotFound(f"room {self.room} is not open for sending on this engine rank; call BeginSend (init) first")
        if self._last_sent:
            raise FailedPrecondition(f"room {self.room}: the last chunk was already sent")
        array = as_indices(pages, "pages")
        last = (self._sent + array.size >= self.num_pages) if is_last is None else is_last
        states = {name: as_indices(indices, f"state {name!r}") for name, indices in (state or {}).items()} if last else {}
        check_chunk(
            self.engine.layout,
            declared=self.num_pages,
            sent=self._sent,
            pages=array,
            is_last=last,
            aux_row=self.aux_row if last else None,
            state=states,
        )
        request = transfer_pb2.SendChunkRequest(room=self.room, pages=encode_indices(array), is_last=last)
        if room_page is not None:
            request.room_page = room_page
        if last:
            if self.aux_row is not None:
                request.aux_row = self.aux_row
            for name, indices in states.items():
                request.state.add(component=name, indices=encode_indices(indices, f"state {name!r}"))
        return _Chunk(array.size, last, lambda seq: transfer_pb2.SessionCommand(seq=seq, send_chunk=request))

    def commit(self, chunk: _Chunk) -> int:
        """Count a queued chunk; its index."""
        index = self._chunks
        self._chunks += 1
        self._sent += chunk.size
        self._last_sent = chunk.last
        return index


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
        prefix_pages: int = 0,
        verify_checksum: bool = False,
        *,
        priority: Priority = None,
        deadline_seconds: float | None = None,
    ) -> common_pb2.RoomStatus:
        """Open the room (ExpectRoom): destination pages in the order the
        sender's chunks fill them, the aux row, and state indices per
        component (components with no indices are not expected).
        ``prefix_pages``: the leading pages of the room this rank already
        holds (its prefix cache); ``pages`` are then the pages after them, and
        only those are written. ``verify_checksum``: check every chunk end to
        end against a checksum the sending broker computes (a mismatch fails
        the room with MISMATCH; what moves through the device path is
        checked part by part). ``priority`` (``"interactive"``,
        ``"standard"``, ``"bulk"``, a ``RoomPriority`` value, or None:
        standard) and ``deadline_seconds`` (from now; within its class, a
        room with a deadline moves first) order the room's work on both
        brokers: these win over the sender's. Returns at once; the room
        bootstraps in the background."""
        command = self.command(pages, aux_row, state, prefix_pages, verify_checksum, priority, deadline_seconds)
        (status,) = self.engine.session.open_rooms([(self.room, command)])
        return status

    def announce(self) -> None:
        """Say that this rank still wants the room before it can open it (before
        ``init``): while the request waits for pages, this engine's broker
        renews the sender's lease on the prefill's pages (``AnnounceRoom``),
        for as long as this engine's registration lives. ``init`` ends the
        announcement (the room's own registration holds the sender from
        then on), as do ``abort`` and the engine going away: the renewals stop
        and the prefill's lease runs out. Queued, like the other commands;
        calling it again is harmless, and an unreachable sender's broker never
        fails it (the renewal is retried)."""
        self.engine.check_role(common_pb2.ROLE_DECODE, "announce rooms")
        request = transfer_pb2.AnnounceRoomRequest(
            room=self.room,
            sender=transfer_pb2.SenderRef(broker_address=self.sender.broker_address, group=self.sender.group),
        )
        self.engine.session.submit_many(
            [(self.room, lambda seq: transfer_pb2.SessionCommand(seq=seq, announce_room=request))], always=True
        )

    def landed_pages(self) -> IndexArray:
        """The room's pages that arrived whole, known once the room FAILED and
        its pages are settled (``RoomStatus.landed_pages``): the engine need
        recompute only the others. Empty before that; on SUCCESS every page
        arrived. Aux and state come with the last chunk: after a failure, do
        not trust them."""
        return decode_indices(self.status().landed_pages, what="landed pages")

    def command(
        self,
        pages: Pages,
        aux_row: int | None = None,
        state: Mapping[str, Pages] | None = None,
        prefix_pages: int = 0,
        verify_checksum: bool = False,
        priority: Priority = None,
        deadline_seconds: float | None = None,
    ) -> MakeCommand:
        """Check the room's indices and build its ExpectRoom command."""
        self.engine.check_role(common_pb2.ROLE_DECODE, "expect rooms")
        prefix_pages = _count(prefix_pages, "prefix_pages")
        array = as_indices(pages, "pages")
        if aux_row is not None:
            aux_row = as_index(aux_row, "aux_row")
        states = {name: as_indices(indices, f"state {name!r}") for name, indices in (state or {}).items()}
        check_room_indices(self.engine.layout, pages=array, aux_row=aux_row, state=states)
        request = transfer_pb2.ExpectRoomRequest(
            room=self.room,
            sender=transfer_pb2.SenderRef(broker_address=self.sender.broker_address, group=self.sender.group),
            pages=encode_indices(array),
            prefix_pages=prefix_pages,
            verify_checksum=verify_checksum,
            priority=priority_value(priority),  # type: ignore[arg-type]
            deadline_ms=deadline_value(deadline_seconds),
        )
        if aux_row is not None:
            request.aux_row = aux_row
        for name, indices in states.items():
            request.state.add(component=name, indices=encode_indices(indices, f"state {name!r}"))
        trace = current_trace_context()
        return lambda seq: transfer_pb2.SessionCommand(seq=seq, expect_room=request, trace_context=trace)



def _count(value: int, name: str) -> int:
    """A page count on the wire (uint32), checked."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise InvalidArgument(f"{name} must be a non-negative integer below 2**32, got {value!r}")
    return value

_CLASSES = {"bulk": 1, "standard": 2, "interactive": 3}


def priority_value(priority: Priority) -> int:
    """``priority`` as a ``common_pb2.RoomPriority`` value (``ValueError`` naming the classes)."""
    if priority is None:
        return 0
    if isinstance(priority, str):
        value = _CLASSES.get(priority.lower().removeprefix("room_priority_"))
        if value is None:
            raise ValueError(f"priority {priority!r} is not one of {', '.join(_CLASSES)}")
        return value
    if int(priority) not in (0, *_CLASSES.values()):
        raise ValueError(f"priority {priority} is not a RoomPriority value (0 unspecified, 1 bulk, 2 standard, 3 interactive)")
    return int(priority)


def deadline_value(seconds: float | None) -> int:
    """A deadline ``seconds`` from now as the wire's milliseconds (0: none; at least 1)."""
    if seconds is None:
        return 0
    if not seconds > 0:
        raise ValueError(f"deadline_seconds must be positive, not {seconds}")
    return max(1, min(round(seconds * 1000), 2**32 - 1))

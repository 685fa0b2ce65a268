"""An engine rank registered with its broker: opens rooms, polls, waits."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from kvbroker.client.memory import EngineMemory, RankSpec
from kvbroker.client.rooms import KVReceiver, KVSender, Pages, Priority, RoomState, SenderRef
from kvbroker.client.session import Session
from kvbroker.errors import DeadlineExceeded, FailedPrecondition, NotFound, from_rpc_error
from kvbroker.plan import Layout, RoomTimeouts, rank_key
from kvbroker.v1 import common_pb2, transfer_pb2

if TYPE_CHECKING:
    from kvbroker.client.connection import BrokerClient

__all__ = ["EngineHandle", "ExpectSpec"]


@dataclass(frozen=True)
class ExpectSpec:
    """One room to open on a decode rank (``EngineHandle.expect``)."""

    room: int
    sender: SenderRef
    pages: Pages
    aux_row: int | None = None
    state: Mapping[str, Pages] | None = None
    #: The leading pages of the room the rank already holds (``KVReceiver.init``).
    prefix_pages: int = 0
    #: Check every chunk end to end (``KVReceiver.init``).
    verify_checksum: bool = False
    #: The room's class and deadline (``KVReceiver.init``).
    priority: Priority = None
    deadline_seconds: float | None = None


class EngineHandle:
    """One registered engine rank. Made by ``BrokerClient.register_engine``.

    The handle owns the engine's two connections with the broker: the fd
    socket (the broker releases the engine when it closes) and the session
    stream (``client/session.py``), which carries the room commands and
    brings back room states.

    Threading: every method may be called from any thread. Room commands
    (``init``, ``send``, ``abort`` and the batch calls) queue and return at
    once; the broker applies them in the order they were queued, so the
    commands of one room should come from one thread (or be ordered by the
    caller). ``poll`` and ``status`` read the session's table; ``wait`` and
    ``wait_any`` block the calling thread only.
    """

    def __init__(
        self,
        client: BrokerClient,
        engine_id: str,
        rank: RankSpec,
        memory: EngineMemory,
        fd_session: socket.socket,
        broker_id: str,
        timeouts: RoomTimeouts,
    ) -> None:
        self.client = client
        self.engine_id = engine_id
        self.rank = rank
        self.memory = memory
        #: The rank's own timeouts for its rooms (sent again when it registers again).
        self.timeouts = timeouts
        #: The broker process this engine is registered with.
        self.broker_id = broker_id
        #: The engine's own layout, for checking indices before they are queued.
        self.layout = Layout.from_proto(memory.layout, rank=rank_key(rank.to_proto()), buffer_sizes=memory.buffer_sizes())
        self._fd_session: socket.socket | None = fd_session
        self._lock = threading.Lock()
        self.session = Session(self)

    # -- rooms -------------------------------------------------------------
    def sender(self, room: int) -> KVSender:
        """A sender for ``room`` (prefill ranks). Call ``init`` on it next."""
        return KVSender(self, room)

    def receiver(self, room: int, sender: SenderRef) -> KVReceiver:
        """A receiver for ``room`` (decode ranks) whose data comes from ``sender``.
        Call ``init`` on it next."""
        return KVReceiver(self, room, sender)

    def expect(self, rooms: Iterable[ExpectSpec]) -> list[KVReceiver]:
        """Open many receiving rooms (decode ranks): ``KVReceiver.init`` for
        each, checked first as a whole (nothing is queued if one is invalid)."""
        receivers = [(KVReceiver(self, spec.room, spec.sender), spec) for spec in rooms]
        commands = [(r, r.command(
                spec.pages, spec.aux_row, spec.state, spec.prefix_pages, spec.verify_checksum, spec.priority, spec.deadline_seconds
            )) for r, spec in receivers]
        self.session.open_rooms([(r.room, make) for r, make in commands])
        return [r for r, _ in receivers]

    def send(self, chunks: Iterable[tuple[KVSender, Pages]]) -> list[int]:
        """Send one chunk of each of many rooms (prefill ranks): ``KVSender.send``
        with its defaults, checked first as a whole; the chunk indices."""
        prepared = [(sender, sender.prepare(pages)) for sender, pages in chunks]
        self.session.submit_many([(sender.room, chunk.make) for sender, chunk in prepared])
        return [sender.commit(chunk) for sender, chunk in prepared]

    def poll(self, rooms: Sequence[int]) -> dict[int, common_pb2.RoomStatus]:
        """The status of many rooms. Rooms this engine opened are answered from
        the session's table (no call); others are asked of the broker (Poll)."""
        known, unknown = self.session.statuses(rooms)
        if unknown:
            response: transfer_pb2.PollResponse = self.client.call(
                self.client.stub.Poll, transfer_pb2.PollRequest(engine_id=self.engine_id, rooms=unknown)
            )
            known.update((s.room, s) for s in response.statuses)
        return known

    def wait(self, rooms: Sequence[int], *, timeout_seconds: float) -> dict[int, common_pb2.RoomStatus]:
        """Block until every room is SUCCESS or FAILED; their final statuses.

        Wakes when the session hears of a change, not on a polling interval.
        Raises ``DeadlineExceeded`` after ``timeout_seconds``.
        """
        done = self.session.wait(rooms, timeout_seconds)
        rest = [room for room in rooms if room not in done]
        if rest:
            done.update(self._watch_until_done(rest, timeout_seconds))
        return done

    def wait_any(self, rooms: Sequence[int], *, timeout_seconds: float) -> dict[int, common_pb2.RoomStatus]:
        """Block until at least one of ``rooms`` (opened by this engine) is
        SUCCESS or FAILED; the statuses of those that are."""
        return self.session.wait(rooms, timeout_seconds, any_=True)

    def watch(self, rooms: Iterable[int] = ()) -> Iterator[common_pb2.RoomStatus]:
        """Stream every state change of ``rooms`` (all of this engine's rooms if
        empty) from the broker (WatchRooms): the current status of each watched
        room first, then every change. Ends when the engine unregisters."""
        call = self.client.stub.WatchRooms(transfer_pb2.WatchRoomsRequest(engine_id=self.engine_id, rooms=list(rooms)))
        try:
            yield from call
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def _watch_until_done(self, rooms: Sequence[int], timeout_seconds: float) -> dict[int, common_pb2.RoomStatus]:
        """``wait`` for rooms the session does not track (opened elsewhere)."""
        pending = set(rooms)
        done: dict[int, common_pb2.RoomStatus] = {}
        call = self.client.stub.WatchRooms(
            transfer_pb2.WatchRoomsRequest(engine_id=self.engine_id, rooms=sorted(pending)), timeout=timeout_seconds
        )
        try:
            for status in call:
                if status.state in (RoomState.SUCCESS, RoomState.FAILED) and status.room in pending:
                    pending.discard(status.room)
                    done[status.room] = status
                    if not pending:
                        break
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(
                    f"{len(pending)} rooms did not finish in {timeout_seconds} s: {sorted(pending)[:8]}"
                ) from None
            raise from_rpc_error(exc) from None
        finally:
            call.cancel()
        if pending:
            raise FailedPrecondition(f"the broker ended the watch with rooms unfinished: {sorted(pending)[:8]}")
        return done

    def check_role(self, role: int, action: str) -> None:
        """``FailedPrecondition`` unless this engine rank has ``role`` (a ROLE_BOTH rank has
        either; the broker's own check, made here first)."""
        if self.layout.role not in (role, common_pb2.ROLE_BOTH):
            raise FailedPrecondition(
                f"engine {self.engine_id} ({common_pb2.Role.Name(self.layout.role)}) cannot {action}; "
                f"that needs a {common_pb2.Role.Name(role)} engine"
            )

    def flush(self, timeout_seconds: float | None = None) -> None:
        """Block until the broker has applied every room command queued so far
        (refusals are then in the rooms' statuses)."""
        self.session.flush(self.client.timeout_seconds if timeout_seconds is None else timeout_seconds)

    # -- lifecycle -------------------------------------------------------------
    def broker_gone(self) -> bool:
        """Whether the broker process this engine registered with is gone: its
        end of the engine's fd connection closed (the kernel closes it when the
        process exits; a stopped or busy process keeps it open)."""
        with self._lock:
            fd_session = self._fd_session
        if fd_session is None:
            return True
        try:
            return fd_session.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, and nothing to read: the process holds it
        except OSError:
            return True

    def register_again(self) -> None:
        """Register with the broker again (it restarted); the session calls this."""
        info = self.client.refresh_info()
        engine_id, fd_session = self.client.upload_and_register(self.rank, self.memory, self.timeouts)
        with self._lock:
            old, self._fd_session = self._fd_session, fd_session
            self.engine_id = engine_id
            self.broker_id = info.broker_id
        if old is not None:
            old.close()

    def close(self) -> None:
        """Send what is queued, then unregister (idempotent). The broker fails rooms still open.
        An engine the broker already let go of (its memory could not be backed) closes quietly."""
        with self._lock:
            fd_session, self._fd_session = self._fd_session, None
        if fd_session is None:
            return
        try:
            self.session.close(self.client.timeout_seconds)
            with contextlib.suppress(NotFound):
                self.client.call(
                    self.client.stub.UnregisterEngine, transfer_pb2.UnregisterEngineRequest(engine_id=self.engine_id)
                )
        finally:
            fd_session.close()

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

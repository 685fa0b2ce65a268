"""An engine rank's session with its broker: ordered commands out, room states in.

One bidirectional gRPC stream (``TransferBroker.Session``) per registered
engine rank carries both directions:

- commands (ExpectRoom, BeginSend, SendChunk, Abort). The calling thread
  queues a command and returns; gRPC's request-iterator thread sends
  everything queued as one message (up to ``_MAX_BATCH`` commands), in the
  order it was queued. Commands are numbered; the broker applies them in
  that order, so the commands of one room reach it in the order the engine
  made them.
- events from the broker: how far it has applied the commands, the commands
  it refused, and the latest status of each of this engine's rooms whose state
  changed. The reader thread (``kvb-session``) keeps a table of room statuses;
  ``poll`` reads that table and makes no call.

Failures are never lost: a refused command fails its room with the broker's
message (``FAILURE_KIND_REFUSED``), and a room's first failure cause is the one
it keeps. If the stream breaks, the reader reconnects: to the same broker
process it resumes (commands the broker had not applied are sent again, and
the statuses of open rooms are refreshed), to a restarted broker it fails the
open rooms (``FAILURE_KIND_BROKER_LOST``; the old process is gone, so no
transfer can still write into their pages), registers the engine again and
carries on with new rooms.

Nothing waits for a broker that stays away: gRPC keepalive notices one that
stopped answering without closing its connection (a stopped process) within
about three seconds, and once the broker has not answered for
``BrokerClient.broker_lost_after_seconds`` the open rooms fail
(``BROKER_LOST``, naming the broker and what was seen) and new commands raise
``Unavailable`` until it answers again. Their pages are settled if the broker
process is gone (the engine's fd connection to it was closed: nothing of it
can write any more), and not otherwise: a broker that is alive may still
land a transfer. When that same process answers again, the session resumes
and its first commands abort those rooms there (commands of them not yet
applied became aborts), so the broker drops their transfers and reports
their pages settled; the resumed stream also asks for those rooms' statuses,
since one may have ended there while the stream was broken (its settled
status went out on the broken stream and the abort changes nothing). A new
process settles them at once.

Backpressure: at most ``max_pending`` commands may be queued or unapplied; a
caller beyond that blocks until the broker catches up, for at most the
client's timeout, then gets ``ResourceExhausted``. Memory is bounded by that
and by ``finished_kept``: statuses of finished rooms are kept for the newest
``finished_kept`` of them; an older room's status is asked of the broker.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING

import grpc

from kvbroker.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    KvBrokerError,
    NotFound,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import common_pb2, transfer_pb2

if TYPE_CHECKING:
    from kvbroker.client.engine import EngineHandle

__all__ = ["DEFAULT_FINISHED_KEPT", "DEFAULT_MAX_PENDING", "Session"]

log = logging.getLogger("kvbroker.client")

#: Commands per stream message.
_MAX_BATCH = 1024
DEFAULT_MAX_PENDING = 65536
DEFAULT_FINISHED_KEPT = 65536
_TERMINAL = (common_pb2.ROOM_STATE_SUCCESS, common_pb2.ROOM_STATE_FAILED)
_RECONNECT_FIRST_S = 0.05
_RECONNECT_MAX_S = 1.0
#: How long one "is the broker back?" probe waits.
_PROBE_TIMEOUT_S = 0.5


def _abort(seq: int, room: int, reason: str) -> transfer_pb2.SessionCommand:
    return transfer_pb2.SessionCommand(seq=seq, abort=transfer_pb2.AbortRequest(room=room, reason=reason))


def _abort_if(command: transfer_pb2.SessionCommand, rooms: Mapping[int, object], reason: str) -> transfer_pb2.SessionCommand:
    """``command``, or an abort in its place (same number: the broker's count
    has no gap) if it is one of ``rooms``'."""
    which = command.WhichOneof("command")
    room = int(getattr(command, which).room) if which else -1
    return _abort(command.seq, room, reason) if room in rooms else command


def failed_status(room: int, kind: int, message: str, origin: str, *, settled: bool) -> common_pb2.RoomStatus:
    """A FAILED status made on this side (a refused command, a lost broker)."""
    return common_pb2.RoomStatus(
        room=room,
        state=common_pb2.ROOM_STATE_FAILED,
        cause=common_pb2.FailureCause(kind=kind, message=message, origin_broker=origin),  # type: ignore[arg-type]
        pages_settled=settled,
    )


class _RoomView:
    """What this session knows of one of its rooms."""

    __slots__ = ("opened_seq", "status")

    def __init__(self, room: int, opened_seq: int) -> None:
        self.opened_seq = opened_seq
        self.status = common_pb2.RoomStatus(room=room, state=common_pb2.ROOM_STATE_BOOTSTRAPPING)

    @property
    def terminal(self) -> bool:
        return self.status.state in _TERMINAL


class Session:
    """The command stream of one engine rank. Made by ``EngineHandle``; thread-safe."""

    def __init__(
        self,
        handle: EngineHandle,
        *,
        max_pending: int = DEFAULT_MAX_PENDING,
        finished_kept: int = DEFAULT_FINISHED_KEPT,
    ) -> None:
        self._handle = handle
        self._max_pending = max_pending
        self._finished_kept = finished_kept
        self._cond = threading.Condition(threading.Lock())
        self._next_seq = 1
        #: Commands not yet handed to the current stream.
        self._outbox: collections.deque[transfer_pb2.SessionCommand] = collections.deque()
        #: Commands handed to the stream that the broker has not applied yet.
        self._sent: collections.deque[transfer_pb2.SessionCommand] = collections.deque()
        self._applied = 0
        self._rooms: dict[int, _RoomView] = {}
        self._finished: collections.OrderedDict[int, None] = collections.OrderedDict()
        #: Bumped for every stream: a request iterator of an older one stops.
        self._generation = 0
        self._closing = False
        self._broken: KvBrokerError | None = None
        #: Set while the broker has not answered for the bound: why (new commands raise it).
        self._unreachable: KvBrokerError | None = None
        self._call: grpc.Call | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._run, name="kvb-session", daemon=True)
        self._reader.start()

    # -- commands (any thread) ------------------------------------------------
    def open_rooms(self, rooms: list[tuple[int, Callable[[int], transfer_pb2.SessionCommand]]]) -> list[common_pb2.RoomStatus]:
        """Track each room and queue the command that opens it (``make(seq)``);
        their statuses now. ``AlreadyExists`` (and nothing queued) if this
        engine already opened one of them."""
        with self._cond:
            self._check_open()
            seen = set()
            for room, _ in rooms:
                view = self._rooms.get(room)
                if view is not None or room in seen:
                    raise AlreadyExists(
                        f"room {room} was already opened by this engine rank"
                        + (" and has ended; room ids must be unique" if view is not None and view.terminal else "")
                    )
                seen.add(room)
            self._wait_room(len(rooms))
            out = []
            for room, make in rooms:
                seq = self._take_seq()
                view = _RoomView(room, seq)
                self._rooms[room] = view
                self._outbox.append(make(seq))
                out.append(view.status)
            self._cond.notify_all()
            return out

    def submit_many(self, commands: list[tuple[int, Callable[[int], transfer_pb2.SessionCommand]]], *, always: bool = False) -> None:
        """Queue commands of open rooms; a room that already ended here gets
        none (``always``: it does; aborts are idempotent)."""
        with self._cond:
            self._check_open()
            self._wait_room(len(commands))
            for room, make in commands:
                view = self._rooms.get(room)
                if view is not None and view.terminal and not always:
                    continue
                self._outbox.append(make(self._take_seq()))
            self._cond.notify_all()

    def is_tracked(self, room: int) -> bool:
        with self._cond:
            return room in self._rooms

    # -- room states (any thread) ----------------------------------------------------
    def statuses(self, rooms: Iterable[int]) -> tuple[dict[int, common_pb2.RoomStatus], list[int]]:
        """(statuses of the tracked rooms, rooms this session does not track)."""
        known: dict[int, common_pb2.RoomStatus] = {}
        unknown: list[int] = []
        with self._cond:
            for room in rooms:
                view = self._rooms.get(room)
                if view is None:
                    unknown.append(room)
                else:
                    known[room] = view.status
        return known, unknown

    def wait(self, rooms: Iterable[int], timeout_seconds: float, *, any_: bool = False) -> dict[int, common_pb2.RoomStatus]:
        """Block until every room (``any_``: at least one) is SUCCESS or FAILED;
        the finished ones. Rooms this session does not track count as finished
        with their current status (``None`` entries are left out)."""
        wanted = list(rooms)
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            while True:
                done = {}
                pending = 0
                for room in wanted:
                    view = self._rooms.get(room)
                    if view is None:
                        continue
                    if view.terminal:
                        done[room] = view.status
                    else:
                        pending += 1
                if not pending or (any_ and done):
                    return done
                left = deadline - time.monotonic()
                if left <= 0:
                    open_rooms = [r for r in wanted if r in self._rooms and not self._rooms[r].terminal]
                    raise DeadlineExceeded(f"{len(open_rooms)} rooms did not finish in {timeout_seconds} s: {open_rooms[:8]}")
                self._cond.wait(left)

    def flush(self, timeout_seconds: float) -> None:
        """Block until the broker has applied every command queued so far."""
        deadline = time.monotonic() + timeout_seconds
        with self._cond:
            target = self._next_seq - 1
            while self._applied < target:
                if self._broken is not None:
                    raise self._broken
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DeadlineExceeded(f"the broker applied commands up to {self._applied} of {target} in {timeout_seconds} s")
                self._cond.wait(left)

    # -- lifecycle ------------------------------------------------------------------
    def wait_ready(self, timeout_seconds: float) -> None:
        """Block until the first stream is open (or raise why it is not)."""
        if not self._ready.wait(timeout_seconds):
            raise DeadlineExceeded(f"the session stream did not open in {timeout_seconds} s")
        if self._broken is not None:
            raise self._broken

    def close(self, timeout_seconds: float) -> None:
        """Send what is queued, end the stream and stop the reader."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._reader.join(timeout_seconds)
        call = self._call
        if self._reader.is_alive() and call is not None:
            call.cancel()
            self._reader.join(timeout_seconds)

    # -- internals: the caller's side ----------------------------------------------
    def _take_seq(self) -> int:
        seq = self._next_seq
        self._next_seq += 1
        return seq

    def _check_open(self) -> None:
        if self._broken is not None:
            raise self._broken
        if self._closing:
            raise FailedPrecondition("this engine rank was closed")
        if self._unreachable is not None:
            raise self._unreachable

    def _wait_room(self, count: int) -> None:
        """Block (lock held) while more than ``max_pending`` commands would be unapplied."""
        if len(self._outbox) + len(self._sent) + count <= self._max_pending:
            return
        timeout = self._handle.client.timeout_seconds
        deadline = time.monotonic() + timeout
        while len(self._outbox) + len(self._sent) and len(self._outbox) + len(self._sent) + count > self._max_pending:
            if self._broken is not None:
                raise self._broken
            left = deadline - time.monotonic()
            if left <= 0:
                raise ResourceExhausted(
                    f"{self._max_pending} commands are waiting for the broker, which applied none for {timeout} s"
                )
            self._cond.wait(left)

    # -- internals: the stream --------------------------------------------------------
    def _requests(self, generation: int, opening: transfer_pb2.SessionOpen) -> Iterator[transfer_pb2.SessionRequest]:
        """The request iterator of one stream: the opening, then queued commands."""
        yield transfer_pb2.SessionRequest(open=opening)
        while True:
            with self._cond:
                while not self._outbox and not self._closing and self._generation == generation:
                    self._cond.wait()
                if self._generation != generation or (self._closing and not self._outbox):
                    return
                batch = [self._outbox.popleft() for _ in range(min(_MAX_BATCH, len(self._outbox)))]
                self._sent.extend(batch)
            yield transfer_pb2.SessionRequest(commands=batch)

    def _opening(self) -> transfer_pb2.SessionOpen:
        """(lock held) The first message of a stream: resume from what was applied."""
        self._generation += 1
        # Commands sent on the broken stream and not applied go again, first.
        self._outbox.extendleft(reversed(self._sent))
        self._sent.clear()
        return transfer_pb2.SessionOpen(
            engine_id=self._handle.engine_id,
            protocol_version=PROTOCOL_VERSION,
            resume_after=self._applied,
            # Rooms the broker has opened (a room whose opening is still to be
            # sent again would be reported unknown) that are open here, or that
            # failed here with their pages not settled (the broker was
            # unreachable): the room may have ended there meanwhile, and its
            # settled status, sent on the broken stream, would never come again.
            rooms=[
                room
                for room, view in self._rooms.items()
                if view.opened_seq <= self._applied and not (view.terminal and view.status.pages_settled)
            ],
        )

    def _run(self) -> None:
        delay = _RECONNECT_FIRST_S
        while True:
            with self._cond:
                if self._closing and not self._outbox and not self._sent:
                    self._ready.set()
                    return
                opening = self._opening()
                generation = self._generation
            call = self._handle.client.stub.Session(self._requests(generation, opening))
            self._call = call
            error: KvBrokerError | None = None
            try:
                for event in call:
                    self._ready.set()
                    delay = _RECONNECT_FIRST_S
                    self._apply(event)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
            with self._cond:
                self._generation += 1  # stop this stream's request iterator
                self._cond.notify_all()
                if self._closing:
                    self._ready.set()
                    return
            if error is None or isinstance(error, NotFound):
                # The broker unregistered this engine (its fd connection closed,
                # or it is stopping): it failed the engine's rooms and says so
                # in their statuses. The handle is done.
                self._ended(FailedPrecondition(
                    f"the broker at {self._handle.client.address} ended this engine rank's session"
                    + (f": {error.message}" if error is not None else " (it unregistered the engine)")
                ))
                return
            log.warning("kvbroker session %s: the stream broke (%s); reconnecting", self._handle.engine_id, error.message)
            info = self._reach_broker(delay, error.message)
            if info is None:
                return  # closing
            delay = min(delay * 2, _RECONNECT_MAX_S)
            if info.broker_id != self._handle.broker_id:
                self._engine_lost(f"the broker restarted ({error.message})")
            else:
                with self._cond:
                    self._unreachable = None  # the same process answers: the stream resumes

    def _ended(self, why: KvBrokerError) -> None:
        """The session is over for good: open rooms fail, new commands raise ``why``."""
        with self._cond:
            self._broken = why
            self._closing = True
            for view in self._rooms.values():
                if not view.terminal:
                    self._set(
                        view,
                        failed_status(
                            view.status.room, common_pb2.FAILURE_KIND_ENGINE_LOST, why.message, self._handle.broker_id, settled=False
                        ),
                    )
            self._outbox.clear()
            self._sent.clear()
            self._cond.notify_all()
        self._ready.set()

    def _pause(self, seconds: float) -> bool:
        """Sleep ``seconds`` unless the session closes first; whether it is closing."""
        with self._cond:
            if not self._closing:
                self._cond.wait(seconds)
            return self._closing

    def _reach_broker(self, delay: float, why: str) -> transfer_pb2.BrokerInfo | None:
        """Wait until the broker answers again (backing off from ``delay``); its
        info, or None if the session closes first. Past the client's bound,
        the open rooms fail (:meth:`_broker_unreachable`); later, if the
        broker process turns out gone, their pages settle."""
        since = time.monotonic()
        bound = self._handle.client.broker_lost_after_seconds
        lost = False
        while not self._pause(delay if lost else max(0.0, min(delay, since + bound - time.monotonic()))):
            try:
                return self._handle.client.refresh_info(timeout_seconds=_PROBE_TIMEOUT_S)
            except KvBrokerError as exc:
                delay = min(delay * 2, _RECONNECT_MAX_S)
                waited = time.monotonic() - since
                if not lost and waited >= bound:
                    self._broker_unreachable(f"the session stream broke ({why}) and it has not answered since ({exc.message})", waited)
                    lost = True
                elif lost and self._handle.broker_gone():
                    self._settle_failed()
        return None

    def _broker_unreachable(self, seen: str, waited: float) -> None:
        """The broker has not answered for the client's bound: fail every open
        room; new commands raise ``Unavailable`` until it answers. The pages
        are settled only if its process is gone. The rooms' commands it has
        not applied become aborts, and rooms it opened get one, so the same
        process, answering again, drops their transfers."""
        gone = self._handle.broker_gone()
        address, broker = self._handle.client.address, self._handle.broker_id
        state = (
            "its process is gone (the engine's fd connection to it closed): nothing can write into the pages"
            if gone
            else "it may still be running: the pages are not settled until it answers again"
        )
        message = f"this engine's broker at {address} ({broker}) did not answer for {waited:.1f} s: {seen}; {state}"
        with self._cond:
            failed = {room: view for room, view in self._rooms.items() if not view.terminal}
            for room, view in failed.items():
                self._set(view, failed_status(room, common_pb2.FAILURE_KIND_BROKER_LOST, message, broker, settled=gone))
            self._unreachable = Unavailable(f"the broker at {address} ({broker}) is unreachable: it did not answer for {waited:.1f} s: {seen}")
            reason = f"the engine failed the room: its broker did not answer for {waited:.1f} s"
            self._outbox = collections.deque(_abort_if(command, failed, reason) for command in self._outbox)
            self._sent = collections.deque(_abort_if(command, failed, reason) for command in self._sent)
            for room, view in failed.items():
                if view.opened_seq <= self._applied:
                    self._outbox.append(_abort(self._take_seq(), room, reason))
            self._cond.notify_all()
        log.warning("kvbroker session %s: %s; %d open rooms failed", broker, message, len(failed))

    def _settle_failed(self) -> None:
        """The broker process is gone: nothing can write into any room's pages any more."""
        with self._cond:
            for view in self._rooms.values():
                if view.terminal and not view.status.pages_settled:
                    view.status.pages_settled = True
            self._cond.notify_all()

    def _engine_lost(self, why: str) -> None:
        """The broker restarted: fail every open room, register the engine again."""
        broker = self._handle.broker_id
        self._settle_failed()  # the old process is gone
        with self._cond:
            self._unreachable = None
            failed = [view for view in self._rooms.values() if not view.terminal]
            for view in failed:
                self._set(
                    view,
                    failed_status(
                        view.status.room,
                        common_pb2.FAILURE_KIND_BROKER_LOST,
                        f"this engine's broker at {self._handle.client.address} lost the room: {why}",
                        broker,
                        settled=True,
                    ),
                )
            self._outbox.clear()
            self._sent.clear()
            self._applied = self._next_seq - 1
            self._cond.notify_all()
        log.warning("kvbroker session %s: %s; %d open rooms failed, registering again", broker, why, len(failed))
        delay = _RECONNECT_FIRST_S
        while True:
            try:
                self._handle.register_again()
            except KvBrokerError as exc:
                log.warning("kvbroker: registering engine %s again failed: %s", self._handle.rank, exc.message)
                if self._pause(delay):
                    return
                delay = min(delay * 2, _RECONNECT_MAX_S)
            else:
                return

    def _apply(self, event: transfer_pb2.SessionEvent) -> None:
        with self._cond:
            if event.applied > self._applied:
                self._applied = event.applied
                while self._sent and self._sent[0].seq <= event.applied:
                    self._sent.popleft()
            for refusal in event.refused:
                view = self._rooms.get(refusal.room)
                if view is None or view.terminal:
                    log.warning("kvbroker: broker refused command %d of room %d: %s", refusal.seq, refusal.room, refusal.message)
                    continue
                if refusal.seq == view.opened_seq or refusal.room_failed:
                    self._set(
                        view,
                        failed_status(
                            refusal.room,
                            common_pb2.FAILURE_KIND_REFUSED,
                            refusal.message,
                            self._handle.broker_id,
                            settled=refusal.pages_settled,
                        ),
                    )
            for status in event.statuses:
                view = self._rooms.get(status.room)
                if view is None:
                    continue
                if view.terminal:
                    # The first terminal status stays, with its cause (a
                    # refusal made here, say); only pages_settled may change,
                    # and with it come the pages that arrived whole.
                    if status.pages_settled and not view.status.pages_settled:
                        view.status.pages_settled = True
                        view.status.landed_pages.CopyFrom(status.landed_pages)
                    continue
                self._set(view, status)
            self._cond.notify_all()

    def _set(self, view: _RoomView, status: common_pb2.RoomStatus) -> None:
        """(lock held) Record a status; remember finished rooms in a bounded window."""
        was_terminal = view.terminal
        view.status = status
        if view.terminal and not was_terminal:
            self._finished[status.room] = None
            while len(self._finished) > self._finished_kept:
                old, _ = self._finished.popitem(last=False)
                self._rooms.pop(old, None)

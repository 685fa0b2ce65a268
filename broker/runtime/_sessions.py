"""Engine session streams (``TransferBroker.Session``): the room commands an
engine sends in, and what each stream owes its engine.

An engine's session stream carries its room commands in and its room states
out (the client side is ``client/session.py``). :class:`Sessions` opens and
closes streams and applies their commands in order (the same calls as the
unary engine API, ``_engine_calls``). :class:`SessionStream` is the outgoing
side of one stream: between two messages it collects

- the seq of the last command applied,
- the commands refused (each with the room, the status code and the message),
- the latest status of every room of the engine whose state changed, one per
  room: a newer status replaces an older one not yet sent.

So what a slow engine is owed is bounded by its number of rooms, not by the
number of changes (the WatchRooms stream, by contrast, sends every change).
The hub (``rooms.WatchHub``) offers the statuses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import propagate

from kvbroker.broker.execution import Machines
from kvbroker.broker.memory import Engine, EngineTable
from kvbroker.broker.rooms import (
    Receiver,
    Source,
    cause,
)
from kvbroker.broker.runtime._engine_calls import EngineCalls
from kvbroker.broker.runtime._requests import NO_TRACE, check_version
from kvbroker.broker.runtime._room_sides import settled, side_of
from kvbroker.errors import (
    Aborted,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    KvBrokerError,
    NotFound,
)
from kvbroker.v1 import common_pb2, transfer_pb2

__all__ = ["SessionStream", "Sessions"]

log = structlog.get_logger(__name__)


class SessionStream:
    """The outgoing half of one engine's Session stream. Control loop only."""

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id
        self._statuses: dict[int, common_pb2.RoomStatus] = {}
        self._refused: list[transfer_pb2.CommandRefused] = []
        self._applied = 0
        self._sent_applied = -1
        self._wake = asyncio.Event()
        self._ended = False
        self._error: KvBrokerError | None = None

    # -- what the broker owes the engine -------------------------------------
    def offer(self, status: common_pb2.RoomStatus) -> None:
        """A room's state changed (``WatchHub.publish``)."""
        self._statuses[status.room] = status
        self._wake.set()

    def applied(self, seq: int) -> None:
        self._applied = seq
        self._wake.set()

    def refuse(self, seq: int, room: int, error: KvBrokerError, *, room_failed: bool, pages_settled: bool) -> None:
        """Command ``seq`` of ``room`` was refused with ``error``."""
        self._refused.append(
            transfer_pb2.CommandRefused(
                seq=seq,
                room=room,
                code=error.status_number,
                message=f"{error.code.name}: {error.message}",
                room_failed=room_failed,
                pages_settled=pages_settled,
            )
        )
        self._wake.set()

    def end(self, error: KvBrokerError | None = None) -> None:
        """End the stream once what is owed is sent (``error``: with that status)."""
        self._ended = True
        if error is not None and self._error is None:
            self._error = error
        self._wake.set()

    # -- the stream -----------------------------------------------------------
    async def next_event(self) -> transfer_pb2.SessionEvent | None:
        """The next message (everything owed so far), or None when the stream ends."""
        while True:
            if self._statuses or self._refused or self._applied != self._sent_applied:
                event = transfer_pb2.SessionEvent(
                    applied=self._applied, statuses=self._statuses.values(), refused=self._refused
                )
                self._statuses = {}
                self._refused = []
                self._sent_applied = self._applied
                return event
            if self._ended:
                if self._error is not None:
                    raise self._error
                return None
            self._wake.clear()
            await self._wake.wait()

    # The hub ends every stream of an engine that unregistered.
    close = end


class Sessions:
    """Opens engines' session streams and applies their commands. Control loop only."""

    def __init__(self, *, machines: Machines, engines: EngineTable, engine_calls: EngineCalls) -> None:
        self._broker_id = machines.broker_id
        self._engines = engines
        self._rooms = machines.rooms
        self._sender = machines.sender
        self._receiver = machines.receiver
        self._turn = machines.turn
        self._hub = machines.hub
        self._calls = engine_calls
        #: Session commands by name (``SessionCommand.command``).
        self._commands: dict[str, Callable[[Any], object]] = {
            "expect_room": engine_calls.expect_room,
            "begin_send": engine_calls.begin_send,
            "send_chunk": engine_calls.send_chunk,
            "abort": engine_calls.abort,
            "announce_room": engine_calls.announce_room,
        }

    def open_session(self, opening: transfer_pb2.SessionOpen) -> tuple[Engine, SessionStream]:
        """Start a session stream for the engine in ``opening``; a previous one ends."""
        check_version(opening.protocol_version, "Session")
        engine = self._engines.get(opening.engine_id)
        if engine.session is not None:
            engine.session.end(Aborted("another session stream of this engine rank replaced this one"))
            self._hub.unsubscribe(engine.engine_id, engine.session)
        if engine.applied == 0:
            engine.applied = opening.resume_after
        elif opening.resume_after > engine.applied:
            raise FailedPrecondition(
                f"the engine says command {opening.resume_after} was applied; this broker applied up to {engine.applied}"
            )
        stream = SessionStream(engine.engine_id)
        engine.session = stream
        self._hub.add(engine.engine_id, stream)
        for room in opening.rooms:
            stream.offer(self._calls.status(engine, room))
        stream.applied(engine.applied)
        return engine, stream

    def close_session(self, engine: Engine, stream: SessionStream) -> None:
        """The stream's call ended: the engine has no session stream until it opens another."""
        self._hub.unsubscribe(engine.engine_id, stream)
        if engine.session is stream:
            engine.session = None

    def apply_commands(self, engine: Engine, stream: SessionStream, commands: Iterable[transfer_pb2.SessionCommand]) -> None:
        """Apply a session message's commands in order. A command sent again
        after a reconnect (seq already applied) is skipped; a gap in the
        numbering ends the stream (INVALID_ARGUMENT). A refused command is
        reported on the stream, and fails its room if the room was open."""
        if self._engines.by_id.get(engine.engine_id) is not engine:
            raise NotFound(f"engine {engine.engine_id} is no longer registered")
        for command in commands:
            if command.seq <= engine.applied:
                continue
            if command.seq != engine.applied + 1:
                stream.applied(engine.applied)  # the commands before the gap were applied
                raise InvalidArgument(f"session command {command.seq} follows {engine.applied}: commands were lost")
            which = command.WhichOneof("command")
            request = getattr(command, which) if which else None
            room = request.room if request is not None else 0
            # The room's spans join the engine's trace, or start their own:
            # never the long-lived stream's.
            token = otel_context.attach(propagate.extract(command.trace_context) if command.trace_context else NO_TRACE)
            error: KvBrokerError | None = None
            try:
                if request is None:
                    raise InvalidArgument(f"session command {command.seq} carries no command")
                request.engine_id = engine.engine_id
                self._commands[which](request)
            except KvBrokerError as exc:
                error = exc
            except Exception:
                log.exception("session_command_failed", engine=engine.label, command=which, room=room)
                error = Internal(f"{which} failed inside the broker; see its log")
            finally:
                otel_context.detach(token)
            if error is not None:
                failed, pages_settled = self._refused(engine, which or "", room, error)
                stream.refuse(command.seq, room, error, room_failed=failed, pages_settled=pages_settled)
            engine.applied = command.seq
        stream.applied(engine.applied)

    def _refused(self, engine: Engine, which: str, room: int, error: KvBrokerError) -> tuple[bool, bool]:
        """After a refused command: (the room was open and is failed now, its pages are settled).

        A refused opening (ExpectRoom, BeginSend) leaves any room already there
        alone; a refused chunk or abort of an open room fails the room: the
        engine's stream of commands for it has a hole.
        """
        side = side_of(self._rooms, engine, room)
        if which in ("expect_room", "begin_send", "announce_room"):
            return False, side is None or settled(side)
        if side is None or side.terminal:
            return False, side is None or settled(side)
        why = cause(common_pb2.FAILURE_KIND_REFUSED, f"{which} refused: {error.message}", self._broker_id)
        with self._turn:
            if isinstance(side, Source):
                self._sender.fail(side, why)
            else:
                assert isinstance(side, Receiver)
                self._receiver.fail(side, why)
        return True, settled(side)

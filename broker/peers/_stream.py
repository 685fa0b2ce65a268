"""The peer stream (``PeerBroker.Stream``, protocol 9): one stream from this
broker to each peer it calls, carrying the room calls as frames.

A unary call pays its own HTTP/2 stream, headers both ways, deadline and
task; on this 2-core machine that is most of a millisecond per call, and a
room made two or three of them between brokers. On the stream a call is one
``PeerCall`` in a frame, its answer one ``PeerAnswer`` (same id) in a frame
back; calls queued while a frame is written go together in the next one.

The calls it carries are those of the table of peer calls
(``peers._calls``) with a stream field; they keep their unary names,
requests, answers and status codes. A call fails with the project's error
for its status (``kvbroker.errors``), as the unary call's would through
:class:`~kvbroker.broker.peers.PeerCaller`, so the callers' retry policies
(``PeerClient``, ``execution._registration``) read one kind of error either
way. Handshake and the transport self-test's probe calls stay unary.

Lifecycle:

- opened when a handshake succeeds (``PeerClient.handshake``), else by the
  first call; each side's first frame is a ``StreamOpen`` naming its
  protocol version and broker id. No call is written before the callee's
  ``StreamOpen`` arrives, so a stream that never opened delivered nothing.
- a stream that cannot open fails its waiting calls ``Unavailable`` at once,
  except those made ``wait_for_ready`` (room registrations: a broker may be
  restarting at the address), which wait for a stream up to their own
  deadline, as a unary call with ``wait_for_ready`` waits for its channel.
  A callee without ``Stream`` (protocol 8 or older) fails them
  ``FailedPrecondition``, naming both versions.
- a stream that breaks fails every call written on it ``Unavailable`` (it may
  have been delivered, as a unary call that broke); calls not yet written
  go on the next stream as above.
- each call has its own deadline: past it, ``DeadlineExceeded``, and a late
  answer is dropped.
- ``close`` (the peer is dropped: lost or restarted; the broker stops)
  cancels the stream (its calls fail ``Unavailable``); a later call opens
  a new one.

Liveness: a stream that answered within the heartbeat is the peer's
heartbeat (``heard_within``); the monitor pings only a peer whose stream
was idle (``PeerClient.ping``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import Message
from opentelemetry import propagate

from kvbroker.broker.peers._calls import PeerMethod
from kvbroker.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    KvBrokerError,
    Unavailable,
    from_rpc_error,
    from_status,
)
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2, peer_pb2_grpc

__all__ = ["PeerStream", "Req", "Ans"]

log = structlog.get_logger(__name__)

Req = TypeVar("Req", bound=Message)
Ans = TypeVar("Ans", bound=Message)

#: How long a stream that could not open waits before it tries again for
#: the calls that wait for one (``wait_for_ready``).
_REOPEN_DELAY_SECONDS = 0.1
#: Tries to open a stream whose opening write failed inside gRPC: grpc.aio then
#: ends the call INTERNAL ("Internal error from Core") and loses the status the
#: callee sent, such as UNIMPLEMENTED from a broker without the stream.
_OPEN_TRIES = 3
#: Calls per frame at most (a burst of rooms goes in frames of this many: the
#: callee answers a frame's calls in one pass of its loop).
_FRAME_CALLS = 512


@dataclass
class _Pending:
    """A call made on the stream, until it is answered, fails or times out."""

    method: PeerMethod[Any, Any]
    future: asyncio.Future[Any]
    wait_for_ready: bool
    written: bool = False


@dataclass
class _Opened:
    """One stream's gRPC call and the callee process that answered it."""

    call: Any
    broker_id: str
    #: Why it broke (None while it holds).
    broken: KvBrokerError | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


class PeerStream:
    """This broker's stream to one peer: its calls multiplexed by id and
    batched per frame. Control loop only."""

    def __init__(self, stub: peer_pb2_grpc.PeerBrokerStub, address: str, own_id: Callable[[], str]) -> None:
        self._stub = stub
        self._address = address
        self._own_id = own_id
        self._ids = itertools.count(1)
        #: Calls waiting for their answer, by id.
        self._pending: dict[int, _Pending] = {}
        #: Calls made and not yet written (the next frame's).
        self._queue: list[peer_pb2.PeerCall] = []
        #: The last call of each method made by ``submit_item``: (its id, its request in the queue).
        self._joining: dict[str, tuple[int, Message]] = {}
        self._wake = asyncio.Event()
        #: The task that opens the stream and writes its frames (None: none runs).
        self._runner: asyncio.Task[None] | None = None
        self._opened: _Opened | None = None
        #: When the callee last answered on a stream (monotonic; 0: never).
        self._heard_at = 0.0
        self._closed = False
        #: Calls and frames written on this peer's streams (``ListPeers``).
        self.calls_written = 0
        self.frames_written = 0

    @property
    def broker_id(self) -> str | None:
        """The broker process at the other end of the open stream (None: none is open)."""
        opened = self._opened
        return opened.broker_id if opened is not None and opened.broken is None else None

    def heard_within(self, seconds: float) -> bool:
        """Whether the open stream's callee answered in the last ``seconds``."""
        return self.broker_id is not None and time.monotonic() - self._heard_at <= seconds

    def open(self) -> None:
        """Open the stream now, if none is open or opening (after a handshake)."""
        self._closed = False
        self._start()

    def submit(
        self, method: PeerMethod[Req, Ans], request: Req, *, timeout: float | None, wait_for_ready: bool = False
    ) -> asyncio.Future[Ans]:
        """Make ``method`` (one the stream carries) on the stream, with no task
        of its own: the future of its answer, or of its error
        (``KvBrokerError``; ``DeadlineExceeded`` once ``timeout`` passes).
        Cancelling the future gives the call up. Calls made in the same loop
        pass go out in one frame."""
        if method.field is None:
            raise TypeError(f"{method.name} does not ride the peer stream")
        loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        message = peer_pb2.PeerCall(id=call_id)
        getattr(message, method.field).CopyFrom(request)
        propagate.inject(message.trace_context)
        future: asyncio.Future[Ans] = loop.create_future()
        self._pending[call_id] = _Pending(method, future, wait_for_ready)
        self._queue.append(message)
        self._closed = False
        self._start()
        self._wake.set()
        deadline = loop.call_later(timeout, self._expire, call_id, timeout) if timeout is not None else None
        future.add_done_callback(lambda _f: self._forget(call_id, deadline))
        return future

    def submit_item(
        self, method: PeerMethod[Req, Ans], request: Req, items: str, *, timeout: float | None, wait_for_ready: bool = False
    ) -> tuple[asyncio.Future[Ans], int]:
        """Add the items of ``request`` (its repeated field ``items``: one, for
        RegisterRooms and AbortRooms) to the last call of ``method`` made on this
        stream if its frame is not written yet (up to ``_FRAME_CALLS`` items),
        else make the call (:meth:`submit`; the timeout and ``wait_for_ready``
        are its first item's): the call's future, shared by its items (never
        cancel it), and the index of the first item in its request and
        answer. Items made in one loop pass go in one call."""
        joining = self._joining.get(method.name)
        if joining is not None:
            call_id, embedded = joining
            pending, joined = self._pending.get(call_id), getattr(embedded, items)
            if pending is not None and not pending.written and not pending.future.done() and len(joined) < _FRAME_CALLS:
                index = len(joined)
                joined.extend(getattr(request, items))
                return pending.future, index
        future = self.submit(method, request, timeout=timeout, wait_for_ready=wait_for_ready)
        made = self._queue[-1]
        self._joining[method.name] = (made.id, getattr(made, str(method.field)))
        return future, 0

    def _expire(self, call_id: int, timeout: float) -> None:
        pending = self._pending.get(call_id)
        if pending is not None and not pending.future.done():
            pending.future.set_exception(
                DeadlineExceeded(f"{pending.method.name} to the broker at {self._address}: no answer within {timeout:g} s")
            )

    def _forget(self, call_id: int, deadline: asyncio.TimerHandle | None) -> None:
        """A call is over (answered, failed, expired or given up): its record goes;
        if it was not written, the writer skips it (``_unwritten``)."""
        if deadline is not None:
            deadline.cancel()
        self._pending.pop(call_id, None)

    def _unwritten(self) -> list[peer_pb2.PeerCall]:
        """The queued calls still waiting to be written (those given up meanwhile dropped)."""
        pending = self._pending
        self._queue = [m for m in self._queue if m.id in pending and not pending[m.id].future.done()]
        return self._queue

    def close(self) -> None:
        """End the stream (its peer is dropped, or this broker stops): calls on it fail ``Unavailable``."""
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.cancel()
        closed = Unavailable(f"the stream to the broker at {self._address} was closed")
        if self._opened is not None:
            self._break(self._opened, closed)
        self._fail_waiting(closed, all_calls=True)

    # -- the runner -------------------------------------------------------------
    def _start(self) -> None:
        if self._runner is None and not self._closed:
            self._runner = asyncio.get_running_loop().create_task(self._run(), name=f"peer-stream-{self._address}")

    async def _run(self) -> None:
        """Open a stream, then write what is queued until it breaks; again while calls wait for one."""
        try:
            while not self._closed:
                try:
                    opened = await self._open()
                except grpc.RpcError as exc:
                    error = self._refusal(exc)
                    log.debug("peer_stream_unopened", peer=self._address, error=error.message)
                    self._fail_waiting(error, all_calls=not isinstance(error, Unavailable))
                    if not self._unwritten():
                        return
                    await asyncio.sleep(_REOPEN_DELAY_SECONDS)
                    continue
                await self._write(opened)
                if not self._unwritten():
                    return  # the next call opens another
                await asyncio.sleep(_REOPEN_DELAY_SECONDS)  # calls not written yet: on a new stream
        finally:
            if self._runner is asyncio.current_task():
                self._runner = None

    async def _open(self) -> _Opened:
        """A stream whose callee answered our ``StreamOpen`` with its own. An
        opening that ended INTERNAL is tried again (``_OPEN_TRIES``): its write
        raced the callee's status, which grpc.aio then loses (seen in CI: a
        broker without the stream taken for one that would not answer)."""
        tries = 1
        while True:
            try:
                return await self._open_once()
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.INTERNAL or tries >= _OPEN_TRIES:
                    raise
                tries += 1
                log.debug("peer_stream_open_again", peer=self._address, error=exc.details())

    async def _open_once(self) -> _Opened:
        call = self._stub.Stream()
        try:
            await call.write(peer_pb2.PeerFrame(open=peer_pb2.StreamOpen(protocol_version=PROTOCOL_VERSION, broker_id=self._own_id())))
            first = await call.read()
        except asyncio.CancelledError:
            call.cancel()
            raise
        except Exception:
            # The call ended as it opened (no broker at the address, no Stream
            # there, ...): its status says why (a write to an ended call only
            # says that it ended). Cancelling a call that ended changes nothing.
            call.cancel()
            raise grpc.aio.AioRpcError(await call.code(), grpc.aio.Metadata(), grpc.aio.Metadata(), await call.details()) from None
        if first is grpc.aio.EOF or not first.HasField("open"):
            call.cancel()
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                f"the broker at {self._address} ended the peer stream as it opened",
            )
        opened = _Opened(call, first.open.broker_id)
        self._opened = opened
        self._heard_at = time.monotonic()
        opened.tasks.append(asyncio.get_running_loop().create_task(self._read(opened), name=f"peer-stream-read-{self._address}"))
        log.debug("peer_stream_opened", peer=self._address, broker=opened.broker_id)
        return opened

    def _refusal(self, exc: grpc.RpcError) -> KvBrokerError:
        """What a stream that would not open tells its calls."""
        error = from_rpc_error(exc)
        if error.code == grpc.StatusCode.UNIMPLEMENTED:
            return FailedPrecondition(
                f"the broker at {self._address} has no peer stream: it speaks a kvbroker protocol older than "
                f"{PROTOCOL_VERSION}, which this broker needs (run one version across the fleet)"
            )
        if isinstance(error, FailedPrecondition):
            return error
        return Unavailable(f"no peer stream to the broker at {self._address}: {error.message}")

    async def _write(self, opened: _Opened) -> None:
        """Write the queued calls, a frame at a time, until the stream breaks or closes."""
        try:
            while opened.broken is None:
                if not self._unwritten():
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                batch, self._queue = self._queue[:_FRAME_CALLS], self._queue[_FRAME_CALLS:]
                for message in batch:
                    pending = self._pending.get(message.id)
                    if pending is not None:
                        pending.written = True
                await opened.call.write(peer_pb2.PeerFrame(calls=batch))
                self.calls_written += len(batch)
                self.frames_written += 1
        except Exception as exc:  # a write to a broken or cancelled call: RpcError, or grpc's usage errors
            self._break(opened, Unavailable(f"the stream to the broker at {self._address} broke: {_why(exc)}"))
        finally:
            if opened.broken is None:  # cancelled (closed)
                self._break(opened, Unavailable(f"the stream to the broker at {self._address} was closed"))

    async def _read(self, opened: _Opened) -> None:
        """Hand each answer to its call, until the stream ends."""
        try:
            while True:
                frame = await opened.call.read()
                if frame is grpc.aio.EOF:
                    raise Unavailable("it ended the stream")
                self._heard_at = time.monotonic()
                for answer in frame.answers:
                    pending = self._pending.get(answer.id)
                    if pending is None or pending.future.done():
                        continue  # its caller gave up (deadline, cancelled)
                    if answer.code:
                        pending.future.set_exception(from_status(answer.code, answer.message))
                    else:
                        pending.future.set_result(getattr(answer, str(pending.method.field)))
        except Exception as exc:  # RpcError, or anything else: a reader that stopped must not leave the stream looking open
            self._break(opened, Unavailable(f"the stream to the broker at {self._address} broke: {_why(exc)}"))

    def _break(self, opened: _Opened, error: KvBrokerError) -> None:
        """``opened`` is over: the calls written on it fail with ``error``."""
        if opened.broken is not None:
            return
        opened.broken = error
        if self._opened is opened:
            self._opened = None
        opened.call.cancel()
        for task in opened.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        self._wake.set()
        for pending in list(self._pending.values()):
            if pending.written and not pending.future.done():
                pending.future.set_exception(error)
        log.debug("peer_stream_broken", peer=self._address, broker=opened.broker_id, error=error.message)

    def _fail_waiting(self, error: KvBrokerError, *, all_calls: bool) -> None:
        """Fail the calls not written yet, but those that wait for a stream (unless ``all_calls``)."""
        failed = {
            call_id
            for call_id, pending in self._pending.items()
            if not pending.written and (all_calls or not pending.wait_for_ready) and not pending.future.done()
        }
        for call_id in failed:
            self._pending[call_id].future.set_exception(error)
        self._unwritten()


def _why(exc: BaseException) -> str:
    """What broke a stream, in words."""
    if isinstance(exc, KvBrokerError):
        return exc.message
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.details() or exc.code().name
    return repr(exc)

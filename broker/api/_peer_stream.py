"""The callee's side of the peer stream (``PeerBroker.Stream``; the caller's
and the lifecycle: ``peers._stream``).

Each call on the stream is answered through the same chain as its unary
form (``api._peer_calls``), found by its field in the table of peer calls
(``peers.BY_FIELD``). A call answered at once (a
registration, a report, an abort, a ping, a renewal) is answered as its
frame is read, in the order the caller made them; one that may wait for
room (ReserveStaging, GrantCredits) answers from a task of its own, so it
holds up nothing else. Answers ready together go back in one frame.

When the caller ends the stream (or it breaks), the calls still waiting are
cancelled, as gRPC cancels a unary call whose caller went away.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Iterable
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message

from kvbroker.broker.api._peer_calls import PeerAnswers, typed
from kvbroker.broker.peers import BY_FIELD, PeerMethod
from kvbroker.errors import FailedPrecondition, InvalidArgument, KvBrokerError
from kvbroker.protocol import PROTOCOL_VERSION
from kvbroker.v1 import peer_pb2

__all__ = ["ServedStreams", "serve_stream"]

log = structlog.get_logger(__name__)


class ServedStreams:
    """The peer streams this broker answers now, so that it can end them when it stops (a stream
    the server cancels instead leaves grpc's task for it pending, logged as an error at exit)."""

    def __init__(self) -> None:
        self._live: set[_Answers] = set()

    def end_all(self) -> None:
        for answers in list(self._live):
            answers.end()


async def serve_stream(
    requests: AsyncIterator[peer_pb2.PeerFrame],
    context: grpc.aio.ServicerContext[Any, Any],
    broker_id: str,
    answers: PeerAnswers,
    served: ServedStreams,
) -> AsyncIterator[peer_pb2.PeerFrame]:
    """Answer a peer's stream: its ``StreamOpen`` (refused if it speaks
    another protocol), then each of its calls, until the caller ends it or
    ``served.end_all()``."""
    try:
        first = await requests.__anext__()
    except StopAsyncIteration:
        return
    try:
        _check_open(first)
    except KvBrokerError as exc:
        await context.abort(exc.code, exc.message)
    yield peer_pb2.PeerFrame(open=peer_pb2.StreamOpen(protocol_version=PROTOCOL_VERSION, broker_id=broker_id))
    stream = _Answers(answers)
    served._live.add(stream)
    reader = asyncio.get_running_loop().create_task(stream.take_all(first.calls, requests), name="peer-stream-reader")
    try:
        while (frame := await stream.next_frame()) is not None:
            yield frame
    finally:
        served._live.discard(stream)
        reader.cancel()
        stream.cancel()


def _check_open(first: peer_pb2.PeerFrame) -> None:
    if not first.HasField("open"):
        raise InvalidArgument("the first frame of a peer stream must carry StreamOpen")
    if first.open.protocol_version != PROTOCOL_VERSION:
        raise FailedPrecondition(
            f"broker {first.open.broker_id or '(unnamed)'} speaks kvbroker protocol {first.open.protocol_version}; "
            f"this broker speaks {PROTOCOL_VERSION} (run one version across the fleet)"
        )


class _Answers:
    """The answers of one stream, until they are written. Control loop only."""

    def __init__(self, answers: PeerAnswers) -> None:
        self._answers = answers
        self._ready: list[peer_pb2.PeerAnswer] = []
        self._wake = asyncio.Event()
        #: Calls that wait (for room) in tasks of their own.
        self._waiting: set[asyncio.Future[Message]] = set()
        self._reading = True
        self._ended = False

    async def take_all(self, opening: Iterable[peer_pb2.PeerCall], requests: AsyncIterator[peer_pb2.PeerFrame]) -> None:
        """Answer the calls of every frame the caller sends, until it ends the stream."""
        try:
            self.take(opening)
            async for frame in requests:
                if frame.HasField("open"):
                    raise InvalidArgument("StreamOpen may only be the first frame of a peer stream")
                self.take(frame.calls)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.info("peer_stream_read_failed", error=exc.message if isinstance(exc, KvBrokerError) else repr(exc))
        finally:
            self._reading = False
            self._wake.set()

    def take(self, calls: Iterable[peer_pb2.PeerCall]) -> None:
        for call in calls:
            method = BY_FIELD.get(call.WhichOneof("call") or "")
            if method is None:
                self._put(peer_pb2.PeerAnswer(id=call.id, code=grpc.StatusCode.UNIMPLEMENTED.value[0], message="an unknown peer call"))
                continue
            try:
                result = self._answers.answer(method, getattr(call, str(method.field)), call.trace_context)
            except KvBrokerError as exc:
                self._put(_failed(call.id, exc))
                continue
            if isinstance(result, asyncio.Future):
                self._waiting.add(result)
                result.add_done_callback(functools.partial(self._answered, call.id, method))
            else:
                self._put(_answer(call.id, method, result))

    def _answered(self, call_id: int, method: PeerMethod[Any, Any], task: asyncio.Future[Message]) -> None:
        """A call that waited is answered (or failed; cancelled: the stream ended)."""
        self._waiting.discard(task)
        self._wake.set()
        if task.cancelled():
            return
        error = task.exception()
        if error is None:
            self._put(_answer(call_id, method, task.result()))
        else:
            self._put(_failed(call_id, typed(method, error) if isinstance(error, Exception) else KvBrokerError(repr(error))))

    def _put(self, answer: peer_pb2.PeerAnswer) -> None:
        self._ready.append(answer)
        self._wake.set()

    async def next_frame(self) -> peer_pb2.PeerFrame | None:
        """The answers ready now, in one frame; None once the caller ended the stream and every call is answered."""
        while not self._ready:
            if self._ended or (not self._reading and not self._waiting):
                return None
            self._wake.clear()
            await self._wake.wait()
        if self._ended:
            return None
        frame, self._ready = peer_pb2.PeerFrame(answers=self._ready), []
        return frame

    def end(self) -> None:
        """End the stream now (the broker stops): calls unanswered fail at the caller as on a broken stream."""
        self._ended = True
        self._wake.set()

    def cancel(self) -> None:
        for task in list(self._waiting):
            task.cancel()


def _answer(call_id: int, method: PeerMethod[Any, Any], result: Message) -> peer_pb2.PeerAnswer:
    answer = peer_pb2.PeerAnswer(id=call_id)
    getattr(answer, str(method.field)).CopyFrom(result)
    return answer


def _failed(call_id: int, error: KvBrokerError) -> peer_pb2.PeerAnswer:
    """A call's error as its answer: its own status."""
    return peer_pb2.PeerAnswer(id=call_id, code=error.status_number, message=error.message)

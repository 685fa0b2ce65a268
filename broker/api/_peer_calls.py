"""The callee's one chain for peer calls: every ``PeerBroker`` call is
answered here, whether it came unary (``PeerService``'s methods, made from
the table) or on a peer stream (``api._peer_stream``).

For each call, in order:

- **metrics**: counted in ``Stats.peer_calls_answered`` under its method;
- **tracing**: a stream call's own trace context is attached while its
  handler runs (a unary call's is the server interceptor's);
- **the protocol check**: a request that names a protocol version of
  another kvbroker is refused ``FailedPrecondition``;
- **the handler** (``peers.answers``): its answer, or an awaitable of it;
- **errors**: a ``KvBrokerError`` stays itself (its status goes back);
  anything else is logged with its traceback and becomes ``Internal``, so a
  bug never leaks a Python trace to the peer.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc
import structlog
from google.protobuf.message import Message
from opentelemetry import context as otel_context
from opentelemetry import propagate

from kvbroker.broker.peers import PEER_METHODS, PeerMethod
from kvbroker.broker.telemetry import Counters
from kvbroker.errors import FailedPrecondition, Internal, KvBrokerError
from kvbroker.protocol import PROTOCOL_VERSION

__all__ = ["PeerAnswers", "unary_method"]

log = structlog.get_logger(__name__)

#: A call's answer, or the task that will answer it (a handler that may wait).
Answer = Message | asyncio.Future[Message]


class PeerAnswers:
    """Answers peer calls with their handlers, through the chain above."""

    def __init__(self, handlers: Mapping[str, Callable[[Any], Any]], counters: Counters) -> None:
        #: The handler of each method, by name.
        self.handlers = dict(handlers)
        self._counters = counters

    def answer(self, method: PeerMethod[Any, Any], request: Message, trace_context: Mapping[str, str] | None = None) -> Answer:
        """``method``'s answer to ``request``, or the task that answers it;
        raises (or the task raises) ``KvBrokerError`` only."""
        self._counters.peer_calls_answered[method.name] += 1
        token = otel_context.attach(propagate.extract(trace_context)) if trace_context else None
        try:
            if method.versioned and request.protocol_version != PROTOCOL_VERSION:  # type: ignore[attr-defined]
                raise FailedPrecondition(
                    f"{method.name} speaks protocol version {request.protocol_version}; "  # type: ignore[attr-defined]
                    f"this broker speaks {PROTOCOL_VERSION}"
                )
            result = self.handlers[method.name](request)
            if inspect.isawaitable(result):
                # A task made now, in the call's trace context (the handler runs in it).
                return asyncio.ensure_future(_typed_later(method, result))
            answer: Message = result
            return answer
        except Exception as exc:
            raise typed(method, exc) from None
        finally:
            if token is not None:
                otel_context.detach(token)


async def _typed_later(method: PeerMethod[Any, Any], result: Awaitable[Message]) -> Message:
    try:
        return await result
    except Exception as exc:
        raise typed(method, exc) from None


def typed(method: PeerMethod[Any, Any], exc: Exception) -> KvBrokerError:
    """A handler's failure as the error its caller gets: its own, or ``Internal`` (logged)."""
    if isinstance(exc, KvBrokerError):
        return exc
    log.error("rpc_failed", rpc=method.name, exc_info=exc)
    return Internal(f"{method.name} failed inside the broker; see its log")


def unary_method(name: str) -> Callable[[Any, Message, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]:
    """The servicer method that answers ``PeerBroker.<name>`` as a unary
    call, through the owner's ``answers`` (a :class:`PeerAnswers`)."""
    method = PEER_METHODS[name]

    async def unary(self: Any, request: Message, context: grpc.aio.ServicerContext[Any, Any]) -> Message:
        answers: PeerAnswers = self.answers
        try:
            result = answers.answer(method, request)
            return await result if isinstance(result, asyncio.Future) else result
        except KvBrokerError as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable: context.abort raises")

    unary.__name__ = unary.__qualname__ = name
    unary.__doc__ = f"``PeerBroker.{name}``, answered unary."
    return unary

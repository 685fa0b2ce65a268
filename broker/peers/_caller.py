"""The calls this broker makes to one peer, typed by the table of peer calls.

:class:`PeerCaller` makes any method of the table (``peers._calls``): on the
peer's stream when the method rides it, else as a unary call derived from
the same row (its path, its request's serializer, its answer's parser).
Either way the answer comes typed by the method's handle and a failure is
the project's error for its status (``kvbroker.errors``), never a
``grpc.RpcError``: the retry policies read those.
"""

from __future__ import annotations

import asyncio

import grpc

from kvbroker.broker.peers._calls import PeerMethod
from kvbroker.broker.peers._stream import Ans, PeerStream, Req
from kvbroker.errors import from_rpc_error

__all__ = ["PeerCaller", "call_unary"]


async def call_unary(
    channel: grpc.aio.Channel, method: PeerMethod[Req, Ans], request: Req, *, timeout: float | None, wait_for_ready: bool = False
) -> Ans:
    """``method`` as a unary call on ``channel``: its answer, or its error typed."""
    call = channel.unary_unary(method.path, request_serializer=method.request.SerializeToString, response_deserializer=method.answer.FromString)
    try:
        answer: Ans = await call(request, timeout=timeout, wait_for_ready=wait_for_ready)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None
    return answer


class PeerCaller:
    """This broker's calls to one peer: the stream's on ``stream``, the others unary on ``channel``."""

    def __init__(self, channel: grpc.aio.Channel, stream: PeerStream) -> None:
        self._channel = channel
        self.stream = stream

    async def call(self, method: PeerMethod[Req, Ans], request: Req, *, timeout: float | None, wait_for_ready: bool = False) -> Ans:
        """Make ``method``: its answer, or its ``KvBrokerError``."""
        if method.field is None:
            return await call_unary(self._channel, method, request, timeout=timeout, wait_for_ready=wait_for_ready)
        return await self.stream.submit(method, request, timeout=timeout, wait_for_ready=wait_for_ready)

    def submit_item(
        self, method: PeerMethod[Req, Ans], request: Req, items: str, *, timeout: float | None, wait_for_ready: bool = False
    ) -> tuple[asyncio.Future[Ans], int]:
        """An item of a stream call, joined to the call not written yet (:meth:`PeerStream.submit_item`)."""
        return self.stream.submit_item(method, request, items, timeout=timeout, wait_for_ready=wait_for_ready)

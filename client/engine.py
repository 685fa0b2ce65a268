"""An engine rank registered with its broker: opens rooms, polls, watches."""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from kvbroker.client.memory import EngineMemory, RankSpec
from kvbroker.client.rooms import KVReceiver, KVSender, RoomState, SenderRef
from kvbroker.errors import DeadlineExceeded, FailedPrecondition, from_rpc_error
from kvbroker.v1 import common_pb2, transfer_pb2

if TYPE_CHECKING:
    from kvbroker.client.connection import BrokerClient

__all__ = ["EngineHandle"]


class EngineHandle:
    """One registered engine rank. Made by ``BrokerClient.register_engine``.

    The handle owns the engine's session with the broker (the fd socket
    connection). ``close()`` unregisters: the broker fails the engine's open
    rooms, waits for their transfers to settle and releases its memory.
    Thread-safety: calls may come from several threads; a room's sender or
    receiver should be driven by one.
    """

    def __init__(
        self,
        client: BrokerClient,
        engine_id: str,
        rank: RankSpec,
        memory: EngineMemory,
        session: socket.socket,
    ) -> None:
        self.client = client
        self.engine_id = engine_id
        self.rank = rank
        self.memory = memory
        self._session: socket.socket | None = session

    # -- rooms -------------------------------------------------------------
    def sender(self, room: int) -> KVSender:
        """A sender for ``room`` (prefill ranks). Call ``init`` on it next."""
        return KVSender(self, room)

    def receiver(self, room: int, sender: SenderRef) -> KVReceiver:
        """A receiver for ``room`` (decode ranks) whose data comes from ``sender``.
        Call ``init`` on it next."""
        return KVReceiver(self, room, sender)

    def poll(self, rooms: Sequence[int]) -> dict[int, common_pb2.RoomStatus]:
        """The status of many rooms in one call."""
        response: transfer_pb2.PollResponse = self.client.call(
            self.client.stub.Poll, transfer_pb2.PollRequest(engine_id=self.engine_id, rooms=list(rooms))
        )
        return {s.room: s for s in response.statuses}

    def watch(self, rooms: Iterable[int] = ()) -> Iterator[common_pb2.RoomStatus]:
        """Stream state changes of ``rooms`` (all of this engine's rooms if empty).

        Yields the current status of each watched room first, then every
        change. Ends when the engine unregisters; break out of the loop to stop.
        """
        call = self.client.stub.WatchRooms(transfer_pb2.WatchRoomsRequest(engine_id=self.engine_id, rooms=list(rooms)))
        try:
            yield from call
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call) and exc.code() != grpc.StatusCode.CANCELLED:
                raise from_rpc_error(exc) from None
        finally:
            call.cancel()

    def wait(self, rooms: Sequence[int], *, timeout_seconds: float) -> dict[int, common_pb2.RoomStatus]:
        """Block until every room is SUCCESS or FAILED; their final statuses.

        Uses the WatchRooms stream, so it wakes when the broker changes a
        room's state rather than on a polling interval. Raises
        ``DeadlineExceeded`` after ``timeout_seconds``.
        """
        pending = set(rooms)
        done: dict[int, common_pb2.RoomStatus] = {}
        if not pending:
            return done
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

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Unregister (idempotent). The broker fails rooms still open."""
        if self._session is None:
            return
        try:
            self.client.call(
                self.client.stub.UnregisterEngine, transfer_pb2.UnregisterEngineRequest(engine_id=self.engine_id)
            )
        finally:
            self._session.close()
            self._session = None

    def __enter__(self) -> EngineHandle:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

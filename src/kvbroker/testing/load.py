"""Load for the scheduling checks: an engine pair that moves rooms of one class
between two brokers (:class:`RoomLoad`), a thread that keeps some of its rooms
in flight and counts the bytes they move (:class:`Saturate`), and rooms timed
one at a time (:func:`timed_rooms`). The priority tests and
``bench/priority_bench.py`` share them; every room that succeeds has its
bytes checked against the reference pattern (``testing.pattern``): all of a
timed room's, the first and last page of a saturating one's.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvbroker.client import (
    BrokerClient,
    EngineHandle,
    EngineMemory,
    ExpectSpec,
    ModelSpec,
    RankSpec,
    SenderRef,
)
from kvbroker.client.rooms import Priority
from kvbroker.errors import DeadlineExceeded, RoomFailed
from kvbroker.testing.pattern import fill_rank, verify_room
from kvbroker.v1 import common_pb2

__all__ = ["RoomLoad", "Saturate", "room_bytes", "timed_rooms"]


def room_bytes(model: ModelSpec, pages: int) -> int:
    """The KV bytes ``pages`` pages of ``model`` hold (one rank of tp 1)."""
    import torch

    itemsize = torch.empty((), dtype=model.dtype).element_size()
    per_token = model.num_layers * (1 if model.mla else 2) * model.total_kv_heads * model.head_dim * itemsize
    return per_token * model.page_size * pages


@dataclass
class RoomLoad:
    """A prefill rank and a decode rank of tp 1, one engine group each (``name``-prefill,
    ``name``-decode), registered with their brokers; ``slots`` rooms of ``room_pages`` pages fit."""

    model: ModelSpec
    room_pages: int
    slots: int
    priority: Priority
    prefill: EngineHandle
    decode: EngineHandle
    ranks: tuple[RankSpec, RankSpec]
    memories: tuple[EngineMemory, EngineMemory]
    clients: tuple[BrokerClient, BrokerClient]
    ids: itertools.count[int] = field(default_factory=lambda: itertools.count(secrets.randbits(40) << 20))
    #: Rooms open: their slot.
    slot_of: dict[int, int] = field(default_factory=dict)
    #: The first page of slot 0 (a load sharing another's engines uses pages after its).
    first_page: int = 0
    #: Whether :meth:`close` lets the engines go (a load made by :meth:`alongside` does not).
    owns_engines: bool = True

    @classmethod
    def register(
        cls, prefill_address: str, decode_address: str, *, name: str, model: ModelSpec, room_pages: int, slots: int,
        priority: Priority = None, prepare: Callable[[EngineMemory], None] | None = None, spare_pages: int = 0,
    ) -> RoomLoad:
        """``prepare(memory)``: run on both ranks' memory before they register (``as_fake_vram``);
        ``spare_pages``: pages beyond the slots, for loads :meth:`alongside` this one."""
        ranks = (RankSpec(f"{name}-prefill", "prefill"), RankSpec(f"{name}-decode", "decode"))
        memories = tuple(EngineMemory.allocate(rank, model, num_pages=room_pages * slots + spare_pages) for rank in ranks)
        fill_rank(memories[0], model, ranks[0])
        if prepare is not None:
            for memory in memories:
                prepare(memory)
        clients = (BrokerClient(prefill_address), BrokerClient(decode_address))
        engines = [client.register_engine(rank, memory) for client, rank, memory in zip(clients, ranks, memories, strict=True)]
        return cls(model, room_pages, slots, priority, engines[0], engines[1], ranks, memories, clients)  # type: ignore[arg-type]

    def alongside(self, *, priority: Priority, room_pages: int, slots: int) -> RoomLoad:
        """Rooms of another class and size on this load's own engines, in the pages after its slots
        (registered with ``spare_pages`` enough for them): one engine's rooms of two classes."""
        first = self.first_page + self.room_pages * self.slots
        return RoomLoad(self.model, room_pages, slots, priority, self.prefill, self.decode, self.ranks, self.memories,
                        self.clients, first_page=first, owns_engines=False)

    @property
    def bytes_per_room(self) -> int:
        return room_bytes(self.model, self.room_pages)

    def pages(self, slot: int) -> np.ndarray:
        first = self.first_page + slot * self.room_pages
        return np.arange(first, first + self.room_pages, dtype=np.int32)

    def open(self, slot: int, *, deadline_seconds: float | None = None) -> int:
        """Open a room in ``slot`` on both sides and send its pages in one chunk; its id."""
        room = next(self.ids)
        pages = self.pages(slot)
        self.slot_of[room] = slot
        sender = SenderRef(self.clients[0].address, self.ranks[0].group)
        self.decode.expect([ExpectSpec(room, sender, pages, priority=self.priority, deadline_seconds=deadline_seconds)])
        out = self.prefill.sender(room)
        out.init(len(pages), priority=self.priority)
        out.send(pages)
        return room

    def finish(self, room: int, status: common_pb2.RoomStatus, *, whole: bool) -> int:
        """Check a room the decode side ended: ``RoomFailed`` unless SUCCESS, ``AssertionError``
        unless its bytes are right (``whole``: every page; else the first and the last). Its slot,
        free again."""
        slot = self.slot_of.pop(room)
        if status.state != common_pb2.ROOM_STATE_SUCCESS:
            raise RoomFailed(room, status.cause)
        pages = self.pages(slot) if whole else self.pages(slot)[[0, -1]]
        problems = verify_room(self.memories[1], self.model, self.ranks[1], src_pages=pages, dst_pages=pages, room=room, aux_row=None)
        if problems:
            raise AssertionError(f"room {room} of {self.ranks[1].group} landed wrong bytes: {problems[:3]}")
        return slot

    def close(self) -> None:
        if not self.owns_engines:
            return
        for engine in (self.prefill, self.decode):
            engine.close()
        for client in self.clients:
            client.close()
        for memory in self.memories:
            memory.close()


class Saturate:
    """Keeps ``inflight`` rooms of ``load`` moving (a thread) until :meth:`stop`:
    when each room ended and the bytes it moved."""

    def __init__(self, load: RoomLoad, inflight: int, *, timeout_seconds: float = 120.0) -> None:
        if inflight > load.slots:
            raise ValueError(f"{inflight} rooms in flight need as many slots (the load has {load.slots})")
        self.load, self.inflight, self.timeout = load, inflight, timeout_seconds
        #: (when it ended, bytes) of each room that succeeded.
        self.done: list[tuple[float, int]] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"saturate-{load.ranks[0].group}", daemon=True)

    def start(self) -> Saturate:
        self._thread.start()
        return self

    def _run(self) -> None:
        load, free = self.load, list(range(self.load.slots))
        try:
            open_rooms = [load.open(free.pop()) for _ in range(self.inflight)]
            while open_rooms:
                ended = load.decode.wait_any(open_rooms, timeout_seconds=self.timeout)
                for room, status in ended.items():
                    open_rooms.remove(room)
                    free.append(load.finish(room, status, whole=False))
                    self.done.append((time.monotonic(), load.bytes_per_room))
                    if not self._stop.is_set():
                        open_rooms.append(load.open(free.pop()))
        except BaseException as exc:  # reported by stop()
            self.error = exc

    def bytes_between(self, start: float, end: float) -> int:
        return sum(n for t, n in list(self.done) if start <= t < end)

    def stop(self) -> None:
        """Open no more rooms, wait for those in flight; raises what failed."""
        self._stop.set()
        self._thread.join(self.timeout)
        if self.error is not None:
            raise self.error


def timed_rooms(load: RoomLoad, count: int, interval_seconds: float, *, stop: Callable[[], bool] = lambda: False,
                timeout_seconds: float = 60.0) -> list[float]:
    """Open ``count`` rooms of ``load`` at a steady rate, one every ``interval_seconds`` whether
    those before ended or not (while a slot is free), until ``stop()``: the seconds from each
    ExpectRoom to its decode side's SUCCESS, every byte checked."""
    latencies: list[float] = []
    opened: dict[int, float] = {}
    free = list(range(load.slots))
    next_at, made = time.monotonic(), 0
    while opened or (made < count and not stop()):
        now = time.monotonic()
        arriving = made < count and not stop()
        if arriving and now >= next_at and free:
            opened[load.open(free.pop())] = now
            made, next_at = made + 1, next_at + interval_seconds
            continue
        if opened and now - min(opened.values()) > timeout_seconds:
            raise DeadlineExceeded(f"{len(opened)} timed rooms of {load.ranks[1].group} did not end in {timeout_seconds} s")
        if not opened:
            time.sleep(max(0.0, next_at - now))
            continue
        try:
            ended = load.decode.wait_any(list(opened), timeout_seconds=max(1e-4, next_at - now) if arriving and free else 1.0)
        except DeadlineExceeded:
            continue
        for room, status in ended.items():
            latencies.append(time.monotonic() - opened.pop(room))
            free.append(load.finish(room, status, whole=True))
    return latencies

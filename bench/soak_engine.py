"""The prefill engine of ``soak.py``: a spawned child process that sends the rooms the soak orders and survives its broker.

It receives room orders from the soak over its pipe, opens each room
(BeginSend), sends it in chunks with small gaps, polls until it ends and
reports the sender-side outcome. When its broker goes away it reports its
open rooms as lost and registers again (new client, new memory) until the
broker is back. Messages to the soak: ("ready", reason, attempts, seconds,
last refusal), ("final", room, state, cause, message, bytes), ("error", room,
message), ("lost", rooms, reason), ("note", room, text), ("crash",
traceback), ("stopped", unfinished rooms).
"""

from __future__ import annotations

import heapq
import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import model_spec, release

from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState
from kvbroker.demo.pattern import fill_rank, write_aux
from kvbroker.errors import KvBrokerError, NotFound, Unavailable
from kvbroker.v1 import common_pb2

MODEL = model_spec(4, kv_heads=4, head_dim=32)
AUX_ROW_BYTES = [32]
PREFILL_POOL_PAGES = 256
FINAL = (RoomState.SUCCESS, RoomState.FAILED)


def kind_name(kind: int) -> str:
    return common_pb2.FailureKind.Name(kind).removeprefix("FAILURE_KIND_")


class BrokerGone(Exception):
    pass


@dataclass
class SendingRoom:
    sender: Any
    src: list[int]
    bounds: list[tuple[int, int]]
    abort_after: int | None
    gap: float
    next_chunk: int = 0


class PrefillEngine:
    """One prefill rank that sends the rooms the soak orders, and survives its broker."""

    def __init__(self, address: str, group: str, slots: int, conn: Any) -> None:
        self.address = address
        self.spec = RankSpec(group=group, role="prefill")
        self.slots = slots
        self.conn = conn
        self.client: BrokerClient | None = None
        self.engine: Any = None
        self.memory: EngineMemory | None = None
        self.open: dict[int, SendingRoom] = {}
        self.actions: list[tuple[float, int, int, str]] = []
        self.seq = 0
        self.stopping_since: float | None = None

    # -- connection -------------------------------------------------------
    def connect(self, reason: str) -> None:
        started = time.monotonic()
        attempts = 0
        last = ""
        while True:
            attempts += 1
            memory = client = None
            try:
                client = BrokerClient(self.address, timeout_seconds=5)
                memory = EngineMemory.allocate(
                    self.spec, MODEL, num_pages=PREFILL_POOL_PAGES, aux_rows=self.slots, aux_row_bytes=AUX_ROW_BYTES
                )
                fill_rank(memory, MODEL, self.spec)
                engine = client.register_engine(self.spec, memory)
            except (KvBrokerError, OSError) as exc:
                last = str(exc)
                release(None, client, memory)
                time.sleep(0.2)
                continue
            self.client, self.memory, self.engine = client, memory, engine
            self.conn.send(("ready", reason, attempts, round(time.monotonic() - started, 3), last[:300]))
            return

    def disconnect(self) -> None:
        release(self.engine, self.client, self.memory)
        self.engine = self.client = self.memory = None

    def session_closed(self) -> bool:
        """Whether the broker closed our fd-socket session (it died)."""
        return self.engine is None or bool(self.engine.broker_gone())

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a broker call; BrokerGone when the broker (or our registration) went away."""
        try:
            return fn(*args, **kwargs)
        except Unavailable as exc:
            raise BrokerGone(str(exc)) from None
        except NotFound as exc:
            if "is not registered with this broker" in exc.message:
                raise BrokerGone(str(exc)) from None
            raise

    # -- rooms ------------------------------------------------------------
    def schedule(self, delay: float, room: int, what: str) -> None:
        self.seq += 1
        heapq.heappush(self.actions, (time.monotonic() + delay, self.seq, room, what))

    def fail(self, room: int, what: str, exc: Exception) -> None:
        self.open.pop(room, None)
        self.conn.send(("error", room, f"{what}: {exc}"[:400]))

    def begin(self, room: int, src: list[int], bounds: list[tuple[int, int]], slot: int, abort_after: int | None, gap: float) -> None:
        assert self.memory is not None
        write_aux(self.memory, room, slot)
        sender = self.engine.sender(room)
        # Open before the call: a BrokerGone from it reports the room as lost.
        self.open[room] = SendingRoom(sender, src, bounds, abort_after, gap)
        try:
            self.call(sender.init, num_pages=len(src), aux_row=slot)
        except KvBrokerError as exc:
            self.fail(room, "BeginSend", exc)
            return
        if abort_after == -1:
            self.schedule(gap, room, "abort")
        else:
            self.chunk(room)

    def chunk(self, room: int) -> None:
        state = self.open.get(room)
        if state is None:
            return
        i = state.next_chunk
        a, b = state.bounds[i]
        last = i == len(state.bounds) - 1
        try:
            self.call(state.sender.send, np.asarray(state.src[a:b], dtype=np.int32), is_last=last)
        except KvBrokerError as exc:
            self.fail(room, f"SendChunk {i}", exc)
            return
        state.next_chunk += 1
        if state.abort_after == i:
            self.schedule(state.gap, room, "abort")
        elif not last:
            self.schedule(state.gap, room, "chunk")

    def abort(self, room: int, reason: str) -> None:
        state = self.open.get(room)
        if state is None:
            return
        try:
            self.call(state.sender.abort, reason)
        except KvBrokerError as exc:
            self.conn.send(("note", room, f"sender abort: {exc}"[:400]))

    def poll_open(self) -> None:
        if not self.open:
            return
        for room, status in self.call(self.engine.poll, list(self.open)).items():
            if status.state in FINAL and room in self.open:
                del self.open[room]
                cause = kind_name(status.cause.kind) if status.state == RoomState.FAILED else ""
                self.conn.send(("final", room, RoomState(status.state).name, cause, status.cause.message[:400], status.bytes))

    def handle(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "room":
            self.begin(*msg[1:])
        elif msg[0] == "abort":
            self.abort(msg[1], "soak: the decode side could not open the room")
        elif msg[0] == "stop":
            self.stopping_since = time.monotonic()

    # -- loop -------------------------------------------------------------
    def run(self) -> None:
        self.connect("start")
        next_poll = 0.0
        next_session_check = 0.0
        while True:
            try:
                now = time.monotonic()
                wait = min(0.02, max(0.0, next_poll - now))
                if self.actions:
                    wait = min(wait, max(0.0, self.actions[0][0] - now))
                if self.conn.poll(wait):
                    for _ in range(64):
                        self.handle(self.conn.recv())
                        if not self.conn.poll(0):
                            break
                now = time.monotonic()
                while self.actions and self.actions[0][0] <= now:
                    _, _, room, what = heapq.heappop(self.actions)
                    if what == "chunk":
                        self.chunk(room)
                    else:
                        self.abort(room, "soak: prefill abort")
                if now >= next_poll:
                    next_poll = now + 0.02
                    self.poll_open()
                if now >= next_session_check:
                    next_session_check = now + 0.2
                    if self.session_closed():
                        raise BrokerGone("the broker closed the engine session (fd socket EOF)")
                if self.stopping_since is not None and (not self.open or now - self.stopping_since > 30):
                    unfinished = list(self.open)
                    self.disconnect()
                    self.conn.send(("stopped", unfinished))
                    return
            except KvBrokerError as exc:
                # A call that failed for another reason (a deadline on a loaded machine): go on.
                self.conn.send(("note", 0, f"{exc}"[:400]))
                time.sleep(0.05)
            except BrokerGone as exc:
                lost = list(self.open)
                self.open.clear()
                self.actions.clear()
                self.conn.send(("lost", lost, str(exc)[:400]))
                self.disconnect()
                if self.stopping_since is not None:
                    self.conn.send(("stopped", lost))
                    return
                self.connect(str(exc)[:200])


def prefill_engine_main(conn: Any, address: str, group: str, slots: int, log_path: str) -> None:
    torch.set_num_threads(1)
    try:
        PrefillEngine(address, group, slots, conn).run()
    except BaseException:
        with open(log_path, "a") as f:
            f.write(f"{time.strftime('%H:%M:%S')} pid {os.getpid()} crashed:\n{traceback.format_exc()}\n")
        try:
            conn.send(("crash", traceback.format_exc()[-2000:]))
        except Exception:
            pass
        raise

"""The decode side of ``soak.py``: one decode rank in the soak's process that opens every room, watches it, checks its bytes and reuses its slot once its pages are settled."""

from __future__ import annotations

import argparse
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from soak_engine import AUX_ROW_BYTES, FINAL, MODEL, PREFILL_POOL_PAGES, kind_name
from soak_report import Room, Tally

from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
from kvbroker.demo.pattern import verify_room
from kvbroker.errors import KvBrokerError
from kvbroker.v1 import common_pb2

DECODE_GROUP = "soak-decode"


def span_pages(pages: int) -> int:
    return pages + max(2, pages // 2)


def pick_pages(rng: random.Random, pages: int, base: int) -> list[int]:
    """``pages`` distinct pages from [base, base + span): contiguous runs in shuffled order."""
    span = span_pages(pages)
    chosen = sorted(rng.sample(range(span), pages))
    runs: list[list[int]] = []
    for page in chosen:
        if runs and runs[-1][-1] == page - 1:
            runs[-1].append(page)
        else:
            runs.append([page])
    rng.shuffle(runs)
    return [base + p for run in runs for p in run]


class DecodeSide:
    """The decode rank and the rooms in flight: ``rooms`` by id, the destination slots free and retired."""

    def __init__(
        self, args: argparse.Namespace, rng: random.Random, tally: Tally, prefill_address: str, event: Callable[[str], None]
    ) -> None:
        self.args, self.rng, self.tally, self.counts = args, rng, tally, tally.counts
        self.prefill_address = prefill_address
        self.event = event
        self.rooms: dict[int, Room] = {}
        self.room_ids = secrets.randbits(30) << 24
        self.free_slots = list(range(args.slots))
        self.retired_slots: list[int] = []
        self.spec = RankSpec(group=DECODE_GROUP, role="decode")
        self.memory: Any = None
        self.client: Any = None
        self.engine: Any = None

    def register(self, address: str) -> None:
        """Register the decode rank with the broker at ``address``."""
        args = self.args
        self.memory = EngineMemory.allocate(
            self.spec, MODEL, num_pages=args.slots * span_pages(args.max_pages), aux_rows=args.slots, aux_row_bytes=AUX_ROW_BYTES
        )
        self.client = BrokerClient(address)
        self.engine = self.client.register_engine(self.spec, self.memory)

    def unregister(self) -> list[str]:
        """Unregister (the soak is over); the guard canaries of the pool that were overwritten."""
        guard_problems: list[str] = self.memory.check_guards()
        try:
            self.engine.close()
        except KvBrokerError as exc:
            self.event(f"decode UnregisterEngine failed: {exc}")
        self.client.close()
        return guard_problems

    def open_room(self, child: Any, faults: bool) -> None:
        """Open a room on a free slot, sent by ``child`` (``faults``: it may be aborted on purpose)."""
        args = self.args
        slot = self.free_slots.pop(0)
        n = self.rng.randint(args.min_pages, args.max_pages)
        src_span = span_pages(n)
        src = pick_pages(self.rng, n, self.rng.randrange(0, PREFILL_POOL_PAGES - src_span + 1))
        dst = pick_pages(self.rng, n, slot * span_pages(args.max_pages))
        nchunks = self.rng.randint(1, min(4, n))
        cuts = sorted(self.rng.sample(range(1, n), nchunks - 1)) if nchunks > 1 else []
        edges = [0, *cuts, n]
        bounds = list(zip(edges[:-1], edges[1:]))
        fault = None
        if faults and self.rng.random() < args.fault_rate:
            fault = self.rng.choice(["abort-decode", "abort-prefill"])
        abort_after = None
        if fault == "abort-prefill":
            abort_after = self.rng.randrange(-1, nchunks - 1) if nchunks > 1 else -1
        gap = self.rng.uniform(0, 0.02)
        self.room_ids += 1
        rid = self.room_ids
        room = Room(rid, child, slot, src, dst, time.monotonic(), fault)
        if fault:
            room.tag(fault)
        if fault:
            self.counts[f"aborts_{fault.removeprefix('abort-')}"] += 1
        if fault == "abort-decode":
            room.abort_at = time.monotonic() + self.rng.uniform(0, 0.06)
        # Zero the destination so a page the broker did not write cannot pass.
        idx = torch.as_tensor(dst, dtype=torch.int64)
        for layer in range(MODEL.num_layers):
            for t in self.memory.kv_tensors(layer):
                t[idx] = 0
        for aux in self.memory.aux:
            aux[slot].zero_()
        self.rooms[rid] = room
        child.rooms.add(rid)
        self.counts["rooms_started"] += 1
        order = ("room", rid, src, bounds, slot, abort_after, gap)
        receiver_first = self.rng.random() < 0.5
        if not receiver_first:
            child.conn.send(order)
        try:
            self.engine.receiver(rid, SenderRef(self.prefill_address, child.group)).init(dst, aux_row=slot)
        except KvBrokerError as exc:
            room.decode_state, room.decode_cause, room.decode_message = "INIT_ERROR", type(exc).__name__, str(exc)
            room.decode_final_at, room.settled = time.monotonic(), True
            self.counts["decode_init_errors"] += 1
            self.tally.failure(room, f"INIT_ERROR {type(exc).__name__}", str(exc))
            if not receiver_first:
                child.conn.send(("abort", rid))
            else:
                room.sender_state = "NOT_SENT"
            return
        if receiver_first:
            child.conn.send(order)

    def abort(self, room: Room, reason: str) -> None:
        try:
            self.engine.receiver(room.id, SenderRef(self.prefill_address, room.child.group)).abort(reason)
        except KvBrokerError as exc:
            self.event(f"room {room.id}: decode abort failed: {exc}")

    def poll(self) -> None:
        """Watch the rooms: see them end (check the bytes of those that succeed) and settle."""
        ids = [r.id for r in self.rooms.values() if r.decode_state is None or not r.settled]
        if not ids:
            return
        statuses = self.engine.poll(ids)
        now = time.monotonic()
        for rid, status in statuses.items():
            room = self.rooms.get(rid)
            if room is None:
                continue
            if room.decode_state is None and status.state in FINAL:
                room.decode_final_at = now
                room.abort_at = None
                if status.state == RoomState.SUCCESS:
                    room.decode_state = "SUCCESS"
                    self.verify(room)
                else:
                    cause = kind_name(status.cause.kind)
                    room.decode_state, room.decode_cause, room.decode_message = "FAILED", cause, status.cause.message
                    self.tally.failure(room, cause, status.cause.message)
            if room.decode_state is not None:
                if status.pages_settled:
                    room.settled = True
                elif status.state == RoomState.FAILED and status.cause.kind == common_pb2.FAILURE_KIND_UNKNOWN_ROOM:
                    # Unknown to the broker (or evicted after we saw it end): nothing of it can still write.
                    room.settled = True

    def verify(self, room: Room) -> None:
        problems = verify_room(
            self.memory,
            MODEL,
            self.spec,
            src_pages=np.asarray(room.src),
            dst_pages=np.asarray(room.dst),
            room=room.id,
            aux_row=room.slot,
        )
        self.tally.checked(room, problems)

    def retire_finished(self) -> None:
        """Let go of the rooms both sides are done with; abort those stuck open."""
        now = time.monotonic()
        stuck_after = self.args.stuck_after
        for rid in list(self.rooms):
            room = self.rooms[rid]
            if room.decode_state is not None and room.settled and room.sender_state is not None:
                self.release(room, keep_slot=True)
                continue
            age = now - room.started
            if room.decode_state is None and age > stuck_after and "stuck" not in room.tags:
                room.tag("stuck")
                self.counts["stuck_rooms"] += 1
                self.event(f"room {rid} still open on the decode side after {age:.0f} s; aborting it")
                self.abort(room, "soak: stuck")
            elif room.decode_final_at is not None and now - room.decode_final_at > stuck_after:
                if not room.settled:
                    self.counts["rooms_never_settled"] += 1
                    self.event(f"room {rid}: decode pages not settled {stuck_after:.0f} s after {room.decode_state}; slot {room.slot} retired")
                    self.release(room, keep_slot=False)
                elif room.sender_state is None:
                    self.counts["sender_never_finished"] += 1
                    self.event(f"room {rid}: no sender-side outcome {stuck_after:.0f} s after the decode side ended")
                    self.release(room, keep_slot=True)

    def release(self, room: Room, keep_slot: bool) -> None:
        self.tally.released(room)
        del self.rooms[room.id]
        room.child.rooms.discard(room.id)
        (self.free_slots if keep_slot else self.retired_slots).append(room.slot)

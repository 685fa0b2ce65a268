"""The raw NIXL baselines of ``gpu_bench.py`` and the geometry and page plans every method moves.

A spawned target process holds the destination and the slots of the staged
path; this process initiates with a bare NIXL agent made like the broker's.
See the docstring of ``gpu_bench.py`` for the methods and what they time.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from common import BenchFailed, bare_agent, report_error, spawn

Pages = tuple[np.ndarray, np.ndarray]  # (src, dst) page indices
Shape = tuple[int, int, int]  # a buffer as [region, page, byte]


@dataclass
class Geometry:
    """One page size: a chunk is ``chunk_pages`` pages of every region; rooms x chunks a sample."""

    regions: int
    page_bytes: int
    chunk_pages: int
    chunks: int  # per room
    rooms: int

    def __post_init__(self) -> None:
        self.room_pages = self.chunk_pages * self.chunks
        self.pool_pages = self.room_pages * self.rooms  # every page of a pool moves once
        self.chunk_bytes = self.regions * self.chunk_pages * self.page_bytes
        self.payload = self.chunk_bytes * self.chunks * self.rooms
        self.shape: Shape = (self.regions, self.pool_pages, self.page_bytes)


@dataclass(frozen=True)
class Plan:
    src: np.ndarray  # [rooms, room_pages] int64 page indices, in room order
    dst: np.ndarray

    def chunks(self, cp: int) -> list[Pages]:
        """(src, dst) pages of every chunk, in the order kvbroker sends them (chunk-major)."""
        rooms, pages = self.src.shape
        return [(self.src[r, c : c + cp], self.dst[r, c : c + cp])
                for c in range(0, pages, cp) for r in range(rooms)]


def make_plan(geo: Geometry, pattern: str, seed: int) -> Plan:
    """Every pool page once per side: random pages, or rooms of contiguous pages, shuffled."""
    rng, n, shape = np.random.default_rng(seed), geo.pool_pages, (geo.rooms, geo.room_pages)
    if pattern == "random":
        return Plan(rng.permutation(n).reshape(shape), rng.permutation(n).reshape(shape))
    runs = np.arange(geo.room_pages)[None, :]
    return Plan(*(rng.permutation(geo.rooms)[:, None] * geo.room_pages + runs for _ in range(2)))


def pattern_bytes(seed: int, n: int, device: torch.device) -> torch.Tensor:
    """``n`` pseudo-random bytes, the same in every process for one device and seed."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shaped(flat: torch.Tensor, shape: Shape) -> torch.Tensor:
    return flat[: math.prod(shape)].view(shape)


class Lane:
    """A dedicated CUDA stream and blocking events on it; on the host work is done when issued."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def on(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def mark(self) -> torch.cuda.Event | None:
        event = torch.cuda.Event(blocking=True) if self.stream is not None else None
        if event is not None:
            event.record(self.stream)
        return event

    @staticmethod
    def done(event: torch.cuda.Event | None, wait: bool) -> bool:
        if event is not None and wait:
            event.synchronize()
        return event is None or wait or bool(event.query())


# -- raw NIXL -------------------------------------------------------------------------------------


def mem_kind(device: torch.device) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def register(agent: Any, *tensors: torch.Tensor) -> None:
    for t in tensors:
        mem, dev = mem_kind(t.device)
        agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), dev, "")], mem)


def page_descs(base: int, shape: Shape, pages: np.ndarray, dev: int) -> np.ndarray:
    """N x 3 (address, bytes, device): one descriptor per page of every region, region-major."""
    regions, pool, page = shape
    rows = np.arange(regions, dtype=np.uint64)[:, None] * np.uint64(pool) + pages.astype(np.uint64)
    out = np.empty((rows.size, 3), dtype=np.uint64)
    out[:, 0] = rows.ravel() * np.uint64(page) + np.uint64(base)
    out[:, 1], out[:, 2] = page, dev
    return out


def settle(agent: Any, handles: list[Any], what: str) -> list[Any]:
    """Progress posted transfers: release those DONE, raise on ERR; those still in flight."""
    left = []
    for h in handles:
        state = agent.check_xfer_state(h)
        if state == "ERR":
            raise BenchFailed(f"{what}: a NIXL transfer failed")
        if state == "DONE":
            agent.release_xfer_handle(h)
        else:
            left.append(h)
    return left


def require(what: str, problem: str) -> None:
    if problem:
        raise BenchFailed(f"{what}: byte mismatch: {problem}")


def differs(dst: torch.Tensor, ref: torch.Tensor, shape: Shape, pages: Pages | None) -> str:
    """'' if ``dst`` holds ``ref``'s bytes (all, or dst pages = src pages of every region)."""
    if pages is None:
        return "" if torch.equal(dst, ref) else "the buffer differs from the source"
    s, d = (torch.from_numpy(p.ravel()).to(dst.device) for p in pages)
    dv, rv = shaped(dst, shape), shaped(ref, shape)
    bad = [r for r in range(shape[0]) if not torch.equal(dv[r][d], rv[r][s])]
    return f"regions {bad[:8]} differ from their source pages" if bad else ""


def scatter_slots(agent: Any, peer: str, dstv: torch.Tensor, ring: torch.Tensor,
                  didx: list[torch.Tensor], timeout: float) -> float:
    """The staged path's target: scatter each slot that arrives, then return it; the end time."""
    lane, pending, done = Lane(dstv.device), deque(), 0
    regions, _, page = dstv.shape
    deadline = time.monotonic() + timeout
    while done < len(didx):
        arrived = 0
        for msgs in agent.get_new_notifs().values():
            for msg in msgs:
                i, k = map(int, bytes(msg).decode().split(":"))
                slot = ring[k, : regions * didx[i].numel() * page].view(regions, -1, page)
                with lane.on():
                    dstv.index_copy_(1, didx[i], slot)
                pending.append((k, lane.mark()))
                arrived += 1
        while pending and Lane.done(pending[0][1], wait=not arrived):
            agent.send_notif(peer, str(pending.popleft()[0]).encode())
            done += 1
        if time.monotonic() > deadline:
            raise BenchFailed(f"raw staged target: {done} of {len(didx)} chunks after {timeout} s")
    return time.perf_counter()


def target_main(conn: Any, device_name: str, nbytes: int, slot_bytes: int, slots: int,
                seed: int) -> None:
    """The raw NIXL target process: the destination and slots; scatters and checks on command."""
    try:
        device = torch.device(device_name)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        agent = bare_agent(f"gpubench-target-{os.getpid()}")
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
        register(agent, dst, ring)
        ref = pattern_bytes(seed, nbytes, device)  # what the initiator's source holds
        conn.send((bytes(agent.get_agent_metadata()), dst.data_ptr(), ring.data_ptr()))
        peer = agent.add_remote_agent(conn.recv())
        shape, didx = (1, nbytes, 1), []
        while True:
            while not conn.poll(0.001):
                agent.get_new_notifs()  # progress while idle, as a serving process would
            cmd, *a = conn.recv()
            out: Any = None
            if cmd == "exit":
                break
            if cmd == "zero":
                dst.zero_()
            elif cmd == "plan":  # the dst pages of each chunk, for the staged path
                shape, didx = a[0], [torch.from_numpy(d).to(device) for d in a[1]]
            elif cmd == "scatter":
                conn.send(("ok", None))
                out = scatter_slots(agent, peer, shaped(dst, shape), ring, didx, a[0])
            elif cmd == "verify":
                out = differs(dst, ref, a[0], a[1])
            sync(device)
            conn.send(("ok", out))
    except Exception:
        report_error(conn)


class RawPeer:
    """This process initiates; a spawned child holds the destination (payload bytes) and slots."""

    def __init__(self, device: torch.device, nbytes: int, slot_bytes: int, slots: int, seed: int):
        self.device, self.slots, self.slot_bytes = device, slots, slot_bytes
        self.child = spawn("raw NIXL target", target_main, str(device), nbytes, slot_bytes, slots, seed)
        self.conn = self.child.conn
        try:
            self.agent = bare_agent(f"gpubench-initiator-{os.getpid()}")
            self.src = pattern_bytes(seed, nbytes, device)
            self.ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
            register(self.agent, self.src, self.ring)
            self.mem, self.dev = mem_kind(device)
            meta, self.dst_ptr, self.ring_ptr = self.child.recv(300)
            self.peer = self.agent.add_remote_agent(meta)
            self.conn.send(bytes(self.agent.get_agent_metadata()))
            self.lane = Lane(device)
            sync(device)
        except BaseException:
            self.close()
            raise

    def call(self, *cmd: Any, timeout: float = 600) -> Any:
        return self.child.ask(*cmd, timeout=timeout)[1]

    def check(self, what: str, shape: Shape, pages: Pages | None) -> None:
        require(what, self.call("verify", shape, pages))

    def descs(self, rows: np.ndarray) -> Any:
        return self.agent.get_xfer_descs(rows, self.mem)

    def one(self, base: int, size: int) -> Any:
        return self.descs(np.array([[base, size, self.dev]], dtype=np.uint64))

    def page_work(self, geo: Geometry, chunks: list[Pages]) -> list[tuple[Any, Any]]:
        return [(self.descs(page_descs(self.src.data_ptr(), geo.shape, s, self.dev)),
                 self.descs(page_descs(self.dst_ptr, geo.shape, d, self.dev))) for s, d in chunks]

    def post_all(self, work: Sequence[tuple[Any, Any]], what: str, timeout: float) -> float:
        """One WRITE per (local, remote) pair, back to back; seconds until all are DONE."""
        t0 = time.perf_counter()
        handles = []
        for local, remote in work:
            h = self.agent.initialize_xfer("WRITE", local, remote, self.peer, b"")
            if self.agent.transfer(h) == "ERR":
                raise BenchFailed(f"{what}: NIXL refused a transfer")
            handles.append(h)
        deadline = time.monotonic() + timeout
        while handles:
            handles = settle(self.agent, handles, what)
            if handles and time.monotonic() > deadline:
                raise BenchFailed(f"{what}: transfers not DONE after {timeout} s")
        return time.perf_counter() - t0

    def staged(self, geo: Geometry, sidx: list[torch.Tensor], timeout: float) -> float:
        """Gather -> one WRITE -> scatter per chunk, ``slots`` in flight; s to the last scatter."""
        ag, n, size, step = self.agent, len(sidx), geo.chunk_bytes, self.slot_bytes
        slots = [(self.one(self.ring.data_ptr() + k * step, size),
                  self.one(self.ring_ptr + k * step, size)) for k in range(self.slots)]
        srcv = shaped(self.src, geo.shape)
        free, gathered, inflight = deque(range(self.slots)), deque(), []
        issued = credits = 0
        self.call("scatter", timeout)
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        while credits < n:
            while issued < n and free:
                k = free.popleft()
                slot = self.ring[k, :size].view(geo.regions, -1, geo.page_bytes)
                with self.lane.on():
                    torch.index_select(srcv, 1, sidx[issued], out=slot)
                gathered.append((issued, k, self.lane.mark()))
                issued += 1
            if gathered and Lane.done(gathered[0][2], wait=not inflight):
                i, k, _ = gathered.popleft()
                h = ag.initialize_xfer("WRITE", *slots[k], self.peer, f"{i}:{k}".encode())
                if ag.transfer(h) == "ERR":
                    raise BenchFailed("raw staged: NIXL refused a transfer")
                inflight.append(h)
            inflight = settle(ag, inflight, "raw staged")
            for msgs in ag.get_new_notifs().values():
                free.extend(int(bytes(m)) for m in msgs)
                credits += len(msgs)
            if time.monotonic() > deadline:
                raise BenchFailed(f"raw staged: {credits} of {n} chunks after {timeout} s")
        t_end = self.child.recv(timeout)[1]
        while inflight:
            inflight = settle(ag, inflight, "raw staged")
        return t_end - t0

    def close(self) -> None:
        self.child.stop()


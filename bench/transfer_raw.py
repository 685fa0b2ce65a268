"""The raw NIXL and memcpy paths of ``transfer_bench.py``, and the page plans all its paths move.

The page plans: rooms of non-contiguous pages made of contiguous runs, in
shuffled order with gaps, independently on the two sides. The raw NIXL path:
this process initiates with a bare NIXL agent made like the broker's, a
spawned child is the target; the same buffers and runs as the brokers'.
See the docstring of ``transfer_bench.py``.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from common import BenchFailed, bare_agent, spawn

TARGET_POLL_SECONDS = 100e-6


# -- page plans ------------------------------------------------------------


@dataclass(frozen=True)
class RoomPlan:
    src: np.ndarray  # int32 page indices, in room order
    dst: np.ndarray
    #: [start, end) of each chunk over the room's pages.
    chunks: tuple[tuple[int, int], ...]


def _place(rng: np.random.Generator, lengths: np.ndarray, base: int) -> tuple[np.ndarray, int]:
    """Pages of runs of ``lengths`` (room order) laid out in shuffled order with gaps of 1-3 pages."""
    n = len(lengths)
    order = rng.permutation(n)
    gaps = rng.integers(1, 4, size=n)
    starts = np.empty(n, dtype=np.int64)
    pos = 0
    for i, run in enumerate(order):
        pos += int(gaps[i])
        starts[run] = pos
        pos += int(lengths[run])
    pages = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in range(n)]) + base
    return pages.astype(np.int32), pos + 1


def make_plans(
    n: int, pages: int, chunks: int, mean_run: int, seed: int
) -> tuple[list[RoomPlan], int]:
    """``n`` rooms on disjoint pages of each side; the pool size (pages) both sides need."""
    rng = np.random.default_rng(seed)
    plans = []
    src_base = dst_base = 0
    for _ in range(n):
        lengths = []
        left = pages
        while left > 0:
            run = min(left, int(rng.integers(1, 2 * mean_run)))
            lengths.append(run)
            left -= run
        arr = np.array(lengths, dtype=np.int64)
        src, src_extent = _place(rng, arr, src_base)
        dst, dst_extent = _place(rng, arr, dst_base)
        src_base += src_extent
        dst_base += dst_extent
        k = max(1, min(chunks, pages))
        bounds = np.linspace(0, pages, k + 1).astype(int)
        plans.append(
            RoomPlan(src, dst, tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])))
        )
    return plans, max(src_base, dst_base, pages)


# -- descriptors --------------------------------------------------------------


@dataclass(frozen=True)
class Regions:
    """The K/V layer regions of the pool (identical on both sides)."""

    offsets: np.ndarray  # uint64 byte offsets of each region in the buffer
    item_bytes: int


def chunk_descs(
    regions: Regions, src_addr: int, dst_addr: int, src: np.ndarray, dst: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One descriptor per (region, coalesced run): local and remote N x 3 uint64 arrays."""
    from kvbroker.plan._descriptors import coalesce_runs

    runs = coalesce_runs(src, dst).astype(np.uint64)  # (src start, dst start, length)
    item = np.uint64(regions.item_bytes)
    offs = regions.offsets[:, None]
    n = len(regions.offsets) * len(runs)
    local = np.empty((n, 3), dtype=np.uint64)
    remote = np.empty((n, 3), dtype=np.uint64)
    local[:, 0] = (np.uint64(src_addr) + offs + runs[None, :, 0] * item).ravel()
    remote[:, 0] = (np.uint64(dst_addr) + offs + runs[None, :, 1] * item).ravel()
    local[:, 1] = remote[:, 1] = np.broadcast_to(
        runs[None, :, 2] * item, (len(regions.offsets), len(runs))
    ).ravel()
    local[:, 2] = remote[:, 2] = 0
    return local, remote


def copy_list(regions: Regions, plans: Sequence[RoomPlan]) -> list[tuple[int, int, int]]:
    """(src byte offset, dst byte offset, bytes) per run, chunk by chunk, region by region."""
    from kvbroker.plan._descriptors import coalesce_runs

    out = []
    item = regions.item_bytes
    for plan in plans:
        for a, b in plan.chunks:
            runs = coalesce_runs(plan.src[a:b], plan.dst[a:b])
            for off in regions.offsets.tolist():
                for s, d, n in runs.tolist():
                    out.append((off + s * item, off + d * item, n * item))
    return out



def verify(
    what: str,
    src: np.ndarray,
    dst: np.ndarray,
    regions: Regions,
    num_pages: int,
    plans: Sequence[RoomPlan],
) -> None:
    """The chosen dst pages equal the src pages, byte for byte; every other dst page is zero."""
    item = regions.item_bytes
    s_idx = np.concatenate([p.src for p in plans]).astype(np.int64)
    d_idx = np.concatenate([p.dst for p in plans]).astype(np.int64)
    untouched = np.ones(num_pages, dtype=bool)
    untouched[d_idx] = False
    for r, off in enumerate(regions.offsets.tolist()):
        sv = src[off : off + num_pages * item].reshape(num_pages, item)
        dv = dst[off : off + num_pages * item].reshape(num_pages, item)
        got, want = dv[d_idx], sv[s_idx]
        if not np.array_equal(got, want):
            bad = int(np.count_nonzero(np.any(got != want, axis=1)))
            raise BenchFailed(
                f"{what}: region {r}: {bad} of {len(d_idx)} destination pages differ from their source pages"
            )
        if np.any(dv[untouched]):
            bad = int(np.count_nonzero(np.any(dv[untouched] != 0, axis=1)))
            raise BenchFailed(f"{what}: region {r}: {bad} pages outside the rooms were written")



# -- raw NIXL ----------------------------------------------------------------------


def _target_main(conn: Any, name: str, ucx_error_mode: str, fd_path: str, size: int) -> None:
    """The raw-NIXL target process: maps the destination memfd, registers it, reports notifications."""
    agent = bare_agent(name, ucx_error_mode=ucx_error_mode, telemetry=True)
    fd = os.open(fd_path, os.O_RDWR)
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    view = np.frombuffer(mapping, dtype=np.uint8)
    addr = int(view.ctypes.data)
    reg = agent.register_memory([(addr, size, 0, "")], "DRAM")
    conn.send(("ready", bytes(agent.get_agent_metadata()), addr))
    peer = agent.add_remote_agent(conn.recv())
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "exit":
                break
            if msg[0] == "arm":
                tag, timeout = msg[1], msg[2]
                conn.send(("armed",))
                deadline = time.monotonic() + timeout
                got = None
                while got is None:
                    for msgs in agent.get_new_notifs().values():
                        if tag in msgs:
                            got = time.perf_counter()
                    if got is None:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(TARGET_POLL_SECONDS)
                conn.send(("notif", got))
    finally:
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        del view
        mapping.close()
        os.close(fd)



class RawNixl:
    """This process as initiator, a spawned child as target; buffers like the engines'."""

    def __init__(self, ucx_error_mode: str, src: np.ndarray, layout: Any, num_pages: int) -> None:
        self.size = src.size
        self.fd = os.memfd_create("kvbroker-bench-raw-dst", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self.mapping = mmap.mmap(
            self.fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
        )
        self.dst = np.frombuffer(self.mapping, dtype=np.uint8)
        self.dst[:] = 0  # touch every page before anything is timed
        self.src = src
        self.src_addr = int(src.ctypes.data)
        tag = secrets.token_hex(4)
        fd_path = f"/proc/{os.getpid()}/fd/{self.fd}"
        self.child = spawn("raw NIXL target", _target_main, f"bench-target-{tag}", ucx_error_mode, fd_path, self.size)
        self.conn = self.child.conn
        try:
            self._setup(ucx_error_mode, tag, layout, num_pages)
        except BaseException:
            self.child.proc.kill()
            self.child.proc.join()
            raise

    def _setup(self, ucx_error_mode: str, tag: str, layout: Any, num_pages: int) -> None:
        from kvbroker.plan import BufferPlacement, Layout, RankKey, build_descriptor_table
        from kvbroker.v1 import common_pb2

        self.agent = bare_agent(f"bench-initiator-{tag}", ucx_error_mode=ucx_error_mode, telemetry=True)
        self.reg = self.agent.register_memory([(self.src_addr, self.size, 0, "")], "DRAM")
        _, metadata, self.dst_addr = self.child.recv(120.0, "ready")
        self.target = self.agent.add_remote_agent(metadata)
        if isinstance(self.target, bytes):
            self.target = self.target.decode()
        self.conn.send(bytes(self.agent.get_agent_metadata()))
        # Prepared lists of every page, as the broker prepares them at registration.
        lay = Layout.from_proto(layout, rank=RankKey("raw", 0, 0), buffer_sizes=[self.size])
        dram = common_pb2.MEMORY_KIND_DRAM
        src_table = build_descriptor_table(
            lay, [BufferPlacement(self.src_addr, self.size, dram, 0)]
        )
        dst_table = build_descriptor_table(
            lay, [BufferPlacement(self.dst_addr, self.size, dram, 0)]
        )
        self.region_base = np.array(
            [
                src_table.region_base[lay.kv_regions[(k, layer)]]
                for layer in range(lay.layer_begin, lay.layer_end)
                for k in lay.kv_kinds()
            ],
            dtype=np.int32,
        )
        # The broker's own form: strided rows, one per region.
        self.local_dlist = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", src_table.rows[dram], "DRAM")
        self.remote_dlist = self.agent.prep_xfer_dlist(self.target, dst_table.rows[dram], "DRAM")
        self.num_pages = num_pages
        self._seq = 0

    def prepare(
        self, regions: Regions, plans: Sequence[RoomPlan]
    ) -> dict[str, list[tuple[Any, Any]]]:
        """Everything built before the clock starts: numpy descriptor arrays and index arrays."""
        chunked = [
            chunk_descs(regions, self.src_addr, self.dst_addr, p.src[a:b], p.dst[a:b])
            for p in plans
            for a, b in p.chunks
        ]
        single = [
            (np.concatenate([lo for lo, _ in chunked]), np.concatenate([re for _, re in chunked]))
        ]
        prepped = []
        for p in plans:
            for a, b in p.chunks:
                li = (self.region_base[:, None] + p.src[a:b][None, :]).ravel().astype(np.int32)
                ri = (self.region_base[:, None] + p.dst[a:b][None, :]).ravel().astype(np.int32)
                prepped.append((li, ri))
        return {"chunked": chunked, "single": single, "prepped": prepped}

    def run(
        self, variant: str, work: list[tuple[Any, Any]], timeout: float = 60.0
    ) -> tuple[float, dict[str, float]]:
        """Post ``work`` (one transfer per entry, notification on the last); seconds and details."""
        self._seq += 1
        tag = f"bench-{self._seq}".encode()
        self.conn.send(("arm", tag, timeout))
        self.child.recv(30.0, "armed")
        agent = self.agent
        handles = []
        t0 = time.perf_counter()
        for i, (local, remote) in enumerate(work):
            notif = tag if i == len(work) - 1 else b""
            if variant == "prepped":
                h = agent.make_prepped_xfer(
                    "WRITE", self.local_dlist, local, self.remote_dlist, remote, notif
                )
            else:
                h = agent.initialize_xfer(
                    "WRITE",
                    agent.get_xfer_descs(local, "DRAM"),
                    agent.get_xfer_descs(remote, "DRAM"),
                    self.target,
                    notif,
                )
            if agent.transfer(h) == "ERR":
                raise BenchFailed(f"raw NIXL ({variant}): transfer {i} rejected")
            handles.append(h)
        t_posted = time.perf_counter()
        pending = list(handles)
        deadline = time.monotonic() + timeout
        while pending:
            still = []
            for h in pending:
                state = agent.check_xfer_state(h)
                if state == "ERR":
                    raise BenchFailed(f"raw NIXL ({variant}): a transfer failed")
                if state == "PROC":
                    still.append(h)
            pending = still
            if pending and time.monotonic() > deadline:
                raise BenchFailed(f"raw NIXL ({variant}): transfers not done after {timeout} s")
        t_done = time.perf_counter()
        _, t_notif = self.child.recv(timeout + 10, "notif")
        if t_notif is None:
            raise BenchFailed(f"raw NIXL ({variant}): the target never saw the notification")
        descs = 0
        for h in handles:
            try:
                descs += int(agent.get_xfer_telemetry(h).descCount)
            except Exception:
                pass
            agent.release_xfer_handle(h)
        end = max(t_done, t_notif)
        return end - t0, {
            "post_ms": (t_posted - t0) * 1e3,
            "done_ms": (t_done - t0) * 1e3,
            "notif_ms": (t_notif - t0) * 1e3,
            "transfers": len(work),
            "descriptors": descs,
        }

    def close(self) -> None:
        try:
            self.child.stop()
        finally:
            try:
                self.agent.release_dlist_handle(self.local_dlist)
                self.agent.release_dlist_handle(self.remote_dlist)
                self.agent.remove_remote_agent(self.target)
                self.agent.deregister_memory(self.reg)
            except Exception:
                pass
            del self.dst
            try:
                self.mapping.close()
            except BufferError:
                pass  # a numpy view is still alive; the mapping goes with it
            os.close(self.fd)


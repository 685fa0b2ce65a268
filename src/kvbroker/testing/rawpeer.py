"""A bare NIXL agent pair moving the same bytes as kvbroker: the baseline the benchmarks compare it against.

:class:`RawPeer` makes two NIXL agents the way the broker makes its own (the UCX backend, the broker's error mode,
no progress thread): this process initiates, a spawned target process holds the destination. On a GPU (a real
one, or one that ``kvbroker.testing.gpu_model`` models) it moves pages raw: one descriptor per page, one
descriptor of everything, or gather -> one WRITE -> scatter per chunk through transfer slots, as the broker's
device path does. On the host its destination is a memfd both processes map, written with plain DRAM writes.
Every byte it moves can be checked against its source (:func:`pattern_bytes`, :func:`differs`).
``bench/gpu_bench.py`` and ``bench/transfer_bench.py`` run it beside kvbroker; ``bench/registration_bench.py``
times a bare agent's registrations (:func:`bare_agent`).

It needs NIXL and torch, and is imported lazily: ``kvbroker.testing`` does not load it (import it by module
path), and it loads NIXL, and the modelled GPU, only when it makes an agent.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from multiprocessing.connection import Connection
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "Child",
    "Holder",
    "Lane",
    "Pages",
    "PeerFailed",
    "RawPeer",
    "Shape",
    "bare_agent",
    "differs",
    "modelled",
    "pattern_bytes",
    "shaped",
    "sync",
]


class PeerFailed(RuntimeError):
    """A raw transfer, the target or the bytes failed: the figures are not valid."""


class Child(Protocol):
    """A spawned child process and this end of its pipe (bench/harness.py's ``Child``); its messages are tuples
    whose first item names them."""

    conn: Connection

    def recv(self, timeout: float, expect: str | None = None) -> Any:
        """The next message; an error if the child fails, exits or says nothing for ``timeout`` s."""

    def ask(self, *command: Any, timeout: float = 600, expect: str | None = None) -> Any:
        """Send ``command`` and return the answer."""

    def stop(self) -> None:
        """Tell the child to exit, then end it."""


class Holder(Protocol):
    """What holds a run (bench/harness.py's ``Held``): it spawns the target and stops it when the run ends."""

    def spawn(self, name: str, target: Callable[..., object], *args: Any) -> Child:
        """Start ``target(conn, *args)`` in a child process that reports its failure; stop it when the run ends."""

    def defer(self, what: str, step: Callable[[], object]) -> None:
        """Run ``step`` when the run ends."""

    def now(self, *steps: Callable[[], object]) -> None:
        """Run these deferred steps now."""

# -- the bytes ---------------------------------------------------------------------------

Shape = tuple[int, int, int]  # a buffer as [region, page, byte]
Pages = tuple[npt.NDArray[Any], npt.NDArray[Any]]  # (src, dst) page indices


def pattern_bytes(seed: int, n: int, device: Any) -> Any:
    """``n`` pseudo-random bytes, the same in every process for one device and seed."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def sync(device: Any) -> None:
    """Wait for the work issued on ``device`` (a GPU's; nothing on the host)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shaped(flat: Any, shape: Shape) -> Any:
    """The first bytes of ``flat`` viewed as ``shape``."""
    return flat[: math.prod(shape)].view(shape)


def differs(dst: Any, ref: Any, shape: Shape, pages: Pages | None) -> str:
    """'' if ``dst`` holds ``ref``'s bytes (all, or dst pages = src pages of every region)."""
    if pages is None:
        return "" if torch.equal(dst, ref) else "the buffer differs from the source"
    s, d = (torch.from_numpy(p.ravel()).to(dst.device) for p in pages)
    dv, rv = shaped(dst, shape), shaped(ref, shape)
    bad = [r for r in range(shape[0]) if not torch.equal(dv[r][d], rv[r][s])]
    return f"regions {bad[:8]} differ from their source pages" if bad else ""

# -- raw NIXL ------------------------------------------------------------------------------


def bare_agent(name: str, *, ucx_error_mode: str = "peer", telemetry: bool = False) -> Any:
    """A bare NIXL agent made like the broker's: no progress thread, the UCX backend with the broker's error mode
    (``telemetry``: per-transfer telemetry on)."""
    from kvbroker.broker.dataplane import import_nixl
    api = import_nixl()
    # After the import: NIXL's logging setup (dictConfig, on first import) sets its logger to INFO on
    # stdout, which would break --json.
    logging.getLogger("nixl").setLevel(logging.WARNING)
    config = api.nixl_agent_config(enable_prog_thread=False, backends=[], capture_telemetry=telemetry)
    agent = api.nixl_agent(name, config)
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_mode})
    return agent


def _mem(device: Any) -> tuple[str, int]:
    return ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)


def _register(agent: Any, *tensors: Any) -> None:
    for t in tensors:
        agent.register_memory([(t.data_ptr(), t.numel() * t.element_size(), _mem(t.device)[1], "")], _mem(t.device)[0])


def _settle(agent: Any, handles: list[Any], what: str, count: list[int] | None = None) -> list[Any]:
    """Progress posted transfers: release those DONE (adding their descriptors to ``count``), raise on ERR; those in
    flight."""
    left = []
    for h in handles:
        state = agent.check_xfer_state(h)
        if state == "ERR":
            raise PeerFailed(f"{what}: a NIXL transfer failed")
        if state != "DONE":
            left.append(h)
            continue
        if count is not None:
            count[0] += int(agent.get_xfer_telemetry(h).descCount)
        agent.release_xfer_handle(h)
    return left


class Lane:
    """A dedicated CUDA stream and blocking events on it; on the host work is done when issued, unless a modelled GPU
    (``streams``: kvbroker.testing.gpu_model) says when it is done."""

    def __init__(self, device: Any, streams: Any = None) -> None:
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        self.streams = streams

    def on(self) -> Any:
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def mark(self, op: str, nbytes: int) -> Any:
        """An event after the work issued so far (``op`` over ``nbytes``: what a modelled GPU times)."""
        if self.streams is not None:
            from kvbroker.broker.device import Work
            return self.streams.timelines.take(op, self.streams.host, 0, self.streams.model.job_seconds(Work(op, nbytes)), nbytes)
        event = torch.cuda.Event(blocking=True) if self.stream is not None else None  # type: ignore[no-untyped-call]
        if event is not None:
            event.record(self.stream)
        return event

    @staticmethod
    def done(event: Any, wait: bool) -> bool:
        if isinstance(event, float):  # a modelled GPU's: when it completes
            if wait:
                time.sleep(max(0.0, event - time.monotonic()))
            return time.monotonic() >= event
        if event is not None and wait:
            event.synchronize()
        return event is None or wait or bool(event.query())


def modelled(spec: str | None) -> tuple[Any, Any]:
    """The modelled GPU ``spec`` names (kvbroker.testing.gpu_model), as a lane's streams and a write clock; (None, None)
    without one."""
    if not spec:
        return None, None
    from kvbroker.testing.gpu_model import ModelledStreams, ModelSetting
    streams = ModelledStreams(ModelSetting.parse(spec))
    return streams, streams.clock()


def _scatter_slots(agent: Any, peer: str, dstv: Any, ring: Any, didx: list[Any], timeout: float,
                   lane: Lane) -> tuple[float, dict[int, dict[str, float]]]:
    """The staged path's target: scatter each slot that arrives, then return it; the end time, and each chunk's times
    (``r.`` hops of ``kvbroker.testing.otlp.PART_HOPS``)."""
    pending: deque[tuple[int, Any, int]] = deque()
    done, hops = 0, {}
    regions, _, page = dstv.shape
    deadline = time.monotonic() + timeout
    while done < len(didx):
        arrived = 0
        for msgs in agent.get_new_notifs().values():
            for msg in msgs:
                i, k = map(int, bytes(msg).decode().split(":"))
                hops[i] = {"r.notice": time.monotonic(), "r.scatter_start": time.monotonic()}
                slot = ring[k, : regions * didx[i].numel() * page].view(regions, -1, page)
                with lane.on():
                    dstv.index_copy_(1, didx[i], slot)
                pending.append((k, lane.mark("scatter", slot.numel()), i))
                arrived += 1
        while pending and Lane.done(pending[0][1], wait=not arrived):
            k, _, i = pending.popleft()
            hops[i]["r.scatter_end"] = time.monotonic()
            agent.send_notif(peer, str(k).encode())
            done += 1
        if not arrived:
            os.sched_yield()  # a pass that found nothing gives the kernel its turn (UCX's TCP lanes need it on small hosts)
        if time.monotonic() > deadline:
            raise PeerFailed(f"raw staged target: {done} of {len(didx)} chunks after {timeout} s")
    return time.perf_counter(), hops


def _target_main(conn: Connection, device_name: str, nbytes: int, dst_path: str, slot_bytes: int, slots: int,
                 seed: int, ucx_error_mode: str, model: str | None = None) -> None:
    """The raw NIXL target process: the destination and slots; zeroes, checks, waits for a notification and scatters on
    command (each answered ("ok", value))."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # as the broker's copies: a pool of a thread per core spins on the cores the other side needs
    streams, clock = modelled(model)
    agent = bare_agent(f"bench-target-{os.getpid()}", ucx_error_mode=ucx_error_mode)
    if clock is not None:
        from kvbroker.testing.gpu_model import ModelledNixl
        agent = ModelledNixl(agent, clock)
    lane = Lane(device, streams)
    if dst_path:  # the initiator's memfd: it reads the bytes itself
        fd = os.open(dst_path, os.O_RDWR)
        dst = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
        os.close(fd)
    else:
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
    _register(agent, dst, *([ring] if slots else []))
    ref = None
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
            out = _scatter_slots(agent, peer, shaped(dst, shape), ring, didx, a[0], lane)
        elif cmd == "arm":  # when the notification ``a[0]`` arrives (None: not within a[1] s)
            conn.send(("ok", None))
            deadline = time.monotonic() + a[1]
            while out is None and time.monotonic() < deadline:
                if any(a[0] in msgs for msgs in agent.get_new_notifs().values()):
                    out = time.perf_counter()
                else:
                    time.sleep(100e-6)
        elif cmd == "verify":
            ref = pattern_bytes(seed, nbytes, device) if ref is None else ref  # the initiator's source
            out = differs(dst, ref, a[0], a[1])
        sync(device)
        conn.send(("ok", out))


class RawPeer:
    """Bare NIXL agents made like the broker's: this process initiates from ``src`` (by default ``nbytes`` of
    :func:`pattern_bytes`, registered), a spawned target holds the destination (on a GPU, or a memfd this process
    maps too, ``dst``) and ``slots`` transfer slots of the staged path. The target polls for notifications every 100
    us while it waits for one, and every 1 ms while idle. ``held`` spawns the target and stops it, and closes the
    memfd, when the run ends (or :meth:`close` before); ``model``: a modelled GPU's setting (``kvbroker.testing.gpu_model``)
    both agents' writes and the lanes' copies take their times from."""

    def __init__(self, held: Holder, device: Any, nbytes: int, *, src: Any = None, slot_bytes: int = 0,
                 slots: int = 0, seed: int = 1, ucx_error_mode: str = "peer", telemetry: bool = False,
                 model: str | None = None) -> None:
        self.device, self.slots, self.slot_bytes, self.telemetry = device, slots, slot_bytes, telemetry
        dst_path = ""
        self.dst: npt.NDArray[np.uint8] | None = None
        if device.type == "cpu":
            self.fd = os.memfd_create("kvbroker-bench-raw-dst", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self.dst = np.frombuffer(mmap.mmap(self.fd, nbytes), dtype=np.uint8)
            self.dst[:] = 0  # touch every page before anything is timed
            dst_path = f"/proc/{os.getpid()}/fd/{self.fd}"
            held.defer("closing the raw NIXL destination", lambda: os.close(self.fd))
        self.held = held
        self.child = held.spawn("raw NIXL target", _target_main, str(device), nbytes, dst_path, slot_bytes,
                                slots, seed, ucx_error_mode, model)
        streams, clock = modelled(model)
        torch.set_num_threads(1)  # as the target's
        self.agent = bare_agent(f"bench-initiator-{os.getpid()}", ucx_error_mode=ucx_error_mode, telemetry=telemetry)
        if clock is not None:
            from kvbroker.testing.gpu_model import ModelledNixl
            self.agent = ModelledNixl(self.agent, clock)
        self.src = pattern_bytes(seed, nbytes, device) if src is None else src
        self.ring = torch.zeros(slots, slot_bytes, dtype=torch.uint8, device=device)
        _register(self.agent, self.src, *([self.ring] if slots else []))
        self.mem, self.dev = _mem(device)
        meta, self.dst_ptr, self.ring_ptr = self.child.recv(300)
        self.peer = self.agent.add_remote_agent(meta)
        self.peer = self.peer.decode() if isinstance(self.peer, bytes) else self.peer
        self.child.conn.send(bytes(self.agent.get_agent_metadata()))
        self.lane = Lane(device, streams)
        self.seq = 0
        sync(device)

    def call(self, *cmd: Any, timeout: float = 600) -> Any:
        return self.child.ask(*cmd, timeout=timeout)[1]

    def close(self) -> None:
        """Stop the target now (before the run ends)."""
        self.held.now(self.child.stop)

    def check(self, what: str, shape: Shape, pages: Pages | None) -> None:
        """The target's destination holds the default source's bytes (all, or ``pages`` of every region)."""
        problem = self.call("verify", shape, pages)
        if problem:
            raise PeerFailed(f"{what}: byte mismatch: {problem}")

    def descs(self, rows: npt.NDArray[np.uint64]) -> Any:
        return self.agent.get_xfer_descs(rows, self.mem)

    def one(self, base: int, size: int) -> Any:
        return self.descs(np.array([[base, size, self.dev]], dtype=np.uint64))

    def post_all(self, work: Sequence[tuple[Any, Any]], what: str, timeout: float, *, notify: bool = False,
                 make: Callable[[Any, Any, bytes], Any] | None = None) -> tuple[float, dict[str, float]]:
        """One WRITE per (local, remote) pair, back to back (``make(local, remote, notif)``: its handle; default
        ``initialize_xfer``); seconds until all are DONE and (``notify``) the target saw the last one's
        notification, and when each happened (ms)."""
        self.seq += 1
        tag = f"bench-{self.seq}".encode() if notify else b""
        if notify:
            self.call("arm", tag, timeout)
        agent, handles, descriptors = self.agent, [], [0]
        t0 = time.perf_counter()
        for i, (local, remote) in enumerate(work):
            notif = tag if i == len(work) - 1 else b""
            h = make(local, remote, notif) if make else agent.initialize_xfer("WRITE", local, remote, self.peer, notif)
            if agent.transfer(h) == "ERR":
                raise PeerFailed(f"{what}: NIXL refused a transfer")
            handles.append(h)
        t_posted = time.perf_counter()
        deadline = time.monotonic() + timeout
        while handles:
            handles = _settle(agent, handles, what, descriptors if self.telemetry else None)
            if handles and time.monotonic() > deadline:
                raise PeerFailed(f"{what}: transfers not DONE after {timeout} s")
        t_done = t_notif = time.perf_counter()
        if notify:
            t_notif = self.child.recv(timeout + 10)[1]
            if t_notif is None:
                raise PeerFailed(f"{what}: the target never saw the notification")
        ms = {k: (t - t0) * 1e3 for k, t in (("post_ms", t_posted), ("done_ms", t_done), ("notif_ms", t_notif))}
        return max(t_done, t_notif) - t0, ms | {"transfers": len(work), "descriptors": descriptors[0]}

    def staged(self, shape: Shape, chunk_bytes: int, sidx: list[Any], timeout: float, hops: list[Any] | None = None) -> float:
        """Gather -> one WRITE -> scatter per chunk (its pages ``sidx``, of every region of ``shape``), ``slots`` in
        flight; s to the last scatter (the target was told the dst pages: ``call("plan", ...)``). ``hops``: gets each
        chunk's times (as ``kvbroker.testing.otlp.PART_HOPS`` names them)."""
        ag, n, step, now = self.agent, len(sidx), self.slot_bytes, time.monotonic
        times = [{"s.handed_on": now()} for _ in range(n)]
        holder, writing = {}, {}
        slots = [(self.one(self.ring.data_ptr() + k * step, chunk_bytes),
                  self.one(self.ring_ptr + k * step, chunk_bytes)) for k in range(self.slots)]
        srcv = shaped(self.src, shape)
        free, gathered, inflight = deque(range(self.slots)), deque[tuple[int, int, Any]](), list[Any]()
        issued = credits = 0
        self.call("scatter", timeout)
        deadline = time.monotonic() + timeout
        t0 = time.perf_counter()
        while credits < n:
            while issued < n and free:
                k = free.popleft()
                holder[k], t = issued, times[issued]
                t["s.slot"] = t["s.credit"] = t["s.gather_start"] = now()
                slot = self.ring[k, :chunk_bytes].view(shape[0], -1, shape[2])
                with self.lane.on():
                    torch.index_select(srcv, 1, sidx[issued], out=slot)
                gathered.append((issued, k, self.lane.mark("gather", chunk_bytes)))
                issued += 1
            if gathered and Lane.done(gathered[0][2], wait=not inflight):
                i, k, _ = gathered.popleft()
                times[i]["s.gathered"] = now()
                h = ag.initialize_xfer("WRITE", *slots[k], self.peer, f"{i}:{k}".encode())
                if ag.transfer(h) == "ERR":
                    raise PeerFailed("raw staged: NIXL refused a transfer")
                times[i]["s.posted"], writing[id(h)] = now(), i
                inflight.append(h)
            left = _settle(ag, inflight, "raw staged")
            for h in inflight if len(left) < len(inflight) else ():
                if h not in left:
                    times[writing.pop(id(h))]["s.done"] = now()
            inflight = left
            returned = [int(bytes(m)) for msgs in ag.get_new_notifs().values() for m in msgs]
            for k in returned:
                times[holder[k]]["s.credit_back"] = now()
            free.extend(returned)
            credits += len(returned)
            if not returned:
                os.sched_yield()  # as the target's loop
            if time.monotonic() > deadline:
                raise PeerFailed(f"raw staged: {credits} of {n} chunks after {timeout} s")
        t_end, seen = self.child.recv(timeout)[1]
        while inflight:
            inflight = _settle(ag, inflight, "raw staged")
        if hops is not None:
            hops.extend(times[i] | t for i, t in seen.items())
        return float(t_end - t0)

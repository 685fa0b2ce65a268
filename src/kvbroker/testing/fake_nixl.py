"""A scripted fake NIXL agent: the one fake, shipped for tests.

``FakeAgent`` follows ``kvbroker.broker.dataplane.Agent``. Agents that share
a :class:`FakeFabric` reach each other by name, in one process, and really
copy bytes (``ctypes.memmove``) between registered memory when a transfer
completes, so a test sees byte-exact results or the lack of them.

Each posted transfer follows an :class:`XferScript`: ``check`` answers PROC
``proc_polls`` times, then DONE (copy the bytes, deliver the notification),
ERR, or nothing ever (HANG). Scripts queue per agent (``agent.script(...)``);
with none queued, transfers complete on the first check.

With the fake CUDA driver attached (``FakeAgent(..., cuda=FakeCudaLib)`` or
``agent.cuda = ...``), VRAM follows what a real GPU showed
(``kvbroker.testing.fake_cuda``): registering a pointer opened from a CUDA
IPC handle fails as NIXL's did (``NIXL_ERR_BACKEND``), and a write whose
target is a VMM allocation finishes only after its bytes would have crossed
TCP on the host (``HOST_SPEED_BPS``), counted in ``host_speed_writes``.
Remote metadata loads as NIXL 1.5 loads it: what a peer's metadata holds
is added to what was loaded before (memory the peer freed stays known), and
a registration at a loaded (address, size, kind, device) whose keys changed
is refused with ``NIXL_ERR_NOT_ALLOWED``. Host memory registered again at the
same place keeps its keys (UCX over loopback showed it); VRAM gets new ones
with each registration (a new cudaMalloc's IPC handle, as an H200 showed).
With ``wire_bps`` set, every write crosses one wire of that speed in the
order it was posted (as NIXL moves what was posted first come, first served).
With ``clock`` set (a modelled GPU's, ``gpu_model.WriteClock``), a write
from or into VRAM is DONE, and its notification delivered, no sooner than
the model's link allows.
``vram_registrations()`` lists what VRAM is registered now, by allocation
kind; ``vram_registered``, ``vram_sources`` and ``vram_targets`` keep what
the agent saw over its whole life (every VRAM registration, and the VRAM
each write read from and wrote to, by allocation kind), so a check after
the engines have gone still sees what was registered while they were there.
"""

from __future__ import annotations

import ctypes
import json
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np

from kvbroker.broker.dataplane import XferState
from kvbroker.errors import InvalidArgument, NixlError
from kvbroker.plan import IndexArray, expand_rows
from kvbroker.testing.gpu_model import WRITE_TAG
from kvbroker.v1 import common_pb2

if TYPE_CHECKING:
    from kvbroker.testing.fake_cuda import FakeCudaLib
    from kvbroker.testing.gpu_model import WriteClock

__all__ = ["HOST_SPEED_BPS", "FakeAgent", "FakeFabric", "XferScript"]

#: What a NIXL write into a CUDA VMM target moved on an H100 (UCX fell back
#: to TCP on the host): 0.43-0.50 GB/s.
HOST_SPEED_BPS = 0.45e9
_VRAM = common_pb2.MEMORY_KIND_VRAM


@dataclass(frozen=True)
class XferScript:
    """How one posted transfer behaves."""

    #: ``check`` reports PROC this many times before the outcome.
    proc_polls: int = 0
    #: DONE copies the bytes and delivers the notification; ERR reports an
    #: error (after copying ``partial_fraction`` of the descriptors); HANG
    #: stays PROC forever.
    outcome: Literal["DONE", "ERR", "HANG"] = "DONE"
    #: Reject the post itself (``post_write`` raises ``NixlError``).
    fail_post: bool = False
    #: With ERR: the share of descriptors written before the error.
    partial_fraction: float = 0.0


@dataclass
class FakeFabric:
    """The agents that can reach each other."""

    agents: dict[str, FakeAgent] = field(default_factory=dict)


_DEFAULT_FABRIC = FakeFabric()


@dataclass
class _Dlist:
    agent: str
    descs: np.ndarray
    kind: int = 0
    #: VRAM lists: what memory each descriptor lies in.
    memory: list[str] = field(default_factory=list)


@dataclass
class _Xfer:
    pairs: list[tuple[int, int, int]]
    target: str
    notif: bytes
    script: XferScript
    polls: int = 0
    finished: XferState | None = None
    #: A VMM target: not DONE before this time (host speed).
    not_before: float = 0.0


class FakeAgent:
    """A fake NIXL agent. See the module docstring."""

    def __init__(self, name: str, fabric: FakeFabric | None = None, cuda: FakeCudaLib | None = None) -> None:
        self._name = name
        self._fabric = fabric if fabric is not None else _DEFAULT_FABRIC
        self._fabric.agents[name] = self
        #: The fake CUDA driver whose allocations this agent's VRAM lives in (optional).
        self.cuda = cuda
        self._regs: dict[int, tuple[int, int, int, int]] = {}
        #: Registration -> its keys (what a peer's load compares, as NIXL compares its metaInfo).
        self._keys: dict[int, str] = {}
        #: Registration -> what its memory is ("host", or a ``FakeCudaLib.memory_kind``).
        self._memory: dict[int, str] = {}
        self._next_reg = 0
        #: Remote agent -> its loaded registrations (start, size, kind, device, memory) -> their keys.
        self._remotes: dict[str, dict[tuple[int, int, int, int, str], str]] = {}
        #: Writes that moved at host speed (their target was a VMM allocation).
        self.host_speed_writes = 0
        #: Over the agent's life: VRAM registrations (also those deregistered since), and the VRAM
        #: descriptors that writes read from and wrote to, by allocation kind.
        self.vram_registered: Counter[str] = Counter()
        self.vram_sources: Counter[str] = Counter()
        self.vram_targets: Counter[str] = Counter()
        self._inbox: deque[tuple[str, bytes]] = deque()
        self._scripts: deque[XferScript] = deque()
        self.live_dlists: set[int] = set()
        #: Bytes per second of one wire every write of this agent crosses in the order posted (None: instant).
        self.wire_bps: float | None = None
        self._wire_free = 0.0
        #: A modelled GPU's writes: VRAM writes finish when it says (None: at once).
        self.clock: WriteClock | None = None
        self.live_xfers: set[int] = set()
        self.posted = 0

    # -- test controls -------------------------------------------------
    def script(self, *scripts: XferScript) -> None:
        """Queue scripts for the next posted transfers, in order."""
        self._scripts.extend(scripts)

    def rekey(self) -> None:
        """Give every registration new keys, as memory registered again over RDMA gets."""
        for handle in self._keys:
            self._keys[handle] += "'"

    @property
    def registrations(self) -> int:
        return len(self._regs)

    def vram_registrations(self) -> Counter[str]:
        """VRAM registered now, by allocation kind (``FakeCudaLib.memory_kind``); what ever was:
        ``vram_registered``."""
        return Counter(self._memory[h] for h, reg in self._regs.items() if reg[2] == _VRAM)

    # -- Agent protocol -------------------------------------------------
    @property
    def name(self) -> str:
        return self._name

    def metadata(self) -> bytes:
        regs = [(*reg, self._memory[h], self._keys[h]) for h, reg in self._regs.items()]
        return json.dumps({"name": self._name, "regs": regs}).encode()

    def register(self, address: int, size_bytes: int, kind: int, device_id: int) -> int:
        memory = "host"
        if kind == _VRAM and self.cuda is not None:
            memory = self.cuda.memory_kind(address, size_bytes)
            if memory == "ipc":
                raise NixlError(
                    f"NIXL could not register {size_bytes} bytes at {address:#x}: NIXL_ERR_BACKEND "
                    "(fake: a pointer opened from a CUDA IPC handle, as measured on an H100)"
                )
        handle = self._next_reg
        self._next_reg += 1
        self._regs[handle] = (address, size_bytes, kind, device_id)
        self._memory[handle] = memory
        self._keys[handle] = f"{memory}:{handle}" if kind == _VRAM else f"host:{address:#x}+{size_bytes}"
        if kind == _VRAM:
            self.vram_registered[memory] += 1
        return handle

    def deregister(self, registration: int) -> None:
        del self._regs[registration]
        del self._memory[registration]
        del self._keys[registration]

    def add_remote(self, metadata: bytes) -> str:
        try:
            meta = json.loads(metadata)
            name = str(meta["name"])
            regs = {
                (int(start), int(size), int(kind), int(dev), str(mem)): str(key)
                for start, size, kind, dev, mem, key in meta["regs"]
            }
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(f"fake agent metadata is malformed: {exc!r}") from exc
        if name not in self._fabric.agents:
            raise InvalidArgument(f"fake agent {name} is not on this fabric")
        loaded = self._remotes.setdefault(name, {})
        for reg, key in regs.items():
            if loaded.get(reg, key) != key:
                raise InvalidArgument(
                    f"NIXL rejected a peer's agent metadata: NIXL_ERR_NOT_ALLOWED (fake: {name} registered "
                    f"{reg[0]:#x}+{reg[1]} again with new keys)"
                )
            loaded[reg] = key
        return name

    def remove_remote(self, name: str) -> None:
        self._remotes.pop(name, None)

    def prep_dlist(self, agent: str | None, rows: np.ndarray, kind: int) -> _Dlist:
        if rows.ndim != 2 or rows.shape[1] != 5:
            raise NixlError("a prepared list is made of strided K x 5 rows")
        return self._prep(agent, expand_rows(rows), kind)

    def _prep(self, agent: str | None, descs: np.ndarray, kind: int) -> _Dlist:
        if agent is None or agent == self._name:
            regions = [(*reg, self._memory[h]) for h, reg in self._regs.items()]
        elif agent in self._remotes:
            regions = list(self._remotes[agent])
        else:
            raise NixlError(f"fake agent {self._name} has no metadata for {agent}")
        # As NIXL: a descriptor lies inside memory registered with the same
        # memory type and device id.
        for addr, length, dev in descs.tolist():
            if not any(
                start <= addr and addr + length <= start + size and k == kind and d == dev
                for start, size, k, d, _ in regions
            ):
                raise NixlError(
                    f"descriptor {addr:#x}+{length} (kind {kind}, device {dev}) is not inside memory registered "
                    f"by {agent or self._name} with that kind and device"
                )
        memory = [
            next((m for start, size, _, _, m in regions if start <= addr < start + size), "host") for addr, _, _ in descs.tolist()
        ] if kind == _VRAM else []
        dlist = _Dlist(agent or "", np.array(descs, dtype=np.uint64, copy=True), kind, memory)
        self.live_dlists.add(id(dlist))
        return dlist

    def release_dlist(self, dlist: _Dlist) -> None:
        self.live_dlists.discard(id(dlist))

    def post_write(
        self,
        local: _Dlist,
        local_indices: IndexArray,
        remote: _Dlist,
        remote_indices: IndexArray,
        notif: bytes,
    ) -> _Xfer:
        if local.agent:
            raise NixlError("the local side of a transfer must be a local descriptor list")
        if len(local_indices) != len(remote_indices):
            raise NixlError("local and remote index lists differ in length")
        for idx, dl in ((local_indices, local), (remote_indices, remote)):
            if len(idx) and (int(np.min(idx)) < 0 or int(np.max(idx)) >= len(dl.descs)):
                raise NixlError("index out of range of the prepared list")
        script = self._scripts.popleft() if self._scripts else XferScript()
        if script.fail_post:
            raise NixlError("fake: post rejected by script")
        pairs = []
        sources: set[str] = set()
        targets: set[str] = set()
        for li, ri in zip(local_indices.tolist(), remote_indices.tolist()):
            src, slen, _ = local.descs[li].tolist()
            dst, dlen, _ = remote.descs[ri].tolist()
            if slen != dlen:
                raise NixlError("local and remote descriptors differ in length")
            pairs.append((src, dst, slen))
            if local.memory:
                sources.add(local.memory[li])
            if remote.memory:
                targets.add(remote.memory[ri])
        target = remote.agent if remote.agent and remote.agent != self._name else self._name
        xfer = _Xfer(pairs=pairs, target=target, notif=notif, script=script)
        self.vram_sources.update(sources)
        self.vram_targets.update(targets)
        if "vmm" in targets:
            # Measured: UCX moves a write into a VMM allocation over TCP on the host.
            self.host_speed_writes += 1
            xfer.not_before = time.monotonic() + sum(n for _, _, n in pairs) / HOST_SPEED_BPS
        if self.clock is not None and _VRAM in (local.kind, remote.kind) and pairs:
            device = int(local.descs[int(local_indices[0])][2])
            xfer.not_before = max(xfer.not_before, self.clock.post(sum(n for _, _, n in pairs), device, WRITE_TAG if notif else None))
        if self.wire_bps:
            # One wire, first come first served: a write ends after those posted before it.
            self._wire_free = max(time.monotonic(), self._wire_free) + sum(n for _, _, n in pairs) / self.wire_bps
            xfer.not_before = max(xfer.not_before, self._wire_free)
        self.live_xfers.add(id(xfer))
        self.posted += 1
        return xfer

    def post_write_descs(
        self,
        local_descs: np.ndarray,
        local_kind: int,
        remote_descs: np.ndarray,
        remote_kind: int,
        remote_agent: str,
        notif: bytes,
    ) -> _Xfer:
        local = self._prep(None, local_descs, local_kind)
        remote = self._prep(remote_agent, remote_descs, remote_kind)
        try:
            return self.post_write(
                local,
                np.arange(len(local_descs), dtype=np.int32),
                remote,
                np.arange(len(remote_descs), dtype=np.int32),
                notif,
            )
        finally:
            self.release_dlist(local)
            self.release_dlist(remote)

    def check(self, xfer: _Xfer) -> XferState:
        if xfer.finished is not None:
            return xfer.finished
        if xfer.polls < xfer.script.proc_polls or xfer.script.outcome == "HANG" or time.monotonic() < xfer.not_before:
            xfer.polls += 1
            return XferState.PROC
        if xfer.script.outcome == "ERR":
            cut = int(len(xfer.pairs) * xfer.script.partial_fraction)
            self._copy(xfer.pairs[:cut])
            xfer.finished = XferState.ERR
            return xfer.finished
        self._copy(xfer.pairs)
        if xfer.notif:
            self._deliver(xfer.target, xfer.notif)
        xfer.finished = XferState.DONE
        return xfer.finished

    def release_xfer(self, xfer: _Xfer) -> None:
        self.live_xfers.discard(id(xfer))

    def descriptor_count(self, xfer: _Xfer) -> int | None:
        merged = 0
        prev: tuple[int, int, int] | None = None
        for src, dst, length in xfer.pairs:
            if prev is None or prev[0] + prev[2] != src or prev[1] + prev[2] != dst:
                merged += 1
            prev = (src, dst, length)
        return merged

    def send_notif(self, agent: str, message: bytes) -> None:
        if agent != self._name and agent not in self._remotes:
            raise NixlError(f"fake agent {self._name} has no metadata for {agent}")
        self._deliver(agent, message)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        out = list(self._inbox)
        self._inbox.clear()
        return out

    def close(self) -> None:
        self._regs.clear()
        self._remotes.clear()
        if self._fabric.agents.get(self._name) is self:
            del self._fabric.agents[self._name]

    # -- internals ------------------------------------------------------
    def _deliver(self, target: str, message: bytes) -> None:
        agent = self._fabric.agents.get(target)
        if agent is None:
            raise NixlError(f"fake agent {target} is gone")
        agent._inbox.append((self._name, message))

    @staticmethod
    def _copy(pairs: list[tuple[int, int, int]]) -> None:
        for src, dst, length in pairs:
            ctypes.memmove(dst, src, length)

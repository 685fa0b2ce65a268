"""A ``kvbroker serve`` process on a fake GPU: testing and benchmarks only.

With ``KVBROKER_TESTING_FAKE_GPUS=N`` (N >= 1) in its environment,
``kvbroker serve`` runs its device path against :class:`FakeCudaLib` (N
devices, granularity 4096) instead of ``libcuda.so.1``: "device memory" is
host memory in memfds, the broker views it as torch CPU tensors
(``device_as_host``), its transfer buffers are the fake ``cuMemAlloc``'s
memfds, and the real NIXL agent (UCX) registers and writes them as DRAM
(:class:`FakeGpuAgent`). Engines in other processes hand it VRAM made with
``as_fake_vram`` and a fake driver of their own; the broker's driver takes
their memfds as allocations it did not make (``foreign_fds``).

So two broker processes run the whole device path, gather, one NIXL write
over loopback and scatter, with real gRPC, real UCX and real threads: what
``bench/gpu_bench.py --fake-gpu`` measures and
``tests/test_fake_gpu_process.py`` checks. A broker started so says so on
stderr at start, and its GPU figures are not a GPU's. Production cannot
reach any of this without that variable.

With ``KVBROKER_TESTING_GPU_MODEL`` too (``kvbroker.testing.gpu_model``),
the fake GPUs keep a model's time: the broker's GPU lanes run (their copies
at once, on the copy thread), their events complete when the modelled GPU
would have finished the copies, and a write from a transfer buffer is DONE,
and its notification seen at the peer, no sooner than the modelled link
allows. ``bench/gpu_bench.py --fake-gpu --model h200`` measures that.
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
import structlog

from kvbroker import cudavmm
from kvbroker.broker.dataplane import Agent, XferState
from kvbroker.plan import IndexArray
from kvbroker.testing.fake_cuda import FakeCudaLib
from kvbroker.testing.gpu_model import WRITE_TAG, ModelledStreams, WriteClock, model_from_env
from kvbroker.v1 import common_pb2

__all__ = ["FAKE_GPUS_ENV", "FakeGpuAgent", "fake_gpu_server_options"]

#: The environment variable that puts ``kvbroker serve`` on N fake GPUs.
FAKE_GPUS_ENV = "KVBROKER_TESTING_FAKE_GPUS"
#: The fake driver's allocation granularity (EngineMemory buffers are page-aligned).
GRANULARITY = 4096

_VRAM = common_pb2.MEMORY_KIND_VRAM
_DRAM = common_pb2.MEMORY_KIND_DRAM

log = structlog.get_logger(__name__)


def _host(kind: int) -> int:
    return _DRAM if kind == _VRAM else kind


class FakeGpuAgent:
    """A real agent that registers and writes the fake driver's "VRAM" as DRAM.

    Every call goes to ``inner``; a VRAM memory kind becomes DRAM on the way
    (device ids pass unchanged, the same on both sides). It logs a warning,
    which the tests and the benchmark read, when the broker registers or
    writes from VRAM that is not one of its ``cuMemAlloc`` transfer buffers,
    which a GPU would have refused or moved at host speed.
    """

    def __init__(self, inner: Agent, cuda: FakeCudaLib, clock: WriteClock | None = None) -> None:
        self._inner = inner
        self._cuda = cuda
        #: A modelled GPU's writes (None: a write is DONE when UCX says so).
        self._clock = clock
        #: VRAM registrations by the fake driver's allocation kind ("cudaMalloc", ...).
        self.vram_registrations: Counter[str] = Counter()

    @property
    def name(self) -> str:
        return self._inner.name

    def _check_vram(self, what: str, address: int, size: int) -> None:
        kind = self._cuda.memory_kind(address, size)
        if kind != "cudaMalloc":
            log.warning("fake_gpu_vram_outside_transfer_buffers", what=what, address=hex(address), bytes=size, allocation=kind)

    def metadata(self) -> bytes:
        return self._inner.metadata()

    def register(self, address: int, size_bytes: int, kind: int, device_id: int) -> Any:
        if kind == _VRAM:
            self.vram_registrations[self._cuda.memory_kind(address, size_bytes)] += 1
            self._check_vram("register", address, size_bytes)
        return self._inner.register(address, size_bytes, _host(kind), device_id)

    def deregister(self, registration: Any) -> None:
        self._inner.deregister(registration)

    def add_remote(self, metadata: bytes) -> str:
        return self._inner.add_remote(metadata)

    def remove_remote(self, name: str) -> None:
        self._inner.remove_remote(name)

    def prep_dlist(self, agent: str | None, rows: np.ndarray, kind: int) -> Any:
        if kind == _VRAM and agent is None:
            for row in rows:
                self._check_vram("prep_dlist", int(row[0]), int(row[3]) * max(int(row[4]) - 1, 0) + int(row[1]))
        return self._inner.prep_dlist(agent, rows, _host(kind))

    def release_dlist(self, dlist: Any) -> None:
        self._inner.release_dlist(dlist)

    def post_write(self, local: Any, local_indices: IndexArray, remote: Any, remote_indices: IndexArray, notif: bytes) -> Any:
        return self._inner.post_write(local, local_indices, remote, remote_indices, notif)

    def post_write_descs(
        self,
        local_descs: np.ndarray,
        local_kind: int,
        remote_descs: np.ndarray,
        remote_kind: int,
        remote_agent: str,
        notif: bytes,
    ) -> Any:
        if local_kind == _VRAM:
            for row in local_descs:
                self._check_vram("write", int(row[0]), int(row[1]))
        if self._clock is None or _VRAM not in (local_kind, remote_kind):
            return self._inner.post_write_descs(local_descs, _host(local_kind), remote_descs, _host(remote_kind), remote_agent, notif)
        due = self._clock.post(int(local_descs[:, 1].sum()), int(local_descs[0, 2]), WRITE_TAG if notif else None)
        handle = self._inner.post_write_descs(
            local_descs, _host(local_kind), remote_descs, _host(remote_kind), remote_agent, self._clock.stamp(notif, due)
        )
        return _Modelled(handle, due)

    def check(self, xfer: Any) -> XferState:
        if isinstance(xfer, _Modelled):
            state = self._inner.check(xfer.handle)
            return XferState.PROC if state is XferState.DONE and time.monotonic() < xfer.due else state
        return self._inner.check(xfer)

    def release_xfer(self, xfer: Any) -> None:
        self._inner.release_xfer(xfer.handle if isinstance(xfer, _Modelled) else xfer)

    def descriptor_count(self, xfer: Any) -> int | None:
        return self._inner.descriptor_count(xfer.handle if isinstance(xfer, _Modelled) else xfer)

    def send_notif(self, agent: str, message: bytes) -> None:
        self._inner.send_notif(agent, message)

    def get_notifs(self) -> list[tuple[str, bytes]]:
        notifs = self._inner.get_notifs()
        return notifs if self._clock is None else self._clock.arrived(notifs)

    def close(self) -> None:
        self._inner.close()


@dataclass(frozen=True)
class _Modelled:
    """A modelled write: UCX's handle, and when the model lets it be DONE."""

    handle: Any
    due: float


def fake_gpu_server_options(agent_name: str, ucx_error_mode: str, environ: dict[str, str] | None = None) -> dict[str, Any] | None:
    """``BrokerServer`` keyword arguments for a broker on fake GPUs, if
    ``KVBROKER_TESTING_FAKE_GPUS`` asks for them (None: it does not, the real
    driver and agent). Says so on stderr. ``ValueError`` if the value is
    not a positive count."""
    value = (os.environ if environ is None else environ).get(FAKE_GPUS_ENV, "").strip()
    if not value:
        return None
    try:
        devices = int(value)
    except ValueError:
        devices = 0
    if devices < 1:
        raise ValueError(f"{FAKE_GPUS_ENV}={value!r}: not a count of fake GPUs (unset it for real ones)")
    from kvbroker.broker.dataplane import AgentConfig, UcxAgent

    cuda = FakeCudaLib(devices=devices, granularity=GRANULARITY, foreign_fds=True)
    setting = model_from_env(environ)
    streams = ModelledStreams(setting) if setting is not None else None
    timing = (
        f"  Its copies and writes finish when a MODEL of a GPU says ({setting.spec()}).\n"
        if setting is not None
        else ""
    )
    banner = "!" * 78
    print(
        f"{banner}\n"
        f"kvbroker serve: TESTING ONLY: {FAKE_GPUS_ENV}={devices}: this broker runs on {devices} FAKE GPU(s).\n"
        "  CUDA is a scripted fake (kvbroker.testing.fake_cuda): its 'device memory' is host memory,\n"
        "  registered with NIXL as DRAM. No GPU is used; no figure from this broker is a GPU's.\n"
        f"{timing}{banner}",
        file=sys.stderr,
        flush=True,
    )
    agent = UcxAgent(AgentConfig(name=agent_name, ucx_error_mode=ucx_error_mode))
    clock = streams.clock() if streams is not None else None
    return {
        "agent": FakeGpuAgent(agent, cuda, clock),
        "cuda_driver": cudavmm.Driver(cuda),
        "device_as_host": True,
        "device_streams": streams,
    }

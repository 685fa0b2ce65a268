"""A timing-faithful fake GPU: when the device path's copies and writes finish, by a model.

The fake CUDA driver (``fake_cuda``) makes "device memory" of host memory,
and a broker on it copies that memory on its copy thread at once, at CPU
speed: it shows what the device path does, not when. With a
:class:`GpuModel` the copies still happen (the bytes are real, and
checked), on a thread of the modelled GPU's own (so the broker's thread
that launched them is free at once, as it is on a GPU), but when each one
*finishes* follows the model:

- **A GPU is one engine.** Every copy job launched on it (a batch of
  gathers, of scatters, a checksum), by any process, runs in the order
  launched, after the one before: CUDA time-slices the contexts of
  processes that share a GPU (no MPS), so the prefill broker's gathers and
  the decode broker's scatters on one GPU take turns. A job ends
  ``launch_us`` + its bytes over its op's rate after the engine is free
  (``gather_gbps``, ``scatter_gbps``, ``checksum_gbps``, ``copy_gbps``).
- **A job's event completes then** (and not before its copies are done),
  and the broker's data-plane thread, which launched it, sees it complete
  in its next pass (:class:`ModelledStreams`, the broker's ``device.Streams``).
- **A GPU's writes cross one link**, first posted first: a write from its
  transfer buffer is DONE ``write_us`` + its bytes over ``write_gbps`` after
  the link is free (CUDA IPC through a copy engine on one host; the GPU's
  NIC between hosts), and its notification is not seen at the peer before
  then (:class:`WriteClock`). What the CPU does around it stays real: UCX
  still moves the (scaled) bytes and the notification over loopback, and
  the brokers' threads poll and wake as they do.
- **Scaled bytes.** Each real byte stands for ``byte_scale`` modelled bytes,
  so that the real copies stay well under the modelled times on a small
  host: pages keep their count and only their width shrinks (a 16 KiB page
  is 16 real bytes at a scale of 1024), so the brokers' work per page and
  per part is what it would be.

Timelines (when each engine and link is free next) are shared by the
processes of one modelled host through a small file (``timelines=PATH``):
the two brokers, and the bench's raw loop, on one modelled GPU take turns on
it as they would on the real one. Processes on different modelled hosts
(``host=N``) have engines and links of their own.

A broker takes a model from ``KVBROKER_TESTING_GPU_MODEL`` (with
``KVBROKER_TESTING_FAKE_GPUS``; :func:`model_from_env`), for example
``h200,byte_scale=1024,timelines=/dev/shm/kvb-model-1,host=0``. Testing and
benchmarks only: docs/benchmarks.md gives the presets and their calibration.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from kvbroker.broker.dataplane import name_thread
from kvbroker.broker.device import Work

__all__ = [
    "MODELS",
    "MODEL_ENV",
    "WRITE_TAG",
    "GpuModel",
    "Interval",
    "ModelSetting",
    "ModelledNixl",
    "ModelledStreams",
    "Timelines",
    "WriteClock",
    "model_from_env",
]

T = TypeVar("T")

#: The environment variable that gives a fake-GPU broker a timing model.
MODEL_ENV = "KVBROKER_TESTING_GPU_MODEL"
#: Devices per modelled host that have timelines.
_DEVICES = 16
#: Modelled hosts that have timelines.
_HOSTS = 8
#: Resources per device: its engine, its link.
_ENGINE, _LINK = 0, 1
_SLOTS = _HOSTS * _DEVICES * 2
#: The tag of a write that carries a notification (a part's, not a probe's) on the timelines.
WRITE_TAG = "notified"
#: The first bytes of a notification a modelled write carries: the time it may be seen.
_STAMP = b"\xffkvbmdl\x00"
_STAMPED = struct.Struct("<d")


@dataclass(frozen=True)
class GpuModel:
    """How fast one modelled GPU's copies and writes are (GB/s are 1e9 bytes a
    second of modelled bytes)."""

    #: Page gathers into a slot (index_select over the regions).
    gather_gbps: float = 310.0
    #: Page scatters out of a slot (index_copy_).
    scatter_gbps: float = 310.0
    #: A device CRC-32 over a slot (not measured on a GPU: a guess).
    checksum_gbps: float = 300.0
    #: A plain device copy (copy_).
    copy_gbps: float = 1300.0
    #: A job's fixed cost on its GPU's engine: launches, index upload, the event, and
    #: the switch between the contexts of the processes that share the GPU.
    launch_us: float = 127.0
    #: One GPU's writes from its transfer buffer.
    write_gbps: float = 1000.0
    #: A write's fixed cost beyond its bytes, post to DONE.
    write_us: float = 10.0
    #: Modelled bytes per real byte.
    byte_scale: int = 1

    def job_seconds(self, work: Work) -> float:
        """How long ``work`` holds its GPU's engine."""
        rate = {"gather": self.gather_gbps, "scatter": self.scatter_gbps, "checksum": self.checksum_gbps}.get(work.op, self.copy_gbps)
        return self.launch_us * 1e-6 + work.nbytes * self.byte_scale / (rate * 1e9)

    def write_seconds(self, nbytes: int) -> float:
        """How long a write of ``nbytes`` (real) takes, once its link is free."""
        return self.write_us * 1e-6 + nbytes * self.byte_scale / (self.write_gbps * 1e9)

    def ideal_gbps(self, part_bytes: int, slots: int, *, one_gpu: bool) -> tuple[float, str]:
        """What this model can move at best in steady state, in modelled GB/s, with
        parts of ``part_bytes`` (real) and ``slots`` in flight, and what bounds it:
        the busiest resource (``one_gpu``: both sides' jobs share one engine), or a
        part's cycle over the slots (gather, write, scatter back to back, no
        waiting between them)."""
        gather = self.job_seconds(Work("gather", part_bytes))
        scatter = self.job_seconds(Work("scatter", part_bytes))
        write = self.write_seconds(part_bytes)
        busiest = {"the engine (gather + scatter on one GPU)": gather + scatter} if one_gpu else {
            "the sender's engine (gather)": gather, "the receiver's engine (scatter)": scatter}
        busiest["the link (write)"] = write
        busiest[f"one part's cycle over {slots} slots"] = (gather + write + scatter) / slots
        bound = max(busiest, key=lambda k: busiest[k])
        return part_bytes * self.byte_scale / busiest[bound] / 1e9, bound

    def text(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name):g}" for f in fields(self))


#: Presets. "h200": one H200 that two processes share, writes over CUDA IPC,
#: calibrated to the raw gather -> WRITE -> scatter loop measured there
#: (docs/benchmarks.md). "h200-400g": a production host's GPU, each GPU's
#: writes on a NIC of its own (400 Gb/s, about 50 GB/s), the other side on
#: another host.
MODELS: dict[str, GpuModel] = {
    "h200": GpuModel(),
    "h200-400g": GpuModel(write_gbps=50.0, write_us=5.0),
}


@dataclass(frozen=True)
class ModelSetting:
    """A model, and where this process is in it: its modelled host, and the file of
    the timelines it shares with the other processes of that host (None: its own)."""

    model: GpuModel
    host: int = 0
    timelines: str | None = None

    def spec(self) -> str:
        """This setting as ``KVBROKER_TESTING_GPU_MODEL`` says it."""
        base = MODELS["h200"]
        parts = ["h200"] + [f"{f.name}={getattr(self.model, f.name):g}" for f in fields(self.model) if getattr(self.model, f.name) != getattr(base, f.name)]
        parts.append(f"host={self.host}")
        if self.timelines:
            parts.append(f"timelines={self.timelines}")
        return ",".join(parts)

    @classmethod
    def parse(cls, text: str) -> ModelSetting:
        """``name[,key=value...]``: a preset, then any of its fields, ``host`` and
        ``timelines``. ``ValueError`` saying what is wrong."""
        name, *pairs = [p.strip() for p in text.split(",") if p.strip()] or [""]
        if name not in MODELS:
            raise ValueError(f"{MODEL_ENV}={text!r}: no model {name!r} (presets: {', '.join(MODELS)})")
        model, host, path = MODELS[name], 0, None
        kinds = {f.name: f.type for f in fields(GpuModel)}
        for pair in pairs:
            key, _, value = pair.partition("=")
            try:
                if key == "host":
                    host = int(value)
                elif key == "timelines":
                    path = value or None
                elif key in kinds:
                    number: Any = int(value) if kinds[key] in (int, "int") else float(value)
                    model = replace(model, **{key: number})
                else:
                    raise ValueError(f"no setting {key!r}")
            except ValueError as exc:
                raise ValueError(f"{MODEL_ENV}={text!r}: {pair!r}: {exc}") from None
        if not 0 <= host < _HOSTS:
            raise ValueError(f"{MODEL_ENV}={text!r}: host {host} is not 0..{_HOSTS - 1}")
        return cls(model, host, path)


def model_from_env(environ: Mapping[str, str] | None = None) -> ModelSetting | None:
    """The model ``KVBROKER_TESTING_GPU_MODEL`` names, or None (no model: copies finish when done)."""
    text = (os.environ if environ is None else environ).get(MODEL_ENV, "").strip()
    return ModelSetting.parse(text) if text else None


@dataclass(frozen=True)
class Interval:
    """One job or write on a timeline (kept by :class:`Timelines` with ``history``)."""

    what: str
    host: int
    device: int
    start: float
    end: float
    nbytes: int
    tag: Any = None


class Timelines:
    """When each modelled engine and link is free next: in this process, or in a file
    the processes of one modelled host share (``path``; made if missing)."""

    def __init__(self, path: str | None = None, *, history: bool = False) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd: int | None = None
        if path is None:
            self._times: Any = [0.0] * _SLOTS
        else:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            if os.fstat(self._fd).st_size < _SLOTS * 8:
                os.ftruncate(self._fd, _SLOTS * 8)
            self._map = mmap.mmap(self._fd, _SLOTS * 8)
            self._times = memoryview(self._map).cast("d")
        #: Every job and write taken, in order (``history``): what tests read.
        self.history: list[Interval] | None = [] if history else None

    def take(self, what: str, host: int, device: int, seconds: float, nbytes: int = 0, tag: Any = None) -> float:
        """Hold the engine (``what`` a job's op) or the link (``what`` = "write") of
        ``device`` on ``host`` for ``seconds`` from when it is free, or from now; when
        that ends (``time.monotonic``)."""
        slot = ((host % _HOSTS) * _DEVICES + device % _DEVICES) * 2 + (_LINK if what == "write" else _ENGINE)
        with self._lock:
            if self._fd is not None:
                fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                start = max(time.monotonic(), float(self._times[slot]))
                end = start + seconds
                self._times[slot] = end
            finally:
                if self._fd is not None:
                    fcntl.lockf(self._fd, fcntl.LOCK_UN)
            if self.history is not None:
                self.history.append(Interval(what, host, device, start, end, nbytes, tag))
        return end

    def close(self) -> None:
        if self._fd is not None:
            self._times.release()
            self._map.close()
            os.close(self._fd)
            self._fd = None


@dataclass
class _Stream:
    device: int


class ModelledStreams:
    """The broker's ``device.Streams`` on a modelled GPU: a job's copies run on a
    thread of their own (one for every modelled GPU of the process: the
    broker's array views and launch count are one thread's), in the order
    launched (CPU tensors over the fake driver's memory), so the launching
    thread is free at once, as a GPU's would be; its event completes when the
    model's engine would have finished it, and not before the copies are done."""

    def __init__(self, setting: ModelSetting, timelines: Timelines | None = None) -> None:
        self.setting = setting
        self.model = setting.model
        self.host = setting.host
        self.timelines = timelines or Timelines(setting.timelines)
        self._copies: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def clock(self) -> WriteClock:
        """The writes of the same modelled host (its links on the same timelines)."""
        return WriteClock(self.setting, self.timelines)

    def open(self, device: int) -> _Stream:
        from kvbroker.broker.device._block_copies import torch_for_copies

        torch_for_copies()
        return _Stream(device)

    def launch(self, stream: _Stream, job: Callable[[], Callable[[], T]], work: Work) -> tuple[Future[Callable[[], T]], tuple[Future[Any], float]]:
        with self._lock:
            if self._copies is None:
                self._copies = ThreadPoolExecutor(1, "kvb-fakegpu", initializer=name_thread, initargs=("kvb-fakegpu",))
        end = self.timelines.take(work.op, self.host, stream.device, self.model.job_seconds(work), work.nbytes)
        copies = self._copies.submit(job)
        return copies, (copies, end)

    def query(self, stream: _Stream, event: tuple[Future[Any], float]) -> bool:
        return time.monotonic() >= event[1] and event[0].done()

    def finish(self, stream: _Stream, read: Future[Callable[[], T]]) -> T:
        return read.result()()


@dataclass
class WriteClock:
    """When a modelled GPU's writes are DONE, and when their notifications may be
    seen: for an agent of the fake-GPU broker, the in-process fake agent and the
    bench's raw loop."""

    setting: ModelSetting
    timelines: Timelines
    #: Notifications that arrived before their write could have landed: (when, agent, payload).
    _held: list[tuple[float, str, bytes]] = field(default_factory=list)

    def post(self, nbytes: int, device: int, tag: Any = None) -> float:
        """A write of ``nbytes`` (real) from ``device``'s transfer buffer posted now: when it is DONE."""
        return self.timelines.take("write", self.setting.host, device, self.setting.model.write_seconds(nbytes), nbytes, tag)

    @staticmethod
    def stamp(notif: bytes, due: float) -> bytes:
        """``notif`` marked not to be seen before ``due``."""
        return _STAMP + _STAMPED.pack(due) + notif if notif else notif

    def arrived(self, notifs: list[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
        """Of the notifications that arrived (and those held before), those that may
        be seen now, unmarked, in order of arrival; the rest are held."""
        now = time.monotonic()
        for agent, payload in notifs:
            due = 0.0
            if payload[: len(_STAMP)] == _STAMP:
                (due,) = _STAMPED.unpack_from(payload, len(_STAMP))
                payload = payload[len(_STAMP) + _STAMPED.size :]
            self._held.append((due, agent, payload))
        seen = [(agent, payload) for due, agent, payload in self._held if due <= now]
        self._held = [held for held in self._held if held[0] > now]
        return seen

    def next_due(self) -> float | None:
        """When the next held notification may be seen (None: none held)."""
        return min((due for due, _, _ in self._held), default=None)


class ModelledNixl:
    """A bare ``nixl_agent`` (the bench's raw loop) whose writes follow a modelled GPU:
    ``check_xfer_state`` says DONE, and the peer's :meth:`get_new_notifs` shows a
    write's notification, no sooner than the model allows. The rest passes through."""

    def __init__(self, agent: Any, clock: WriteClock, device: int = 0) -> None:
        self._agent = agent
        self._clock = clock
        self._device = device
        self._sizes: dict[int, int] = {}
        self._due: dict[int, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def get_xfer_descs(self, rows: Any, mem: str) -> Any:
        descs = self._agent.get_xfer_descs(rows, mem)
        self._sizes[id(descs)] = int(sum(int(r[1]) for r in rows))
        return descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notif: bytes = b"") -> Any:
        due = self._clock.post(self._sizes.get(id(local), 0), self._device, WRITE_TAG if notif else None)
        handle = self._agent.initialize_xfer(op, local, remote, peer, self._clock.stamp(notif, due))
        self._due[id(handle)] = due
        return handle

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._agent.check_xfer_state(handle))
        if state == "DONE" and time.monotonic() < self._due.get(id(handle), 0.0):
            return "PROC"
        return state

    def release_xfer_handle(self, handle: Any) -> None:
        self._due.pop(id(handle), None)
        self._agent.release_xfer_handle(handle)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        arrived = [(agent, bytes(m)) for agent, msgs in self._agent.get_new_notifs().items() for m in msgs]
        out: dict[str, list[bytes]] = {}
        for agent, payload in self._clock.arrived(arrived):
            out.setdefault(agent, []).append(payload)
        return out

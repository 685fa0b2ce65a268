"""The device data path: kvbroker moving VRAM KV pages against its baselines, on one GPU, or on a modelled
GPU (``--fake-gpu``: no GPU needed; kvbroker.testing.gpu_model).

    python bench/gpu_bench.py                         # cuda:0: the whole matrix and the targets
    python bench/gpu_bench.py --device cpu --quick    # smoke test without a GPU (host memory, small)
    python bench/gpu_bench.py --fake-gpu [--gpus 8]   # a modelled H200 (--model), 128 and 32 MiB parts

A sample moves ``--rooms`` rooms x ``--chunks`` chunks of ``--chunk-mib`` MiB (the same pages of 2 x
``--layers`` K/V regions, 8 KV heads, bfloat16, ``--page-kib`` KiB a page and region; pages random or
contiguous, independent on each side). Per case (page size x pattern x chunk size x tp) and method: payload
/ wall seconds, best and median of ``--repeat`` samples after a warm-up, the methods of a case interleaved:
1 kvbroker: two ``kvbroker serve`` per chunk size (a chunk fits ``--device-part-mib``; transfer buffers of
``--buffer-parts`` parts; default: the brokers' own, 1 GiB), engines registered from this process; tp2->tp1: two prefill ranks (head slices).
From the first ExpectRoom to the last SUCCESS the decode engine sees; per part, the brokers' CPU, device
launches, peer RPCs. 2 raw pages: bare NIXL (UCX, no progress thread) into a spawned target, a descriptor
per page and region, a transfer per chunk. 3 raw staged: gather (index_select on its own stream) into one
of ``--slots`` slots -> one WRITE with a notification -> scatter (index_copy_) -> the slot comes back.
4 raw one: one descriptor of the whole payload (the NIXL ceiling). 5 copy: torch ``copy_`` on the device.

Raw rows move the tp1->tp1 case's bytes. Also 1-page room latency (median, p90), KV on ``--device`` vs in
DRAM, and each hop of a part (median us: kvbroker's from its brokers' spans, the raw loop's own). Every
sample's bytes are checked (a difference, failed room or transfer exits 1). Read ratios within one run.

On a modelled GPU (``--fake-gpu``, ``--model``): brokers on fake GPUs whose copies and writes finish when a
model says, the raw loop on the same model, and the model's ideal pipeline (its limit) beside them. One real
byte stands for ``--scale`` modelled ones (pages keep their count); GB/s are modelled bytes (the model and
its calibration: docs/benchmarks.md). ``--gpus N``: N modelled GPUs behind each broker (default model
h200-400g: each GPU's writes on a 50 GB/s NIC of its own, the brokers on two hosts), an engine pair per GPU,
all moving at once.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import platform
import secrets
import shlex
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"  # before NIXL loads: here, in the raw target, in the brokers

import harness as h
import numpy as np
import torch

from kvbroker.broker.config import BrokerConfig
from kvbroker.client import ExpectSpec
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY
from kvbroker.testing.gpu_model import MODEL_ENV, MODELS, ModelSetting
from kvbroker.testing.otlp import PART_HOPS, OtlpReceiver, part_times
from kvbroker.testing.rawpeer import RawPeer, Shape, differs, pattern_bytes

PARTS = ("broker", "raw-pages", "raw-staged", "raw-one", "copy", "latency")
_CASES = dict(page_kib="16,4", patterns="random,contiguous", tp="1,2", parts=",".join(PARTS))
PROFILES = {  # defaults: one H100 (the targets), --quick (a 2-core smoke test), --fake-gpu (a modelled H200)
    "gpu": dict(layers=32, chunk_mib="128", rooms=8, chunks=2, repeat=3, latency_rooms=100, timeout=300.0, **_CASES),
    "quick": dict(layers=4, chunk_mib="8", rooms=2, chunks=2, repeat=2, latency_rooms=20, timeout=300.0, **_CASES),
    "model": dict(layers=32, chunk_mib="128,32", rooms=8, chunks=2, repeat=3, latency_rooms=100, timeout=300.0, page_kib="16",
                  patterns="random", tp="1", parts="broker,raw-staged,latency")}
WARM_ROOMS = 4  # untimed 1-page rooms per KV kind before the latency samples
NA_CPU = "not applicable on CPU (the targets are for one H100)"
LABELS = {"kvbroker": "1 kvbroker", "raw-pages": "2 raw NIXL, 1 descriptor/page",
          "raw-staged": "3 raw gather->WRITE->scatter", "raw-one": "4 raw NIXL, 1 descriptor", "copy": "5 copy_"}


@dataclass
class Geometry:
    """One page size: a chunk is ``chunk_pages`` pages of every region; rooms x chunks a sample."""
    regions: int
    page_bytes: int
    chunk_pages: int
    chunks: int  # per room
    rooms: int
    scale: int = 1  # modelled bytes per real byte (a modelled GPU)

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

    def chunks(self, cp: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(src, dst) pages of every chunk, in the order kvbroker sends them (chunk-major)."""
        rooms, pages = self.src.shape
        return [(self.src[r, c : c + cp], self.dst[r, c : c + cp]) for c in range(0, pages, cp) for r in range(rooms)]


def make_plan(geo: Geometry, pattern: str, seed: int) -> Plan:
    """Every pool page once per side: random pages, or rooms of contiguous pages, shuffled."""
    rng, n, shape = np.random.default_rng(seed), geo.pool_pages, (geo.rooms, geo.room_pages)
    if pattern == "random":
        return Plan(rng.permutation(n).reshape(shape), rng.permutation(n).reshape(shape))
    runs = np.arange(geo.room_pages)[None, :]
    return Plan(*(rng.permutation(geo.rooms)[:, None] * geo.room_pages + runs for _ in range(2)))


def page_descs(base: int, shape: Shape, pages: np.ndarray, dev: int) -> np.ndarray:
    """N x 3 (address, bytes, device): one descriptor per page of every region, region-major."""
    regions, pool, page = shape
    rows = np.arange(regions, dtype=np.uint64)[:, None] * np.uint64(pool) + pages.astype(np.uint64)
    out = np.empty((rows.size, 3), dtype=np.uint64)
    out[:, 0] = rows.ravel() * np.uint64(page) + np.uint64(base)
    out[:, 1], out[:, 2] = page, dev
    return out


@dataclass
class Engines:
    """A prefill group (tp ranks, all on the prefill broker) and a decode rank of tp 1 on the decode broker."""
    prefill: h.Group
    decode: h.Group

    @classmethod
    def register(cls, held: h.Held, brokers: Sequence[Any], model: Any, tp: int, pages: int, device: str,
                 prepare: Callable[[Any], None] | None = None) -> Engines:
        """``prepare(memory)`` runs on each rank's memory (the prefill's filled) before it registers."""
        return cls(held.group(brokers[0].address, "prefill", model, pages, tp=tp, device=device, seed=7, prepare=prepare),
                   held.group(brokers[1].address, "decode", model, pages, device=device, prepare=prepare))

    def zero_decode(self) -> None:
        memory = self.decode.memories[0]
        for layer in memory.k:
            for t in memory.kv_tensors(layer):
                t.zero_()
        h.sync(memory.raw.device)

    def move(self, ids: list[int], plan: Plan, cp: int, timeout: float) -> float:
        """The rooms of ``plan``, ``cp`` pages a chunk: first ExpectRoom to last SUCCESS (of the decode side), s."""
        ref, decode, room_pages = self.prefill.ref(), self.decode.engines[0], plan.src.shape[1]
        t0 = time.perf_counter()
        decode.expect([ExpectSpec(room, ref, plan.dst[i]) for i, room in enumerate(ids)])
        senders = [[engine.sender(room) for room in ids] for engine in self.prefill.engines]
        for s in (s for row in senders for s in row):
            s.init(num_pages=room_pages)
        for c in range(0, room_pages, cp):
            for engine, row in zip(self.prefill.engines, senders, strict=True):
                engine.send([(s, plan.src[i, c : c + cp]) for i, s in enumerate(row)])
        statuses = decode.wait(ids, timeout_seconds=timeout)
        seconds = time.perf_counter() - t0
        h.failed_rooms("kvbroker", statuses)
        return seconds


@dataclass
class Measure:
    """One method of one case: how to take a sample (zero, time, check), and its samples."""
    method: str
    nbytes: int
    zero: Callable[[], Any]
    sample: Callable[[], float]
    check: Callable[[], None]
    kib: int = 0  # 0: all cases (the same bytes)
    pattern: str = ""
    tp: int = 0  # 0: a raw path
    pids: Sequence[int] = ()  # the brokers: their CPU seconds per sample
    chunk_mib: int = 0
    #: What the brokers counted (parts, device launches, peer RPCs but heartbeats), read around a sample.
    counts: Callable[[], tuple[int, int, int]] | None = None
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    cpu_roles: list[Counter[str]] = field(default_factory=list)
    counted: list[tuple[int, int, int]] = field(default_factory=list)
    #: Each part's times (raw staged: what the raw loop recorded, as ``PART_HOPS`` names them).
    hops: list[dict[str, float]] = field(default_factory=list)
    gpus: int = 1  # engine pairs, one per GPU, moving at once

    @property
    def case(self) -> str:
        if not self.kib:
            return "all cases (same bytes)"
        return f"{self.kib} KiB {self.pattern} {self.chunk_mib} MiB " + (f"tp{self.tp}->tp1" if self.tp else "(tp1 bytes)") + (
            f" x{self.gpus} GPUs" if self.gpus > 1 else "")

    def gbps(self, how: str = "median") -> float:
        return self.nbytes / (min(self.seconds) if how == "best" else statistics.median(self.seconds)) / 1e9

    def once(self, record: bool) -> None:
        """Zero the destination, take one sample, check its bytes; keep it if ``record``."""
        self.zero()
        n0 = self.counts() if self.counts else (0, 0, 0)  # (GetStats, outside the CPU window: it scans every room)
        cpu0 = self.roles()
        seconds = self.sample()
        cpu = self.roles()
        n1 = self.counts() if self.counts else (0, 0, 0)
        self.check()
        if record:
            self.seconds.append(seconds)
            cpu.subtract(cpu0)
            self.cpu.append(sum(cpu.values()) - cpu["fake-gpu"])  # (a modelled GPU's copies stand in for the GPU's work)
            self.cpu_roles.append(cpu)
            self.counted.append((n1[0] - n0[0], n1[1] - n0[1], n1[2] - n0[2]))

    def roles(self) -> Counter[str]:
        """CPU seconds of the brokers' threads so far, by role (to the nanosecond)."""
        return sum((Counter(h.thread_cpu_seconds(pid)) for pid in self.pids), Counter())

    def per_part(self) -> str:
        """The brokers' CPU, device launches and peer RPCs per part (medians), as a note."""
        parts = statistics.median(c[0] for c in self.counted) if self.counted else 0
        if not parts:
            return f"brokers' CPU {statistics.median(self.cpu) * 1e3:.0f} ms/sample"
        roles = ", ".join(f"{r} {statistics.median(c[r] for c in self.cpu_roles) / parts * 1e6:.0f}" for r in h.THREAD_ROLES)
        return (f"per part: brokers' CPU {statistics.median(self.cpu) / parts * 1e6:.0f} us ({roles}), launches "
                f"{statistics.median(c[1] for c in self.counted) / parts:.2f}, peer RPCs {statistics.median(c[2] for c in self.counted) / parts:.3f}")


def run(a: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    """Measure what ``a`` asks for into ``held.result`` (filled as it goes)."""
    done: list[Measure] = []
    latency: dict[str, list[float]] = {}
    res = held.result
    in_flight: dict[int, int] = {}  # parts in flight per pair, by part size
    res.update(args=a, done=done, latency=latency, in_flight=in_flight)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    env, vram, kv_device = None, [None] * a.gpus, a.device  # vram[i]: makes an engine's memory fake VRAM of GPU i
    if a.model:  # a modelled GPU: fake VRAM (host memory) whose copies and writes finish when the model says
        a.model = f"{a.model},byte_scale={a.scale},timelines={held.workdir / 'gpu-timelines'}"
        env = {**os.environ, FAKE_GPUS_ENV: str(a.gpus), MODEL_ENV: a.model + ",host=0"}
        fake = FakeCudaLib(devices=a.gpus, granularity=GRANULARITY)
        vram, kv_device = [functools.partial(as_fake_vram, fake=fake, device=i) for i in range(a.gpus)], "cpu"
        res["gpu_model"] = ModelSetting.parse(a.model).model
    spans = OtlpReceiver() if not a.no_hops else None  # each part's hops, from the brokers' spans
    if spans is not None:
        held.defer("stopping the span receiver", spans.stop)
        env = {**(env or os.environ), "OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_ENDPOINT": spans.endpoint,
               "OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_BSP_MAX_QUEUE_SIZE": "65536",  # a share of the rooms traced:
               "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": str(a.traced)}  # (spans cost CPU)
    name = (torch.cuda.get_device_name(device) if device.type == "cuda" else "a MODELLED GPU (no GPU: "
            f"{a.model})" if a.model else f"no GPU: host CPU {platform.machine()}, {os.cpu_count()} cores")
    held.say(f"gpu_bench on {name}; torch {torch.__version__}; UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")
    held.say(f"command: {shlex.join([sys.executable, *sys.argv])}")
    held.say(f"cases: page KiB {a.page_kib} x {a.patterns} x prefill tp {a.tp} into decode tp 1, chunks of "
             f"{a.chunk_mib} MiB; parts: {', '.join(a.parts)}")
    held.say(f"model: {a.layers} layers x K,V = {2 * a.layers} regions, {h.KV_HEADS} KV heads, bfloat16; {a.rooms} rooms x "
             f"{a.chunks} chunks; raw staged: {a.slots} slots; kvbroker: transfer buffers of {a.buffer_parts or 'a default 1 GiB of'} parts; best/median of {a.repeat} "
             f"samples after 1 warm-up; {a.latency_rooms} 1-page rooms per KV kind, {a.page_kib[0]} KiB pages"
             + (f"; 1 real byte stands for {a.scale} (pages keep their count, GB/s are modelled bytes)" if a.model else ""))
    held.say("compare within this run, as ratios; this machine is noisy\n")
    ids = itertools.count(secrets.randbits(40) << 20)  # room ids

    def model(kib: int) -> Any:
        if a.model:  # one token a page, as wide as the page's real bytes
            return h.model_spec(a.layers, head_dim=(kib << 10) // a.scale // (h.KV_HEADS * 2), page_size=1)
        return h.model_spec(a.layers, head_dim=a.head_dim, page_size=(kib << 10) // (h.KV_HEADS * a.head_dim * 2))

    def repeat(measures: Sequence[Measure]) -> None:
        done.extend(measures)
        for rep in range(-1, a.repeat):  # -1: the untimed warm-up
            for m in measures:
                m.once(record=rep >= 0)

    for chunk_mib in a.chunk_mib:
        geos = {kib: Geometry(2 * a.layers, (kib << 10) // a.scale, chunk_mib * h.MIB // (2 * a.layers << 10) // kib,
                              a.chunks, a.rooms, a.scale) for kib in a.page_kib}
        slot = max(g.chunk_bytes for g in geos.values())
        part = -(-slot // 4096) * 4096  # a chunk fits one part
        in_flight[chunk_mib] = a.buffer_parts or max(2, BrokerConfig.device_send_bytes // (part * a.scale))  # as users get
        broker_args = ["--device-buffer-mib", repr(in_flight[chunk_mib] * part / h.MIB), "--device-part-mib", repr(part / h.MIB),
                       "--log-level", "warning", *(["--verify-checksums"] if a.checksums else []),
                       # the self-test's floor in real bytes (20 GB/s of modelled bytes)
                       *(["--transport-floor-gbps", repr(20 / a.scale)] if a.model else [])]
        held.say(f"{chunk_mib} MiB chunks: brokers: 2 x kvbroker serve --listen 127.0.0.1:0 ... {shlex.join(broker_args)}")
        for kib, g in geos.items():
            held.say(f"  {kib} KiB pages: chunk {g.chunk_pages} pages x {g.regions} regions = {g.chunk_bytes * a.scale / h.MIB:g} "
                     f"MiB, room {g.room_pages} pages, sample {g.payload / h.MIB:g} MiB = {g.regions * g.pool_pages} page descriptors")
        payload = max(g.payload for g in geos.values())
        names, brokers = [f"prefill-{chunk_mib}", f"decode-{chunk_mib}"], []
        if a.gpus > 1:  # a host of GPUs per broker: the two brokers on two modelled hosts
            brokers = held.start_brokers(names[:1], broker_args, env) + held.start_brokers(names[1:], broker_args, {
                **(env or {}), MODEL_ENV: a.model + ",host=1"})
        elif {"broker", "latency"} & set(a.parts):
            brokers = held.start_brokers(names, broker_args, env)
        for b in reversed(brokers):  # e.g. vram_transfer_at_host_speed: GPU memory moved like a host copy
            held.defer("reading the broker logs", lambda b=b: held.say(f"broker {b.name} warnings: "
                                            f"{', '.join(f'{e} x{n}' for e, n in sorted(b.warnings().items())) or 'none'}"))
        pids = [b.process.pid for b in brokers]

        def counts(brokers: list[Any] = brokers) -> tuple[int, int, int]:
            stats = [b.stats() for b in brokers]
            return (stats[0].transfers_packed, sum(s.device_launches for s in stats),
                    sum(n for s in stats for m, n in s.peer_calls_answered.items() if m != "Ping"))
        raw = RawPeer(held, device, payload, slot_bytes=slot, slots=a.slots, seed=a.seed, model=a.model) \
            if {"raw-pages", "raw-staged", "raw-one"} & set(a.parts) else None
        if chunk_mib == a.chunk_mib[0]:
            repeat(ceilings(a, raw, device, payload))
        for kib, geo in geos.items():
            engines = {tp: [Engines.register(held, brokers, model(kib), tp, geo.pool_pages, kv_device, vram[i])
                            for i in range(a.gpus)] for tp in (a.tp if "broker" in a.parts else ())}  # an engine pair per GPU
            for pattern in a.patterns:
                repeat(case_measures(a, raw, engines, geo, kib, pattern, ids, pids, chunk_mib, counts))
                held.say(f"  measured: {kib} KiB {pattern}, {chunk_mib} MiB chunks")
            held.release(*(g for pairs in engines.values() for eng in pairs for g in (eng.prefill, eng.decode)))
        if "latency" in a.parts and chunk_mib == a.chunk_mib[0]:
            kinds = ((f"on {a.device}", a.device, None), ("in DRAM", "cpu", None)) if not a.model else \
                (("on the modelled GPU", "cpu", vram[0]), ("in DRAM", "cpu", None))
            pairs = {key: Engines.register(held, brokers, model(a.page_kib[0]), 1, a.latency_rooms + WARM_ROOMS, dev, prep)
                     for key, dev, prep in kinds}
            latency.update(one_page_rooms(pairs, a.latency_rooms, ids, a.timeout))
    if spans is not None:
        time.sleep(1.0)  # the last spans' export
        res["hops"] = part_times(spans.spans())
    return res


def report_hops(res: dict[str, Any]) -> None:
    """One line per hop: the median in us, kvbroker's and the raw loop's, per part size."""
    a = res["args"]
    cols = [(f"kvbroker {size * a.scale / h.MIB:g} MiB", parts) for size, parts in sorted(res.get("hops", {}).items(), reverse=True)]
    cols += [(f"raw {m.chunk_mib} MiB", m.hops) for m in res["done"] if m.method == "raw-staged" and m.hops]
    if not cols:
        return
    print(f"\nper hop, median us (parts: {', '.join(f'{n} {len(p)}' for n, p in cols)}, kvbroker's of the {a.traced:.0%} of rooms "
          "traced; GPU time is in gather, write, scatter)")
    print(f"  {'hop':44}" + "".join(f"{n:>20}" for n, _ in cols))
    for hop, start, end in PART_HOPS:
        cells = [[(t[end] - t[start]) * 1e6 for t in parts if start in t and end in t] for _, parts in cols]
        print(f"  {hop:44}" + "".join(f"{statistics.median(c):20.0f}" if c else f"{'-':>20}" for c in cells))


def ceilings(a: argparse.Namespace, raw: RawPeer | None, device: Any, payload: int) -> list[Measure]:
    """The ceilings of ``payload`` bytes: a device copy, one NIXL write of it all."""
    out = []
    if "copy" in a.parts:
        src = raw.src if raw else pattern_bytes(a.seed, payload, device)
        dst = torch.empty_like(src)

        def copy() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            h.sync(device)
            return time.perf_counter() - t0

        def check() -> None:
            if wrong := differs(dst, src, (1, payload, 1), None):
                raise h.BenchFailed(f"copy: byte mismatch: {wrong}")
        out.append(Measure("copy", payload, dst.zero_, copy, check))
    if raw and "raw-one" in a.parts:
        work = [(raw.one(raw.src.data_ptr(), payload), raw.one(raw.dst_ptr, payload))]
        out.append(Measure("raw-one", payload * a.scale, lambda: raw.call("zero"), lambda: raw.post_all(work, "raw one", a.timeout)[0],
                           lambda: raw.check("raw one", (1, payload, 1), None)))
    return out


def broker_measure(a: argparse.Namespace, pairs: Sequence[Engines], plan: Plan, geo: Geometry, case: tuple[int, str, int],
                   ids: Iterator[int], pids: Sequence[int], chunk_mib: int, counts: Callable[[], tuple[int, int, int]]) -> Measure:
    """kvbroker on ``pairs``, one engine pair per GPU, each moving ``plan``'s rooms, all at once; ``case``: (page KiB,
    pattern, tp). A sample: one pair's own clock (:meth:`Engines.move`), or the wall time of them all."""
    (kib, pattern, tp), pages = case, (plan.src, plan.dst)

    def sample() -> float:
        rooms = [list(itertools.islice(ids, a.rooms)) for _ in pairs]
        if len(pairs) == 1:
            return pairs[0].move(rooms[0], plan, geo.chunk_pages, a.timeout)
        with ThreadPoolExecutor(len(pairs)) as pool:
            t0 = time.perf_counter()
            list(pool.map(lambda e, r: e.move(r, plan, geo.chunk_pages, a.timeout), pairs, rooms))
            return time.perf_counter() - t0

    def check() -> None:
        for i, e in enumerate(pairs):
            h.check_kv(f"kvbroker {kib} KiB {pattern} tp{tp}" + (f" GPU {i}" if len(pairs) > 1 else ""), e.prefill, e.decode, *pages)
    return Measure("kvbroker", geo.payload * geo.scale * len(pairs), lambda: [e.zero_decode() for e in pairs], sample, check,
                   *case, pids, chunk_mib, counts, gpus=len(pairs))


def case_measures(a: argparse.Namespace, raw: RawPeer | None, engines: dict[int, list[Engines]], geo: Geometry, kib: int,
                  pattern: str, ids: Iterator[int], pids: Sequence[int], chunk_mib: int,
                  counts: Callable[[], tuple[int, int, int]]) -> list[Measure]:
    """kvbroker for each tp (a pair per GPU) and the raw paths, of one page size, pattern and chunk size (indices uploaded)."""
    plan = make_plan(geo, pattern, a.seed + kib)
    chunks, pages, case, nbytes = plan.chunks(geo.chunk_pages), (plan.src, plan.dst), (kib, pattern), geo.payload * geo.scale
    out = [broker_measure(a, pairs, plan, geo, (*case, tp), ids, pids, chunk_mib, counts) for tp, pairs in engines.items()]
    if raw and "raw-pages" in a.parts:
        work = [(raw.descs(page_descs(raw.src.data_ptr(), geo.shape, s, raw.dev)),
                 raw.descs(page_descs(raw.dst_ptr, geo.shape, d, raw.dev))) for s, d in chunks]
        out.append(Measure("raw-pages", nbytes, lambda: raw.call("zero"), lambda: raw.post_all(work, "raw pages", a.timeout)[0],
                           lambda: raw.check("raw pages", geo.shape, pages), *case, chunk_mib=chunk_mib))
    if raw and "raw-staged" in a.parts:
        sidx = [torch.from_numpy(s).to(raw.device) for s, _ in chunks]
        raw.call("plan", geo.shape, [d for _, d in chunks])
        h.sync(raw.device)
        m = Measure("raw-staged", nbytes, lambda: raw.call("zero"), lambda: raw.staged(geo.shape, geo.chunk_bytes, sidx, a.timeout, m.hops),
                    lambda: raw.check("raw staged", geo.shape, pages), *case, chunk_mib=chunk_mib)
        out.append(m)
    return out


def one_page_rooms(pairs: dict[str, Engines], n: int, ids: Iterator[int], timeout: float) -> dict[str, list[float]]:
    """Seconds of ``n`` sequential 1-page rooms per engine pair, interleaved, after warm-ups."""
    rng, warm = np.random.default_rng(3), WARM_ROOMS
    plans = {k: Plan(rng.integers(0, n + warm, (n + warm, 1)), rng.permutation(n + warm)[:, None]) for k in pairs}
    out: dict[str, list[float]] = {k: [] for k in pairs}
    for i in range(n + warm):
        for key, eng in pairs.items():
            seconds = eng.move([next(ids)], Plan(plans[key].src[i : i + 1], plans[key].dst[i : i + 1]), 1, timeout)
            if i >= warm:
                out[key].append(seconds)
    for key, eng in pairs.items():
        h.check_kv(f"1-page rooms, KV {key}", eng.prefill, eng.decode, plans[key].src, plans[key].dst)
    return out


def report(res: dict[str, Any]) -> None:
    a, latency, gpu = res["args"], res["latency"], res.get("gpu_model")
    done: list[Measure] = [m for m in res["done"] if m.seconds]
    by, ideal = {(m.method, m.kib, m.pattern, m.tp, m.chunk_mib): m for m in done}, {}
    print(f"\n{'case':36} {'method':31} {'MiB':>6} {'best GB/s':>9} {'median GB/s':>11}  notes")
    for m in sorted(done, key=lambda m: m.kib == 0):
        note = ""
        if m.method == "kvbroker":
            staged = by.get(("raw-staged", m.kib, m.pattern, 0, m.chunk_mib))
            note = f"x{m.gbps() / staged.gbps():.2f} of raw staged; " if staged else ""
            note += m.per_part()
        label = LABELS[m.method] + (" (memcpy)" if m.method == "copy" and a.device == "cpu" else "")
        print(f"{m.case:36} {label:31} {m.nbytes / h.MIB:6.0f} {m.gbps('best'):9.2f} {m.gbps():11.2f}  {note}")
    for chunk in a.chunk_mib if gpu else ():
        part = 2 * a.layers * (chunk * h.MIB // (2 * a.layers << 10) // a.page_kib[0]) * (a.page_kib[0] << 10) // a.scale
        gbps, bound = gpu.ideal_gbps(part, res["in_flight"][chunk], one_gpu=a.gpus == 1)
        ideal[chunk] = gbps * a.gpus
        print(f"{f'the model, {chunk} MiB parts, {a.gpus} GPU(s)':36} {'0 ideal pipeline (its limit)':31} {'':6} {gbps * a.gpus:9.2f} "
              f"{gbps * a.gpus:11.2f}  bound by {bound}" + (" of each GPU" if a.gpus > 1 else ""))
    print("raw rows move the bytes of the tp1->tp1 case; tp2->tp1 moves as many into decode")
    lat = {k: (statistics.median(v) * 1e3, h.percentile(v, 0.9) * 1e3) for k, v in latency.items()}
    for key, (med, p90) in lat.items():
        print(f"1-page room, KV {key:19} median {med:7.2f} ms  p90 {p90:7.2f} ms  (n={len(latency[key])})")
    vram, dram = lat.get("on the modelled GPU" if gpu else f"on {a.device}"), lat.get("in DRAM")
    if vram and dram:
        print(f"1-page room, KV {'on the modelled GPU' if gpu else 'on ' + a.device} / KV in DRAM (medians): {vram[0] / dram[0]:.2f}")
    if gpu:
        print(f"the modelled GPU: {gpu.text()}")
    report_hops(res)
    if res["failures"]:
        return
    na = a.device == "cpu" and not gpu
    print(f"\ntargets, from this run's medians{': ' + NA_CPU if na else ' (on the model: issue 40)' if gpu else ''}")
    met = []

    def target(text: str, value: float | None, limit: float, at_most: bool = False) -> None:
        if value is not None:
            met.append(value <= limit if at_most else value >= limit)
        verdict = ("not measured in this run" if value is None else "not applicable on CPU" if na
                   else "MET" if met[-1] else "NOT MET")
        print(f"  {text}: {'-' if value is None else f'{value:.2f}'} -> {verdict}")

    def ratio(x: Measure | None, y: Measure | None) -> float | None:
        return x.gbps() / y.gbps() if x and y else None

    main = by.get(("kvbroker", 16, "random", 1, a.chunk_mib[0]))
    size = f" (ran {a.chunk_mib[0]} MiB, {a.layers} layers)" if (a.chunk_mib[0], a.layers) != (128, 32) else ""
    if not gpu:
        target(f"kvbroker GB/s >= 150, 16 KiB random tp1->tp1, 128 MiB chunks{size}", main.gbps() if main else None, 150)
    for (method, kib, pattern, tp, chunk), m in by.items():
        if method == "kvbroker" and a.gpus > 1:
            target(f"kvbroker on {a.gpus} GPUs / the modelled host's limit >= 0.9, {m.case}", m.gbps() / ideal[chunk], 0.9)
        elif method == "kvbroker":
            target(f"kvbroker / raw gather-write-scatter >= 0.8, {m.case}", ratio(m, by.get(("raw-staged", kib, pattern, 0, chunk))), 0.8)
        if method == "kvbroker" and tp == 2:
            target(f"head slices / equal tp >= 0.7, {kib} KiB {pattern} {chunk} MiB", ratio(m, by.get((method, kib, pattern, 1, chunk))), 0.7)
    target("1-page room, VRAM / DRAM <= 1.2 (medians)", vram[0] / dram[0] if vram and dram else None, 1.2, at_most=True)
    if not na:
        print(f"  {sum(met)} of {len(met)} measured targets met")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--fake-gpu", action="store_true", help="on a MODELLED GPU (--model; no GPU needed): the defaults below after 'model:'")
    add("--model", help=f"the modelled GPU: {', '.join(MODELS)}[,field=value...] (default h200; kvbroker.testing.gpu_model)")
    add("--gpus", type=int, default=1, help="on a modelled GPU: GPUs per broker, an engine pair on each (default model h200-400g)")
    add("--scale", type=int, default=1024, help="on a modelled GPU: modelled bytes per real byte (pages keep their count)")
    add("--device", default="cuda:0", help="cuda:N, or cpu: the smoke test on host memory")
    add("--quick", action="store_true", help=f"small defaults: {PROFILES['quick']}")
    add("--layers", type=int, help="layers, each a K and a V region (default 32)")
    add("--page-kib", help="page sizes per layer region, KiB (comma list; default 16,4; model: 16)")
    add("--patterns", help="page patterns (comma list; default random,contiguous; model: random)")
    add("--tp", help="prefill tp sizes (1, 2) into decode tp 1 (comma list; default 1,2; model: 1)")
    add("--chunk-mib", help="MiB per chunk and part, all regions (comma list; default 128; model: 128,32)")
    add("--chunks", type=int, help="chunks per room (default 2)")
    add("--rooms", type=int, help="rooms per sample, all in flight (default 8)")
    add("--slots", type=int, default=4, help="transfer slots of the raw staged path")
    add("--buffer-parts", type=int, help="parts each of a broker's transfer buffers holds (default: as many as its default 1 GiB holds)")
    add("--head-dim", type=int, default=128)
    add("--repeat", type=int, help="timed samples per measurement, after one warm-up (default 3)")
    add("--latency-rooms", type=int, help="sequential 1-page rooms per KV kind (default 100)")
    add("--parts", help=f"what to measure: {', '.join(PARTS)} (default all; model: broker, raw-staged, latency)")
    add("--checksums", action="store_true", help="brokers run with --verify-checksums")
    add("--timeout", type=float, help="seconds one sample may take (default 300)")
    add("--seed", type=int, default=1)
    add("--keep-logs", action="store_true", help="keep the brokers' logs (their directory is printed)")
    add("--no-hops", action="store_true", help="no per-hop figures (they need the brokers to export their spans)")
    add("--traced", type=float, default=0.25, help="the share of rooms whose spans give the per-hop figures")
    a = p.parse_args(argv)
    a.model = a.model or (("h200-400g" if a.gpus > 1 else "h200") if a.fake_gpu else None)
    if a.gpus > 1 and (not a.model or not {"raw-pages", "raw-staged", "raw-one", "copy", "latency"}.isdisjoint((a.parts or "broker").split(","))):
        p.error("--gpus: on a modelled GPU (--fake-gpu), and --parts broker only")
    a.parts = a.parts or ("broker" if a.gpus > 1 else None)
    for key, value in PROFILES["quick" if a.quick else "model" if a.model else "gpu"].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.scale = max(1, a.scale) if a.model else 1
    if a.model:
        a.device = "cpu"
        if a.model.split(",")[0] not in MODELS:
            p.error(f"--model {a.model}: presets {', '.join(MODELS)}")
        if not {"raw-pages", "copy"}.isdisjoint(a.parts.split(",")):
            p.error("--model: the parts it models are broker, raw-staged, raw-one, latency")
    a.page_kib, a.tp, a.chunk_mib = ([int(x) for x in v.split(",")] for v in (a.page_kib, a.tp, a.chunk_mib))
    a.patterns, a.parts = a.patterns.split(","), a.parts.split(",")
    if not (set(a.patterns) <= {"random", "contiguous"} and set(a.tp) <= {1, 2} and set(a.parts) <= set(PARTS)):
        p.error(f"--patterns: random, contiguous; --tp: 1, 2; --parts: {', '.join(PARTS)}")
    token = h.KV_HEADS * (a.head_dim if not a.model else 1) * 2
    for kib in a.page_kib:
        if (kib << 10) % (token * a.scale) or min(a.chunk_mib) * h.MIB < 2 * a.layers * (kib << 10):
            p.error(f"--page-kib {kib}: not whole tokens of {token} B (real bytes, 1 for every {a.scale}), or more than a chunk")
    if a.device != "cpu" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch sees no CUDA device; --device cpu is the smoke test, --fake-gpu a modelled GPU")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    return h.bench_main("gpu_bench", a, lambda held: run(a, held), report)


if __name__ == "__main__":
    sys.exit(main())

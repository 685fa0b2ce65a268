"""The device data path: kvbroker moving VRAM KV pages against its baselines, on one GPU; and, with
``--fake-gpu``, what the device path's packed parts cost the brokers, on CPU.

    python bench/gpu_bench.py                         # cuda:0: the whole matrix and the targets
    python bench/gpu_bench.py --device cpu --quick    # smoke test without a GPU (host memory, small)
    python bench/gpu_bench.py --fake-gpu --repeat 7   # the device path's own cost on CPU (--checksums)

On a GPU. A sample moves ``--rooms`` rooms x ``--chunks`` chunks of ``--chunk-mib`` MiB (the same pages of
2 x ``--layers`` K/V regions, 8 KV heads, bfloat16, ``--page-kib`` KiB a page and region; pages random or
contiguous, independent on each side). Per case (page size x pattern x tp) and method: payload / wall
seconds, best and median of ``--repeat`` samples after a warm-up, the methods of a case interleaved:

1 kvbroker    two ``kvbroker serve`` (a chunk fits ``--device-part-mib``), engines registered from this
              process on ``--device``; tp2->tp1: two prefill ranks (half the heads each): head slices.
              From the first ExpectRoom to the last SUCCESS the decode engine sees.
2 raw pages   bare NIXL (UCX, no progress thread) into a spawned target (the harness's ``RawPeer``), one
              descriptor per page and region (what engines' NIXL connectors post), a transfer per chunk.
3 raw staged  gather (index_select on its own stream) into one of ``--slots`` slots -> one WRITE with a
              notification -> scatter (index_copy_) at the target -> the slot comes back; index tensors
              uploaded before the clock; to the target's last scatter.
4 raw one     one descriptor of the whole payload: the NIXL ceiling.
5 copy        torch ``copy_`` of the payload on the device: the HBM ceiling (memcpy on a host).

Raw rows move the tp1->tp1 case's bytes. Also 1-page room latency (median, p90), KV on ``--device`` vs in
DRAM. Every sample's bytes are checked on the device (a difference, failed room or transfer exits 1). Read
ratios within one run; the targets at the end, from this run's medians, are for one H100.

On fake GPUs (``--fake-gpu``; ``--help`` marks its options; the setup: docs/benchmarks.md). Engines here hand
two fake-GPU brokers fake VRAM (``as_fake_vram``) or DRAM, and chunks of one shape move both ways:

1 per part   ``--rooms`` x ``--chunks`` 1-page chunks (``--layers`` x K,V regions of ``--page-tokens``
             tokens: no copy counts), all in flight, packed and DRAM samples interleaved after a warm-up.
             Per sample and broker, first ExpectRoom to last SUCCESS: CPU by thread role, GetStats counters.
2 part size  as 1, packed, chunks of ``--big-chunk-pages`` pages: launches per part must not grow.
3 throughput kvbroker on fake VRAM (``--tput-*``) against method 3 above on host tensors.

These say what the brokers' Python costs per part on this host's CPUs, not what a GPU moves.
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
from dataclasses import dataclass, field
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"  # before NIXL loads: here, in the raw target, in the brokers

import harness as h
import numpy as np
import torch

from kvbroker.client import ExpectSpec
from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY

PARTS = ("broker", "raw-pages", "raw-staged", "raw-one", "copy", "latency")
PROFILES = {  # defaults: one H100 (what the targets are for), --quick (a 2-core smoke test), --fake-gpu
    "gpu": dict(layers=32, chunk_mib=128, rooms=8, chunks=2, repeat=3, latency_rooms=100, timeout=300.0),
    "quick": dict(layers=4, chunk_mib=8, rooms=2, chunks=2, repeat=2, latency_rooms=20, timeout=300.0),
    "fake": dict(layers=4, rooms=8, chunks=64, repeat=3, timeout=120.0)}
WARM_ROOMS = 4  # untimed 1-page rooms per KV kind before the latency samples
NA_CPU = "not applicable on CPU (the targets are for one H100)"
LABELS = {"kvbroker": "1 kvbroker", "raw-pages": "2 raw NIXL, 1 descriptor/page",
          "raw-staged": "3 raw gather->WRITE->scatter", "raw-one": "4 raw NIXL, 1 descriptor", "copy": "5 copy_"}
SIDES = ("prefill", "decode")
TARGET_CPU_US, TARGET_RATIO = 150.0, 2.5  # --fake-gpu's targets, per packed part
PART_LAUNCHES = 2  # device launches of one packed part on either side, at most, whatever its size


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
        self.shape: h.Shape = (self.regions, self.pool_pages, self.page_bytes)


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


def page_descs(base: int, shape: h.Shape, pages: np.ndarray, dev: int) -> np.ndarray:
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

    def move(self, ids: list[int], plan: Plan, cp: int, timeout: float, both: bool = False) -> float:
        """The rooms of ``plan``, ``cp`` pages a chunk: first ExpectRoom to last SUCCESS (of the decode side), s;
        ``both``: the prefill side must succeed too."""
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
        for engine in self.prefill.engines if both else ():
            h.failed_rooms("kvbroker, the prefill side", engine.wait(ids, timeout_seconds=timeout))
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
    seconds: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    @property
    def case(self) -> str:
        if not self.kib:
            return "all cases (same bytes)"
        return f"{self.kib} KiB {self.pattern} " + (f"tp{self.tp}->tp1" if self.tp else "(tp1 bytes)")

    def gbps(self, how: str = "median") -> float:
        return self.nbytes / (min(self.seconds) if how == "best" else statistics.median(self.seconds)) / 1e9

    def once(self, record: bool) -> None:
        """Zero the destination, take one sample, check its bytes; keep it if ``record``."""
        self.zero()
        cpu0 = sum(h.cpu_seconds(p) for p in self.pids)
        seconds = self.sample()
        cpu = sum(h.cpu_seconds(p) for p in self.pids) - cpu0
        self.check()
        if record:
            self.seconds.append(seconds)
            self.cpu.append(cpu)


def run(a: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    """Measure what ``a`` asks for into ``held.result`` (filled as it goes)."""
    done: list[Measure] = []
    latency: dict[str, list[float]] = {}
    res = held.result
    res.update(args=a, done=done, latency=latency)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    geos = {kib: Geometry(2 * a.layers, kib << 10, a.chunk_mib * h.MIB // (2 * a.layers << 10) // kib, a.chunks, a.rooms)
            for kib in a.page_kib}
    slot = max(g.chunk_bytes for g in geos.values())
    part = -(-slot // h.MIB)  # a chunk rounded up to MiB: it fits one part
    broker_args = ["--device-buffer-mib", str(4 * part), "--device-part-mib", str(part), "--log-level", "warning"]
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"no GPU: host CPU {platform.machine()}, {os.cpu_count()} cores")
    held.say(f"gpu_bench on {name}; torch {torch.__version__}; UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")
    held.say(f"command: {shlex.join([sys.executable, *sys.argv])}")
    held.say(f"brokers: 2 x kvbroker serve --listen 127.0.0.1:0 ... {shlex.join(broker_args)}")
    held.say(f"cases: page KiB {a.page_kib} x {a.patterns} x prefill tp {a.tp} into decode tp 1; parts: {', '.join(a.parts)}")
    held.say(f"model: {a.layers} layers x K,V = {2 * a.layers} regions, {h.KV_HEADS} KV heads x {a.head_dim}, bfloat16; "
             f"{a.rooms} rooms x {a.chunks} chunks; raw staged: {a.slots} slots; best/median of {a.repeat} samples after "
             f"1 warm-up; {a.latency_rooms} 1-page rooms per KV kind, {a.page_kib[0]} KiB pages")
    for kib, g in geos.items():
        held.say(f"  {kib} KiB pages: chunk {g.chunk_pages} pages x {g.regions} regions = {g.chunk_bytes / h.MIB:g} MiB, room "
                 f"{g.room_pages} pages, sample {g.payload / h.MIB:g} MiB = {g.regions * g.pool_pages} page descriptors")
    held.say("compare within this run, as ratios; this machine is noisy\n")
    ids = itertools.count(secrets.randbits(40) << 20)  # room ids
    payload = max(g.payload for g in geos.values())

    def model(kib: int) -> Any:
        return h.model_spec(a.layers, head_dim=a.head_dim, page_size=(kib << 10) // (h.KV_HEADS * a.head_dim * 2))

    def repeat(measures: Sequence[Measure]) -> None:
        done.extend(measures)
        for rep in range(-1, a.repeat):  # -1: the untimed warm-up
            for m in measures:
                m.once(record=rep >= 0)

    brokers = held.start_brokers(["prefill", "decode"], broker_args) if {"broker", "latency"} & set(a.parts) else []
    for b in reversed(brokers):  # e.g. vram_transfer_at_host_speed: GPU memory moved like a host copy
        held.defer("reading the broker logs", lambda b=b: held.say(f"broker {b.name} warnings: "
                                        f"{', '.join(f'{e} x{n}' for e, n in sorted(b.warnings().items())) or 'none'}"))
    pids = [b.process.pid for b in brokers]
    raw = h.RawPeer(held, device, payload, slot_bytes=slot, slots=a.slots, seed=a.seed) \
        if {"raw-pages", "raw-staged", "raw-one"} & set(a.parts) else None
    if "copy" in a.parts:
        src = raw.src if raw else h.pattern_bytes(a.seed, payload, device)
        dst = torch.empty_like(src)

        def copy() -> float:
            t0 = time.perf_counter()
            dst.copy_(src)
            h.sync(device)
            return time.perf_counter() - t0
        repeat([Measure("copy", payload, dst.zero_, copy, lambda: h.require("copy", h.differs(dst, src, (1, payload, 1), None)))])
        del dst
    if raw and "raw-one" in a.parts:
        work = [(raw.one(raw.src.data_ptr(), payload), raw.one(raw.dst_ptr, payload))]
        repeat([Measure("raw-one", payload, lambda: raw.call("zero"), lambda: raw.post_all(work, "raw one", a.timeout)[0],
                        lambda: raw.check("raw one", (1, payload, 1), None))])
    for kib, geo in geos.items():
        engines = {tp: Engines.register(held, brokers, model(kib), tp, geo.pool_pages, a.device)
                   for tp in (a.tp if "broker" in a.parts else ())}
        for pattern in a.patterns:
            repeat(case_measures(a, raw, engines, geo, kib, pattern, ids, pids))
            held.say(f"  measured: {kib} KiB {pattern}")
        held.release(*(g for eng in engines.values() for g in (eng.prefill, eng.decode)))
    if "latency" in a.parts:
        pairs = {key: Engines.register(held, brokers, model(a.page_kib[0]), 1, a.latency_rooms + WARM_ROOMS, dev)
                 for key, dev in ((f"on {a.device}", a.device), ("in DRAM", "cpu"))}
        latency.update(one_page_rooms(pairs, a.latency_rooms, ids, a.timeout))
    return res


def case_measures(a: argparse.Namespace, raw: h.RawPeer | None, engines: dict[int, Engines], geo: Geometry, kib: int,
                  pattern: str, ids: Iterator[int], pids: Sequence[int]) -> list[Measure]:
    """kvbroker for each tp and the raw paths, of one page size and pattern (indices uploaded)."""
    plan = make_plan(geo, pattern, a.seed + kib)
    chunks, pages, case = plan.chunks(geo.chunk_pages), (plan.src, plan.dst), (kib, pattern)
    out = [Measure("kvbroker", geo.payload, eng.zero_decode,
                   lambda e=eng: e.move(list(itertools.islice(ids, a.rooms)), plan, geo.chunk_pages, a.timeout),
                   lambda e=eng, t=tp: h.check_kv(f"kvbroker {kib} KiB {pattern} tp{t}", e.prefill, e.decode, *pages),
                   *case, tp, pids)
           for tp, eng in engines.items()]
    if raw and "raw-pages" in a.parts:
        work = [(raw.descs(page_descs(raw.src.data_ptr(), geo.shape, s, raw.dev)),
                 raw.descs(page_descs(raw.dst_ptr, geo.shape, d, raw.dev))) for s, d in chunks]
        out.append(Measure("raw-pages", geo.payload, lambda: raw.call("zero"), lambda: raw.post_all(work, "raw pages", a.timeout)[0],
                           lambda: raw.check("raw pages", geo.shape, pages), *case))
    if raw and "raw-staged" in a.parts:
        sidx = [torch.from_numpy(s).to(raw.device) for s, _ in chunks]
        raw.call("plan", geo.shape, [d for _, d in chunks])
        h.sync(raw.device)
        out.append(Measure("raw-staged", geo.payload, lambda: raw.call("zero"),
                           lambda: raw.staged(geo.shape, geo.chunk_bytes, sidx, a.timeout),
                           lambda: raw.check("raw staged", geo.shape, pages), *case))
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
    a, latency = res["args"], res["latency"]
    done: list[Measure] = [m for m in res["done"] if m.seconds]
    by = {(m.method, m.kib, m.pattern, m.tp): m for m in done}
    print(f"\n{'case':29} {'method':31} {'MiB':>6} {'best GB/s':>9} {'median GB/s':>11}  notes")
    for m in sorted(done, key=lambda m: m.kib == 0):
        note = ""
        if m.method == "kvbroker":
            staged = by.get(("raw-staged", m.kib, m.pattern, 0))
            note = f"x{m.gbps() / staged.gbps():.2f} of raw staged; " if staged else ""
            note += f"brokers' CPU {statistics.median(m.cpu) * 1e3:.0f} ms/sample"
        label = LABELS[m.method] + (" (memcpy)" if m.method == "copy" and a.device == "cpu" else "")
        print(f"{m.case:29} {label:31} {m.nbytes / h.MIB:6.0f} {m.gbps('best'):9.2f} {m.gbps():11.2f}  {note}")
    print("raw rows move the bytes of the tp1->tp1 case; tp2->tp1 moves as many into decode")
    lat = {k: (statistics.median(v) * 1e3, h.percentile(v, 0.9) * 1e3) for k, v in latency.items()}
    for key, (med, p90) in lat.items():
        print(f"1-page room, KV {key:12} median {med:7.2f} ms  p90 {p90:7.2f} ms  (n={len(latency[key])})")
    vram, dram = lat.get(f"on {a.device}"), lat.get("in DRAM")
    if vram and dram:
        print(f"1-page room, KV on {a.device} / KV in DRAM (medians): {vram[0] / dram[0]:.2f}")
    if res["failures"]:
        return
    print(f"\ntargets, from this run's medians{'' if a.device != 'cpu' else ': ' + NA_CPU}")
    met = []

    def target(text: str, value: float | None, limit: float, at_most: bool = False) -> None:
        if value is not None:
            met.append(value <= limit if at_most else value >= limit)
        verdict = ("not measured in this run" if value is None else "not applicable on CPU" if a.device == "cpu"
                   else "MET" if met[-1] else "NOT MET")
        print(f"  {text}: {'-' if value is None else f'{value:.2f}'} -> {verdict}")

    def ratio(x: Measure | None, y: Measure | None) -> float | None:
        return x.gbps() / y.gbps() if x and y else None

    main = by.get(("kvbroker", 16, "random", 1))
    size = f" (ran {a.chunk_mib} MiB, {a.layers} layers)" if (a.chunk_mib, a.layers) != (128, 32) else ""
    target(f"kvbroker GB/s >= 150, 16 KiB random tp1->tp1, 128 MiB chunks{size}", main.gbps() if main else None, 150)
    for (method, kib, pattern, tp), m in by.items():
        if method == "kvbroker":
            target(f"kvbroker / raw gather-write-scatter >= 0.8, {m.case}", ratio(m, by.get(("raw-staged", kib, pattern, 0))), 0.8)
        if method == "kvbroker" and tp == 2:
            target(f"head slices / equal tp >= 0.7, {kib} KiB {pattern}", ratio(m, by.get((method, kib, pattern, 1))), 0.7)
    target(f"1-page room, KV on {a.device} / KV in DRAM <= 1.5 (medians)", vram[0] / dram[0] if vram and dram else None, 1.5,
           at_most=True)
    if a.device != "cpu":
        print(f"  {sum(met)} of {len(met)} measured targets met")


@dataclass
class Sample:
    """One sample of one kind of rooms: what both brokers spent and counted."""
    parts: int
    seconds: float
    cpu: dict[str, float]  # side -> CPU seconds (its threads)
    roles: dict[str, dict[str, float]]  # side -> thread role -> CPU seconds
    launches: dict[str, int]  # side -> device launches
    rpcs: Counter[str] = field(default_factory=Counter)  # method -> calls, both brokers

    def per_part(self, value: float) -> float:
        return value / self.parts if self.parts else float("nan")


def fake_sample(brokers: Sequence[Any], eng: Engines, what: str, plan: Plan, cp: int, packed: bool, ids: Any,
                timeout: float) -> Sample:
    """Move ``plan``'s rooms in chunks of ``cp`` pages (both sides to SUCCESS), check the bytes; what it cost."""

    def counts() -> dict[str, dict[str, Any]]:
        return {side: {"parts": s.transfers_packed if packed else s.transfers_posted, "launches": s.device_launches,
                       "rpcs": Counter(dict(s.peer_calls_answered))} for side, s in zip(SIDES, (b.stats() for b in brokers))}

    eng.zero_decode()
    rooms = list(itertools.islice(ids, plan.src.shape[0]))
    before, roles0 = counts(), {side: h.thread_cpu_seconds(b.process.pid) for side, b in zip(SIDES, brokers)}
    seconds = eng.move(rooms, plan, cp, timeout, both=True)
    roles1, after = {side: h.thread_cpu_seconds(b.process.pid) for side, b in zip(SIDES, brokers)}, counts()
    h.check_kv(what, eng.prefill, eng.decode, plan.src, plan.dst)
    rpcs: Counter[str] = Counter()
    for side in SIDES:
        rpcs.update(after[side]["rpcs"])
        rpcs.subtract(before[side]["rpcs"])
    roles = {s: {r: roles1[s][r] - roles0[s][r] for r in h.THREAD_ROLES} for s in SIDES}
    return Sample(after["prefill"]["parts"] - before["prefill"]["parts"], seconds, {s: sum(roles[s].values()) for s in SIDES},
                  roles, {s: after[s]["launches"] - before[s]["launches"] for s in SIDES}, +rpcs)


def med(samples: Sequence[Sample], fn: Callable[[Sample], float]) -> float:
    return statistics.median(fn(s) for s in samples)


def run_fake(a: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    out = held.result
    out.update(args=a, part_bytes=2 * a.layers * a.page_tokens * h.KV_HEADS * 128 * 2)
    token = h.KV_HEADS * 128 * 2
    page = a.page_tokens * token
    geo = Geometry(2 * a.layers, page, 1, a.chunks, a.rooms)
    tgeo = Geometry(2 * a.tput_layers, a.tput_page_kib << 10,
                    (a.tput_chunk_mib * h.MIB) // (2 * a.tput_layers * (a.tput_page_kib << 10)), a.tput_chunks, a.tput_rooms)
    part_mib = max(1, -(-tgeo.chunk_bytes // h.MIB))
    args = ["--log-level", "warning", "--device-part-mib", str(part_mib), "--device-buffer-mib", str(4 * part_mib),
            *(["--verify-checksums"] if a.checksums else [])]
    ids = itertools.count(secrets.randbits(40) << 20)
    fake = FakeCudaLib(devices=1, granularity=GRANULARITY)  # the engines' driver, in this process
    vram = functools.partial(as_fake_vram, fake=fake)
    brokers = held.start_brokers(SIDES, args, env={**os.environ, FAKE_GPUS_ENV: "1"})
    for b in brokers:
        if "FAKE GPU" not in b.log_tail(100_000):
            raise h.BenchFailed(f"broker {b.name} does not say it runs on a fake GPU")
    held.defer("reading the broker logs", lambda: out.update(warnings={b.name: b.warnings() for b in brokers}))
    pids = {side: b.process.pid for side, b in zip(SIDES, brokers)}
    held.say(f"gpu_bench --fake-gpu on {platform.machine()}, {os.cpu_count()} cores, no GPU; torch {torch.__version__}; "
             f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}; load average {os.getloadavg()[0]:.2f} (the host's other work "
             "shares these cores)")
    held.say(f"brokers: 2 x {FAKE_GPUS_ENV}=1 kvbroker serve {' '.join(args)} (pids: prefill {pids['prefill']}, decode {pids['decode']})")
    held.say(f"1 per part: {a.rooms} rooms x {a.chunks} chunks of 1 page; {geo.regions} regions x {page} B = "
             f"{geo.chunk_bytes / 1024:g} KiB a part; median of {a.repeat} samples per kind after a warm-up; checksums "
             f"{'on' if a.checksums else 'off'}")

    def cpu() -> dict[str, float]:
        return {side: sum(h.thread_cpu_seconds(pid).values()) for side, pid in pids.items()}

    small = h.model_spec(a.layers, page_size=a.page_tokens)
    packed = Engines.register(held, brokers, small, 1, geo.pool_pages, "cpu", vram)
    dram = Engines.register(held, brokers, small, 1, geo.pool_pages, "cpu")
    c0 = cpu()
    time.sleep(1.0)
    c1 = cpu()
    out["idle"] = {s: c1[s] - c0[s] for s in SIDES}
    ticks0 = {side: h.cpu_seconds(pid) for side, pid in pids.items()}
    plan = make_plan(geo, "random", a.seed)
    kinds = {"packed": (packed, True), "dram": (dram, False)}
    runs: dict[str, list[Sample]] = {k: [] for k in (*kinds, "big")}
    out["runs"] = runs
    for rep in range(-1, a.repeat):
        for kind, (eng, is_packed) in kinds.items():
            s = fake_sample(brokers, eng, f"{kind} 1-page chunks", plan, 1, is_packed, ids, a.timeout)
            if rep >= 0:
                runs[kind].append(s)
        held.say(f"  per part: sample {rep + 1} of {a.repeat}" if rep >= 0 else "  per part: warm-up")
    c2 = cpu()
    out["check"] = {side: (h.cpu_seconds(pid) - ticks0[side], c2[side] - c1[side]) for side, pid in pids.items()}
    # The same rooms and chunks, each chunk big_chunk_pages pages: only the parts' size differs.
    bgeo = Geometry(geo.regions, page, a.big_chunk_pages, a.chunks, a.rooms)
    bplan = make_plan(bgeo, "random", a.seed + 3)
    bigger = Engines.register(held, brokers, small, 1, bgeo.pool_pages, "cpu", vram)
    for rep in range(-1, a.repeat):
        s = fake_sample(brokers, bigger, f"packed {a.big_chunk_pages}-page chunks", bplan, a.big_chunk_pages, True, ids, a.timeout)
        if rep >= 0:
            runs["big"].append(s)
    held.say("  part size: done")
    if a.no_throughput:
        return out
    tmodel = h.model_spec(a.tput_layers, page_size=(a.tput_page_kib << 10) // token)
    teng = Engines.register(held, brokers, tmodel, 1, tgeo.pool_pages, "cpu", vram)
    raw = h.RawPeer(held, torch.device("cpu"), tgeo.payload, slot_bytes=tgeo.chunk_bytes, slots=a.slots, seed=a.seed)
    tplan = make_plan(tgeo, "random", a.seed + 7)
    chunks = tplan.chunks(tgeo.chunk_pages)
    sidx = [torch.from_numpy(s) for s, _ in chunks]
    raw.call("plan", tgeo.shape, [d for _, d in chunks])
    tput: dict[str, list[float]] = {"kvbroker": [], "raw": []}
    out["tput"], out["tgeo"] = tput, tgeo
    for rep in range(-1, a.tput_repeat):
        s = fake_sample(brokers, teng, "throughput", tplan, tgeo.chunk_pages, True, ids, a.timeout)
        raw.call("zero")
        seconds = raw.staged(tgeo.shape, tgeo.chunk_bytes, sidx, a.timeout)
        raw.check("raw staged", tgeo.shape, (tplan.src, tplan.dst))
        if rep >= 0:
            tput["kvbroker"].append(tgeo.payload / s.seconds / 1e9)
            tput["raw"].append(tgeo.payload / seconds / 1e9)
    held.say("  throughput: done")
    return out


def report_fake(out: dict[str, Any]) -> None:
    a, runs = out["args"], out.get("runs", {})
    if not runs.get("packed") or not runs.get("dram"):
        return
    pk, dr, big = runs["packed"], runs["dram"], runs["big"]

    def us(x: float) -> str:
        return f"{x * 1e6:8.0f} us"

    print(f"\n1 per part ({pk[0].parts} packed parts, {dr[0].parts} DRAM chunks a sample; median of {len(pk)}; idle CPU over "
          f"1 s: prefill {out['idle']['prefill'] * 1e3:.0f} ms, decode {out['idle']['decode'] * 1e3:.0f} ms)")
    print(f"  {'broker CPU per part':34} {'packed part':>11} {'DRAM chunk':>11} {'packed/DRAM':>11}")
    ratios = {}
    for side in SIDES:
        p_cpu, d_cpu = (med(x, lambda s, side=side: s.per_part(s.cpu[side])) for x in (pk, dr))
        ratios[side] = (p_cpu, p_cpu / d_cpu if d_cpu else float("nan"))
        print(f"  {side + ' broker (process)':34} {us(p_cpu)} {us(d_cpu)} {ratios[side][1]:10.2f}x")
        for role in h.THREAD_ROLES:
            pr, drr = (med(x, lambda s, side=side, role=role: s.per_part(s.roles[side][role])) for x in (pk, dr))
            if pr or drr:
                print(f"    {'thread ' + role:32} {us(pr)} {us(drr)}")
    if "check" in out:
        print("  (CPU over all of part 1, warm-up included, by /proc/PID/stat ticks vs the threads' schedstat: "
              + ", ".join(f"{side} {t:.2f} s vs {n:.2f} s" for side, (t, n) in out["check"].items()) + ")")
    both_p, both_d = (med(x, lambda s: s.per_part(sum(s.cpu.values()))) for x in (pk, dr))
    print(f"  {'both brokers':34} {us(both_p)} {us(both_d)} {both_p / both_d:10.2f}x")
    wall_p, wall_d = (med(x, lambda s: s.per_part(s.seconds)) for x in (pk, dr))
    print(f"  {'wall per part (sample / parts)':34} {us(wall_p)} {us(wall_d)} {wall_p / wall_d:10.2f}x")

    def rpcs(samples: Sequence[Sample]) -> dict[str, float]:
        return {m: med(samples, lambda s, m=m: s.per_part(s.rpcs.get(m, 0))) for m in sorted({m for s in samples for m in s.rpcs})}

    p_rpc, d_rpc = rpcs(pk), rpcs(dr)
    steady = sum(v for m, v in p_rpc.items() if m != "Ping")
    print("  peer RPCs per part, both brokers: " + "; ".join(
        f"{kind} {sum(r.values()):.3f} ({', '.join(f'{m} {v:.3f}' for m, v in r.items()) or 'none'})"
        for kind, r in (("packed", p_rpc), ("DRAM", d_rpc))))
    launches = {side: med(pk, lambda s, side=side: s.per_part(s.launches[side])) for side in SIDES}
    print(f"  device launches per packed part: prefill {launches['prefill']:.2f}, decode {launches['decode']:.2f} (DRAM chunks: "
          f"{med(dr, lambda s: s.per_part(sum(s.launches.values()))):.2f})")
    big_l = {side: med(big, lambda s, side=side: s.per_part(s.launches[side])) for side in SIDES}
    big_cpu = {side: med(big, lambda s, side=side: s.per_part(s.cpu[side])) for side in SIDES}
    print(f"\n2 part size ({big[0].parts} packed parts of {a.big_chunk_pages} pages, {a.big_chunk_pages * out['part_bytes'] / 1024:g} "
          f"KiB, a sample; median of {len(big)}): launches per part prefill {big_l['prefill']:.2f}, decode {big_l['decode']:.2f} "
          f"(1-page parts: {launches['prefill']:.2f}, {launches['decode']:.2f}); broker CPU per part prefill "
          f"{big_cpu['prefill'] * 1e6:.0f} us, decode {big_cpu['decode'] * 1e6:.0f} us")
    tput = out.get("tput")
    if tput and tput["kvbroker"]:
        kb, raw, g = statistics.median(tput["kvbroker"]), statistics.median(tput["raw"]), out["tgeo"]
        print(f"\n3 throughput ({g.rooms} rooms x {g.chunks} chunks of {g.chunk_pages} pages x {g.regions} regions x "
              f"{g.page_bytes >> 10} KiB = {g.payload / h.MIB:g} MiB, {g.chunk_bytes / h.MIB:g} MiB parts; median (best) of "
              f"{len(tput['raw'])}): kvbroker on fake VRAM {kb:.2f} ({max(tput['kvbroker']):.2f}) GB/s, raw "
              f"gather->WRITE->scatter {raw:.2f} ({max(tput['raw']):.2f}) GB/s: kvbroker / raw {kb / raw:.2f}")
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    print(f"broker warnings: {', '.join(f'{b}: {w}' for b, w in out.get('warnings', {}).items() if w) or 'none'}")
    print("\ntargets on this machine (issue 28), from the medians above:")

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    for side in SIDES:
        cpu, ratio = ratios[side]
        print(f"  {side} broker CPU per packed part <= {TARGET_CPU_US:.0f} us: {cpu * 1e6:.0f} us -> {verdict(cpu * 1e6 <= TARGET_CPU_US)}")
        print(f"  {side} broker, packed part / DRAM chunk <= {TARGET_RATIO}x: {ratio:.2f}x -> {verdict(ratio <= TARGET_RATIO)}")
    print(f"  0 peer RPCs per part in steady state (all but Ping, the heartbeat): {steady:.3f} -> {verdict(steady < 0.01)}")
    # Larger parts launch no more than 1-page ones, nor (without checksums) more than 2 a part
    # (an index upload and an index op): parts that land together share one batch's 4 (the
    # decode's scatter_all), so a side may launch fewer, by how the parts happened to batch.
    cap = 0 if a.checksums else PART_LAUNCHES
    bounded = all(big_l[s] <= max(launches[s], cap) + 0.01 for s in SIDES)
    print(f"  launches per part independent of part size ({a.big_chunk_pages} pages vs 1 page"
          f"{'' if a.checksums else f', or at most {PART_LAUNCHES}'}): {verdict(bounded)}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--fake-gpu", action="store_true", help="the device path's own cost on CPU, on fake GPUs (its options below)")
    add("--device", default="cuda:0", help="cuda:N, or cpu: the smoke test on host memory")
    add("--quick", action="store_true", help=f"small defaults: {PROFILES['quick']}")
    add("--layers", type=int, help="layers, each a K and a V region (default 32; --fake-gpu: of the per-part model, 4)")
    add("--page-kib", default="16,4", help="page sizes per layer region, KiB (comma list)")
    add("--patterns", default="random,contiguous", help="page patterns (comma list)")
    add("--tp", default="1,2", help="prefill tp sizes (1, 2) into decode tp 1 (comma list)")
    add("--chunk-mib", type=int, help="MiB per chunk, all regions (default 128)")
    add("--chunks", type=int, help="chunks per room (default 2; --fake-gpu: 1-page chunks, one part each, 64)")
    add("--rooms", type=int, help="rooms per sample, all in flight (default 8)")
    add("--slots", type=int, default=4, help="transfer slots of the raw staged path")
    add("--head-dim", type=int, default=128)
    add("--repeat", type=int, help="timed samples per measurement, after one warm-up (default 3)")
    add("--latency-rooms", type=int, help="sequential 1-page rooms per KV kind (default 100)")
    add("--parts", default=",".join(PARTS), help=f"what to measure: {', '.join(PARTS)}")
    add("--timeout", type=float, help="seconds one sample may take (default 300; --fake-gpu: 120)")
    add("--seed", type=int, default=1)
    add("--keep-logs", action="store_true", help="keep the brokers' logs (their directory is printed)")
    add("--page-tokens", type=int, default=1, help="--fake-gpu: tokens per page of the per-part model")
    add("--big-chunk-pages", type=int, default=16, help="--fake-gpu: pages per chunk of the part-size check")
    for name, default in (("layers", 4), ("page-kib", 16), ("chunk-mib", 8), ("chunks", 2), ("rooms", 8), ("repeat", 5)):
        add(f"--tput-{name}", type=int, default=default, help=f"--fake-gpu, part 3 (throughput): {name}")
    add("--checksums", action="store_true", help="--fake-gpu: brokers run with --verify-checksums")
    add("--no-throughput", action="store_true", help="--fake-gpu: skip part 3 (throughput)")
    a = p.parse_args(argv)
    for key, value in PROFILES["fake" if a.fake_gpu else "quick" if a.quick else "gpu"].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.fake_gpu:
        return a
    a.page_kib, a.tp = ([int(x) for x in v.split(",")] for v in (a.page_kib, a.tp))
    a.patterns, a.parts = a.patterns.split(","), a.parts.split(",")
    if not (set(a.patterns) <= {"random", "contiguous"} and set(a.tp) <= {1, 2} and set(a.parts) <= set(PARTS)):
        p.error(f"--patterns: random, contiguous; --tp: 1, 2; --parts: {', '.join(PARTS)}")
    token = h.KV_HEADS * a.head_dim * 2
    for kib in a.page_kib:
        if (kib << 10) % token or a.chunk_mib * h.MIB < 2 * a.layers * (kib << 10):
            p.error(f"--page-kib {kib}: not whole tokens of {token} B, or more than a chunk")
    if a.device != "cpu" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch sees no CUDA device; --device cpu is the smoke test")
    return a


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.fake_gpu:
        return h.bench_main("gpu_bench --fake-gpu", a, lambda held: run_fake(a, held), report_fake)
    return h.bench_main("gpu_bench", a, lambda held: run(a, held), report)

if __name__ == "__main__":
    sys.exit(main())

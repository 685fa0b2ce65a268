"""The device data path: kvbroker moving VRAM KV pages against its baselines, on one GPU, one run.

    python bench/gpu_bench.py                       # cuda:0: the whole matrix and the targets
    python bench/gpu_bench.py --device cpu --quick  # smoke test without a GPU (host memory, small)
    python bench/gpu_bench.py --fake-gpu            # the device path's own cost on CPU (gpu_fake.py)

A sample moves ``--rooms`` rooms x ``--chunks`` chunks; a chunk is ``--chunk-mib`` MiB: the same
pages of each of the 2 x ``--layers`` K/V regions (8 KV heads, bfloat16, ``--page-kib`` KiB per
page and region), page lists random or contiguous (a room is one run), independent on each side.
Per case (page size x pattern x tp) and method: payload / wall seconds, best and median of
``--repeat`` samples after an untimed warm-up, the methods of a case interleaved:

1 kvbroker    two ``kvbroker serve`` (prefill, decode; ``--device-part-mib`` fits a chunk), engines
              registered from this process, EngineMemory on ``--device``. tp2->tp1: two prefill
              ranks of one tp-2 group (half the heads each), one decode rank: head slices. From
              the first ExpectRoom to the last SUCCESS seen by the decode engine.
2 raw pages   bare NIXL (UCX, no progress thread) into a spawned target, torch buffers
              (cudaMalloc as VRAM; DRAM on the host), one descriptor per page and region (what
              engines' NIXL connectors post), one transfer per chunk, until all are DONE.
3 raw staged  gather (index_select on a dedicated stream, blocking event) into one of ``--slots``
              slots -> one WRITE into the target's slot with a notification -> scatter
              (index_copy_ on the target's stream) -> the slot comes back with a notification.
              Index tensors uploaded before the clock; timed to the target's last scatter.
4 raw one     one descriptor of the whole payload: the NIXL ceiling.
5 copy        torch ``copy_`` of the payload on the device: the HBM ceiling (memcpy on a host).

Raw rows move the bytes of the tp1->tp1 case (a tp2->tp1 case moves as many into decode). Also
the 1-page room latency (median, p90; KV on ``--device`` vs KV in DRAM, same brokers,
interleaved). Every sample is checked byte for byte (destination pages against source pages, as
uint8, on the device); a difference, a failed room or transfer exits with status 1.

Read ratios within one run (kvbroker / raw staged, tp2 / tp1, VRAM / DRAM): absolute GB/s vary
between runs and hosts, and the 2-core development VM is noisy. The targets at the end come from
this run's medians and are for one H100 (not applicable with --device cpu). UCX_NET_DEVICES=lo.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import secrets
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"  # before NIXL loads: here, in the raw target, in the brokers

import numpy as np
import torch
from common import (
    KV_HEADS,
    BenchFailed,
    cpu_seconds,
    kv_mismatches,
    model_spec,
    percentile,
    release,
)
from gpu_raw import Geometry, Plan, RawPeer, differs, make_plan, pattern_bytes, require, sync

MiB = 1 << 20
PARTS = ("broker", "raw-pages", "raw-staged", "raw-one", "copy", "latency")
PROFILES = {  # defaults: one H100 (what the targets are for), and --quick (a 2-core smoke test)
    "gpu": dict(layers=32, chunk_mib=128, rooms=8, chunks=2, repeat=3, latency_rooms=100),
    "quick": dict(layers=4, chunk_mib=8, rooms=2, chunks=2, repeat=2, latency_rooms=20),
}
WARM_ROOMS = 4  # untimed 1-page rooms per KV kind before the latency samples
NA_CPU = "not applicable on CPU (the targets are for one H100)"
LABELS = {"kvbroker": "1 kvbroker", "raw-pages": "2 raw NIXL, 1 descriptor/page",
          "raw-staged": "3 raw gather->WRITE->scatter", "raw-one": "4 raw NIXL, 1 descriptor",
          "copy": "5 copy_"}


# -- kvbroker -------------------------------------------------------------------------------------


@dataclass
class Rank:
    memory: Any
    client: Any
    engine: Any = None


@dataclass
class Engines:
    """A prefill group (tp ranks, all on the prefill broker) and a decode rank of tp 1."""

    prefill_address: str
    group: str
    prefill: list[Rank] = field(default_factory=list)
    decode: list[Rank] = field(default_factory=list)

    @classmethod
    def register(cls, brokers: Sequence[Any], model: Any, tp: int, pages: int, device: str,
                 prepare: Callable[[Any], None] | None = None) -> Engines:
        """``prepare(memory)`` runs on each rank's memory (filled) before it registers."""
        from kvbroker.client import BrokerClient, EngineMemory, RankSpec

        eng = cls(brokers[0].address, f"gpubench-{secrets.token_hex(4)}")
        try:
            for role, size, broker, ranks in (("prefill", tp, brokers[0], eng.prefill),
                                              ("decode", 1, brokers[1], eng.decode)):
                for tp_rank in range(size):
                    spec = RankSpec(f"{eng.group}-{role}", role, tp_size=size, tp_rank=tp_rank)
                    memory = EngineMemory.allocate(spec, model, num_pages=pages, device=device)
                    ranks.append(rank := Rank(memory, BrokerClient(broker.address)))
                    for _, t in eng.tensors(rank) if role == "prefill" else ():
                        t.view(torch.uint8).random_(0, 256)
                    sync(memory.raw.device)
                    if prepare is not None:
                        prepare(memory)
                    rank.engine = rank.client.register_engine(spec, memory)
        except BaseException:
            eng.close()
            raise
        return eng

    @staticmethod
    def tensors(rank: Rank) -> Iterator[tuple[str, torch.Tensor]]:
        for layer in sorted(rank.memory.k):
            yield f"layer {layer} K", rank.memory.k[layer]
            yield f"layer {layer} V", rank.memory.v[layer]

    def zero_decode(self) -> None:
        for _, t in self.tensors(self.decode[0]):
            t.zero_()
        sync(self.decode[0].memory.raw.device)

    def move(self, ids: list[int], plan: Plan, cp: int, timeout: float) -> float:
        """The rooms of ``plan``, ``cp`` pages a chunk: first ExpectRoom to last SUCCESS, s."""
        from kvbroker.client import ExpectSpec, RoomState, SenderRef

        ref = SenderRef(self.prefill_address, f"{self.group}-prefill")
        decode = self.decode[0].engine
        room_pages = plan.src.shape[1]
        t0 = time.perf_counter()
        decode.expect([ExpectSpec(room, ref, plan.dst[i]) for i, room in enumerate(ids)])
        senders = [[rank.engine.sender(room) for room in ids] for rank in self.prefill]
        for s in (s for row in senders for s in row):
            s.init(num_pages=room_pages)
        for c in range(0, room_pages, cp):
            for rank, row in zip(self.prefill, senders, strict=True):
                rank.engine.send([(s, plan.src[i, c : c + cp]) for i, s in enumerate(row)])
        statuses = decode.wait(ids, timeout_seconds=timeout)
        seconds = time.perf_counter() - t0
        bad = [(r, s.cause.message) for r, s in statuses.items() if s.state != RoomState.SUCCESS]
        if bad:
            raise BenchFailed(f"kvbroker: {len(bad)} of {len(ids)} rooms failed, e.g. {bad[0]}")
        return seconds

    def verify(self, what: str, plan: Plan) -> None:
        """decode[dst pages] == rank r's prefill[src pages] in r's heads, as bytes, every region."""
        wrong = kv_mismatches(what, [r.memory for r in self.prefill], [self.decode[0].memory],
                              plan.src, plan.dst)
        if wrong:
            raise BenchFailed(wrong[0])

    def close(self) -> None:
        for rank in (*self.prefill, *self.decode):  # every rank is released even if one fails
            if error := release(rank.engine, rank.client, rank.memory):
                print(f"gpu_bench: unregistering an engine failed: {error!r}", file=sys.stderr)


def one_page_rooms(pairs: dict[str, Engines], n: int, ids: Iterator[int], timeout: float
                   ) -> dict[str, list[float]]:
    """Seconds of ``n`` sequential 1-page rooms per engine pair, interleaved, after warm-ups."""
    rng, warm = np.random.default_rng(3), WARM_ROOMS
    plans = {k: Plan(rng.integers(0, n + warm, (n + warm, 1)), rng.permutation(n + warm)[:, None])
             for k in pairs}
    out: dict[str, list[float]] = {k: [] for k in pairs}
    for i in range(n + warm):
        for key, eng in pairs.items():
            one = Plan(plans[key].src[i : i + 1], plans[key].dst[i : i + 1])
            seconds = eng.move([next(ids)], one, 1, timeout)
            if i >= warm:
                out[key].append(seconds)
    for key, eng in pairs.items():
        eng.verify(f"1-page rooms, KV {key}", plans[key])
    return out


# -- the run --------------------------------------------------------------------------------------


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
        return f"{self.kib} KiB {self.pattern} " + (
            f"tp{self.tp}->tp1" if self.tp else "(tp1 bytes)")

    def gbps(self, how: str = "median") -> float:
        s = min(self.seconds) if how == "best" else statistics.median(self.seconds)
        return self.nbytes / s / 1e9

    def once(self, record: bool) -> None:
        """Zero the destination, take one sample, check its bytes; keep it if ``record``."""
        self.zero()
        cpu0 = sum(cpu_seconds(p) for p in self.pids)
        seconds = self.sample()
        cpu = sum(cpu_seconds(p) for p in self.pids) - cpu0
        self.check()
        if record:
            self.seconds.append(seconds)
            self.cpu.append(cpu)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--device", default="cuda:0", help="cuda:N, or cpu: the smoke test on host memory")
    add("--quick", action="store_true", help=f"small defaults: {PROFILES['quick']}")
    add("--layers", type=int, help="layers, each a K and a V region (default 32)")
    add("--page-kib", default="16,4", help="page sizes per layer region, KiB (comma list)")
    add("--patterns", default="random,contiguous", help="page patterns (comma list)")
    add("--tp", default="1,2", help="prefill tp sizes (1, 2) into decode tp 1 (comma list)")
    add("--chunk-mib", type=int, help="MiB per chunk, all regions (default 128)")
    add("--chunks", type=int, help="chunks per room (default 2)")
    add("--rooms", type=int, help="rooms per sample (default 8)")
    add("--slots", type=int, default=4, help="transfer slots of the raw staged path")
    add("--head-dim", type=int, default=128)
    add("--repeat", type=int, help="timed samples per measurement (default 3)")
    add("--latency-rooms", type=int, help="sequential 1-page rooms per KV kind (default 100)")
    add("--parts", default=",".join(PARTS), help=f"what to measure: {', '.join(PARTS)}")
    add("--timeout", type=float, default=300.0, help="seconds one sample may take")
    add("--seed", type=int, default=1)
    a = p.parse_args(argv)
    for key, value in PROFILES["quick" if a.quick else "gpu"].items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.page_kib, a.tp = ([int(x) for x in v.split(",")] for v in (a.page_kib, a.tp))
    a.patterns, a.parts = a.patterns.split(","), a.parts.split(",")
    if not (set(a.patterns) <= {"random", "contiguous"} and set(a.tp) <= {1, 2}
            and set(a.parts) <= set(PARTS)):
        p.error(f"--patterns: random, contiguous; --tp: 1, 2; --parts: {', '.join(PARTS)}")
    token = KV_HEADS * a.head_dim * 2
    for kib in a.page_kib:
        if (kib << 10) % token or a.chunk_mib * MiB < 2 * a.layers * (kib << 10):
            p.error(f"--page-kib {kib}: not whole tokens of {token} B, or more than a chunk")
    if a.device != "cpu" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch sees no CUDA device; --device cpu is the smoke test")
    return a


def header(a: argparse.Namespace, device: torch.device, geos: dict[int, Geometry],
           broker_args: list[str]) -> None:
    name = (torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"no GPU: host CPU {platform.machine()}, {os.cpu_count()} cores")
    print(f"gpu_bench on {name}; torch {torch.__version__}; "
          f"UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}")
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"brokers: 2 x kvbroker serve --listen 127.0.0.1:0 ... {shlex.join(broker_args)}")
    print(f"cases: page KiB {a.page_kib} x {a.patterns} x prefill tp {a.tp} into decode tp 1; "
          f"parts: {', '.join(a.parts)}")
    print(f"model: {a.layers} layers x K,V = {2 * a.layers} regions, {KV_HEADS} KV heads x "
          f"{a.head_dim}, bfloat16; {a.rooms} rooms x {a.chunks} chunks; raw staged: {a.slots} "
          f"slots; best/median of {a.repeat} samples after 1 warm-up; {a.latency_rooms} 1-page "
          f"rooms per KV kind, {a.page_kib[0]} KiB pages")
    for kib, g in geos.items():
        print(f"  {kib} KiB pages: chunk {g.chunk_pages} pages x {g.regions} regions = "
              f"{g.chunk_bytes / MiB:g} MiB, room {g.room_pages} pages, sample {g.payload / MiB:g} "
              f"MiB = {g.regions * g.pool_pages} page descriptors")
    print("compare within this run, as ratios; this machine is noisy\n", flush=True)


def run(a: argparse.Namespace, done: list[Measure], latency: dict[str, list[float]]) -> None:
    """Measure what ``a`` asks for into ``done`` and ``latency`` (filled as it goes)."""
    from kvbroker.brokerproc import BrokerProcess

    device = torch.device(a.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    geos = {kib: Geometry(2 * a.layers, kib << 10, a.chunk_mib * MiB // (2 * a.layers << 10) // kib,
                          a.chunks, a.rooms) for kib in a.page_kib}
    slot = max(g.chunk_bytes for g in geos.values())
    part = -(-slot // MiB)  # a chunk rounded up to MiB: it fits one part
    broker_args = ["--device-buffer-mib", str(4 * part), "--device-part-mib", str(part),
                   "--log-level", "warning"]
    header(a, device, geos, broker_args)
    ids = itertools.count(secrets.randbits(40) << 20)  # room ids
    payload = max(g.payload for g in geos.values())

    def model(kib: int) -> Any:
        return model_spec(a.layers, head_dim=a.head_dim, page_size=(kib << 10) // (KV_HEADS * a.head_dim * 2))

    def repeat(measures: Sequence[Measure]) -> None:
        done.extend(measures)
        for rep in range(-1, a.repeat):  # -1: the untimed warm-up
            for m in measures:
                m.once(record=rep >= 0)

    def logs(failed: Any, *_: Any) -> None:
        for b in brokers if failed else ():
            if b.log_tail(1500).strip():
                print(f"--- broker {b.name}, its log's end:\n{b.log_tail(1500)}", file=sys.stderr)
        for b in brokers:  # e.g. vram_transfer_at_host_speed: GPU memory moved like a host copy
            said = ", ".join(f"{event} x{n}" for event, n in sorted(b.warnings().items())) or "none"
            print(f"broker {b.name} warnings: {said}")

    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvb-gpubench-")))
        brokers: list[Any] = []
        if {"broker", "latency"} & set(a.parts):
            brokers = BrokerProcess.start_many(["prefill", "decode"], workdir, broker_args)
            stack.callback(lambda: [b.stop() for b in brokers])
            stack.push(logs)
        pids = [b.process.pid for b in brokers]
        raw: RawPeer | None = None
        if {"raw-pages", "raw-staged", "raw-one"} & set(a.parts):
            raw = RawPeer(device, payload, slot, a.slots, a.seed)
            stack.callback(raw.close)
        if "copy" in a.parts:
            src = raw.src if raw else pattern_bytes(a.seed, payload, device)
            dst = torch.empty_like(src)

            def copy() -> float:
                t0 = time.perf_counter()
                dst.copy_(src)
                sync(device)
                return time.perf_counter() - t0

            repeat([Measure("copy", payload, dst.zero_, copy,
                            lambda: require("copy", differs(dst, src, (1, payload, 1), None)))])
            del dst
        if raw and "raw-one" in a.parts:
            work = [(raw.one(raw.src.data_ptr(), payload), raw.one(raw.dst_ptr, payload))]
            repeat([Measure("raw-one", payload, lambda: raw.call("zero"),
                            lambda: raw.post_all(work, "raw one", a.timeout),
                            lambda: raw.check("raw one", (1, payload, 1), None))])
        for kib, geo in geos.items():
            with ExitStack() as per_size:
                engines: dict[int, Engines] = {}
                for tp in a.tp if "broker" in a.parts else ():
                    engines[tp] = Engines.register(brokers, model(kib), tp, geo.pool_pages,
                                                   a.device)
                    per_size.callback(engines[tp].close)
                for pattern in a.patterns:
                    repeat(case_measures(a, raw, engines, geo, kib, pattern, ids, pids))
                    print(f"  measured: {kib} KiB {pattern}", flush=True)
        if "latency" in a.parts:
            pairs = {}
            for key, dev in ((f"on {a.device}", a.device), ("in DRAM", "cpu")):
                pairs[key] = Engines.register(brokers, model(a.page_kib[0]), 1,
                                              a.latency_rooms + WARM_ROOMS, dev)
                stack.callback(pairs[key].close)
            latency.update(one_page_rooms(pairs, a.latency_rooms, ids, a.timeout))


def case_measures(a: argparse.Namespace, raw: RawPeer | None, engines: dict[int, Engines],
                  geo: Geometry, kib: int, pattern: str, ids: Iterator[int],
                  pids: Sequence[int]) -> list[Measure]:
    """kvbroker for each tp and the raw paths, of one page size and pattern (indices uploaded)."""
    plan = make_plan(geo, pattern, a.seed + kib)
    chunks, pages, case = plan.chunks(geo.chunk_pages), (plan.src, plan.dst), (kib, pattern)
    out = [Measure("kvbroker", geo.payload, eng.zero_decode,
                   lambda e=eng: e.move(list(itertools.islice(ids, a.rooms)), plan,
                                        geo.chunk_pages, a.timeout),
                   lambda e=eng, t=tp: e.verify(f"kvbroker {kib} KiB {pattern} tp{t}", plan),
                   *case, tp, pids) for tp, eng in engines.items()]
    if raw and "raw-pages" in a.parts:
        work = raw.page_work(geo, chunks)
        out.append(Measure("raw-pages", geo.payload, lambda: raw.call("zero"),
                           lambda: raw.post_all(work, "raw pages", a.timeout),
                           lambda: raw.check("raw pages", geo.shape, pages), *case))
    if raw and "raw-staged" in a.parts:
        sidx = [torch.from_numpy(s).to(raw.device) for s, _ in chunks]
        raw.call("plan", geo.shape, [d for _, d in chunks])
        sync(raw.device)
        out.append(Measure("raw-staged", geo.payload, lambda: raw.call("zero"),
                           lambda: raw.staged(geo, sidx, a.timeout),
                           lambda: raw.check("raw staged", geo.shape, pages), *case))
    return out


def report(a: argparse.Namespace, done: list[Measure], latency: dict[str, list[float]],
           targets: bool = True) -> None:
    done = [m for m in done if m.seconds]
    by = {(m.method, m.kib, m.pattern, m.tp): m for m in done}
    print(f"\n{'case':29} {'method':31} {'MiB':>6} {'best GB/s':>9} {'median GB/s':>11}  notes")
    for m in sorted(done, key=lambda m: m.kib == 0):
        note = ""
        if m.method == "kvbroker":
            staged = by.get(("raw-staged", m.kib, m.pattern, 0))
            note = f"x{m.gbps() / staged.gbps():.2f} of raw staged; " if staged else ""
            note += f"brokers' CPU {statistics.median(m.cpu) * 1e3:.0f} ms/sample"
        label = LABELS[m.method] + (" (memcpy)" if m.method == "copy" and a.device == "cpu" else "")
        print(f"{m.case:29} {label:31} {m.nbytes / MiB:6.0f} {m.gbps('best'):9.2f} "
              f"{m.gbps():11.2f}  {note}")
    print("raw rows move the bytes of the tp1->tp1 case; tp2->tp1 moves as many into decode")
    lat = {k: (statistics.median(v) * 1e3, percentile(v, 0.9) * 1e3) for k, v in latency.items()}
    for key, (med, p90) in lat.items():
        print(f"1-page room, KV {key:12} median {med:7.2f} ms  p90 {p90:7.2f} ms  "
              f"(n={len(latency[key])})")
    vram, dram = lat.get(f"on {a.device}"), lat.get("in DRAM")
    if vram and dram:
        print(f"1-page room, KV on {a.device} / KV in DRAM (medians): {vram[0] / dram[0]:.2f}")
    if not targets:
        return
    print(f"\ntargets, from this run's medians{'' if a.device != 'cpu' else ': ' + NA_CPU}")
    met = []

    def target(text: str, value: float | None, limit: float, at_most: bool = False) -> None:
        if value is not None:
            met.append(value <= limit if at_most else value >= limit)
        verdict = ("not measured in this run" if value is None else "not applicable on CPU"
                   if a.device == "cpu" else "MET" if met[-1] else "NOT MET")
        print(f"  {text}: {'-' if value is None else f'{value:.2f}'} -> {verdict}")

    def ratio(x: Measure | None, y: Measure | None) -> float | None:
        return x.gbps() / y.gbps() if x and y else None

    main = by.get(("kvbroker", 16, "random", 1))
    ran = (a.chunk_mib, a.layers)
    size = f" (ran {ran[0]} MiB, {ran[1]} layers)" if ran != (128, 32) else ""
    target(f"kvbroker GB/s >= 150, 16 KiB random tp1->tp1, 128 MiB chunks{size}",
           main.gbps() if main else None, 150)
    for (method, kib, pattern, tp), m in by.items():
        if method == "kvbroker":
            target(f"kvbroker / raw gather-write-scatter >= 0.8, {m.case}",
                   ratio(m, by.get(("raw-staged", kib, pattern, 0))), 0.8)
        if method == "kvbroker" and tp == 2:
            target(f"head slices / equal tp >= 0.7, {kib} KiB {pattern}",
                   ratio(m, by.get((method, kib, pattern, 1))), 0.7)
    target(f"1-page room, KV on {a.device} / KV in DRAM <= 1.5 (medians)",
           vram[0] / dram[0] if vram and dram else None, 1.5, at_most=True)
    if a.device != "cpu":
        print(f"  {sum(met)} of {len(met)} measured targets met")


def main(argv: Sequence[str] | None = None) -> int:
    if "--fake-gpu" in (sys.argv[1:] if argv is None else argv):  # its own options: gpu_fake.py
        from gpu_fake import main as fake_gpu_main

        return fake_gpu_main([x for x in (sys.argv[1:] if argv is None else argv) if x != "--fake-gpu"])
    a = parse_args(argv)
    done: list[Measure] = []
    latency: dict[str, list[float]] = {}
    try:
        run(a, done, latency)
    except Exception as exc:  # what was measured before is still worth printing
        report(a, done, latency, targets=False)
        why = str(exc) if isinstance(exc, BenchFailed) else traceback.format_exc()
        print(f"\ngpu_bench: FAILED: {why}", file=sys.stderr, flush=True)
        return 1
    report(a, done, latency)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The device path on fake GPUs: what a packed part costs the brokers, measured on CPU.

    python bench/gpu_bench.py --fake-gpu              # ~1-2 minutes on 2 cores
    python bench/gpu_bench.py --fake-gpu --checksums  # brokers with --verify-checksums

Two ``kvbroker serve`` processes (prefill, decode) run with
``KVBROKER_TESTING_FAKE_GPUS=1`` (``kvbroker.testing.fake_gpu``): their CUDA
driver is the scripted fake, "device memory" is host memory in memfds viewed
as torch CPU tensors, and their transfer buffers (the fake ``cuMemAlloc``)
are registered with the real NIXL agent (UCX over loopback) as DRAM. Engines
in this process hand them fake VRAM (``as_fake_vram``, a fake driver of this
process's own), so a chunk moves on the real device path: gathered with
torch index ops into a send slot on the prefill broker, one UCX write, and
scattered from the receive slot on the decode broker. In the same run, on
the same brokers, engines with DRAM memory move the same shape of chunk the
DRAM way (one write of the engines' own registered pages).

1 per part   ``--rooms`` rooms x ``--chunks`` chunks of one page (``--layers`` x K,V regions of
             ``--page-tokens`` tokens of 8 KV heads x 128, bfloat16: small enough that no copy
             counts), all rooms in flight, packed (fake VRAM) and DRAM samples interleaved after
             one warm-up each. Per sample and broker: CPU seconds from /proc/PID/stat (and by
             thread from /proc/PID/task) around first ExpectRoom .. last SUCCESS on both sides;
             Admin.GetStats before and after: parts (prefill transfers_packed, or
             transfers_posted for DRAM), device_launches, peer_calls_answered (both brokers
             together: every broker-to-broker RPC). Medians over ``--repeat`` samples.
2 part size  as 1, packed only, each chunk ``--big-chunk-pages`` pages (so each part that many
             times larger; other engines): launches per part must not grow with the part (at
             most 2 a side; parts that land together share a batch's 4 on the decode).
3 throughput kvbroker on fake VRAM (``--tput-*``: rooms of chunks of 16 KiB pages, one packed
             part a chunk) against a raw gather -> one WRITE -> scatter of the same geometry on
             host tensors (gpu_raw.py's staged path with --device cpu: index_select into a
             slot, a bare NIXL WRITE to a spawned target, index_copy_ there).

Every sample's bytes are checked; a failed room or a wrong byte exits 1. The figures are for
this host's CPUs (the development VM: 2 cores, shared by both brokers and this process) and
say what the brokers' Python costs per part, not what a GPU moves.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ["UCX_NET_DEVICES"] = "lo"

import torch
from common import KV_HEADS, BenchFailed, cpu_seconds, model_spec
from gpu_bench import Engines
from gpu_raw import Geometry, Plan, RawPeer, make_plan

MiB = 1 << 20
SIDES = ("prefill", "decode")
ROLES = ("loop", "nixl", "copy", "other")
TARGET_CPU_US = 150.0
TARGET_RATIO = 2.5
#: Device launches of one packed part on either side, at most, whatever its size.
PART_LAUNCHES = 2


@dataclass
class Sample:
    """One sample of one kind of rooms: what both brokers spent and counted."""

    parts: int
    seconds: float
    cpu: dict[str, float]  # side -> CPU seconds (whole process)
    roles: dict[str, dict[str, float]]  # side -> thread role -> CPU seconds
    launches: dict[str, int]  # side -> device launches
    rpcs: Counter[str] = field(default_factory=Counter)  # method -> calls, both brokers

    def per_part(self, value: float) -> float:
        return value / self.parts if self.parts else float("nan")


def _counts(stats: Any) -> dict[str, Any]:
    return {"packed": stats.transfers_packed, "posted": stats.transfers_posted,
            "launches": stats.device_launches, "rpcs": Counter(dict(stats.peer_calls_answered))}


class Brokers:
    """The two fake-GPU broker processes, and what is read from them around a sample."""

    def __init__(self, procs: Sequence[Any]) -> None:
        self.procs = dict(zip(SIDES, procs, strict=True))
        self.pids = {side: b.process.pid for side, b in self.procs.items()}

    def counts(self) -> dict[str, dict[str, Any]]:
        return {side: _counts(b.stats()) for side, b in self.procs.items()}

    def cpu(self) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
        """CPU seconds so far of each broker, and by thread role (:func:`thread_cpu`)."""
        roles = {side: thread_cpu(pid) for side, pid in self.pids.items()}
        return {side: sum(by.values()) for side, by in roles.items()}, roles


_ROLE_OF = {"kvb-nixl": "nixl", "kvb-copy": "copy"}


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of process ``pid``'s live threads by role, to the nanosecond:
    /proc/PID/task/TID/schedstat (its first field), where /proc/PID/stat counts
    10 ms ticks. Threads that ended are not counted (a broker's are long-lived)."""
    out = dict.fromkeys(ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as fh:
                ns = int(fh.read().split()[0])
            with open(f"/proc/{pid}/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended
        out["loop" if int(tid) == pid else _ROLE_OF.get(name, "other")] += ns / 1e9
    return out


def _move(eng: Engines, ids: list[int], plan: Plan, cp: int, timeout: float) -> float:
    """Both sides of ``plan``'s rooms to SUCCESS; seconds to the decode side's last."""
    from kvbroker.client import RoomState

    seconds = eng.move(ids, plan, cp, timeout)
    for rank in eng.prefill:
        statuses = rank.engine.wait(ids, timeout_seconds=timeout)
        bad = [s.cause.message for s in statuses.values() if s.state != RoomState.SUCCESS]
        if bad:
            raise BenchFailed(f"{len(bad)} rooms failed on the prefill side, e.g. {bad[0]}")
    return seconds


def sample(brokers: Brokers, eng: Engines, what: str, plan: Plan, cp: int, packed: bool,
           ids: Any, timeout: float) -> Sample:
    """Move ``plan``'s rooms in chunks of ``cp`` pages, check the bytes; what it cost."""
    eng.zero_decode()
    rooms = list(itertools.islice(ids, plan.src.shape[0]))
    before = brokers.counts()
    cpu0, roles0 = brokers.cpu()
    seconds = _move(eng, rooms, plan, cp, timeout)
    cpu1, roles1 = brokers.cpu()
    after = brokers.counts()
    eng.verify(what, plan)
    parts = after["prefill"]["packed" if packed else "posted"] - before["prefill"]["packed" if packed else "posted"]
    rpcs: Counter[str] = Counter()
    for side in SIDES:
        rpcs.update(after[side]["rpcs"])
        rpcs.subtract(before[side]["rpcs"])
    return Sample(
        parts=parts,
        seconds=seconds,
        cpu={s: cpu1[s] - cpu0[s] for s in SIDES},
        roles={s: {r: roles1[s][r] - roles0[s][r] for r in ROLES} for s in SIDES},
        launches={s: after[s]["launches"] - before[s]["launches"] for s in SIDES},
        rpcs=+rpcs,
    )


def med(samples: Sequence[Sample], fn: Callable[[Sample], float]) -> float:
    return statistics.median(fn(s) for s in samples)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_bench.py --fake-gpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--rooms", type=int, default=8, help="rooms per per-part sample, all in flight")
    add("--chunks", type=int, default=64, help="1-page chunks per room (one part each)")
    add("--layers", type=int, default=4, help="layers of the per-part model (K and V regions each)")
    add("--page-tokens", type=int, default=1, help="tokens per page of the per-part model")
    add("--big-chunk-pages", type=int, default=16, help="pages per chunk of the part-size check")
    add("--repeat", type=int, default=3, help="timed samples per kind, after one warm-up")
    add("--tput-layers", type=int, default=4)
    add("--tput-page-kib", type=int, default=16)
    add("--tput-chunk-mib", type=int, default=8)
    add("--tput-chunks", type=int, default=2)
    add("--tput-rooms", type=int, default=8)
    add("--tput-repeat", type=int, default=5, help="timed samples of part 3 per method")
    add("--slots", type=int, default=4, help="slots of the raw staged path")
    add("--checksums", action="store_true", help="brokers run with --verify-checksums")
    add("--no-throughput", action="store_true", help="skip part 3 (throughput)")
    add("--timeout", type=float, default=120.0, help="seconds one sample may take")
    add("--keep-logs", action="store_true", help="keep the brokers' logs (their directory is printed)")
    add("--seed", type=int, default=1)
    return p.parse_args(argv)


def run(a: argparse.Namespace, out: dict[str, Any]) -> None:
    from kvbroker.brokerproc import BrokerProcess
    from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
    from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY

    token = KV_HEADS * 128 * 2
    page = a.page_tokens * token
    geo = Geometry(2 * a.layers, page, 1, a.chunks, a.rooms)
    tgeo = Geometry(2 * a.tput_layers, a.tput_page_kib << 10,
                    (a.tput_chunk_mib * MiB) // (2 * a.tput_layers * (a.tput_page_kib << 10)),
                    a.tput_chunks, a.tput_rooms)
    part_mib = max(1, -(-tgeo.chunk_bytes // MiB))
    args = ["--log-level", "warning", "--device-part-mib", str(part_mib),
            "--device-buffer-mib", str(4 * part_mib), *(["--verify-checksums"] if a.checksums else [])]
    ids = itertools.count(secrets.randbits(40) << 20)
    fake = FakeCudaLib(devices=1, granularity=GRANULARITY)  # the engines' driver, in this process

    def vram(memory: Any) -> None:
        as_fake_vram(memory, fake)

    with ExitStack() as stack:
        if a.keep_logs:
            workdir = Path(tempfile.mkdtemp(prefix="kvb-fakegpu-"))
            print(f"broker logs kept in {workdir}", file=sys.stderr)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvb-fakegpu-")))
        env = {**os.environ, FAKE_GPUS_ENV: "1"}
        procs = [BrokerProcess.launch(side, workdir, args, env=env) for side in SIDES]
        stack.callback(lambda: [b.stop() for b in procs])
        for b in procs:
            b.wait_ready(60)
            if "FAKE GPU" not in b.log_tail(100_000):
                raise BenchFailed(f"broker {b.name} does not say it runs on a fake GPU")
        brokers = Brokers(procs)
        stack.callback(lambda: out.update(warnings={b.name: b.warnings() for b in procs}))
        print(f"gpu_bench --fake-gpu on {platform.machine()}, {os.cpu_count()} cores, no GPU; torch "
              f"{torch.__version__}; UCX_NET_DEVICES={os.environ['UCX_NET_DEVICES']}; load average "
              f"{os.getloadavg()[0]:.2f} (the host's other work shares these cores)")
        print(f"brokers: 2 x {FAKE_GPUS_ENV}=1 kvbroker serve {' '.join(args)} "
              f"(pids: prefill {brokers.pids['prefill']}, decode {brokers.pids['decode']})")
        print(f"1 per part: {a.rooms} rooms x {a.chunks} chunks of 1 page; {geo.regions} regions x "
              f"{page} B = {geo.chunk_bytes / 1024:g} KiB a part; median of {a.repeat} samples per "
              f"kind after a warm-up; checksums {'on' if a.checksums else 'off'}", flush=True)

        small = model_spec(a.layers, page_size=a.page_tokens)
        packed = Engines.register(procs, small, 1, geo.pool_pages, "cpu", vram)
        stack.callback(packed.close)
        dram = Engines.register(procs, small, 1, geo.pool_pages, "cpu")
        stack.callback(dram.close)
        c0, _ = brokers.cpu()
        time.sleep(1.0)
        c1, _ = brokers.cpu()
        out["idle"] = {s: c1[s] - c0[s] for s in SIDES}
        ticks0 = {side: cpu_seconds(pid) for side, pid in brokers.pids.items()}
        plan = make_plan(geo, "random", a.seed)
        kinds = {"packed": (packed, True), "dram": (dram, False)}
        runs: dict[str, list[Sample]] = {k: [] for k in (*kinds, "big")}
        out["runs"] = runs
        for rep in range(-1, a.repeat):
            for kind, (eng, is_packed) in kinds.items():
                s = sample(brokers, eng, f"{kind} 1-page chunks", plan, 1, is_packed, ids, a.timeout)
                if rep >= 0:
                    runs[kind].append(s)
            print(f"  per part: sample {rep + 1} of {a.repeat}" if rep >= 0 else "  per part: warm-up",
                  flush=True)
        c2, _ = brokers.cpu()
        out["check"] = {side: (cpu_seconds(pid) - ticks0[side], c2[side] - c1[side])
                        for side, pid in brokers.pids.items()}
        # The same rooms and chunks, each chunk big_chunk_pages pages: only the parts' size differs.
        bgeo = Geometry(geo.regions, page, a.big_chunk_pages, a.chunks, a.rooms)
        bplan = make_plan(bgeo, "random", a.seed + 3)
        bigger = Engines.register(procs, small, 1, bgeo.pool_pages, "cpu", vram)
        stack.callback(bigger.close)
        for rep in range(-1, a.repeat):
            s = sample(brokers, bigger, f"packed {a.big_chunk_pages}-page chunks", bplan,
                       a.big_chunk_pages, True, ids, a.timeout)
            if rep >= 0:
                runs["big"].append(s)
        print("  part size: done", flush=True)
        if a.no_throughput:
            return
        tmodel = model_spec(a.tput_layers, page_size=(a.tput_page_kib << 10) // token)
        teng = Engines.register(procs, tmodel, 1, tgeo.pool_pages, "cpu", vram)
        stack.callback(teng.close)
        raw = RawPeer(torch.device("cpu"), tgeo.payload, tgeo.chunk_bytes, a.slots, a.seed)
        stack.callback(raw.close)
        tplan = make_plan(tgeo, "random", a.seed + 7)
        chunks = tplan.chunks(tgeo.chunk_pages)
        sidx = [torch.from_numpy(s) for s, _ in chunks]
        raw.call("plan", tgeo.shape, [d for _, d in chunks])
        tput: dict[str, list[float]] = {"kvbroker": [], "raw": []}
        out["tput"], out["tgeo"] = tput, tgeo
        for rep in range(-1, a.tput_repeat):
            s = sample(brokers, teng, "throughput", tplan, tgeo.chunk_pages, True, ids, a.timeout)
            raw.call("zero")
            seconds = raw.staged(tgeo, sidx, a.timeout)
            raw.check("raw staged", tgeo.shape, (tplan.src, tplan.dst))
            if rep >= 0:
                tput["kvbroker"].append(tgeo.payload / s.seconds / 1e9)
                tput["raw"].append(tgeo.payload / seconds / 1e9)
        print("  throughput: done", flush=True)


def _us(x: float) -> str:
    return f"{x * 1e6:8.0f} us"


def report(a: argparse.Namespace, out: dict[str, Any]) -> None:
    runs: dict[str, list[Sample]] = out.get("runs", {})
    if not runs.get("packed") or not runs.get("dram"):
        return
    pk, dr, big = runs["packed"], runs["dram"], runs["big"]
    print(f"\n1 per part ({pk[0].parts} packed parts, {dr[0].parts} DRAM chunks a sample; median of "
          f"{len(pk)}; idle CPU over 1 s: prefill {out['idle']['prefill'] * 1e3:.0f} ms, decode "
          f"{out['idle']['decode'] * 1e3:.0f} ms)")
    print(f"  {'broker CPU per part':34} {'packed part':>11} {'DRAM chunk':>11} {'packed/DRAM':>11}")
    ratios = {}
    for side in SIDES:
        p_cpu = med(pk, lambda s, side=side: s.per_part(s.cpu[side]))
        d_cpu = med(dr, lambda s, side=side: s.per_part(s.cpu[side]))
        ratios[side] = (p_cpu, p_cpu / d_cpu if d_cpu else float("nan"))
        print(f"  {side + ' broker (process)':34} {_us(p_cpu)} {_us(d_cpu)} {ratios[side][1]:10.2f}x")
        for role in ROLES:
            pr = med(pk, lambda s, side=side, role=role: s.per_part(s.roles[side][role]))
            drr = med(dr, lambda s, side=side, role=role: s.per_part(s.roles[side][role]))
            print(f"    {'thread ' + role:32} {_us(pr)} {_us(drr)}")
    if "check" in out:
        print("  (CPU over all of part 1, warm-up included, by /proc/PID/stat ticks vs the threads' "
              "schedstat: " + ", ".join(f"{side} {t:.2f} s vs {n:.2f} s" for side, (t, n) in out["check"].items())
              + ")")
    both_p = med(pk, lambda s: s.per_part(sum(s.cpu.values())))
    both_d = med(dr, lambda s: s.per_part(sum(s.cpu.values())))
    print(f"  {'both brokers':34} {_us(both_p)} {_us(both_d)} {both_p / both_d:10.2f}x")
    wall_p, wall_d = med(pk, lambda s: s.per_part(s.seconds)), med(dr, lambda s: s.per_part(s.seconds))
    print(f"  {'wall per part (sample / parts)':34} {_us(wall_p)} {_us(wall_d)} {wall_p / wall_d:10.2f}x")

    def rpcs(samples: Sequence[Sample]) -> dict[str, float]:
        methods = sorted({m for s in samples for m in s.rpcs})
        return {m: med(samples, lambda s, m=m: s.per_part(s.rpcs.get(m, 0))) for m in methods}

    p_rpc, d_rpc = rpcs(pk), rpcs(dr)
    steady = sum(v for m, v in p_rpc.items() if m != "Ping")
    print(f"  peer RPCs per part, both brokers: packed {sum(p_rpc.values()):.3f} "
          f"({', '.join(f'{m} {v:.3f}' for m, v in p_rpc.items()) or 'none'}); DRAM "
          f"{sum(d_rpc.values()):.3f} ({', '.join(f'{m} {v:.3f}' for m, v in d_rpc.items()) or 'none'})")
    launches = {side: med(pk, lambda s, side=side: s.per_part(s.launches[side])) for side in SIDES}
    print(f"  device launches per packed part: prefill {launches['prefill']:.2f}, decode "
          f"{launches['decode']:.2f} (DRAM chunks: "
          f"{med(dr, lambda s: s.per_part(sum(s.launches.values()))):.2f})")
    big_l = {side: med(big, lambda s, side=side: s.per_part(s.launches[side])) for side in SIDES}
    big_cpu = {side: med(big, lambda s, side=side: s.per_part(s.cpu[side])) for side in SIDES}
    print(f"\n2 part size ({big[0].parts} packed parts of {a.big_chunk_pages} pages, "
          f"{a.big_chunk_pages * out['part_bytes'] / 1024:g} KiB, a sample; median of {len(big)}): "
          f"launches per part prefill {big_l['prefill']:.2f}, decode {big_l['decode']:.2f} "
          f"(1-page parts: {launches['prefill']:.2f}, {launches['decode']:.2f}); broker CPU per part "
          f"prefill {big_cpu['prefill'] * 1e6:.0f} us, decode {big_cpu['decode'] * 1e6:.0f} us")
    tput = out.get("tput")
    if tput and tput["kvbroker"]:
        kb, raw = statistics.median(tput["kvbroker"]), statistics.median(tput["raw"])
        g = out["tgeo"]
        print(f"\n3 throughput ({g.rooms} rooms x {g.chunks} chunks of {g.chunk_pages} pages x "
              f"{g.regions} regions x {g.page_bytes >> 10} KiB = {g.payload / MiB:g} MiB, "
              f"{g.chunk_bytes / MiB:g} MiB parts; median (best) of {len(tput['raw'])}): kvbroker on fake "
              f"VRAM {kb:.2f} ({max(tput['kvbroker']):.2f}) GB/s, raw gather->WRITE->scatter "
              f"{raw:.2f} ({max(tput['raw']):.2f}) GB/s: kvbroker / raw {kb / raw:.2f}")
    warnings = out.get("warnings", {})
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f}")
    print(f"broker warnings: {', '.join(f'{b}: {w}' for b, w in warnings.items() if w) or 'none'}")
    print("\ntargets on this machine (issue 28), from the medians above:")

    def verdict(ok: bool) -> str:
        return "MET" if ok else "NOT MET"

    for side in SIDES:
        cpu, ratio = ratios[side]
        print(f"  {side} broker CPU per packed part <= {TARGET_CPU_US:.0f} us: {cpu * 1e6:.0f} us -> "
              f"{verdict(cpu * 1e6 <= TARGET_CPU_US)}")
        print(f"  {side} broker, packed part / DRAM chunk <= {TARGET_RATIO}x: {ratio:.2f}x -> "
              f"{verdict(ratio <= TARGET_RATIO)}")
    print(f"  0 peer RPCs per part in steady state (all but Ping, the heartbeat): {steady:.3f} -> "
          f"{verdict(steady < 0.01)}")
    # Larger parts launch no more than 1-page ones, nor (without checksums) more than 2 a part
    # (an index upload and an index op): parts that land together share one batch's 4 (the
    # decode's scatter_all), so a side may launch fewer, by how the parts happened to batch.
    cap = 0 if a.checksums else PART_LAUNCHES
    bounded = all(big_l[s] <= max(launches[s], cap) + 0.01 for s in SIDES)
    print(f"  launches per part independent of part size ({a.big_chunk_pages} pages vs 1 page"
          f"{'' if a.checksums else f', or at most {PART_LAUNCHES}'}): {verdict(bounded)}")


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    out: dict[str, Any] = {"part_bytes": 2 * a.layers * a.page_tokens * KV_HEADS * 128 * 2}
    try:
        run(a, out)
    except Exception as exc:
        report(a, out)
        why = str(exc) if isinstance(exc, BenchFailed) else traceback.format_exc()
        print(f"\ngpu_bench --fake-gpu: FAILED: {why}", file=sys.stderr, flush=True)
        return 1
    report(a, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

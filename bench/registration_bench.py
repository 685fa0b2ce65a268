"""Seconds to register (and unregister) 1, 4 and 8 GiB engine buffers with one broker, beside bare NIXL and the broker's
own import step on the same memfd, and the longest Poll round trip to the broker while it registers and faults the
memory in after; the same for VRAM engines through the scripted CUDA driver (import and map).

    python bench/registration_bench.py                  # sizes 1,4,8 GiB, once each: ~1 minute here
    python bench/registration_bench.py --repeat 3       # median of 3, sizes interleaved (figures to quote)
    python bench/registration_bench.py --engine-touch   # the engine writes its pages first
    python bench/registration_bench.py --no-vram        # DRAM engines only

VRAM engines register with a second broker on a fake GPU (``KVBROKER_TESTING_FAKE_GPUS=1``, kvbroker.testing.fake_gpu),
whose scripted driver's "device memory" is a memfd: its import and map cost what mapping a memfd costs, not a GPU
driver's; the broker never registers engine VRAM with NIXL ("bare NIXL" there: the host memory registered as DRAM).
Also the brokers' step timings (their logs) and whether a broker let go of the memory (its ``RssShmem``: the host's
``Shmem`` counts other processes). Nothing is asserted; a failed registration, memory kept or a dead broker exits 1.
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import harness as h
import torch

from kvbroker import cudavmm
from kvbroker.broker.memory import importer_for
from kvbroker.client import BrokerClient, RankSpec
from kvbroker.testing.fake_cuda import FakeCudaLib
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY
from kvbroker.testing.idle import wait_until_warm
from kvbroker.testing.rawpeer import bare_agent
from kvbroker.v1 import common_pb2

#: Shared memory left over after a buffer was freed that counts as not released.
LEAK_SLACK_BYTES = 256 * h.MIB
LOG_EVENTS = ("engine_registered", "engine_memory_warmed", "engine_released", "engine_unregistered")


def registered(broker: Any, client: BrokerClient, rank: RankSpec, memory: Any, warms: bool) -> tuple[Any, float]:
    """Register ``memory``; the engine and the seconds it took, once the broker has faulted its memory in (``warms``)."""
    t0 = time.perf_counter()
    engine = client.register_engine(rank, memory)
    took = time.perf_counter() - t0
    if warms:
        wait_until_warm(broker, timeout_seconds=300)
    return engine, took


def loop_stall(poller: Any, during: Callable[[], Any]) -> tuple[Any, list[float]]:
    """``during()``'s result, and the Poll round trips ``poller`` saw while it ran (s)."""
    rtts: list[float] = []
    done = threading.Event()  # the thread polls until it is set (iter calls is_set until it answers True)
    thread = threading.Thread(target=lambda: [rtts.extend(h.poll_round_trips(poller, 0, 1)) for _ in iter(done.is_set, True)])
    thread.start()
    try:
        return during(), rtts
    finally:
        done.set()
        thread.join()


def step_timings(brokers: Sequence[Any], groups: dict[str, tuple[str, float]]) -> dict[tuple[str, float], dict[str, dict[str, float]]]:
    """Median of each ``*_s`` field of the brokers' engine log lines, per (kind, size) (``groups``: a group's) and event."""
    seen: dict[tuple[str, float], dict[str, dict[str, list[float]]]] = {}
    for rec in (rec for b in brokers for rec in b.log_records() if rec.get("event") in LOG_EVENTS):
        if (key := groups.get(str(rec.get("rank") or rec.get("engine") or "").split("/", 1)[0])) is not None:
            for k, v in rec.items():
                if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    seen.setdefault(key, {}).setdefault(str(rec["event"]), {}).setdefault(k, []).append(float(v))
    return {key: {ev: {k: statistics.median(v) for k, v in f.items()} for ev, f in evs.items()} for key, evs in seen.items()}


def as_vram(memory: Any) -> None:
    """Hand ``memory``'s memfd to a fake-GPU broker as GPU 0's VRAM (its scripted driver takes any memfd; ``memory`` closes it)."""
    (fd, spec), = memory.take_fds()
    memory.buffers = [(fd, common_pb2.BufferSpec(size_bytes=spec.size_bytes, kind=common_pb2.MEMORY_KIND_VRAM,
                                                 device_id=0, device_uuid=FakeCudaLib().uuid_of(0)))]


def bare_figures(raw: Any, memory: Any, vram: bool, driver: Any) -> tuple[float, float]:
    """Seconds bare NIXL takes to register (and deregister) ``memory``'s host memory as DRAM (first: pages as the engine
    left them), then the broker's import step (map, unmap) of its buffer (``vram``: as VRAM) here, on a duplicate fd."""
    descs = [(memory.raw.data_ptr(), memory.raw.numel(), 0, "")]
    nixl_s = h.timed_calls(1, lambda: raw.deregister_memory(raw.register_memory(descs, "DRAM")))[0]
    if vram:
        as_vram(memory)
    (fd, spec), = memory.buffers
    return nixl_s, h.timed_calls(1, lambda: importer_for(spec.kind, driver).import_buffer(os.dup(fd), spec).release())[0]


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, page, tag = h.model_spec(args.layers), h.page_bytes(args.layers), secrets.token_hex(3)
    raw = bare_agent(f"regbench-raw-{tag}")
    sides: dict[str, dict[str, Any]] = {}
    for kind in ["DRAM"] + ["VRAM"] * args.vram:
        broker = held.start_brokers([f"broker-{kind.lower()}"], ["--log-level", "info", *args.broker_arg],
                                    {**os.environ, FAKE_GPUS_ENV: "1"} if kind == "VRAM" else None)[0]
        client, rank = BrokerClient(broker.address), RankSpec(f"regbench-{tag}-poller-{kind}", "decode")
        held.defer("closing the client", client.close)
        poller_memory = h.allocate(rank, model, 1, True)[0]
        if kind == "VRAM":  # its registration makes the GPU's transfer buffers: later ones import and map only
            as_vram(poller_memory)
        poller = client.register_engine(rank, poller_memory)
        held.defer("closing the polling engine", poller.close)
        idle = loop_stall(poller, functools.partial(time.sleep, 3.0))[1]
        sides[kind] = {"broker": broker, "client": client, "poller": poller, "rss_start": h.rss(broker.process.pid),
                       "idle_rtt_s": statistics.median(h.poll_round_trips(poller, 0, 200)), "idle_max_s": max(idle),
                       "idle_p99_s": h.percentile(idle, 0.99), "driver": cudavmm.Driver(FakeCudaLib(1, GRANULARITY, foreign_fds=True)),
                       "shmem": h.proc_status(broker.process.pid, "RssShmem") or 0}
    groups: dict[str, tuple[str, float]] = {}
    samples: dict[tuple[str, float], list[dict[str, float]]] = {(k, s): [] for k in sides for s in args.sizes_gib}
    for rnd in range(args.repeat):
        for (kind, size), into in samples.items():
            side, group = sides[kind], f"regbench-{tag}-{len(groups)}"
            groups[group], rank = (kind, size), RankSpec(group, "prefill")
            memory, allocate_s, nbytes = h.allocate(rank, model, max(1, round(size * h.GIB / page)), args.engine_touch)
            engine = None
            try:
                raw_s, import_s = bare_figures(raw, memory, kind == "VRAM", side["driver"])
                (engine, register_s), rtts = loop_stall(side["poller"], functools.partial(
                    registered, side["broker"], side["client"], rank, memory, kind == "DRAM"))
                rss_registered, unregister_s = h.rss(pid := side["broker"].process.pid), h.timed_calls(1, engine.close)[0]
                engine, quiet = None, loop_stall(side["poller"], functools.partial(time.sleep, sum(rtts)))[1]  # as long, idle
            finally:
                h.release(engine, memory=memory)
                del memory
                gc.collect()
            left = ((h.proc_status(pid, "RssShmem") or 0) - side["shmem"]) * 1024
            into.append({"bytes": nbytes, "allocate_s": allocate_s, "register_s": register_s, "unregister_s": unregister_s,
                         "raw_nixl_s": raw_s, "bare_import_s": import_s, "stall_s": max(rtts, default=0.0),
                         "stall_p99_s": h.percentile(rtts, 0.99) if rtts else 0.0, "quiet_max_s": max(quiet, default=0.0),
                         "broker_rss_registered": rss_registered or 0, "broker_rss_after": h.rss(pid) or 0, "shmem_left": left})
            print(f"  round {rnd + 1}/{args.repeat} {kind} {size:g} GiB: allocate {allocate_s:.2f} s, register {register_s:.3f} s, "
                  f"unregister {unregister_s:.2f} s", file=sys.stderr)
            if left > LEAK_SLACK_BYTES:
                raise h.BenchFailed(f"{kind} {size:g} GiB: the broker still maps {left / h.MIB:.0f} MiB more shared memory than "
                                    "before, after the engine unregistered (it kept its mapping?); stopping")
            if side["broker"].process.poll() is not None:
                raise h.BenchFailed(f"the {kind} broker died (exit status {side['broker'].process.returncode})")
    time.sleep(0.2)  # let the last log lines reach the files
    steps = step_timings([s["broker"] for s in sides.values()], groups)
    return {"config": {"sizes_gib": args.sizes_gib, "repeat": args.repeat, "layers": args.layers, "page_bytes": page,
                       "engine_touch": args.engine_touch, "broker_args": args.broker_arg, "cpus": os.cpu_count(),
                       "mem_total_gib": (h.proc_status(None, "MemTotal") or 0) * 1024 / h.GIB, "load_average": os.getloadavg()[0]},
            "brokers": {k: {n: v for n, v in s.items() if n.endswith("_s") or n == "rss_start"} for k, s in sides.items()},
            "rows": [{**{key: float(statistics.median(s[key] for s in ss)) for key in ss[0]}, "kind": kind, "size_gib": size,
                      "samples": ss, "broker_steps": steps.get((kind, size), {})} for (kind, size), ss in samples.items()]}


def print_report(res: dict[str, Any]) -> None:
    c, touch = res["config"], "written by the engine before registering (--engine-touch)" if res["config"]["engine_touch"] else "untouched"
    print(f"kvbroker registration cost: one broker per memory kind, one engine buffer at a time (median of {c['repeat']}; "
          "compare within this run; nothing is asserted)")
    print(f"model: 8 KV heads, bf16, head dim 128, 16 tokens/page, {c['layers']} layers ({c['page_bytes'] // h.MIB} MiB per page); "
          f"engine pages {touch}; cpus={c['cpus']}, load average {c['load_average']:.2f} (the host's other work shares them)")
    print(f"\n{'kind':>4} {'GiB':>4} {'register s':>10} {'bare NIXL s':>11} {'x NIXL':>7} {'bare import s':>13} "
          f"{'loop stall ms':>13} {'x idle RTT':>10} {'p99 ms':>6} {'idle as long ms':>15} {'unregister s':>12} {'broker RSS MiB reg/after':>25}")
    for r in res["rows"]:
        idle = res["brokers"][r["kind"]]["idle_rtt_s"]
        print(f"{r['kind']:>4} {r['size_gib']:4g} {r['register_s']:10.4f} {r['raw_nixl_s']:11.4f} "
              f"{r['register_s'] / max(r['raw_nixl_s'], 1e-9):7.1f} {r['bare_import_s']:13.4f} {r['stall_s'] * 1e3:13.1f} "
              f"{r['stall_s'] / idle:10.1f} {r['stall_p99_s'] * 1e3:6.1f} {r['quiet_max_s'] * 1e3:15.1f} {r['unregister_s']:12.2f} "
              f"{r['broker_rss_registered'] / h.MIB:12.0f} / {r['broker_rss_after'] / h.MIB:<10.0f}")
    for kind, b in res["brokers"].items():
        print(f"{kind} broker, idle Poll round trip: median of 200 {b['idle_rtt_s'] * 1e3:.2f} ms; over 3 s p99 "
              f"{b['idle_p99_s'] * 1e3:.1f} ms, longest {b['idle_max_s'] * 1e3:.1f} ms; RSS before: {(b['rss_start'] or 0) / h.MIB:.0f} MiB")
    print("targets: 4 GiB registered in <= 1 s and <= 3x bare NIXL, the loop's longest stall meanwhile (DRAM: registering, "
          "then faulting the memory in) <= 5x its idle round trip. Idle as long: the longest round trip over as long again "
          "just after, nothing registering (this host's own stalls). Bare import: the broker's mapping step alone, here "
          "(VRAM: the scripted driver's import and map of a memfd, not a GPU's)")
    print("broker step timings from its log (median s):" + "".join(f"\n  {r['kind']} {r['size_gib']:g} GiB {event}: " + ", ".join(
        f"{k} {v:.3f}" for k, v in fields.items()) for r in res["rows"] for event, fields in r["broker_steps"].items()))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Seconds to register and unregister big engine buffers with one broker "
                                "(docs/benchmarks.md).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-gib", type=lambda text: [float(x) for x in text.split(",") if x.strip()], default=[1.0, 4.0, 8.0],
                   help="comma-separated")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is printed")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--engine-touch", action="store_true", help="the engine writes every page before registering (default: pages untouched)")
    p.add_argument("--no-vram", dest="vram", action="store_false", help="skip the VRAM engines (scripted driver, fake-GPU broker)")
    h.add_run_options(p, brokers="")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.layers < 1 or not args.sizes_gib or min(args.sizes_gib) <= 0:
        p.error("--repeat and --layers must be at least 1, --sizes-gib positive")
    total = (h.proc_status(None, "MemAvailable") or 0) * 1024
    if max(args.sizes_gib) * h.GIB > 0.8 * total:
        print(f"registration_bench: {max(args.sizes_gib):g} GiB is more than 80% of the available {total / h.GIB:.1f} GiB", file=sys.stderr)
        return 1
    return h.bench_main("registration_bench", args, lambda held: run(args, held), print_report)

if __name__ == "__main__":
    sys.exit(main())

"""Seconds to register (and unregister) 1, 4 and 8 GiB engine buffers with one broker, beside bare NIXL registering
the same memfd, and the longest Poll round trip to the broker while it registers and faults the memory in after.

    python bench/registration_bench.py                  # sizes 1,4,8 GiB, once each: ~1 minute here
    python bench/registration_bench.py --repeat 3       # median of 3, sizes interleaved (figures to quote)
    python bench/registration_bench.py --engine-touch   # the engine writes its pages first

Also the broker's step timings (its log) and whether the memory went (``Shmem``). Nothing is asserted; a failed
registration, memory not released or a dead broker exits 1.
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

from kvbroker.client import BrokerClient, RankSpec

#: Shared memory left over after a buffer was freed that counts as not released.
LEAK_SLACK_BYTES = 256 * h.MIB
LOG_EVENTS = ("engine_registered", "engine_memory_warmed", "engine_released", "engine_unregistered")


def register_and_warm(broker: Any, client: BrokerClient, rank: RankSpec, memory: Any) -> tuple[Any, float]:
    """Register ``memory``; the engine and the seconds it took, once the broker has faulted its memory in too."""
    t0 = time.perf_counter()
    engine = client.register_engine(rank, memory)
    took = time.perf_counter() - t0
    deadline = time.monotonic() + 300
    while not any(r.get("event") == "engine_memory_warmed" and r.get("engine", "").startswith(rank.group + "/")
                  for r in broker.log_records()):
        if time.monotonic() > deadline:
            raise h.BenchFailed(f"{rank.group}: the broker never logged engine_memory_warmed")
        time.sleep(0.5)
    return engine, took


def loop_stall(poller: Any, during: Callable[[], Any]) -> tuple[Any, float]:
    """``during()``'s result, and the longest Poll round trip ``poller`` saw while it ran (s)."""
    rtts: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            rtts.extend(h.poll_round_trips(poller, 0, 1))

    thread = threading.Thread(target=poll)
    thread.start()
    try:
        return during(), max(rtts, default=0.0)
    finally:
        done.set()
        thread.join()


def step_timings(broker: Any, groups: dict[str, tuple[float, int]]) -> dict[tuple[float, int], dict[str, dict[str, float]]]:
    """Numeric ``*_s`` fields of the broker's engine log lines, per (size, round) and event (``groups``: a group's)."""
    out: dict[tuple[float, int], dict[str, dict[str, float]]] = {}
    for rec in broker.log_records():
        key = groups.get(str(rec.get("rank") or rec.get("engine") or "").split("/", 1)[0])
        fields = {k: float(v) for k, v in rec.items() if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if key is not None and fields and rec.get("event") in LOG_EVENTS:
            out.setdefault(key, {}).setdefault(str(rec["event"]), {}).update(fields)
    return out


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, page = h.model_spec(args.layers), h.page_bytes(args.layers)
    broker = held.start_brokers(["broker"], ["--log-level", "info", *args.broker_arg])[0]
    pid = broker.process.pid
    rss_start = h.rss(pid)
    client = BrokerClient(broker.address)
    held.defer("closing the client", client.close)
    tag = secrets.token_hex(3)
    raw = h.bare_agent(f"regbench-raw-{tag}")
    poller_rank = RankSpec(f"regbench-{tag}-poller", "decode")
    poller_memory = h.allocate(poller_rank, model, 1, True)[0]
    poller = client.register_engine(poller_rank, poller_memory)
    held.defer("closing the polling engine", poller.close)
    idle_rtt = statistics.median(h.poll_round_trips(poller, 0, 200))
    idle_max = loop_stall(poller, functools.partial(time.sleep, 3.0))[1]  # the longest round trip over 3 s idle
    groups: dict[str, tuple[float, int]] = {}
    samples: dict[float, list[dict[str, float]]] = {s: [] for s in args.sizes_gib}
    shmem_base = h.meminfo_bytes("Shmem")
    for rnd in range(args.repeat):
        for size in args.sizes_gib:
            group = f"regbench-{tag}-{len(groups)}"
            groups[group] = (size, rnd)
            rank = RankSpec(group, "prefill")
            memory, allocate_s, nbytes = h.allocate(rank, model, max(1, round(size * h.GIB / page)), args.engine_touch)
            engine = None
            try:
                assert memory.raw is not None
                t0 = time.perf_counter()  # bare NIXL first, while the pages are as the engine left them
                raw.deregister_memory(raw.register_memory([(memory.raw.data_ptr(), memory.raw.numel(), 0, "")], "DRAM"))
                raw_s = time.perf_counter() - t0
                (engine, register_s), stall = loop_stall(poller, functools.partial(register_and_warm, broker, client, rank, memory))
                rss_registered = h.rss(pid)
                t0 = time.perf_counter()
                engine.close()
                unregister_s = time.perf_counter() - t0
                engine = None
            finally:
                h.release(engine, memory=memory)
                del memory
                gc.collect()
            left = h.meminfo_bytes("Shmem") - shmem_base
            samples[size].append({"bytes": nbytes, "allocate_s": allocate_s, "register_s": register_s, "unregister_s": unregister_s,
                                  "raw_nixl_s": raw_s, "stall_s": stall, "broker_rss_registered": rss_registered or 0, "broker_rss_after": h.rss(pid) or 0,
                                  "shmem_left": left})
            print(f"  round {rnd + 1}/{args.repeat} {size:g} GiB: allocate {allocate_s:.2f} s, register {register_s:.2f} s, "
                  f"unregister {unregister_s:.2f} s", file=sys.stderr)
            if left > LEAK_SLACK_BYTES:
                raise h.BenchFailed(f"{size:g} GiB: {left / h.MIB:.0f} MiB of shared memory still allocated after the engine "
                                  "unregistered and freed its buffer (the broker kept its mapping?); stopping before the next buffer")
            if broker.process.poll() is not None:
                raise h.BenchFailed(f"the broker died (exit status {broker.process.returncode})")
    time.sleep(0.2)  # let the last log lines reach the file
    logged = step_timings(broker, groups)
    rows = []
    for size in args.sizes_gib:
        ss = samples[size]
        med = {key: float(statistics.median(s[key] for s in ss)) for key in ss[0]}
        steps: dict[str, dict[str, float]] = {}
        per_round = [logged.get((size, r), {}) for r in range(args.repeat)]
        for event in LOG_EVENTS:
            for name in sorted({k for pr in per_round for k in pr.get(event, {})}):
                vals = [pr[event][name] for pr in per_round if name in pr.get(event, {})]
                steps.setdefault(event, {})[name] = float(statistics.median(vals))
        rows.append({"size_gib": size, "bytes": int(med["bytes"]), "allocate_s": med["allocate_s"], "register_s": med["register_s"],
                     "raw_nixl_s": med["raw_nixl_s"], "stall_s": med["stall_s"],
                     "unregister_s": med["unregister_s"],
                     "broker_rss_registered": int(med["broker_rss_registered"]), "broker_rss_after": int(med["broker_rss_after"]),
                     "samples": ss, "broker_steps": steps})
    return {
        "config": {"sizes_gib": args.sizes_gib, "repeat": args.repeat, "layers": args.layers, "page_bytes": page,
                   "engine_touch": args.engine_touch, "broker_args": args.broker_arg, "cpus": os.cpu_count(),
                   "mem_total_gib": h.meminfo_bytes("MemTotal") / h.GIB},
        "broker_rss_start": rss_start, "idle_rtt_s": idle_rtt, "idle_max_s": idle_max, "rows": rows}


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    print(f"kvbroker registration cost: one broker, one engine buffer at a time (median of {c['repeat']}; compare within this "
          "run; nothing is asserted)")
    touch = "written by the engine before registering (--engine-touch)" if c["engine_touch"] else "untouched before registering"
    print(f"model: 8 KV heads, bf16, head dim 128, 16 tokens/page, {c['layers']} layers ({c['page_bytes'] // h.MIB} MiB per page); "
          f"engine pages {touch}; cpus={c['cpus']}")
    idle = res["idle_rtt_s"]
    print(f"\n{'size GiB':>8} {'allocate s':>10} {'register s':>10} {'bare NIXL s':>11} {'x NIXL':>7} {'loop stall ms':>13} "
          f"{'x idle RTT':>10} {'unregister s':>12} {'broker RSS MiB reg/after':>25}")
    for r in res["rows"]:
        print(f"{r['size_gib']:8g} {r['allocate_s']:10.2f} {r['register_s']:10.3f} {r['raw_nixl_s']:11.3f} "
              f"{r['register_s'] / max(r['raw_nixl_s'], 1e-9):7.1f} {r['stall_s'] * 1e3:13.1f} {r['stall_s'] / idle:10.1f} "
              f"{r['unregister_s']:12.2f} {r['broker_rss_registered'] / h.MIB:12.0f} / {r['broker_rss_after'] / h.MIB:<10.0f}")
    print(f"idle Poll round trip: median of 200 {idle * 1e3:.2f} ms, longest over 3 s {res['idle_max_s'] * 1e3:.1f} ms; targets: 4 GiB registered in <= 1 s and <= 3x bare "
          "NIXL, the loop's stall (registering, then faulting the memory in) <= 5x its idle round trip")
    if any(r["broker_steps"] for r in res["rows"]):
        print("broker step timings from its log (median s):")
        for r in res["rows"]:
            for event, fields in r["broker_steps"].items():
                print(f"  {r['size_gib']:g} GiB {event}: " + ", ".join(f"{k} {v:.3f}" for k, v in fields.items()))
    if res["broker_rss_start"]:
        print(f"broker RSS before any registration: {res['broker_rss_start'] / h.MIB:.0f} MiB")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Seconds to register and unregister big engine buffers with one broker "
                                "(docs/benchmarks.md).", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-gib", type=lambda text: [float(x) for x in text.split(",") if x.strip()], default=[1.0, 4.0, 8.0],
                   help="comma-separated")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is printed")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--engine-touch", action="store_true", help="the engine writes every page before registering (default: pages untouched)")
    h.add_run_options(p, brokers="")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.layers < 1 or not args.sizes_gib or min(args.sizes_gib) <= 0:
        p.error("--repeat and --layers must be at least 1, --sizes-gib positive")
    total = h.meminfo_bytes("MemAvailable")
    if max(args.sizes_gib) * h.GIB > 0.8 * total:
        print(f"registration_bench: {max(args.sizes_gib):g} GiB is more than 80% of the available {total / h.GIB:.1f} GiB", file=sys.stderr)
        return 1
    return h.bench_main("registration_bench", args, lambda held: run(args, held), print_report)

if __name__ == "__main__":
    sys.exit(main())

"""Seconds to register (and unregister) 1, 4 and 8 GiB engine buffers with one broker.

    python bench/registration_bench.py                      # sizes 1,4,8 GiB, once each: ~1 minute here
    python bench/registration_bench.py --repeat 3           # median of 3, sizes interleaved
    python bench/registration_bench.py --engine-touch       # the engine writes its pages first
    python bench/registration_bench.py --json               # one JSON line

What is measured. One ``kvbroker serve`` process on 127.0.0.1 (started with
``kvbroker.testing.BrokerProcess``) and one engine client in this process.
For each size in ``--sizes-gib`` (and each of ``--repeat`` rounds, sizes
interleaved), a prefill engine rank of a model with 8 KV heads, bfloat16,
head dim 128, pages of 16 tokens and ``--layers`` layers (2 MiB per page with
32 layers) allocates a KV pool of about that many bytes and:

allocate_s    ``EngineMemory.allocate`` (a sealed memfd, mapped here, zero
              bytes; guard canaries written). With ``--engine-touch`` it also
              writes one byte of every 4 KiB page, so every page is resident
              before the broker sees it: the cost a real engine pays when it
              writes its pool, moved out of the broker. Without it (the
              default: an engine registering right after start-up) the pages
              do not exist yet and the broker's mapping creates them. This is
              the engine's cost, not the broker's.
register_s    ``BrokerClient.register_engine``: fd upload over the fd socket
              and RegisterEngine, in which the broker maps the buffer
              and faults its pages in, registers it with NIXL and prepares the
              descriptor lists; until the call returns.
unregister_s  ``EngineHandle.close()`` (UnregisterEngine): the broker
              deregisters from NIXL and unmaps; until the call returns.

then frees the memory (``EngineMemory.close``) before the next size, so at
most one buffer exists at a time; the run checks (``Shmem`` in
/proc/meminfo) that each buffer's memory really went away and fails if not.

Printed: a table of size (GiB, actual bytes of the buffer), allocate s,
register s, register s per GiB, unregister s, and the broker's RSS after
unregistering; then the linearity figure, register s per GiB of the largest
size over the smallest (1.0: cost proportional to size; above: worse than
linear). If the broker's log has an ``engine_registered`` (or
``engine_released``/``engine_unregistered``) JSON line for the rank with
numeric fields ending in ``_s`` (step timings such as ``import_s``,
``register_s``, ``prepare_s``), they are printed per size too (median over
rounds); a broker that logs none shows nothing there.

How to read it. Compare within one run; this VM varies by 15-30%. On this
machine faulting in fresh shared memory is slow (a few s/GiB), so whoever
touches the pages first (the engine with ``--engine-touch``, otherwise the
broker inside RegisterEngine) pays most of the time; run both ways to see
the split. How fast fresh pages fault in also depends on what the VM did
with that memory recently (a size right after a bigger one was freed can be
2-3x faster), so single rounds scatter and the linearity figure with them:
use ``--repeat 3`` (about 100 s) for figures to quote. No figure is
asserted. Exit status 1 on a failed registration or
unregistration, memory not released, or a broker that died or exited
non-zero; 130 on Ctrl-C. The broker and the scratch directory are removed on
exit.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from common import (
    GIB,
    MIB,
    BenchFailed,
    Held,
    add_run_options,
    bench_main,
    meminfo_bytes,
    model_spec,
    page_bytes,
    release,
    rss_bytes,
)

#: Shared memory left over after a buffer was freed that counts as not released.
LEAK_SLACK_BYTES = 256 * MIB
LOG_EVENTS = ("engine_registered", "engine_released", "engine_unregistered")


def step_timings(
    log_path: Path, groups: dict[str, tuple[float, int]]
) -> dict[tuple[float, int], dict[str, dict[str, float]]]:
    """Numeric ``*_s`` fields of the broker's engine log lines, per (size, round) and event.

    ``groups`` maps an engine group to its (size, round). Lines that are not
    JSON, lack the fields or name another rank are skipped.
    """
    out: dict[tuple[float, int], dict[str, dict[str, float]]] = {}
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") not in LOG_EVENTS:
            continue
        who = str(rec.get("rank") or rec.get("engine") or "")
        key = groups.get(who.split("/", 1)[0])
        if key is None:
            continue
        fields = {
            k: float(v)
            for k, v in rec.items()
            if k.endswith("_s") and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if fields:
            out.setdefault(key, {}).setdefault(str(rec["event"]), {}).update(fields)
    return out


def run(args: argparse.Namespace, held: Held) -> dict[str, Any]:
    import torch

    from kvbroker.client import BrokerClient, EngineMemory, RankSpec

    torch.set_num_threads(1)
    model = model_spec(args.layers)
    page = page_bytes(args.layers)
    broker = held.start_brokers(["broker"], ["--log-level", "info", *args.broker_arg])[0]
    pid = broker.process.pid
    rss_start = rss_bytes(pid)
    client = BrokerClient(broker.address)
    held.clients.append(client)
    tag = secrets.token_hex(3)
    groups: dict[str, tuple[float, int]] = {}
    samples: dict[float, list[dict[str, float]]] = {s: [] for s in args.sizes_gib}
    shmem_base = meminfo_bytes("Shmem")
    for rnd in range(args.repeat):
        for size in args.sizes_gib:
            num_pages = max(1, round(size * GIB / page))
            group = f"regbench-{tag}-{len(groups)}"
            groups[group] = (size, rnd)
            rank = RankSpec(group, "prefill")
            t0 = time.perf_counter()
            memory = EngineMemory.allocate(rank, model, num_pages=num_pages)
            if args.engine_touch:
                assert memory.raw is not None
                pages = memory.raw.numpy()[::4096]
                pages += 0  # a write to every 4 KiB page (contents, guards unchanged)
            allocate_s = time.perf_counter() - t0
            nbytes = sum(spec.size_bytes for _, spec in memory.buffers)
            engine = None
            try:
                t0 = time.perf_counter()
                engine = client.register_engine(rank, memory)
                register_s = time.perf_counter() - t0
                rss_registered = rss_bytes(pid)
                t0 = time.perf_counter()
                engine.close()
                unregister_s = time.perf_counter() - t0
                engine = None
            finally:
                release(engine, memory=memory)
                del memory
                gc.collect()
            left = meminfo_bytes("Shmem") - shmem_base
            sample = {
                "bytes": nbytes,
                "allocate_s": allocate_s,
                "register_s": register_s,
                "unregister_s": unregister_s,
                "broker_rss_registered": rss_registered or 0,
                "broker_rss_after": rss_bytes(pid) or 0,
                "shmem_left": left,
            }
            samples[size].append(sample)
            if not args.json:
                print(
                    f"  round {rnd + 1}/{args.repeat} {size:g} GiB: allocate {allocate_s:.2f} s, "
                    f"register {register_s:.2f} s, unregister {unregister_s:.2f} s",
                    file=sys.stderr,
                )
            if left > LEAK_SLACK_BYTES:
                raise BenchFailed(
                    f"{size:g} GiB: {left / MIB:.0f} MiB of shared memory still allocated after the "
                    "engine unregistered and freed its buffer (the broker kept its mapping?); stopping "
                    "before the next buffer"
                )
            if broker.process.poll() is not None:
                raise BenchFailed(f"the broker died (exit status {broker.process.returncode})")
    time.sleep(0.2)  # let the last log lines reach the file
    logged = step_timings(broker.log_path, groups)

    rows = []
    for size in args.sizes_gib:
        ss = samples[size]

        def med(key: str, ss: list[dict[str, float]] = ss) -> float:
            return float(statistics.median(s[key] for s in ss))

        steps: dict[str, dict[str, float]] = {}
        per_round = [logged.get((size, r), {}) for r in range(args.repeat)]
        for event in LOG_EVENTS:
            names = sorted({k for pr in per_round for k in pr.get(event, {})})
            for name in names:
                vals = [pr[event][name] for pr in per_round if name in pr.get(event, {})]
                steps.setdefault(event, {})[name] = float(statistics.median(vals))
        gib = med("bytes") / GIB
        rows.append(
            {
                "size_gib": size,
                "bytes": int(med("bytes")),
                "allocate_s": med("allocate_s"),
                "register_s": med("register_s"),
                "register_s_per_gib": med("register_s") / gib,
                "unregister_s": med("unregister_s"),
                "broker_rss_registered": int(med("broker_rss_registered")),
                "broker_rss_after": int(med("broker_rss_after")),
                "samples": ss,
                "broker_steps": steps,
            }
        )
    by_size = sorted(rows, key=lambda r: r["bytes"])
    linearity = (
        by_size[-1]["register_s_per_gib"] / by_size[0]["register_s_per_gib"]
        if len(by_size) > 1 and by_size[0]["register_s_per_gib"] > 0
        else None
    )
    return {
        "config": {
            "sizes_gib": args.sizes_gib,
            "repeat": args.repeat,
            "layers": args.layers,
            "page_bytes": page,
            "engine_touch": args.engine_touch,
            "broker_args": args.broker_arg,
            "cpus": os.cpu_count(),
            "mem_total_gib": meminfo_bytes("MemTotal") / GIB,
        },
        "broker_rss_start": rss_start,
        "rows": rows,
        "linearity_register_s_per_gib_largest_over_smallest": linearity,
    }


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        "kvbroker registration cost: one broker, one engine buffer at a time "
        f"(median of {c['repeat']}; compare within this run; nothing is asserted)"
    )
    print(
        f"model: 8 KV heads, bf16, head dim 128, 16 tokens/page, {c['layers']} layers "
        f"({c['page_bytes'] // MIB} MiB per page); engine pages "
        f"{'written by the engine before registering (--engine-touch)' if c['engine_touch'] else 'untouched before registering'}; "
        f"cpus={c['cpus']}"
    )
    print()
    print(
        f"{'size GiB':>8} {'bytes':>12} {'allocate s':>10} {'register s':>10} {'reg s/GiB':>9} "
        f"{'unregister s':>12} {'broker RSS MiB reg/after':>25}"
    )
    for r in res["rows"]:
        print(
            f"{r['size_gib']:8g} {r['bytes']:12d} {r['allocate_s']:10.2f} {r['register_s']:10.2f} "
            f"{r['register_s_per_gib']:9.2f} {r['unregister_s']:12.2f} "
            f"{r['broker_rss_registered'] / MIB:12.0f} / {r['broker_rss_after'] / MIB:<10.0f}"
        )
    lin = res["linearity_register_s_per_gib_largest_over_smallest"]
    print()
    if lin is None:
        print("linearity: needs two sizes")
    else:
        rows = sorted(res["rows"], key=lambda r: r["bytes"])
        print(
            f"linearity: register s/GiB of {rows[-1]['size_gib']:g} GiB over {rows[0]['size_gib']:g} GiB = "
            f"{lin:.2f} (1.0: proportional to size)"
        )
    if any(r["broker_steps"] for r in res["rows"]):
        print("broker step timings from its log (median s):")
        for r in res["rows"]:
            for event, fields in r["broker_steps"].items():
                text = ", ".join(f"{k} {v:.3f}" for k, v in fields.items())
                print(f"  {r['size_gib']:g} GiB {event}: {text}")
    else:
        print(
            "broker step timings: none in the broker's log (no numeric *_s fields on engine_registered)"
        )
    if res["broker_rss_start"]:
        print(f"broker RSS before any registration: {res['broker_rss_start'] / MIB:.0f} MiB")
    if c["broker_args"]:
        print(f"broker started with extra arguments: {' '.join(c['broker_args'])}")


def parse_sizes(text: str) -> list[float]:
    try:
        sizes = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not sizes or any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return sizes


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Seconds to register and unregister big engine buffers with one broker "
        "(see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--sizes-gib", type=parse_sizes, default=[1.0, 4.0, 8.0], help="comma-separated")
    p.add_argument("--repeat", type=int, default=1, help="rounds; the median is printed")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--engine-touch",
        action="store_true",
        help="the engine writes every page before registering (default: pages untouched)",
    )
    add_run_options(p, brokers="")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.layers < 1:
        p.error("--repeat and --layers must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    total = meminfo_bytes("MemAvailable")
    if max(args.sizes_gib) * GIB > 0.8 * total:
        print(
            f"registration_bench: {max(args.sizes_gib):g} GiB is more than 80% of the available "
            f"{total / GIB:.1f} GiB",
            file=sys.stderr,
        )
        return 1
    return bench_main("registration_bench", args, lambda held: run(args, held), print_report=print_report)


if __name__ == "__main__":
    sys.exit(main())

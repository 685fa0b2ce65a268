"""Priorities and fair shares: an interactive engine's 1-page rooms while a bulk engine keeps the host busy, with the
brokers first come first served (--no-priorities) and with classes; and two bulk engines' byte shares.

    python bench/priority_bench.py [--bulk-mib 256] [--bulk-inflight 3] [--load-seconds 6] [--interval-ms 20]
    python bench/priority_bench.py --fake-vram     # the same through the device path (a fake GPU on each side)

The method and the figures: docs/benchmarks.md. Engine A (bulk) keeps --bulk-inflight rooms of --bulk-mib in flight;
engine B (interactive) opens one 1-page room every --interval-ms (whether those before ended or not) and times
ExpectRoom to SUCCESS on its decode side.
Every room's bytes are checked (B's whole, A's first and last page); any failure fails the run.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Sequence
from typing import Any

import harness as h

from kvbroker.testing.fake_cuda import FakeCudaLib, as_fake_vram
from kvbroker.testing.fake_gpu import FAKE_GPUS_ENV, GRANULARITY
from kvbroker.testing.idle import wait_until_warm
from kvbroker.testing.load import RoomLoad, Saturate, room_bytes, timed_rooms

MODES = {"fifo": ["--no-priorities"], "priorities": []}


def measure(a: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    model = h.model_spec(a.layers, kv_heads=a.heads, head_dim=a.head_dim, page_size=a.page_tokens)
    bulk_pages = max(1, (a.bulk_mib << 20) // room_bytes(model, 1))
    res = held.result
    res.update(args=vars(a), bulk_room_bytes=room_bytes(model, bulk_pages), probe_bytes=room_bytes(model, 1), modes={})
    held.say(f"model: {a.layers} layers x {a.heads} KV heads x {a.head_dim}, {a.page_tokens}-token pages "
             f"({room_bytes(model, 1) >> 10} KiB); bulk rooms {bulk_pages} pages ({res['bulk_room_bytes'] / 2**20:.0f} MiB), "
             f"{a.bulk_inflight} in flight per bulk engine; KV in "
             + (f"fake VRAM (packed parts of {a.part_mib} MiB)" if a.fake_vram else "DRAM"))
    for mode in a.modes.split(","):
        res["modes"][mode] = run_mode(a, held, mode, MODES[mode], model, bulk_pages)
        held.say(f"  measured: {mode}")
    return res


def run_mode(a: argparse.Namespace, held: h.Held, mode: str, flags: list[str], model: Any, bulk_pages: int) -> dict[str, Any]:
    """Both brokers started with ``flags``: B idle, B under A's load (A's GB/s), two bulk engines' shares."""
    fake = FakeCudaLib(devices=1, granularity=GRANULARITY) if a.fake_vram else None  # the engines' driver, here
    env = {**os.environ, FAKE_GPUS_ENV: "1"} if fake else None
    device = ["--device-part-mib", str(a.part_mib), "--device-buffer-mib", str(4 * a.part_mib)] if fake else []
    brokers = held.start_brokers([f"prefill-{mode}", f"decode-{mode}"], [*flags, *device, *a.broker_arg, "--log-level", "warning"], env)
    p, d = (b.address for b in brokers)
    vram = functools.partial(as_fake_vram, fake=fake) if fake else None

    def load(name: str, pages: int, slots: int, priority: str) -> RoomLoad:
        made = RoomLoad.register(p, d, name=f"{name}-{mode}", model=model, room_pages=pages, slots=slots, priority=priority,
                                 prepare=vram)
        held.defer(f"closing {name}", made.close)
        return made

    bulk = [load(f"bulk{i}", bulk_pages, a.bulk_inflight + 1, "bulk") for i in (1, 2)]
    chat = load("chat", 1, 64, "interactive")
    out: dict[str, Any] = {"warm_wait_s": wait_until_warm(*brokers)}  # idle figures only once the memory is warm
    timed_rooms(chat, 10, 0)  # warm-up
    out["idle_s"] = timed_rooms(chat, a.probes, a.interval_ms / 1e3)
    a_load = Saturate(bulk[0], a.bulk_inflight).start()
    time.sleep(a.warmup)
    t0 = time.monotonic()
    out["loaded_s"] = timed_rooms(chat, 10**9, a.interval_ms / 1e3, stop=lambda: time.monotonic() > t0 + a.load_seconds)
    t1 = time.monotonic()
    out["bulk_gbps"] = a_load.bytes_between(t0, t1) / (t1 - t0) / 1e9
    both = [a_load, Saturate(bulk[1], a.bulk_inflight).start()]
    time.sleep(a.warmup)
    t0 = time.monotonic()
    time.sleep(a.shares_seconds)
    moved = [s.bytes_between(t0, time.monotonic()) for s in both]
    for s in both:
        s.stop()
    out["shares"] = [m / max(1, sum(moved)) for m in moved]
    for step in [s[1] for s in held.steps if s[0].startswith("closing")]:
        held.now(step)
    for b in brokers:
        held.brokers.remove(b)
        if (code := b.stop()) != 0:
            held.problems.append(f"broker {b.name} exited with status {code}:\n{b.log_tail(1500)}")
    return out


def report(res: dict[str, Any]) -> None:
    def ms(values: Sequence[float], q: float) -> float:
        return h.percentile(values, q) * 1e3

    modes = res["modes"]
    print(f"\n{'brokers':<12}{'B idle p50/p99 ms':>20}{'B loaded p50/p99 ms':>22}{'p99 / idle p99':>16}{'A GB/s':>9}"
          f"{'two bulk shares':>18}")
    for mode, m in modes.items():
        idle, loaded = m["idle_s"], m["loaded_s"]
        print(f"{mode:<12}{ms(idle, 0.5):>10.2f} /{ms(idle, 0.99):>7.2f}{ms(loaded, 0.5):>12.2f} /{ms(loaded, 0.99):>7.2f}"
              f"{ms(loaded, 0.99) / ms(idle, 0.99):>16.2f}{m['bulk_gbps']:>9.2f}{m['shares'][0]:>11.2f} /{m['shares'][1]:>5.2f}")
    print("B idle: timed once no engine's memory warmed (ListEngines): " + ", ".join(f"{k} {m['warm_wait_s']:.1f} s" for k, m in modes.items()))
    if set(modes) == set(MODES):
        pri, fifo = modes["priorities"], modes["fifo"]
        ratio = ms(pri["loaded_s"], 0.99) / ms(pri["idle_s"], 0.99)
        keep = pri["bulk_gbps"] / fifo["bulk_gbps"] if fifo["bulk_gbps"] else 0.0
        skew = max(abs(s - 0.5) / 0.5 for s in pri["shares"])
        print("\ntargets, from this run")
        print(f"  B p99 under load <= 2x its idle p99 (priorities): {ratio:.2f}x -> {'MET' if ratio <= 2 else 'NOT MET'}"
              f" (FIFO: {ms(fifo['loaded_s'], 0.99) / ms(fifo['idle_s'], 0.99):.2f}x)")
        print(f"  A keeps >= 90% of its FIFO throughput: {keep:.0%} -> {'MET' if keep >= 0.9 else 'NOT MET'}")
        print(f"  two bulk engines' shares equal within 15%: {skew:.0%} off -> {'MET' if skew <= 0.15 else 'NOT MET'}")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--bulk-mib", type=int, default=256, help="bytes of one bulk room, MiB")
    add("--bulk-inflight", type=int, default=3, help="bulk rooms each bulk engine keeps in flight")
    add("--probes", type=int, default=150, help="interactive rooms timed idle")
    add("--load-seconds", type=float, default=6.0, help="seconds interactive rooms are timed under load (and A's bytes counted)")
    add("--interval-ms", type=float, default=20.0, help="one interactive room every this many ms")
    add("--warmup", type=float, default=1.0, help="seconds of load before timing")
    add("--shares-seconds", type=float, default=8.0, help="seconds the two bulk engines' bytes are counted")
    add("--layers", type=int, default=8)
    add("--heads", type=int, default=8)
    add("--head-dim", type=int, default=128)
    add("--page-tokens", type=int, default=16)
    add("--modes", default="fifo,priorities", help="which brokers: fifo (--no-priorities), priorities (comma list)")
    add("--fake-vram", action="store_true", help="KV in fake VRAM: brokers on a fake GPU, rooms through the device path's packed parts")
    add("--part-mib", type=int, default=4, help="--fake-vram: --device-part-mib (transfer buffers of four parts)")
    h.add_run_options(p)
    a = p.parse_args(argv)
    return h.bench_main("priority_bench", a, lambda held: measure(a, held), report)


if __name__ == "__main__":
    raise SystemExit(main())

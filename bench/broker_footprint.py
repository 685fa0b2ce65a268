"""Idle footprint of a broker: CPU while nothing happens, memory, and what it has loaded.

    python bench/broker_footprint.py              # ~30 s: two 10 s windows (--seconds)

Nothing is asserted; a failed warm-up room (bytes checked), a waiting room that ends or a dead broker exits 1.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import harness as h
import numpy as np

from kvbroker.client import RoomState

LIBRARIES = {"libtorch": "libtorch", "libc10": "libc10", "libcuda": "libcuda.so", "libcudart": "libcudart"}  # name: prefix


def mib(pid: int, field: str = "VmRSS") -> float | None:
    kib = h.proc_status(pid, field)
    return None if kib is None else kib / 1024


def libraries(pid: int) -> dict[str, list[str]]:
    """Mapped files matching each of LIBRARIES (basenames, sorted)."""
    with open(f"/proc/{pid}/maps") as f:
        names = {os.path.basename(p[5].strip().removesuffix(" (deleted)"))
                 for line in f if len(p := line.split(maxsplit=5)) == 6 and p[5].startswith("/")}
    return {key: sorted(n for n in names if n.startswith(prefix)) for key, prefix in LIBRARIES.items()}


def measure_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process used over ``seconds`` of wall time."""
    before, t0 = h.cpu_snapshot(pids), time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {name: 100.0 * s / wall for name, s in h.cpu_delta(before, h.cpu_snapshot(pids), 1.0).items()}


def bare_python_rss() -> float | None:
    """VmRSS (MiB) of a child that imported grpc and numpy, read from outside."""
    code = "import grpc, numpy, sys; print('ready', flush=True); sys.stdin.read()"
    with subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stdin is not None
        ready = proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)
        rss = mib(proc.pid) if ready else None
        proc.stdin.close()  # it exits; leaving the block waits for it
    return rss


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    failures: list[str] = []
    result: dict[str, Any] = {"failures": failures, "bare_python_grpc_numpy_rss_mib": bare_python_rss()}
    p_broker, d_broker = held.start_brokers(["P", "D"], ["--log-level", "info", *args.broker_arg])
    pids = {"P": p_broker.process.pid, "D": d_broker.process.pid}
    time.sleep(args.settle)
    rss = {n: {"start": mib(pid)} for n, pid in pids.items()}
    rss_parts = {n: {part: mib(pid, part) for part in ("RssAnon", "RssFile", "RssShmem")} for n, pid in pids.items()}
    threads = {n: {"start": h.proc_status(pid, "Threads")} for n, pid in pids.items()}
    model = h.model_spec(args.layers)
    prefill = held.group(p_broker.address, "prefill", model, args.pages, seed=1)
    decode = held.group(d_broker.address, "decode", model, args.pages)
    eng_p, eng_d, ref = prefill.engines[0], decode.engines[0], prefill.ref()
    pool = sum(spec.size_bytes for _, spec in prefill.memories[0].buffers)
    # Warm-up room: handshake, NIXL connection, one transfer; checked byte for byte.
    room_base = secrets.randbits(40) << 8
    n = min(8, args.pages)
    src, dst = np.arange(n, dtype=np.int32), np.arange(n, dtype=np.int32)[::-1].copy()
    _, bad = h.move_room(room_base, eng_p, [eng_d], ref, src, dst, n, args.timeout)
    if bad:
        raise h.BenchFailed(f"the warm-up room failed: {bad}")
    h.check_kv("warm-up room", prefill, decode, src, dst)
    time.sleep(args.settle)
    cpu_idle = measure_cpu(pids, args.seconds)
    # A room whose prefill side never sends.
    pending = room_base + 1
    receiver = eng_d.receiver(pending, ref)
    receiver.init(np.arange(n, dtype=np.int32))
    try:
        state = RoomState(h.wait_open(eng_d, [pending], args.timeout)[pending].state)
    except h.BenchFailed as exc:
        raise h.BenchFailed(f"the waiting room is not waiting for data: {exc}") from None
    time.sleep(args.settle)
    cpu_waiting = measure_cpu(pids, args.seconds)
    end_state = RoomState(receiver.poll())
    if end_state in (RoomState.FAILED, RoomState.SUCCESS):
        failures.append(f"the waiting room ended ({end_state.name}: {receiver.status().cause.message}) before its window "
                        "closed: the figure does not show a waiting room throughout")
    receiver.abort("broker_footprint: done measuring")
    for name, pid in pids.items():
        rss[name]["after_runs"] = mib(pid)
        threads[name]["after_runs"] = h.proc_status(pid, "Threads")
    libs = {name: libraries(pid) for name, pid in pids.items()}
    held.release(prefill, decode)
    time.sleep(args.settle)
    for name, pid in pids.items():
        rss[name]["engines_closed"] = mib(pid)
    return result | {
        "config": {"seconds": args.seconds, "layers": args.layers, "pages": args.pages, "engine_pool_mib": pool / h.MIB,
                   "broker_args": args.broker_arg, "cpus": os.cpu_count(), "clk_tck": os.sysconf("SC_CLK_TCK")},
        "pids": pids, "cpu_percent_of_one_core": {"idle": cpu_idle, "waiting_room": cpu_waiting},
        "waiting_room_state": {"before": state.name, "after": end_state.name}, "rss_mib": rss, "rss_start_parts_mib": rss_parts,
        "threads": threads, "libraries": libs}


def print_report(res: dict[str, Any]) -> None:
    c, cpu, rss, parts, th, libs = (res[k] for k in ("config", "cpu_percent_of_one_core", "rss_mib", "rss_start_parts_mib", "threads", "libraries"))
    print(f"kvbroker broker footprint: two brokers (P prefill, D decode), one engine each ({c['engine_pool_mib']:.0f} MiB pools), "
          f"{c['seconds']:g} s windows (clock tick 1/{c['clk_tck']} s; nothing is asserted)")
    print(f"\n{'':34} {'P':>10} {'D':>10}")
    print(f"{'CPU idle, % of one core':34} {cpu['idle']['P']:10.2f} {cpu['idle']['D']:10.2f}")
    print(f"{'CPU, one room waiting for data':34} {cpu['waiting_room']['P']:10.2f} {cpu['waiting_room']['D']:10.2f}")

    def mb(v: float | None) -> str:
        return "?" if v is None else f"{v:.0f}"

    rows = [("RSS MiB right after start", rss["P"].get("start"), rss["D"].get("start"))]
    rows += [(label, parts["P"][part], parts["D"][part]) for part, label in (
        ("RssAnon", "  of which anon (heap)"), ("RssFile", "  of which file (code, libraries)"),
        ("RssShmem", "  of which shmem (staging buffers)"))]
    rows += [("RSS MiB after the runs", rss["P"].get("after_runs"), rss["D"].get("after_runs")),
             ("RSS MiB after engines unregistered", rss["P"].get("engines_closed"), rss["D"].get("engines_closed"))]
    for label, pv, dv in rows:
        print(f"{label:34} {mb(pv):>10} {mb(dv):>10}")
    print(f"{'threads (start / after runs)':34} " + " ".join(f"{str(th[s]['start']) + ' / ' + str(th[s]['after_runs']):>10}" for s in "PD"))
    for lib in LIBRARIES:
        found = libs["P"][lib] or libs["D"][lib]
        print(f"{lib + ' mapped':34} " + " ".join(f"{'yes' if libs[s][lib] else 'no':>10}" for s in "PD")
              + (f"   ({', '.join(found)})" if found else ""))
    print(f'\nreference: bare `python -c "import grpc, numpy"` RSS {mb(res["bare_python_grpc_numpy_rss_mib"])} MiB')
    ws = res["waiting_room_state"]
    print(f"waiting room: {ws['before']} when the window opened, {ws['after']} when it closed")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Idle CPU, RSS and loaded libraries of a broker (docs/benchmarks.md).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0, help="length of each CPU window")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pages", type=int, default=64, help="pages of each engine's pool")
    p.add_argument("--settle", type=float, default=1.0, help="seconds to wait before each reading")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any one step")
    h.add_run_options(p)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.layers < 1 or args.pages < 1 or args.settle < 0:
        p.error("--seconds, --layers and --pages must be positive, --settle not negative")
    return h.bench_main("broker_footprint", args, lambda held: run(args, held), print_report)

if __name__ == "__main__":
    sys.exit(main())

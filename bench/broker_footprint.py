"""Idle footprint of a broker: CPU while nothing happens, memory, and what it has loaded.

    python bench/broker_footprint.py              # ~30 s: two 10 s windows
    python bench/broker_footprint.py --seconds 30
    python bench/broker_footprint.py --json       # one JSON line

What is measured. Two ``kvbroker serve`` processes on 127.0.0.1 (a prefill
broker P and a decode broker D, default options plus ``--broker-arg``). A
prefill engine rank registers with P and a decode rank with D, both from this
process (a small model: ``--layers`` layers, 8 KV heads, bfloat16, head dim
128, pages of 16 tokens, ``--pages`` pages each), and one warm-up room moves
(handshake, NIXL connection; its bytes are compared with the source). Then:

idle          ``--seconds`` with nothing happening (engines registered, no
              room open, nobody calling). CPU of each broker process is
              utime + stime from /proc/PID/stat (all threads), before and
              after, divided by SC_CLK_TCK and by the wall time: % of one
              core.
waiting room  the decode rank opens a room (ExpectRoom on D) whose prefill
              side never sends: D handshakes, registers the room at P and
              then waits for data, which makes it poll NIXL notifications
              (backing off to once a millisecond: docs/architecture.md) and
              ping P once a second.
              After the room reaches WAITING_FOR_INPUT (or later), the same
              measurement over ``--seconds``; then the room is aborted. It
              must still be open at the end of the window, or the run fails.

Memory: each broker's VmRSS from /proc/PID/status right after it serves
(before any engine registers), after the two windows (engines still
registered) and after the engines unregistered; also its thread count.
Libraries: /proc/PID/maps of each broker scanned for libtorch*, libc10*,
libcuda.so* and libcudart* (yes/no each, with the files found); a broker
that has torch mapped pays its import time and memory although it does not
compute. Reference: the RSS of a bare ``python -c "import grpc, numpy"``
child (read the same way), the floor for a Python gRPC process.

How to read it. Idle CPU should be near 0% (nothing polls when idle); the
waiting-room figure is the cost of keeping one room open (mostly the NIXL
notification poll). RSS includes the staging buffers (two of ``--staging-mib``
each, mapped populated) and, after registration, nothing of the engines'
pools unless the broker maps them populated (then they count in RSS as
shared pages). Nothing is asserted about the figures. Exit status 1 on a
failed or mismatched warm-up room, the waiting room ending before its window
closed, or a broker that died or exited non-zero; 130 on Ctrl-C. Every
process and the scratch directory are removed on exit.
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

from common import (
    MIB,
    BenchFailed,
    Held,
    add_run_options,
    bench_main,
    cpu_seconds,
    fill_pattern,
    kv_mismatches,
    model_spec,
    move_room,
    proc_status,
    wait_open,
)

LIBRARIES = {
    "libtorch": lambda name: name.startswith("libtorch"),
    "libc10": lambda name: name.startswith("libc10"),
    "libcuda": lambda name: name.startswith("libcuda.so"),
    "libcudart": lambda name: name.startswith("libcudart"),
}


def rss_mib(pid: int) -> float | None:
    kib = proc_status(pid, "VmRSS")
    return None if kib is None else kib / 1024


def libraries(pid: int) -> dict[str, list[str]]:
    """Mapped files matching each of LIBRARIES (basenames, sorted)."""
    found: dict[str, set[str]] = {k: set() for k in LIBRARIES}
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or not parts[5].startswith("/"):
                continue
            base = os.path.basename(parts[5].strip().removesuffix(" (deleted)"))
            for key, match in LIBRARIES.items():
                if match(base):
                    found[key].add(base)
    return {k: sorted(v) for k, v in found.items()}


def measure_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """% of one core each process used over ``seconds`` of wall time."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    return {name: 100.0 * (cpu_seconds(pid) - before[name]) / wall for name, pid in pids.items()}


def bare_python_rss() -> float | None:
    """VmRSS (MiB) of a child that imported grpc and numpy, read from outside."""
    code = "import grpc, numpy, sys; print('ready', flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            return None
        time.sleep(0.2)
        return rss_mib(proc.pid)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# -- the run -------------------------------------------------------------------------


def run(args: argparse.Namespace, held: Held) -> dict[str, Any]:
    import numpy as np

    from kvbroker.client import RankSpec, RoomState, SenderRef

    failures: list[str] = []
    result: dict[str, Any] = {"failures": failures}
    result["bare_python_grpc_numpy_rss_mib"] = bare_python_rss()

    p_broker, d_broker = held.start_brokers(["P", "D"], ["--log-level", "info", *args.broker_arg])
    pids = {"P": p_broker.process.pid, "D": d_broker.process.pid}
    time.sleep(args.settle)
    rss: dict[str, dict[str, float | None]] = {
        n: {"start": rss_mib(pid)} for n, pid in pids.items()
    }
    rss_parts: dict[str, dict[str, float | None]] = {
        n: {
            part: (None if (kib := proc_status(pid, part)) is None else kib / 1024)
            for part in ("RssAnon", "RssFile", "RssShmem")
        }
        for n, pid in pids.items()
    }
    threads: dict[str, dict[str, int | None]] = {
        n: {"start": proc_status(pid, "Threads")} for n, pid in pids.items()
    }

    model = model_spec(args.layers)
    tag = secrets.token_hex(3)
    group_p, group_d = f"fp-prefill-{tag}", f"fp-decode-{tag}"
    rank_p, rank_d = RankSpec(group_p, "prefill"), RankSpec(group_d, "decode")
    mem_p = held.allocate(rank_p, model, num_pages=args.pages)
    mem_d = held.allocate(rank_d, model, num_pages=args.pages)
    pool_bytes = sum(spec.size_bytes for _, spec in mem_p.buffers)
    for layer in range(args.layers):
        fill_pattern(mem_p.k[layer], 2 * layer + 1)
        fill_pattern(mem_p.v[layer], 2 * layer + 2)
    eng_p = held.register(p_broker.address, rank_p, mem_p)
    eng_d = held.register(d_broker.address, rank_d, mem_d)
    ref = SenderRef(p_broker.address, group_p)

    # Warm-up room: handshake, NIXL connection, one transfer; checked byte for byte.
    room_base = secrets.randbits(40) << 8
    n = min(8, args.pages)
    src = np.arange(n, dtype=np.int32)
    dst = np.arange(n, dtype=np.int32)[::-1].copy()
    _, bad = move_room(room_base, eng_p, [eng_d], ref, src, dst, n, args.timeout)
    if bad:
        raise BenchFailed(f"the warm-up room failed: {bad}")
    wrong = kv_mismatches("warm-up room", [mem_p], [mem_d], src, dst)
    if wrong:
        raise BenchFailed(wrong[0])

    time.sleep(args.settle)
    cpu_idle = measure_cpu(pids, args.seconds)

    # A room whose prefill side never sends.
    pending = room_base + 1
    receiver = eng_d.receiver(pending, ref)
    receiver.init(np.arange(n, dtype=np.int32))
    try:
        state = RoomState(wait_open(eng_d, [pending], args.timeout)[pending].state)
    except BenchFailed as exc:
        raise BenchFailed(f"the waiting room is not waiting for data: {exc}") from None
    time.sleep(args.settle)
    cpu_waiting = measure_cpu(pids, args.seconds)
    end_state = RoomState(receiver.poll())
    if end_state in (RoomState.FAILED, RoomState.SUCCESS):
        failures.append(
            f"the waiting room ended ({end_state.name}: {receiver.status().cause.message}) before its "
            "window closed: the figure does not show a waiting room throughout"
        )
    receiver.abort("broker_footprint: done measuring")

    for name, pid in pids.items():
        rss[name]["after_runs"] = rss_mib(pid)
        threads[name]["after_runs"] = proc_status(pid, "Threads")
    libs = {name: libraries(pid) for name, pid in pids.items()}
    for eng in (eng_p, eng_d):
        eng.close()
    time.sleep(args.settle)
    for name, pid in pids.items():
        rss[name]["engines_closed"] = rss_mib(pid)

    result.update(
        {
            "config": {
                "seconds": args.seconds,
                "layers": args.layers,
                "pages": args.pages,
                "engine_pool_mib": pool_bytes / MIB,
                "broker_args": args.broker_arg,
                "cpus": os.cpu_count(),
                "clk_tck": os.sysconf("SC_CLK_TCK"),
            },
            "pids": pids,
            "cpu_percent_of_one_core": {"idle": cpu_idle, "waiting_room": cpu_waiting},
            "waiting_room_state": {"before": state.name, "after": end_state.name},
            "rss_mib": rss,
            "rss_start_parts_mib": rss_parts,
            "threads": threads,
            "libraries": libs,
        }
    )
    return result


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    cpu = res["cpu_percent_of_one_core"]
    print(
        "kvbroker broker footprint: two brokers (P prefill, D decode), one engine each "
        f"({c['engine_pool_mib']:.0f} MiB pools), {c['seconds']:g} s windows "
        f"(clock tick 1/{c['clk_tck']} s; nothing is asserted)"
    )
    print()
    print(f"{'':34} {'P':>10} {'D':>10}")
    print(f"{'CPU idle, % of one core':34} {cpu['idle']['P']:10.2f} {cpu['idle']['D']:10.2f}")
    print(
        f"{'CPU, one room waiting for data':34} {cpu['waiting_room']['P']:10.2f} "
        f"{cpu['waiting_room']['D']:10.2f}"
    )

    def mib(v: float | None) -> str:
        return "?" if v is None else f"{v:.0f}"

    rss = res["rss_mib"]
    parts = res["rss_start_parts_mib"]
    rows = [("RSS MiB right after start", rss["P"].get("start"), rss["D"].get("start"))]
    for part, label in (
        ("RssAnon", "  of which anon (heap)"),
        ("RssFile", "  of which file (code, libraries)"),
        ("RssShmem", "  of which shmem (staging buffers)"),
    ):
        rows.append((label, parts["P"][part], parts["D"][part]))
    rows.append(("RSS MiB after the runs", rss["P"].get("after_runs"), rss["D"].get("after_runs")))
    rows.append(
        (
            "RSS MiB after engines unregistered",
            rss["P"].get("engines_closed"),
            rss["D"].get("engines_closed"),
        )
    )
    for label, pv, dv in rows:
        print(f"{label:34} {mib(pv):>10} {mib(dv):>10}")
    th = res["threads"]
    print(
        f"{'threads (start / after runs)':34} {str(th['P']['start']) + ' / ' + str(th['P']['after_runs']):>10} "
        f"{str(th['D']['start']) + ' / ' + str(th['D']['after_runs']):>10}"
    )
    libs = res["libraries"]
    for lib in LIBRARIES:
        print(
            f"{lib + ' mapped':34} {'yes' if libs['P'][lib] else 'no':>10} {'yes' if libs['D'][lib] else 'no':>10}"
            + (
                f"   ({', '.join(libs['P'][lib] or libs['D'][lib])})"
                if libs["P"][lib] or libs["D"][lib]
                else ""
            )
        )
    print()
    print(
        f'reference: bare `python -c "import grpc, numpy"` RSS {mib(res["bare_python_grpc_numpy_rss_mib"])} MiB'
    )
    ws = res["waiting_room_state"]
    print(f"waiting room: {ws['before']} when the window opened, {ws['after']} when it closed")
    if c["broker_args"]:
        print(f"brokers started with extra arguments: {' '.join(c['broker_args'])}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Idle CPU, RSS and loaded libraries of a broker (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=10.0, help="length of each CPU window")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--pages", type=int, default=64, help="pages of each engine's pool")
    p.add_argument("--settle", type=float, default=1.0, help="seconds to wait before each reading")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any one step")
    add_run_options(p)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.layers < 1 or args.pages < 1 or args.settle < 0:
        p.error("--seconds, --layers and --pages must be positive, --settle not negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main("broker_footprint", args, lambda held: run(args, held), print_report=print_report)


if __name__ == "__main__":
    sys.exit(main())

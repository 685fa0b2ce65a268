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
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from outcome import finish
from proccpu import cpu_seconds

os.environ.setdefault("UCX_NET_DEVICES", "lo")

KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
MIB = 1 << 20
LIBRARIES = {
    "libtorch": lambda name: name.startswith("libtorch"),
    "libc10": lambda name: name.startswith("libc10"),
    "libcuda": lambda name: name.startswith("libcuda.so"),
    "libcudart": lambda name: name.startswith("libcudart"),
}


class BenchFailed(RuntimeError):
    """Something the run depends on failed: the figures are not valid."""


# -- /proc --------------------------------------------------------------------------


def status_field(pid: int, name: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rss_mib(pid: int) -> float | None:
    kib = status_field(pid, "VmRSS")
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


def run(args: argparse.Namespace, workdir: Path, held: dict[str, list[Any]]) -> dict[str, Any]:
    import numpy as np
    import torch

    from kvbroker.client import (
        BrokerClient,
        EngineMemory,
        ModelSpec,
        RankSpec,
        RoomState,
        SenderRef,
    )
    from kvbroker.testing import BrokerProcess

    failures: list[str] = []
    result: dict[str, Any] = {"failures": failures}
    result["bare_python_grpc_numpy_rss_mib"] = bare_python_rss()

    held["brokers"].extend(
        BrokerProcess.start_many(["P", "D"], workdir, ["--log-level", "info", *args.broker_arg])
    )
    p_broker, d_broker = held["brokers"]
    pids = {"P": p_broker.process.pid, "D": d_broker.process.pid}
    time.sleep(args.settle)
    rss: dict[str, dict[str, float | None]] = {
        n: {"start": rss_mib(pid)} for n, pid in pids.items()
    }
    rss_parts: dict[str, dict[str, float | None]] = {
        n: {
            part: (None if (kib := status_field(pid, part)) is None else kib / 1024)
            for part in ("RssAnon", "RssFile", "RssShmem")
        }
        for n, pid in pids.items()
    }
    threads: dict[str, dict[str, int | None]] = {
        n: {"start": status_field(pid, "Threads")} for n, pid in pids.items()
    }

    model = ModelSpec(
        num_layers=args.layers,
        total_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
    )
    tag = secrets.token_hex(3)
    group_p, group_d = f"fp-prefill-{tag}", f"fp-decode-{tag}"
    rank_p, rank_d = RankSpec(group_p, "prefill"), RankSpec(group_d, "decode")
    mem_p = EngineMemory.allocate(rank_p, model, num_pages=args.pages)
    mem_d = EngineMemory.allocate(rank_d, model, num_pages=args.pages)
    held["memories"].extend([mem_p, mem_d])
    pool_bytes = sum(spec.size_bytes for _, spec in mem_p.buffers)
    gen = torch.Generator().manual_seed(1)
    for layer in range(args.layers):
        for t in (mem_p.k[layer], mem_p.v[layer]):
            t.view(torch.int16).copy_(
                torch.randint(-32768, 32767, t.shape, dtype=torch.int16, generator=gen)
            )
    cp, cd = BrokerClient(p_broker.address), BrokerClient(d_broker.address)
    held["clients"].extend([cp, cd])
    eng_p = cp.register_engine(rank_p, mem_p)
    held["engines"].append(eng_p)
    eng_d = cd.register_engine(rank_d, mem_d)
    held["engines"].append(eng_d)
    ref = SenderRef(p_broker.address, group_p)

    # Warm-up room: handshake, NIXL connection, one transfer; checked byte for byte.
    room_base = secrets.randbits(40) << 8
    n = min(8, args.pages)
    src = np.arange(n, dtype=np.int32)
    dst = np.arange(n, dtype=np.int32)[::-1].copy()
    eng_d.receiver(room_base, ref).init(dst)
    sender = eng_p.sender(room_base)
    sender.init(num_pages=n)
    sender.send(src)
    statuses = [
        eng_d.wait([room_base], timeout_seconds=args.timeout)[room_base],
        eng_p.wait([room_base], timeout_seconds=args.timeout)[room_base],
    ]
    bad = [s.cause.message for s in statuses if s.state != RoomState.SUCCESS]
    if bad:
        raise BenchFailed(f"the warm-up room failed: {bad}")
    s_idx, d_idx = torch.from_numpy(src).long(), torch.from_numpy(dst).long()
    for layer in range(args.layers):
        for kind in ("k", "v"):
            got = getattr(mem_d, kind)[layer][d_idx].view(torch.int16)
            want = getattr(mem_p, kind)[layer][s_idx].view(torch.int16)
            if not torch.equal(got, want):
                raise BenchFailed(
                    f"warm-up room: layer {layer} {kind.upper()} differs from the source"
                )

    time.sleep(args.settle)
    cpu_idle = measure_cpu(pids, args.seconds)

    # A room whose prefill side never sends.
    pending = room_base + 1
    receiver = eng_d.receiver(pending, ref)
    receiver.init(np.arange(n, dtype=np.int32))
    deadline = time.monotonic() + args.timeout
    state = RoomState(receiver.poll())
    while state == RoomState.BOOTSTRAPPING and time.monotonic() < deadline:
        time.sleep(0.05)
        state = RoomState(receiver.poll())
    if state not in (RoomState.WAITING_FOR_INPUT, RoomState.TRANSFERRING):
        raise BenchFailed(
            f"the waiting room is {state.name}, not waiting for data: {receiver.status().cause.message}"
        )
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
        threads[name]["after_runs"] = status_field(pid, "Threads")
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
    p.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for both `kvbroker serve` (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any one step")
    p.add_argument("--keep-logs", action="store_true", help="keep the broker logs' directory")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.layers < 1 or args.pages < 1 or args.settle < 0:
        p.error("--seconds, --layers and --pages must be positive, --settle not negative")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvb-fp-"))
    held: dict[str, list[Any]] = {"brokers": [], "clients": [], "engines": [], "memories": []}
    result: dict[str, Any] | None = None
    problems: list[str] = []
    interrupted = False
    try:
        result = run(args, workdir, held)
        problems.extend(result["failures"])
    except KeyboardInterrupt:
        interrupted = True
    except BenchFailed as exc:
        problems.append(str(exc))
    except Exception:
        problems.append(traceback.format_exc())
    finally:
        try:
            for engine in held["engines"]:
                try:
                    engine.close()
                except Exception as exc:
                    problems.append(f"unregistering an engine: {exc!r}")
            for client in held["clients"]:
                client.close()
            for memory in held["memories"]:
                memory.close()
            for broker in held["brokers"]:
                if broker.process.poll() is not None:
                    problems.append(
                        f"broker {broker.name} died (exit status {broker.process.returncode}); "
                        f"log tail:\n{broker.log_tail(1500)}"
                    )
                    continue
                code = broker.stop()
                if code != 0:
                    problems.append(f"broker {broker.name} exited with status {code} on SIGTERM")
        finally:
            for broker in held["brokers"]:
                broker.kill()
            if args.keep_logs:
                print(f"broker_footprint: broker logs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    return finish(
        "broker_footprint", result, problems, interrupted=interrupted, as_json=args.json, print_report=print_report
    )


if __name__ == "__main__":
    sys.exit(main())

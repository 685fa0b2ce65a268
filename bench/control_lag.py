"""Control-loop lag probe: how long an engine's Poll takes while the broker is busy.

    python bench/control_lag.py                 # ~30-90 s: 4 GiB registration + a 256 MiB staged room
    python bench/control_lag.py --no-register   # only the room as load
    python bench/control_lag.py --no-room       # only the registration as load
    python bench/control_lag.py --json          # one JSON line (all figures, no samples)

What is measured. Two ``kvbroker serve`` processes on 127.0.0.1: a prefill
broker P and a decode broker D (staging buffers on, ``--staging-mib``). A
"poller" engine (its own spawned process, a tiny decode rank registered on P)
calls ``EngineHandle.poll([room])`` for a room id nobody opened, back to back
(``--poll-interval-ms`` 0 = a tight loop). The broker answers an unknown room
with FAILED / UNKNOWN_ROOM, so each call is a pure engine -> broker -> engine
round trip through P's event loop: when that loop is busy with something
else, the round trip grows. Each call's start time (CLOCK_MONOTONIC, shared by
all processes) and round trip are sent back at the end and sorted into phases:

(a) idle     ``--idle-seconds`` with nothing else happening (all engines of
             the run already registered, the P<->D handshake and NIXL
             connection already made by a small warm-up room);
(b) loaded   from the moment the load starts until all of it has finished:
             (i)  another engine process (spawned) registers a
                  ``--register-gib`` GiB DRAM KV buffer with P. It allocated
                  the buffer (``EngineMemory.allocate``, a sealed memfd; with
                  ``--engine-touch`` it also wrote every page) and connected
                  to P *before* the phase, so only ``register_engine`` (fd
                  upload + RegisterEngine: the broker maps the buffer, faults
                  its pages in, and registers it with NIXL) falls inside;
             (ii) one room of ``--room-mib`` MiB moves from a prefill tp1
                  rank on P to two decode ranks (tp2) on D: 8 KV heads,
                  bfloat16, head dim 128, pages of 16 tokens, ``--layers``
                  layers, chunks of ``--chunk-mib`` MiB (prefill side). Each
                  decode rank holds 4 of the 8 heads, so every chunk is a
                  head slice and goes through the staging buffers. The room
                  is driven from this process (ExpectRoom on both decode
                  ranks, BeginSend, every SendChunk, then WatchRooms until
                  SUCCESS), like an engine would.
             Both start together; the phase ends when both have finished.
(c) unregister (only with the registration) the registering engine calls
             ``EngineHandle.close()``: the broker fails its (no) rooms,
             deregisters and unmaps the buffer. Reported apart; not part of
             the loaded/idle ratios.

For each phase: number of Polls, p50 / p99 / max round trip in microseconds
(a Poll is assigned to the phase in which it started), and how many took more
than 10 ms; then loaded/idle ratios of p50, p99 and max. Also: the
registration time (seen by the registering engine), the allocation time it
paid before the phase (excluded), and the room time (first ExpectRoom to the
last SUCCESS) with its rate.

How to read it. The idle figures are the floor (a gRPC round trip over a unix
socket, two busy processes sharing two cores). A loaded p50 close to the
idle p50 with a large max means rare long stalls: P's event loop did one long
thing (e.g. mapping a big buffer) while every engine's calls waited. The max
in the loaded phase is the longest time an engine's scheduler loop would
have been blocked on a single Poll. Everything runs on this 2-core machine:
the poller's tight loop, two brokers, the room's engines and the
registering engine compete for the cores, so compare the phases of one run,
not absolute numbers between machines. Nothing here asserts a time.

Correctness: after the room, every decode rank's K and V pages are compared
bit for bit with its heads of the prefill pages (and the decode pool's guard
canaries are checked); the room must be SUCCESS on all three ranks. Exit
status 1 on any failed room, byte mismatch, failed or timed-out Poll,
registration failure or a broker that died or exited non-zero; 130 on
Ctrl-C. Every process and the scratch directory are removed on exit.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import sys
import time
from array import array
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from common import (
    GIB,
    HEAD_DIM,
    KV_HEADS,
    MIB,
    PAGE_SIZE,
    BenchFailed,
    Child,
    Held,
    add_run_options,
    bench_main,
    fill_pattern,
    kv_mismatches,
    model_spec,
    move_room,
    page_bytes,
    percentile,
    release,
    report_error,
)

STALL_US = 10_000.0


# -- child processes ---------------------------------------------------------------


def poller_main(conn: Connection, address: str, group: str, room: int, interval_s: float) -> None:
    """Spawned: register a tiny engine on ``address``, Poll ``room`` until told to stop.

    Protocol: sends ("ready", first_status_name); waits for "start"; polls
    until a message arrives ("stop"), then sends ("samples", starts, rtts,
    errors) with two float64 arrays as bytes.
    """
    from kvbroker.client import BrokerClient, EngineMemory, RankSpec
    from kvbroker.errors import KvBrokerError
    from kvbroker.v1 import common_pb2

    rank = RankSpec(group, "decode")
    memory = EngineMemory.allocate(rank, model_spec(1), num_pages=4)
    client = None
    engine = None
    try:
        client = BrokerClient(address)
        engine = client.register_engine(rank, memory)
        rooms = [room]
        status = engine.poll(rooms)[room]
        for _ in range(200):  # warm the channel and the code paths
            engine.poll(rooms)
        conn.send(("ready", common_pb2.RoomState.Name(status.state), status.cause.message))
        if conn.recv() != "start":
            return
        starts = array("d")
        rtts = array("d")
        errors: list[str] = []
        mono = time.monotonic
        while not conn.poll():
            t0 = mono()
            try:
                engine.poll(rooms)
            except KvBrokerError as exc:
                if len(errors) < 20:
                    errors.append(f"{type(exc).__name__}: {exc}")
                else:
                    errors.append("")
            t1 = mono()
            starts.append(t0)
            rtts.append(t1 - t0)
            if interval_s > 0:
                time.sleep(interval_s)
        conn.recv()
        conn.send(("samples", starts.tobytes(), rtts.tobytes(), errors))
    except KeyboardInterrupt:
        pass
    except BaseException:
        report_error(conn)
        raise
    finally:
        release(engine, client, memory)


def registrar_main(
    conn: Connection, address: str, group: str, layers: int, num_pages: int, touch: bool
) -> None:
    """Spawned: allocate a big KV buffer, then register and unregister it on command.

    Sends ("ready", allocate_s, bytes); on "go" registers and sends
    ("registered", t0, t1); on "unregister" closes the engine and sends
    ("unregistered", t0, t1); returns on "exit" (or EOF).
    """
    from kvbroker.client import BrokerClient, EngineMemory, RankSpec

    rank = RankSpec(group, "prefill")
    memory = None
    client = None
    engine = None
    try:
        t0 = time.monotonic()
        memory = EngineMemory.allocate(rank, model_spec(layers), num_pages=num_pages)
        if touch:
            assert memory.raw is not None
            pages = memory.raw.numpy()[::4096]
            pages += 0  # a write to every 4 KiB page (contents, guards unchanged)
        allocate_s = time.monotonic() - t0
        size = sum(spec.size_bytes for _, spec in memory.buffers)
        client = BrokerClient(address)
        conn.send(("ready", allocate_s, size))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg == "go":
                t0 = time.monotonic()
                engine = client.register_engine(rank, memory)
                t1 = time.monotonic()
                conn.send(("registered", t0, t1))
            elif msg == "unregister":
                t0 = time.monotonic()
                if engine is not None:
                    engine.close()
                t1 = time.monotonic()
                conn.send(("unregistered", t0, t1))
            else:
                return
    except KeyboardInterrupt:
        pass
    except BaseException:
        report_error(conn)
        raise
    finally:
        release(engine, client, memory)


# -- statistics --------------------------------------------------------------------


def phase_stats(rtts_s: Sequence[float]) -> dict[str, float | int]:
    if not rtts_s:
        return {"count": 0}
    us = sorted(v * 1e6 for v in rtts_s)
    return {
        "count": len(us),
        "p50_us": percentile(us, 0.50),
        "p99_us": percentile(us, 0.99),
        "max_us": us[-1],
        "mean_us": statistics.fmean(us),
        "over_10ms": sum(1 for v in us if v > STALL_US),
    }


# -- the run ------------------------------------------------------------------------


def run(args: argparse.Namespace, held: Held) -> dict[str, Any]:
    import torch

    from kvbroker.client import RankSpec, SenderRef

    torch.set_num_threads(1)
    model = model_spec(args.layers)
    page_bytes_prefill = page_bytes(args.layers)
    room_pages = max(1, math.ceil(args.room_mib * MIB / page_bytes_prefill)) if args.room else 0
    chunk_pages = max(1, round(args.chunk_mib * MIB / page_bytes_prefill))
    warm_pages = 2
    pool_pages = room_pages + warm_pages
    register_pages = max(1, round(args.register_gib * GIB / page_bytes_prefill))

    extra = ["--log-level", "info", "--staging-mib", str(args.staging_mib), *args.broker_arg]
    p_broker, d_broker = held.start_brokers(["P", "D"], extra)
    tag = secrets.token_hex(3)
    group_p, group_d = f"lag-prefill-{tag}", f"lag-decode-{tag}"

    # The room's engines: one prefill rank on P, two decode ranks on D.
    prefill_rank = RankSpec(group_p, "prefill", tp_size=1, tp_rank=0)
    decode_ranks = [RankSpec(group_d, "decode", tp_size=2, tp_rank=i) for i in range(2)]
    prefill_mem = held.allocate(prefill_rank, model, num_pages=pool_pages)
    for layer in range(args.layers):
        fill_pattern(prefill_mem.k[layer], 2 * layer + 1)
        fill_pattern(prefill_mem.v[layer], 2 * layer + 2)
    decode_mems = [held.allocate(spec, model, num_pages=pool_pages) for spec in decode_ranks]
    prefill = held.register(p_broker.address, prefill_rank, prefill_mem)
    decode = [held.register(d_broker.address, spec, mem) for spec, mem in zip(decode_ranks, decode_mems)]
    ref = SenderRef(p_broker.address, group_p)
    room_base = secrets.randbits(40) << 8

    def move(room: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, list[str]]:
        """One room over ``src``/``dst`` pages: (seconds from the first ExpectRoom to the
        last decode SUCCESS or FAILED, when that was, problems). Verified if it succeeded."""
        t0 = time.monotonic()
        t1, problems = move_room(room, prefill, decode, ref, src.numpy(), dst.numpy(), chunk_pages, args.timeout)
        if not problems:
            problems = verify(src, dst)
        return t1 - t0, t1, problems

    def verify(src: torch.Tensor, dst: torch.Tensor) -> list[str]:
        problems = kv_mismatches("byte mismatch", [prefill_mem], decode_mems, src, dst)
        for i, mem in enumerate(decode_mems):
            problems.extend(f"decode tp{i}: {g}" for g in mem.check_guards())
        return problems[:10]

    gen = torch.Generator().manual_seed(args.seed)
    warm_src = torch.arange(room_pages, pool_pages, dtype=torch.int32)
    warm_dst = warm_src.flip(0).contiguous()
    warm_s, _, warm_problems = move(room_base, warm_src, warm_dst)
    if warm_problems:
        raise BenchFailed(f"the warm-up room failed: {warm_problems}")

    # The load's engines, ready before the idle phase starts.
    registrar: Child | None = None
    allocate_s = 0.0
    register_bytes = 0
    if args.register:
        registrar = held.spawn(
            "registering engine",
            registrar_main,
            p_broker.address,
            f"lag-big-{tag}",
            args.layers,
            register_pages,
            args.engine_touch,
        )
        _, allocate_s, register_bytes = registrar.recv(args.timeout, "ready")
    poll_room = room_base + 200
    poller = held.spawn(
        "poller",
        poller_main,
        p_broker.address,
        f"lag-poller-{tag}",
        poll_room,
        args.poll_interval_ms / 1e3,
    )
    _, unknown_state, unknown_cause = poller.recv(args.timeout, "ready")

    phases: dict[str, tuple[float, float]] = {}
    poller.conn.send("start")
    time.sleep(0.3)  # let the loop settle; not in any phase
    t = time.monotonic()
    time.sleep(args.idle_seconds)
    phases["idle"] = (t, time.monotonic())

    room_s = 0.0
    room_problems: list[str] = []
    register_s = 0.0
    unregister_s = 0.0
    t_load = time.monotonic()
    ends = []
    if registrar is not None:
        registrar.conn.send("go")
    if args.room:
        src = torch.randperm(room_pages, generator=gen).to(torch.int32)
        dst = torch.randperm(room_pages, generator=gen).to(torch.int32)
        room_s, room_end, room_problems = move(room_base + 1, src, dst)
        ends.append(room_end)
    if registrar is not None:
        _, r0, r1 = registrar.recv(args.timeout, "registered")
        register_s = r1 - r0
        ends.append(r1)
    phases["loaded"] = (t_load, max(ends))
    if registrar is not None:
        time.sleep(0.3)  # a gap, so the two phases do not share a Poll
        registrar.conn.send("unregister")
        _, u0, u1 = registrar.recv(args.timeout, "unregistered")
        unregister_s = u1 - u0
        phases["unregister"] = (u0, u1)
    time.sleep(0.2)

    poller.conn.send("stop")
    _, starts_b, rtts_b, errors = poller.recv(args.timeout, "samples")
    starts, rtts = array("d"), array("d")
    starts.frombytes(starts_b)
    rtts.frombytes(rtts_b)

    per_phase: dict[str, dict[str, float | int]] = {}
    for name, (a, b) in phases.items():
        per_phase[name] = phase_stats([rt for st, rt in zip(starts, rtts) if a <= st < b])
        per_phase[name]["seconds"] = b - a
    ratios: dict[str, float | None] = {}
    idle, loaded = per_phase["idle"], per_phase["loaded"]
    for key in ("p50_us", "p99_us", "max_us"):
        if idle.get(key) and loaded.get(key) is not None:
            ratios[key.removesuffix("_us")] = float(loaded[key]) / float(idle[key])
        else:
            ratios[key.removesuffix("_us")] = None
    failures: list[str] = list(room_problems)
    if errors:
        failures.append(f"{len(errors)} Polls failed, e.g. {[e for e in errors if e][:3]}")
    for name in phases:
        if per_phase[name]["count"] == 0:
            failures.append(f"no Poll started in the {name} phase")
    room_bytes = room_pages * page_bytes_prefill
    return {
        "config": {
            "layers": args.layers,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "page_size": PAGE_SIZE,
            "dtype": "bfloat16",
            "prefill_tp": 1,
            "decode_tp": 2,
            "room_pages": room_pages,
            "chunk_pages": chunk_pages,
            "chunks": math.ceil(room_pages / chunk_pages) if room_pages else 0,
            "staging_mib": args.staging_mib,
            "broker_args": args.broker_arg,
            "register_gib": args.register_gib if args.register else 0,
            "engine_touch": args.engine_touch,
            "poll_interval_ms": args.poll_interval_ms,
            "idle_seconds": args.idle_seconds,
            "cpus": os.cpu_count(),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
        },
        "unknown_room_answer": {"state": unknown_state, "cause": unknown_cause},
        "phases": per_phase,
        "ratios_loaded_over_idle": ratios,
        "registration": {
            "bytes": register_bytes,
            "allocate_s": allocate_s,
            "register_s": register_s,
            "unregister_s": unregister_s,
        }
        if args.register
        else None,
        "room": {
            "bytes": room_bytes,
            "seconds": room_s,
            "gbps": room_bytes / room_s / 1e9 if room_s else None,
            "warmup_seconds": warm_s,
            "ok": not room_problems,
        }
        if args.room
        else None,
        "poll_errors": len(errors),
        "failures": failures,
    }


def print_report(res: dict[str, Any]) -> None:
    c = res["config"]
    print(
        "kvbroker control-loop lag: Poll round trips of an engine on the prefill broker "
        "(compare phases within this run; no figure is asserted)"
    )
    loop = (
        "tight loop"
        if not c["poll_interval_ms"]
        else f"{c['poll_interval_ms']} ms sleep between calls"
    )
    print(
        f"poller: {loop}, one unknown room (answer: {res['unknown_room_answer']['state']}); "
        f"cpus={c['cpus']}"
    )
    load = []
    if res["registration"]:
        reg = res["registration"]
        load.append(
            f"register {reg['bytes'] / GIB:.2f} GiB DRAM engine on P "
            f"(pages {'written by the engine first' if c['engine_touch'] else 'untouched by the engine'})"
        )
    if res["room"]:
        load.append(
            f"room {res['room']['bytes'] / MIB:.0f} MiB prefill tp1 -> decode tp2, {c['layers']} layers, "
            f"{c['chunks']} chunks of {c['chunk_pages']} pages, staging {c['staging_mib']} MiB"
        )
    print("load: " + "; ".join(load))
    print()
    print(
        f"{'phase':11} {'seconds':>8} {'count':>8} {'p50 us':>10} {'p99 us':>10} {'max us':>12} {'>10ms':>6}"
    )
    for name, s in res["phases"].items():
        if not s["count"]:
            print(f"{name:11} {s['seconds']:8.2f} {0:8d}")
            continue
        print(
            f"{name:11} {s['seconds']:8.2f} {s['count']:8d} {s['p50_us']:10.0f} {s['p99_us']:10.0f} "
            f"{s['max_us']:12.0f} {s['over_10ms']:6d}"
        )
    ra = res["ratios_loaded_over_idle"]

    def fmt(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}x"

    print(f"loaded/idle: p50 {fmt(ra['p50'])}, p99 {fmt(ra['p99'])}, max {fmt(ra['max'])}")
    print()
    if res["registration"]:
        reg = res["registration"]
        print(
            f"registration: {reg['register_s']:.2f} s for {reg['bytes'] / GIB:.2f} GiB "
            f"({reg['register_s'] / (reg['bytes'] / GIB):.2f} s/GiB); allocation before the phase "
            f"{reg['allocate_s']:.2f} s (excluded); unregister {reg['unregister_s']:.2f} s"
        )
    if res["room"]:
        room = res["room"]
        if room["ok"]:
            print(
                f"room: {room['seconds']:.2f} s first ExpectRoom -> last SUCCESS "
                f"({room['gbps']:.2f} GB/s), bytes verified on both decode ranks; warm-up room "
                f"{room['warmup_seconds'] * 1e3:.0f} ms"
            )
        else:
            print(
                f"room: FAILED after {room['seconds']:.2f} s (first ExpectRoom -> last decode "
                "rank ended); the loaded phase saw a failed room, not a full transfer"
            )
    if res["config"]["broker_args"]:
        print(f"brokers started with extra arguments: {' '.join(res['config']['broker_args'])}")
    for problem in res["failures"]:
        print(f"FAILED: {problem}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Poll round trips of an engine while its broker registers a big buffer "
        "and moves a staged room (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--register-gib", type=float, default=4.0, help="GiB of KV the other engine registers"
    )
    p.add_argument("--room-mib", type=float, default=256.0, help="MiB of the room (prefill side)")
    p.add_argument("--chunk-mib", type=float, default=4.0, help="MiB per SendChunk (prefill side)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--register",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the big registration is part of the load (--no-register: leave it out)",
    )
    p.add_argument(
        "--room",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the staged room is part of the load (--no-room: leave it out)",
    )
    p.add_argument(
        "--engine-touch",
        action="store_true",
        help="the registering engine writes every page of its buffer before the phase "
        "(default: untouched, as right after allocation; then the broker's populate allocates them)",
    )
    p.add_argument("--idle-seconds", type=float, default=3.0)
    p.add_argument(
        "--poll-interval-ms", type=float, default=0.0, help="sleep between Polls (0: a tight loop)"
    )
    p.add_argument("--staging-mib", type=int, default=64, help="brokers' --staging-mib")
    p.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds to wait for any one step (not a check)",
    )
    p.add_argument("--seed", type=int, default=1)
    add_run_options(p)
    args = p.parse_args(argv)
    if not args.register and not args.room:
        p.error("--no-register and --no-room leave nothing to load the broker with")
    if args.register_gib <= 0 or args.room_mib <= 0 or args.chunk_mib <= 0 or args.layers < 1:
        p.error("sizes and --layers must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return bench_main(
        "control_lag", args, lambda held: run(args, held), print_report=print_report, report_lists_failures=True
    )


if __name__ == "__main__":
    sys.exit(main())

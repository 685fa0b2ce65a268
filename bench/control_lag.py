"""Control-loop lag: how long an engine's Poll takes while its broker registers a big buffer and moves a room.

    python bench/control_lag.py                 # ~30-90 s: 4 GiB registration + a 256 MiB staged room
    python bench/control_lag.py --no-register   # only the room as load (--no-room: only the registration)

A "poller" engine process polls a room nobody opened on the prefill broker, back to back; its Polls are
sorted into phases by when they started: idle, loaded (until the registration and the room are done),
unregister. Nothing is asserted; a failed room (bytes and guards checked), Poll or registration exits 1.
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

import harness as h
import torch

from kvbroker.client import BrokerClient, EngineMemory, RankSpec
from kvbroker.errors import KvBrokerError
from kvbroker.v1 import common_pb2

STALL_US = 10_000.0


def poller_main(conn: Connection, address: str, group: str, room: int, interval_s: float) -> None:
    """Spawned: register a tiny engine on ``address``, Poll ``room`` until told to stop. Sends ("ready", its state, its
    cause); on "start" polls until the next message, then sends ("samples", starts, rtts, errors), two float64
    arrays as bytes."""
    rank = RankSpec(group, "decode")
    memory = EngineMemory.allocate(rank, h.model_spec(1), num_pages=4)
    client = engine = None
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
        starts, rtts, errors = array("d"), array("d"), []
        mono = time.monotonic
        while not conn.poll():
            t0 = mono()
            try:
                engine.poll(rooms)
            except KvBrokerError as exc:
                errors.append(f"{type(exc).__name__}: {exc}" if len(errors) < 20 else "")
            t1 = mono()
            starts.append(t0)
            rtts.append(t1 - t0)
            if interval_s > 0:
                time.sleep(interval_s)
        conn.recv()
        conn.send(("samples", starts.tobytes(), rtts.tobytes(), errors))
    finally:
        h.release(engine, client, memory)


def registrar_main(conn: Connection, address: str, group: str, layers: int, num_pages: int, touch: bool) -> None:
    """Spawned: allocate a big KV buffer, then register and unregister it on command. Sends ("ready", allocate_s,
    bytes); on "go" registers and sends ("registered", t0, t1); on "unregister" closes the engine and sends
    ("unregistered", t0, t1); returns on anything else (or EOF)."""
    rank = RankSpec(group, "prefill")
    memory = client = engine = None
    try:
        memory, allocate_s, nbytes = h.allocate(rank, h.model_spec(layers), num_pages, touch)
        client = BrokerClient(address)
        conn.send(("ready", allocate_s, nbytes))
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            t0 = time.monotonic()
            if msg == "go":
                engine = client.register_engine(rank, memory)
                conn.send(("registered", t0, time.monotonic()))
            elif msg == "unregister":
                if engine is not None:
                    engine.close()
                conn.send(("unregistered", t0, time.monotonic()))
            else:
                return
    finally:
        h.release(engine, client, memory)


def phase_stats(rtts_s: Sequence[float]) -> dict[str, float | int]:
    if not rtts_s:
        return {"count": 0}
    us = sorted(v * 1e6 for v in rtts_s)
    return {"count": len(us), "p50_us": h.percentile(us, 0.50), "p99_us": h.percentile(us, 0.99), "max_us": us[-1],
            "mean_us": statistics.fmean(us), "over_10ms": sum(1 for v in us if v > STALL_US)}


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = h.model_spec(args.layers)
    page = h.page_bytes(args.layers)
    room_pages = max(1, math.ceil(args.room_mib * h.MIB / page)) if args.room else 0
    chunk_pages = max(1, round(args.chunk_mib * h.MIB / page))
    pool_pages = room_pages + 2  # and 2 pages of the warm-up room
    p_broker, d_broker = held.start_brokers(["P", "D"], ["--log-level", "info", "--staging-mib", str(args.staging_mib), *args.broker_arg])
    tag = secrets.token_hex(3)
    # The room's engines: one prefill rank on P, two decode ranks on D.
    prefill = held.group(p_broker.address, "prefill", model, pool_pages, seed=1, name=f"lag-prefill-{tag}")
    decode = held.group(d_broker.address, "decode", model, pool_pages, tp=2, name=f"lag-decode-{tag}")
    room_base = secrets.randbits(40) << 8

    def move(room: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, list[str]]:
        """One room over ``src``/``dst`` pages: (seconds from the first ExpectRoom to the last decode SUCCESS or
        FAILED, when that was, problems). Verified if it succeeded."""
        t0 = time.monotonic()
        t1, problems = h.move_room(room, prefill.engines[0], decode.engines, prefill.ref(), src.numpy(), dst.numpy(),
                                 chunk_pages, args.timeout)
        if not problems:
            problems = h.kv_mismatches("byte mismatch", prefill.memories, decode.memories, src, dst)
            for i, mem in enumerate(decode.memories):
                problems.extend(f"decode tp{i}: {g}" for g in mem.check_guards())
        return t1 - t0, t1, problems[:10]

    gen = torch.Generator().manual_seed(args.seed)
    warm_src = torch.arange(room_pages, pool_pages, dtype=torch.int32)
    warm_s, _, warm_problems = move(room_base, warm_src, warm_src.flip(0).contiguous())
    if warm_problems:
        raise h.BenchFailed(f"the warm-up room failed: {warm_problems}")
    # The load's engines, ready before the idle phase starts.
    registrar: h.Child | None = None
    allocate_s, register_bytes = 0.0, 0
    if args.register:
        registrar = held.spawn("registering engine", registrar_main, p_broker.address, f"lag-big-{tag}", args.layers,
                               max(1, round(args.register_gib * h.GIB / page)), args.engine_touch)
        _, allocate_s, register_bytes = registrar.recv(args.timeout, "ready")
    poller = held.spawn("poller", poller_main, p_broker.address, f"lag-poller-{tag}", room_base + 200, args.poll_interval_ms / 1e3)
    _, unknown_state, unknown_cause = poller.recv(args.timeout, "ready")
    phases: dict[str, tuple[float, float]] = {}
    poller.conn.send("start")
    time.sleep(0.3)  # let the loop settle; not in any phase
    t = time.monotonic()
    time.sleep(args.idle_seconds)
    phases["idle"] = (t, time.monotonic())
    room_s, register_s, unregister_s = 0.0, 0.0, 0.0
    room_problems: list[str] = []
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
    starts, rtts = array("d", starts_b), array("d", rtts_b)
    per_phase = {name: phase_stats([rt for st, rt in zip(starts, rtts) if a <= st < b]) | {"seconds": b - a}
                 for name, (a, b) in phases.items()}
    idle, loaded = per_phase["idle"], per_phase["loaded"]
    ratios = {key.removesuffix("_us"): float(loaded[key]) / float(idle[key]) if idle.get(key) and loaded.get(key) is not None
              else None for key in ("p50_us", "p99_us", "max_us")}
    failures: list[str] = list(room_problems)
    if errors:
        failures.append(f"{len(errors)} Polls failed, e.g. {[e for e in errors if e][:3]}")
    failures.extend(f"no Poll started in the {name} phase" for name in phases if per_phase[name]["count"] == 0)
    room_bytes = room_pages * page
    return {
        "config": {"layers": args.layers, "kv_heads": h.KV_HEADS, "head_dim": h.HEAD_DIM, "page_size": h.PAGE_SIZE,
                   "dtype": "bfloat16", "prefill_tp": 1, "decode_tp": 2, "room_pages": room_pages, "chunk_pages": chunk_pages,
                   "chunks": math.ceil(room_pages / chunk_pages) if room_pages else 0, "staging_mib": args.staging_mib,
                   "broker_args": args.broker_arg, "register_gib": args.register_gib if args.register else 0,
                   "engine_touch": args.engine_touch, "poll_interval_ms": args.poll_interval_ms, "idle_seconds": args.idle_seconds,
                   "cpus": os.cpu_count(), "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES")},
        "unknown_room_answer": {"state": unknown_state, "cause": unknown_cause}, "phases": per_phase, "ratios_loaded_over_idle": ratios,
        "registration": {"bytes": register_bytes, "allocate_s": allocate_s, "register_s": register_s,
                         "unregister_s": unregister_s} if args.register else None,
        "room": {"bytes": room_bytes, "seconds": room_s, "gbps": room_bytes / room_s / 1e9 if room_s else None,
                 "warmup_seconds": warm_s, "ok": not room_problems} if args.room else None,
        "poll_errors": len(errors), "failures": failures}


def print_report(res: dict[str, Any]) -> None:
    c, reg, room = res["config"], res["registration"], res["room"]
    print("kvbroker control-loop lag: Poll round trips of an engine on the prefill broker "
          "(compare phases within this run; no figure is asserted)")
    loop = "tight loop" if not c["poll_interval_ms"] else f"{c['poll_interval_ms']} ms sleep between calls"
    print(f"poller: {loop}, one unknown room (answer: {res['unknown_room_answer']['state']}); cpus={c['cpus']}")
    load = []
    if reg:
        load.append(f"register {reg['bytes'] / h.GIB:.2f} GiB DRAM engine on P "
                    f"(pages {'written by the engine first' if c['engine_touch'] else 'untouched by the engine'})")
    if room:
        load.append(f"room {room['bytes'] / h.MIB:.0f} MiB prefill tp1 -> decode tp2, {c['layers']} layers, "
                    f"{c['chunks']} chunks of {c['chunk_pages']} pages, staging {c['staging_mib']} MiB")
    print("load: " + "; ".join(load))
    print(f"\n{'phase':11} {'seconds':>8} {'count':>8} {'p50 us':>10} {'p99 us':>10} {'max us':>12} {'>10ms':>6}")
    for name, s in res["phases"].items():
        print(f"{name:11} {s['seconds']:8.2f} {s['count']:8d}" + (
            f" {s['p50_us']:10.0f} {s['p99_us']:10.0f} {s['max_us']:12.0f} {s['over_10ms']:6d}" if s["count"] else ""))
    ra = res["ratios_loaded_over_idle"]
    print("loaded/idle: " + ", ".join(f"{k} {'n/a' if ra[k] is None else f'{ra[k]:.1f}x'}" for k in ("p50", "p99", "max")))
    print()
    if reg:
        print(f"registration: {reg['register_s']:.2f} s for {reg['bytes'] / h.GIB:.2f} GiB ({reg['register_s'] / (reg['bytes'] / h.GIB):.2f} "
              f"s/GiB); allocation before the phase {reg['allocate_s']:.2f} s (excluded); unregister {reg['unregister_s']:.2f} s")
    if room and room["ok"]:
        print(f"room: {room['seconds']:.2f} s first ExpectRoom -> last SUCCESS ({room['gbps']:.2f} GB/s), bytes verified on both "
              f"decode ranks; warm-up room {room['warmup_seconds'] * 1e3:.0f} ms")
    elif room:
        print(f"room: FAILED after {room['seconds']:.2f} s (first ExpectRoom -> last decode rank ended); the loaded phase saw "
              "a failed room, not a full transfer")
    for problem in res["failures"]:
        print(f"FAILED: {problem}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Poll round trips of an engine while its broker registers a big buffer "
                                "and moves a staged room.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--register-gib", type=float, default=4.0, help="GiB of KV the other engine registers")
    add("--room-mib", type=float, default=256.0, help="MiB of the room (prefill side)")
    add("--chunk-mib", type=float, default=4.0, help="MiB per SendChunk (prefill side)")
    add("--layers", type=int, default=32)
    add("--register", action=argparse.BooleanOptionalAction, default=True,
        help="the big registration is part of the load (--no-register: leave it out)")
    add("--room", action=argparse.BooleanOptionalAction, default=True,
        help="the staged room is part of the load (--no-room: leave it out)")
    add("--engine-touch", action="store_true", help="the registering engine writes every page of its buffer before the "
        "phase (default: untouched, as right after allocation; then the broker's populate allocates them)")
    add("--idle-seconds", type=float, default=3.0)
    add("--poll-interval-ms", type=float, default=0.0, help="sleep between Polls (0: a tight loop)")
    add("--staging-mib", type=int, default=64, help="brokers' --staging-mib")
    add("--timeout", type=float, default=300.0, help="seconds to wait for any one step (not a check)")
    add("--seed", type=int, default=1)
    h.add_run_options(p)
    args = p.parse_args(argv)
    if not args.register and not args.room:
        p.error("--no-register and --no-room leave nothing to load the broker with")
    if args.register_gib <= 0 or args.room_mib <= 0 or args.chunk_mib <= 0 or args.layers < 1:
        p.error("sizes and --layers must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return h.bench_main("control_lag", args, lambda held: run(args, held), print_report, report_lists_failures=True)

if __name__ == "__main__":
    sys.exit(main())

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
import multiprocessing
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from outcome import finish

os.environ.setdefault("UCX_NET_DEVICES", "lo")

KV_HEADS = 8
HEAD_DIM = 128
PAGE_SIZE = 16
DTYPE_BYTES = 2  # bfloat16
MIB = 1 << 20
GIB = 1 << 30
STALL_US = 10_000.0


class BenchFailed(RuntimeError):
    """Something the run depends on failed: the figures are not valid."""


# -- child processes ---------------------------------------------------------------


def _model(layers: int) -> Any:
    import torch

    from kvbroker.client import ModelSpec

    return ModelSpec(
        num_layers=layers,
        total_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=torch.bfloat16,
        page_size=PAGE_SIZE,
    )


def _child_error(conn: Connection, what: str) -> None:
    try:
        conn.send(("error", f"{what}: {traceback.format_exc(limit=6)}"))
    except Exception:
        pass


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
    memory = EngineMemory.allocate(rank, _model(1), num_pages=4)
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
        _child_error(conn, "poller")
        raise
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        if client is not None:
            client.close()
        memory.close()


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
        memory = EngineMemory.allocate(rank, _model(layers), num_pages=num_pages)
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
        _child_error(conn, "registering engine")
        raise
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass
        if client is not None:
            client.close()
        if memory is not None:
            memory.close()


# -- statistics --------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    n = len(sorted_values)
    return sorted_values[min(n - 1, max(0, math.ceil(q * n) - 1))]


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


@dataclass
class Child:
    name: str
    proc: BaseProcess
    conn: Connection

    def recv(self, timeout: float, expect: str) -> tuple[Any, ...]:
        """The next message, which must be ``expect``; ``BenchFailed`` otherwise."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise BenchFailed(
                    f"{self.name} exited (status {self.proc.exitcode}) before {expect!r}"
                )
            if time.monotonic() > deadline:
                raise BenchFailed(f"{self.name}: no {expect!r} after {timeout:.0f} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise BenchFailed(f"{self.name} closed its pipe before {expect!r}") from None
        if msg[0] == "error":
            raise BenchFailed(msg[1])
        if msg[0] != expect:
            raise BenchFailed(f"{self.name}: expected {expect!r}, got {msg[0]!r}")
        return tuple(msg)

    def stop(self) -> None:
        try:
            self.conn.send("exit")
        except (OSError, ValueError):
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


def spawn(name: str, target: Any, *args: Any) -> Child:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), name=name, daemon=True)
    proc.start()
    child.close()
    return Child(name, proc, parent)


def fill_pattern(tensor: Any, seed: int) -> None:
    """Distinct, never-all-zero words over a contiguous tensor (in place, numpy)."""
    import numpy as np
    import torch

    words = tensor.view(torch.int64).numpy().reshape(-1).view(np.uint64)
    step = 1 << 22
    for i in range(0, words.size, step):
        x = np.arange(i, min(i + step, words.size), dtype=np.uint64)
        x += np.uint64(seed) << np.uint64(40)
        x *= np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(29)
        x |= np.uint64(1)
        words[i : i + x.size] = x


@dataclass
class Run:
    args: argparse.Namespace
    workdir: Path
    brokers: list[Any] = field(default_factory=list)
    children: list[Child] = field(default_factory=list)
    clients: list[Any] = field(default_factory=list)
    engines: list[Any] = field(default_factory=list)
    memories: list[Any] = field(default_factory=list)

    def close(self) -> list[str]:
        """Stop everything, in reverse order of dependence; problems found on the way."""
        problems: list[str] = []
        for child in self.children:
            try:
                child.stop()
            except Exception as exc:
                problems.append(f"stopping {child.name}: {exc!r}")
        for engine in self.engines:
            try:
                engine.close()
            except Exception as exc:
                problems.append(f"unregistering an engine: {exc!r}")
        for client in self.clients:
            client.close()
        for memory in self.memories:
            memory.close()
        for broker in self.brokers:
            if broker.process.poll() is not None:
                problems.append(
                    f"broker {broker.name} died (exit status {broker.process.returncode}); log tail:\n"
                    + broker.log_tail(1500)
                )
                continue
            try:
                code = broker.stop()
            except BaseException:
                broker.kill()
                raise
            if code != 0:
                problems.append(
                    f"broker {broker.name} exited with status {code} on SIGTERM; log tail:\n"
                    + broker.log_tail(1500)
                )
        return problems


def run(args: argparse.Namespace, run_state: Run) -> dict[str, Any]:
    import torch

    from kvbroker.client import BrokerClient, EngineMemory, RankSpec, RoomState, SenderRef
    from kvbroker.errors import KvBrokerError
    from kvbroker.testing import BrokerProcess

    torch.set_num_threads(1)
    r = run_state
    model = _model(args.layers)
    page_bytes_prefill = args.layers * 2 * PAGE_SIZE * KV_HEADS * HEAD_DIM * DTYPE_BYTES
    room_pages = max(1, math.ceil(args.room_mib * MIB / page_bytes_prefill)) if args.room else 0
    chunk_pages = max(1, round(args.chunk_mib * MIB / page_bytes_prefill))
    warm_pages = 2
    pool_pages = room_pages + warm_pages
    register_pages = max(1, round(args.register_gib * GIB / page_bytes_prefill))

    extra = ["--log-level", "info", "--staging-mib", str(args.staging_mib), *args.broker_arg]
    r.brokers = BrokerProcess.start_many(["P", "D"], r.workdir, extra)
    p_broker, d_broker = r.brokers
    tag = secrets.token_hex(3)
    group_p, group_d = f"lag-prefill-{tag}", f"lag-decode-{tag}"

    # The room's engines: one prefill rank on P, two decode ranks on D.
    prefill_rank = RankSpec(group_p, "prefill", tp_size=1, tp_rank=0)
    decode_ranks = [RankSpec(group_d, "decode", tp_size=2, tp_rank=i) for i in range(2)]
    prefill_mem = EngineMemory.allocate(prefill_rank, model, num_pages=pool_pages)
    r.memories.append(prefill_mem)
    for layer in range(args.layers):
        fill_pattern(prefill_mem.k[layer], 2 * layer + 1)
        fill_pattern(prefill_mem.v[layer], 2 * layer + 2)
    decode_mems = [EngineMemory.allocate(s, model, num_pages=pool_pages) for s in decode_ranks]
    r.memories.extend(decode_mems)
    pc = BrokerClient(p_broker.address)
    r.clients.append(pc)
    prefill = pc.register_engine(prefill_rank, prefill_mem)
    r.engines.append(prefill)
    decode = []
    for spec, mem in zip(decode_ranks, decode_mems):
        dc = BrokerClient(d_broker.address)
        r.clients.append(dc)
        decode.append(dc.register_engine(spec, mem))
        r.engines.append(decode[-1])
    ref = SenderRef(p_broker.address, group_p)
    room_base = secrets.randbits(40) << 8

    def move(room: int, src: torch.Tensor, dst: torch.Tensor) -> tuple[float, float, list[str]]:
        """One room over ``src``/``dst`` pages: (seconds from the first ExpectRoom to the
        last decode SUCCESS or FAILED, when that was, problems). Verified if it succeeded."""
        problems: list[str] = []
        t0 = time.monotonic()
        try:
            for eng in decode:
                eng.receiver(room, ref).init(dst.numpy())
            sender = prefill.sender(room)
            sender.init(num_pages=len(src))
            for a in range(0, len(src), chunk_pages):
                sender.send(src[a : a + chunk_pages].numpy())
        except KvBrokerError as exc:
            problems.append(f"room {room}: a control call failed: {type(exc).__name__}: {exc}")
        statuses = []
        for eng in decode:
            try:
                statuses.append(eng.wait([room], timeout_seconds=args.timeout)[room])
            except KvBrokerError as exc:
                problems.append(
                    f"room {room}: waiting on a decode rank: {type(exc).__name__}: {exc}"
                )
        t1 = time.monotonic()
        try:
            statuses.append(prefill.wait([room], timeout_seconds=args.timeout)[room])
        except KvBrokerError as exc:
            problems.append(
                f"room {room}: waiting on the prefill rank: {type(exc).__name__}: {exc}"
            )
        bad = sorted(
            {
                f"{RoomState(s.state).name}: {s.cause.message}"
                for s in statuses
                if s.state != RoomState.SUCCESS
            }
        )
        if bad:
            problems.append(f"room {room} did not succeed on every rank: {bad}")
        if not problems:
            problems.extend(verify(src, dst))
        return t1 - t0, t1, problems

    def verify(src: torch.Tensor, dst: torch.Tensor) -> list[str]:
        heads = KV_HEADS // len(decode)
        s_idx, d_idx = src.to(torch.int64), dst.to(torch.int64)
        problems = []
        for layer in range(args.layers):
            for kind in ("k", "v"):
                want_all = getattr(prefill_mem, kind)[layer][s_idx]
                for i, mem in enumerate(decode_mems):
                    want = want_all[:, :, i * heads : (i + 1) * heads, :]
                    got = getattr(mem, kind)[layer][d_idx]
                    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                        problems.append(
                            f"byte mismatch: decode tp{i} layer {layer} {kind.upper()} differs from "
                            "its heads of the prefill pages"
                        )
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
        registrar = spawn(
            "registering engine",
            registrar_main,
            p_broker.address,
            f"lag-big-{tag}",
            args.layers,
            register_pages,
            args.engine_touch,
        )
        r.children.append(registrar)
        _, allocate_s, register_bytes = registrar.recv(args.timeout, "ready")
    poll_room = room_base + 200
    poller = spawn(
        "poller",
        poller_main,
        p_broker.address,
        f"lag-poller-{tag}",
        poll_room,
        args.poll_interval_ms / 1e3,
    )
    r.children.append(poller)
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
    p.add_argument(
        "--broker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for both `kvbroker serve` (repeat; e.g. --broker-arg=--peer-dead-after=30)",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep-logs", action="store_true", help="keep the broker logs' directory")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the report")
    args = p.parse_args(argv)
    if not args.register and not args.room:
        p.error("--no-register and --no-room leave nothing to load the broker with")
    if args.register_gib <= 0 or args.room_mib <= 0 or args.chunk_mib <= 0 or args.layers < 1:
        p.error("sizes and --layers must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="kvb-lag-"))
    state = Run(args, workdir)
    result: dict[str, Any] | None = None
    problems: list[str] = []
    interrupted = False
    try:
        result = run(args, state)
        problems.extend(result["failures"])
    except KeyboardInterrupt:
        interrupted = True
    except BenchFailed as exc:
        problems.append(str(exc))
    except Exception:
        problems.append(traceback.format_exc())
    finally:
        try:
            problems.extend(state.close())
        finally:
            if args.keep_logs:
                print(f"control_lag: broker logs kept in {workdir}", file=sys.stderr)
            else:
                shutil.rmtree(workdir, ignore_errors=True)
    if problems and not args.keep_logs and not interrupted:
        print("control_lag: run again with --keep-logs to keep the broker logs", file=sys.stderr)
    return finish(
        "control_lag", result, problems, interrupted=interrupted, as_json=args.json, print_report=print_report, report_lists_failures=True
    )


if __name__ == "__main__":
    sys.exit(main())

"""Small rooms through one broker pair: rooms/s, single-room latency hop by hop, what the engine pays; ``--scale``: the
room tables with 10,000 rooms open.

    python bench/rooms_bench.py [--shapes small large] [--windows 1 16 200]
    python bench/rooms_bench.py --scale

The method and the figures: docs/benchmarks.md. The decode pool must equal the prefill pool and every room
succeed; ``--scale``: every per-room table must be back at zero after the TTLs.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import harness as h
import numpy as np
import torch

from kvbroker.client import BrokerClient, EngineMemory, ExpectSpec, RankSpec, RoomState, SenderRef
from kvbroker.testing.idle import wait_until_idle
from kvbroker.v1 import admin_pb2, admin_pb2_grpc

PREFILL_GROUP = "rooms-prefill"


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    pages: int  # per room
    heads: int = 1
    head_dim: int = 64
    page_size: int = 4

SHAPES = {"small": Shape("1-page rooms, 4 layers", layers=4, pages=1),
          "large": Shape("64-page rooms, 32 layers", layers=32, pages=64)}


def _memory(role: str, shape: Shape, slots: int) -> Any:
    """The role's pool: the prefill's filled with the pattern (seed 7), the decode's zero."""
    rank = RankSpec(group=PREFILL_GROUP if role == "prefill" else "rooms-decode", role=role)
    model = h.model_spec(shape.layers, kv_heads=shape.heads, head_dim=shape.head_dim, page_size=shape.page_size)
    memory = EngineMemory.allocate(rank, model, num_pages=slots * shape.pages)
    if role == "prefill":
        h.fill_pattern(memory.raw.numpy(), 7)
    return rank, memory


def _slot_pages(shape: Shape, room_index: int, slots: int) -> Any:
    base = (room_index % slots) * shape.pages
    return np.arange(base, base + shape.pages, dtype=np.int32)


def _digest(memory: Any, shape: Shape, used_slots: int) -> list[str]:
    """SHA-256 of every KV page of the first ``used_slots`` slots, per layer tensor."""
    return [hashlib.sha256(tensor[: used_slots * shape.pages].contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for layer in range(shape.layers) for tensor in memory.kv_tensors(layer)]


def engine_main(conn: Any, peer: Any, role: str, address: str, prefill_address: str, shape: Shape, slots: int) -> None:
    """An engine process of ``role``: registers, then runs the commands of the driver (this file's ``Pair``)."""
    rank, memory = _memory(role, shape, slots)
    engine = BrokerClient(address).register_engine(rank, memory)
    ref = SenderRef(prefill_address, PREFILL_GROUP)
    conn.send(("ready", None))
    blocked: list[float] = []

    def send(room: int, index: int) -> None:
        sender = engine.sender(room)
        sender.init(num_pages=shape.pages)
        t = time.perf_counter()
        sender.send(_slot_pages(shape, index, slots))
        blocked.append(time.perf_counter() - t)

    def check(statuses: dict[int, Any], bad: list[str]) -> None:
        bad.extend(f"room {room}: {s.cause.message}" for room, s in statuses.items() if s.state != RoomState.SUCCESS)

    while True:
        cmd, *rest = conn.recv()
        arg = rest[0] if rest else None
        if cmd == "exit":  # Child.stop's
            engine.close()
            return
        if cmd == "blocked":
            conn.send(("blocked", blocked))
            blocked = []
        elif cmd == "rtt":  # (arg: a finished room, calls) the engine's round trips, and bare streams' to its broker
            def session_rtt(room: int = arg[0]) -> None:  # an abort of the finished room, applied
                engine.receiver(room, ref).abort("round trip")
                engine.flush()

            conn.send(("rtt", {"poll": h.poll_round_trips(engine, *arg), "session": h.timed_calls(arg[1], session_rtt),
                               **h.stream_round_trips(address, arg[1])}))
        elif cmd == "verify":
            conn.send(("verify", _digest(memory, shape, arg)))
        elif cmd == "latency" and role == "prefill":
            base, count = arg
            walls = []  # wall clock when this engine heard of the room, and when its send() returned
            for _ in range(count):
                index = peer.recv()
                wall = time.time()
                send(base + index, index)
                walls.append((wall, wall + blocked[-1]))
            engine.wait([base + i for i in range(count)], timeout_seconds=60)
            conn.send(("done", walls))
        elif cmd == "latency":
            base, count = arg
            latencies, walls, bad = [], [], []  # walls: (wall clock at init, at SUCCESS seen), placed on the brokers' timelines
            for index in range(count):
                wall, t = time.time(), time.perf_counter()
                engine.receiver(base + index, ref).init(_slot_pages(shape, index, slots))
                peer.send(index)
                statuses = engine.wait([base + index], timeout_seconds=60)
                latencies.append(time.perf_counter() - t)
                check(statuses, bad)
                walls.append((wall, wall + latencies[-1]))
            conn.send(("latency", (latencies, walls, bad)))
        elif cmd == "window":
            base, count, window = arg
            bad = []
            open_rooms: set[int] = set()
            t0 = time.perf_counter()
            for index in range(count):
                while len(open_rooms) >= window:
                    statuses = engine.wait_any(sorted(open_rooms), timeout_seconds=60)
                    open_rooms.difference_update(statuses)
                    check(statuses, bad)
                if role == "prefill":
                    send(base + index, index)
                else:
                    engine.receiver(base + index, ref).init(_slot_pages(shape, index, slots))
                open_rooms.add(base + index)
            check(engine.wait(sorted(open_rooms), timeout_seconds=60), bad)
            conn.send(("window", (time.perf_counter() - t0, bad)))


class Pair:
    """Two brokers and two engine processes for one room shape."""

    def __init__(self, held: h.Held, shape: Shape, slots: int, broker_args: Sequence[str]) -> None:
        self.held, self.prefill_said = held, None
        self.brokers = held.start_brokers([f"{shape.pages}p-prefill", f"{shape.pages}p-decode"], ["--log-level", "warning", *broker_args])
        p_peer, d_peer = multiprocessing.get_context("spawn").Pipe()
        address = self.brokers[0].address
        self.prefill = held.spawn("prefill engine", engine_main, p_peer, "prefill", address, address, shape, slots)
        self.decode = held.spawn("decode engine", engine_main, d_peer, "decode", self.brokers[1].address, address, shape, slots)
        for child in (self.prefill, self.decode):
            child.recv(120, "ready")
        self.next_room = (os.getpid() << 24) + 1

    def rooms(self, count: int) -> int:
        self.next_room += count
        return self.next_room - count

    def both(self, cmd: str, arg: Any) -> Any:
        """``cmd`` on both engines; the decode engine's answer (and the prefill's, ``self.prefill_said``)."""
        self.prefill.conn.send((cmd, arg))
        answer = self.decode.ask(cmd, arg)[1]
        self.prefill_said = self.prefill.recv(600)[1]
        return answer

    def pids(self) -> dict[str, int]:
        return {"prefill broker": self.brokers[0].process.pid, "decode broker": self.brokers[1].process.pid,
                "prefill engine": self.prefill.proc.pid or 0, "decode engine": self.decode.proc.pid or 0}

    def blocked(self) -> list[float]:
        return self.prefill.ask("blocked", None)[1]  # type: ignore[no-any-return]

    def close(self) -> None:
        self.held.now(self.prefill.stop, self.decode.stop)
        for broker in self.brokers:
            self.held.brokers.remove(broker)
            broker.stop()


def measure(name: str, args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    shape = SHAPES[name]
    slots = max(args.windows) + 56
    pair = Pair(held, shape, slots, args.broker_arg)
    problems = held.problems
    out: dict[str, Any] = {"shape": shape.name, "bytes_per_room": shape.pages * shape.layers * 2 * shape.page_size * shape.heads * shape.head_dim * 2}
    # Warm-up: handshakes, first descriptors, the session streams.
    base = pair.rooms(slots)
    _, bad = pair.both("window", (base, slots, 16))
    problems.extend(f"{shape.name} warm-up: {b}" for b in bad[:3])
    pair.blocked()
    _, memory = _memory("prefill", shape, slots)  # the prefill pool, made here from the same seed
    expected = _digest(memory, shape, slots)
    memory.close()
    rtts = {k: statistics.median(v) * 1e6 for k, v in pair.decode.ask("rtt", (base, args.rtt_calls))[1].items()}
    poll_rtt = rtts["poll"] / 1e6
    out["poll_rtt_us"], out["rtt_us"] = rtts["poll"], rtts
    base = pair.rooms(args.latency_rooms)
    latencies, walls, bad = pair.both("latency", (base, args.latency_rooms))
    problems.extend(f"{shape.name} latency: {b}" for b in bad[:3])
    all_blocked = pair.blocked()
    lat = h.us_stats(latencies, 0.9, 0.99)
    out["latency"] = {k: lat[k] for k in ("median_us", "p90_us", "p99_us")}
    out["latency"] |= {f"{k[:-3]}_rtts": lat[k] / 1e6 / poll_rtt for k in ("median_us", "p90_us", "p99_us")}
    out["latency"]["timeline_ms"] = _timelines(pair, base, walls, pair.prefill_said)
    out["windows"] = {}
    for window in args.windows:
        count = args.rooms if shape.pages == 1 else max(window * 4, args.rooms // 8)
        pids = pair.pids()
        cpu0 = h.cpu_snapshot(pids)
        elapsed, bad = pair.both("window", (pair.rooms(count), count, window))
        cpu = h.cpu_delta(cpu0, h.cpu_snapshot(pids), 1.0)
        problems.extend(f"{shape.name} W={window}: {b}" for b in bad[:3])
        blocked = pair.blocked()
        all_blocked += blocked
        out["windows"][window] = {"rooms": count, "seconds": elapsed, "rooms_per_s": count / elapsed,
                                  "cpu_ms_per_room": {name: v / count * 1e3 for name, v in cpu.items()},
                                  "send_blocked_median_us": statistics.median(blocked) * 1e6}
    got = pair.decode.ask("verify", slots)[1]
    if got != expected:
        problems.append(f"{shape.name}: the decode pool differs from the prefill pool in {sum(a != b for a, b in zip(got, expected))} layer tensors")
    out["verified_layer_tensors"] = len(expected)
    sb = h.us_stats(all_blocked, 0.99)
    out["send_blocked"] = {"median_us": sb["median_us"], "p99_us": sb["p99_us"], "calls": sb["n"]}
    pair.close()
    return out


def _timelines(pair: Pair, base: int, walls: list[tuple[float, float]], sent: list[tuple[float, float]]) -> dict[str, list[float]]:
    """Each event of the latency rooms' GetRoom timelines on both brokers ("decode.registered", "prefill.ready", ...),
    the decode engine's init call and its seeing SUCCESS ("engine.init", "engine.success"), and the prefill engine's
    hearing of the room and its send() returning ("prefill engine.told", "prefill engine.sent"; one host, one wall
    clock), in ms after the decode broker opened the room, by room, in the order of their medians: where a single
    room's time goes, hop by hop."""
    offsets: dict[str, list[float]] = {}
    channels = {b.name.split("-")[1]: grpc.insecure_channel(b.address) for b in pair.brokers}
    try:
        stubs = {name: admin_pb2_grpc.AdminStub(channel) for name, channel in channels.items()}
        for room, (init, seen), (told, done) in zip(range(base, base + len(walls)), walls, sent):
            events = {"engine.init": init, "engine.success": seen, "prefill engine.told": told, "prefill engine.sent": done}
            events |= {f"{name}.{event.event}": event.at for name, stub in stubs.items()
                       for side in stub.GetRoom(admin_pb2.GetRoomRequest(room=room), timeout=10).sides for event in side.timeline}
            opened = events.get("decode.opened")
            for name, at in events.items() if opened is not None else ():
                offsets.setdefault(name, []).append((at - opened) * 1e3)
    finally:
        for channel in channels.values():
            channel.close()
    return dict(sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])))


def print_report(result: dict[str, Any]) -> None:
    for shape in result["shapes"]:
        print(f"\n{shape['shape']} ({shape['bytes_per_room'] / 1024:.0f} KiB per room)")
        rtt = shape["rtt_us"]
        print(f"  round trips, decode engine -> its broker (median): unary Poll {rtt['poll']:.0f} us; session (a command to\n"
              f"  applied) {rtt['session']:.0f} us; bare peer-stream Ping: sync grpc, as the session {rtt['sync']:.0f} us, "
              f"grpc.aio {rtt['aio']:.0f} us")
        lat = shape["latency"]
        print(f"  single-room latency: median {lat['median_us']:.0f} us ({lat['median_rtts']:.1f} Poll RTTs), "
              f"p90 {lat['p90_us']:.0f} us ({lat['p90_rtts']:.1f}), p99 {lat['p99_us']:.0f} us ({lat['p99_rtts']:.1f})")
        print("  where it goes, hop by hop (GetRoom timelines of both brokers, both engines' calls; ms after the decode broker\n"
              "  opened the room, and each hop from the event before it: median, p90 over the rooms)")
        last = None
        for name, ms in lat["timeline_ms"].items():
            hop = [b - a for a, b in zip(lat["timeline_ms"][last], ms)] if last else [0.0]
            print(f"    {name:<28} at {statistics.median(ms):6.2f}   hop {statistics.median(hop):5.2f} p90 {h.percentile(hop, 0.9):5.2f}")
            last = name
        blocked = shape["send_blocked"]
        print(f"  KVSender.send blocked the caller: median {blocked['median_us']:.0f} us, p99 {blocked['p99_us']:.0f} us ({blocked['calls']} calls)")
        print("  W     rooms   rooms/s   CPU ms per room: prefill broker / decode broker / prefill engine / decode engine")
        for window, w in shape["windows"].items():
            cpu = w["cpu_ms_per_room"]
            print(f"  {window:<5} {w['rooms']:<7} {w['rooms_per_s']:>7.0f}   "
                  f"{cpu['prefill broker']:.3f} / {cpu['decode broker']:.3f} / {cpu['prefill engine']:.3f} / {cpu['decode engine']:.3f}")
        print(f"  bytes verified: {shape['verified_layer_tensors']} layer tensors of the decode pool equal the prefill pool")

TTL = "1.0"


def run_scale(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    problems, n = held.problems, args.rooms or 10_000
    model = h.model_spec(1, kv_heads=1, head_dim=8, page_size=1)
    extra = ["--log-level", "warning", "--finished-room-ttl", TTL, "--tombstone-ttl", TTL, "--receiver-data-timeout", "600",
             "--sender-info-timeout", "600", *args.broker_arg]
    brokers = held.start_brokers(["prefill", "decode"], extra)
    # Room i moves pages 2i and 2i + 1 (one chunk each).
    prefill = held.group(brokers[0].address, "prefill", model, 2 * n, seed=5, name="scale-prefill")
    decode = held.group(brokers[1].address, "decode", model, 2 * n, name="scale-decode")
    pe, de, ref = prefill.engines[0], decode.engines[0], prefill.ref()
    base = (os.getpid() << 24) + 1
    ids = itertools.count(base + 1)

    def session_rtt() -> None:
        receiver = de.receiver(next(ids), ref)
        receiver.init([0])
        receiver.abort("scale: round trip")
        receiver.wait(30)

    def looks() -> dict[str, Any]:
        """Each broker's RSS (bytes), the median Poll and session round trips (s)."""
        return {"rss": {b.name: h.rss(b.process.pid) for b in brokers},
                "poll": statistics.median(h.poll_round_trips(de, base, args.rtt_calls)),
                "session": statistics.median(h.timed_calls(args.rtt_calls // 5, session_rtt))}

    # Warm-up: handshakes, first descriptors, the streams; then evicted.
    warm = [next(ids) for _ in range(200)]
    for i, room in enumerate(warm):
        de.receiver(room, ref).init([i])
        sender = pe.sender(room)
        sender.init(1)
        sender.send([i])
    de.wait(warm, timeout_seconds=60)
    h.timed_calls(50, session_rtt)
    time.sleep(float(TTL) * 2 + 1.5)
    idle = looks()
    rooms = [next(ids) for _ in range(n)]
    half = n // 2
    t0 = time.perf_counter()
    for i in range(0, n, 1000):
        de.expect([ExpectSpec(room, ref, [2 * (i + j), 2 * (i + j) + 1]) for j, room in enumerate(rooms[i : i + 1000])])
    senders = [pe.sender(room) for room in rooms]
    for sender in senders:
        sender.init(2)
    pe.send([(senders[i], [2 * i]) for i in range(half)])
    pe.flush(120)
    de.flush(120)
    # Every room registered (the first half also landed its first chunk).
    h.wait_open(de, rooms, 120, interval=0.1)
    open_s = time.perf_counter() - t0
    open_counts = {b.name: dict(b.stats().per_room_state) for b in brokers}
    opened = looks()
    # Finish: the first half complete, the second half are aborted.
    pe.send([(senders[i], [2 * i + 1]) for i in range(half)])
    for room in rooms[half:]:
        de.receiver(room, ref).abort("scale: done")
    final = de.wait(rooms, timeout_seconds=180)
    sent = set(rooms[:half])
    bad = [(r, s.cause.message) for r, s in final.items() if (s.state == RoomState.SUCCESS) != (r in sent)]
    if bad:
        problems.append(f"{len(bad)} rooms ended otherwise than planned, e.g. {bad[:2]}")
    pages = list(range(2 * half))
    problems.extend(h.kv_mismatches("the decode pages of the completed rooms", prefill.memories, decode.memories, pages, pages))
    # The TTLs pass; every table must empty (and no buffer hold anything reserved).
    try:
        wait_until_idle(*brokers, timeout_seconds=float(TTL) * 2 + 30, interval_seconds=0.5)
    except AssertionError as exc:
        problems.append(f"per-room tables not empty after the TTLs: {exc}")
    left = {b.name: {k: v for k, v in b.stats().per_room_state.items() if v} for b in brokers}
    idle_rss, open_rss = idle["rss"], opened["rss"]
    return {"rooms": n, "open_seconds": open_s, "rss_idle_mib": {k: v / 2**20 for k, v in idle_rss.items() if v},
            "rss_open_mib": {k: v / 2**20 for k, v in open_rss.items() if v},
            "rss_per_open_room_kib": {k: (open_rss[k] - idle_rss[k]) / n / 1024 for k in idle_rss if open_rss[k] and idle_rss[k]},
            "open_tables": open_counts, "tables_after": left,
            **{f"{k}_rtt_us": {"idle": idle[k] * 1e6, "open": opened[k] * 1e6, "ratio": opened[k] / idle[k]} for k in ("poll", "session")}}


def print_scale(res: dict[str, Any]) -> None:
    n = res["rooms"]
    print(f"{n} rooms open on one broker pair (opened in {res['open_seconds']:.1f} s; half with a chunk landed, half waiting)")
    for name in ("prefill", "decode"):
        print(f"  {name:8} broker RSS {res['rss_idle_mib'][name]:.1f} MiB idle -> {res['rss_open_mib'][name]:.1f} MiB open: "
              f"{res['rss_per_open_room_kib'][name]:.2f} KiB per open room (target <= 4)")
        counts = {k: v for k, v in res["open_tables"][name].items() if v}
        print(f"           tables while open: {counts}")
    poll, sess = res["poll_rtt_us"], res["session_rtt_us"]
    print(f"  Poll round trip: idle {poll['idle']:.0f} us, {n} open {poll['open']:.0f} us: {poll['ratio']:.2f}x (target <= 2x)")
    print(f"  session round trip (abort -> FAILED seen): idle {sess['idle']:.0f} us, {n} open {sess['open']:.0f} us: "
          f"{sess['ratio']:.2f}x (target <= 2x)")
    left = res["tables_after"]
    print(f"  per-room tables after the TTLs: {'all zero' if not any(left.values()) else left}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["small", "large"])
    parser.add_argument("--windows", nargs="+", type=int, default=[1, 16, 200])
    parser.add_argument("--rooms", type=int, help="rooms per window for 1-page rooms, default 4000 (larger rooms: an eighth, at "
                        "least 4 W); --scale: rooms open at once, default 10,000")
    parser.add_argument("--latency-rooms", type=int, default=300)
    parser.add_argument("--rtt-calls", type=int, default=500, help="round trips per Poll measurement (--scale: a fifth of it for the session's)")
    parser.add_argument("--scale", action="store_true", help="the room tables at scale (docs/benchmarks.md)")
    h.add_run_options(parser)
    args = parser.parse_args(argv)
    if args.scale:
        return h.bench_main("rooms_bench --scale", args, lambda held: run_scale(args, held), print_scale)
    args.rooms = args.rooms or 4000
    return h.bench_main("rooms_bench", args, lambda held: {"shapes": [measure(name, args, held) for name in args.shapes]}, print_report)

if __name__ == "__main__":
    sys.exit(main())

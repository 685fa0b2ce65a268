"""Small rooms through one broker pair: rooms/s, single-room latency, and what the engine pays.

Two ``kvbroker serve`` processes (a prefill and a decode broker, 127.0.0.1),
and two engine processes, each registered with its broker through the public
client: a prefill rank and a decode rank. Each engine process drives its rooms
with the per-room API an engine uses (``KVReceiver.init``; ``KVSender.init``
and ``send``; ``poll``/``wait`` on the engine handle).

For each room shape (``--shapes``; default: 1-page rooms of a 4-layer model,
and 64-page rooms of a 32-layer model) it prints:

- the round trip of a bare unary ``Poll`` of one room from the decode engine
  (``poll_rtt``): the unit the latency is also given in;
- single-room latency: the decode engine opens a room (ExpectRoom), tells the
  prefill engine over a pipe, which opens its side and sends the room's pages
  in one chunk; the decode engine waits for SUCCESS. Timed on the decode
  engine from before ExpectRoom to SUCCESS (median, p90, p99 of
  ``--latency-rooms``); the pipe hop (tens of µs) is part of it;
- rooms/s with W rooms in flight (``--windows``, default 1 16 200): each
  engine keeps W rooms of its own open (the decode side opens the next room as
  one succeeds; the prefill side opens and sends the next as one of its rooms
  finishes), over ``--rooms`` rooms; timed on the decode engine from its first
  ExpectRoom to its last SUCCESS;
- where a single room's time goes: the median of each event of the latency
  rooms' ``GetRoom`` timelines on both brokers, and of the decode engine's
  ``init`` and its seeing SUCCESS, in ms after the decode broker opened the
  room;
- how long ``KVSender.send`` blocked the prefill engine's calling thread
  (median, p99, over every room of the run);
- CPU seconds per room of each broker, and of each engine process.

After every phase the decode pool is compared with the prefill pool, byte for
byte, over every page a room wrote (each room copies prefill slot ``i mod
slots`` to decode slot ``i mod slots``, so the expected bytes are known), and
every room must end SUCCESS; anything else fails the run (exit status 1).

Compare numbers within one run; this 2-core VM varies between runs. The two
brokers and the two engines share the two cores. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import (
    Held,
    bench_main,
    cpu_snapshot,
    fill_pattern,
    model_spec,
    percentile,
    poll_round_trips,
    spawn,
)

PREFILL_GROUP = "rooms-prefill"


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    pages: int  # per room
    heads: int = 1
    head_dim: int = 64
    page_size: int = 4


SHAPES = {
    "small": Shape("1-page rooms, 4 layers", layers=4, pages=1),
    "large": Shape("64-page rooms, 32 layers", layers=32, pages=64),
}


def _model(shape: Shape) -> Any:
    return model_spec(shape.layers, kv_heads=shape.heads, head_dim=shape.head_dim, page_size=shape.page_size)


def _slot_pages(shape: Shape, room_index: int, slots: int) -> Any:
    import numpy as np

    base = (room_index % slots) * shape.pages
    return np.arange(base, base + shape.pages, dtype=np.int32)


# -- engine processes ---------------------------------------------------------------


def _engine(role: str, address: str, shape: Shape, slots: int) -> tuple[Any, Any]:
    from kvbroker.client import BrokerClient, EngineMemory, RankSpec

    rank = RankSpec(group=PREFILL_GROUP if role == "prefill" else "rooms-decode", role=role)
    memory = EngineMemory.allocate(rank, _model(shape), num_pages=slots * shape.pages)
    assert memory.raw is not None
    if role == "prefill":
        fill_pattern(memory.raw.numpy(), 7)
    else:
        memory.raw.zero_()
    client = BrokerClient(address)
    return client.register_engine(rank, memory), memory


def prefill_main(conn: Any, peer: Any, address: str, shape: Shape, slots: int) -> None:
    engine, memory = _engine("prefill", address, shape, slots)
    conn.send(("ready", None))
    blocked: list[float] = []
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            engine.close()
            conn.send(("stopped", None))
            return
        if cmd == "blocked":
            conn.send(("blocked", blocked))
            blocked = []
        elif cmd == "latency":
            base, count = arg
            for _ in range(count):
                index = peer.recv()
                sender = engine.sender(base + index)
                sender.init(num_pages=shape.pages)
                t = time.perf_counter()
                sender.send(_slot_pages(shape, index, slots))
                blocked.append(time.perf_counter() - t)
            engine.wait([base + i for i in range(count)], timeout_seconds=60)
            conn.send(("done", None))
        elif cmd == "window":
            base, count, window = arg
            open_rooms: set[int] = set()
            for index in range(count):
                while len(open_rooms) >= window:
                    for room in engine.wait_any(sorted(open_rooms), timeout_seconds=60):
                        open_rooms.discard(room)
                sender = engine.sender(base + index)
                sender.init(num_pages=shape.pages)
                t = time.perf_counter()
                sender.send(_slot_pages(shape, index, slots))
                blocked.append(time.perf_counter() - t)
                open_rooms.add(base + index)
            engine.wait(sorted(open_rooms), timeout_seconds=60)
            conn.send(("done", None))


def decode_main(conn: Any, peer: Any, address: str, prefill_address: str, shape: Shape, slots: int) -> None:
    from kvbroker.client import RoomState, SenderRef

    engine, memory = _engine("decode", address, shape, slots)
    ref = SenderRef(prefill_address, PREFILL_GROUP)
    conn.send(("ready", None))
    while True:
        cmd, arg = conn.recv()
        if cmd == "stop":
            engine.close()
            conn.send(("stopped", None))
            return
        if cmd == "rtt":
            room, count = arg
            conn.send(("rtt", poll_round_trips(engine, room, count)))
        elif cmd == "latency":
            base, count = arg
            latencies = []
            walls = []  # (wall clock at init, at SUCCESS seen): placed on the brokers' timelines
            bad = []
            for index in range(count):
                wall = time.time()
                t = time.perf_counter()
                engine.receiver(base + index, ref).init(_slot_pages(shape, index, slots))
                peer.send(index)
                status = engine.wait([base + index], timeout_seconds=60)[base + index]
                latencies.append(time.perf_counter() - t)
                walls.append((wall, wall + latencies[-1]))
                if status.state != RoomState.SUCCESS:
                    bad.append(f"room {base + index}: {status.cause.message}")
            conn.send(("latency", (latencies, walls, bad)))
        elif cmd == "window":
            base, count, window = arg
            bad = []
            open_rooms: set[int] = set()
            t0 = time.perf_counter()
            for index in range(count):
                while len(open_rooms) >= window:
                    for room, status in engine.wait_any(sorted(open_rooms), timeout_seconds=60).items():
                        open_rooms.discard(room)
                        if status.state != RoomState.SUCCESS:
                            bad.append(f"room {room}: {status.cause.message}")
                engine.receiver(base + index, ref).init(_slot_pages(shape, index, slots))
                open_rooms.add(base + index)
            for room, status in engine.wait(sorted(open_rooms), timeout_seconds=60).items():
                if status.state != RoomState.SUCCESS:
                    bad.append(f"room {room}: {status.cause.message}")
            conn.send(("window", (time.perf_counter() - t0, bad)))
        elif cmd == "verify":
            used = arg
            assert memory.raw is not None
            conn.send(("verify", _digest(memory, shape, used)))


def _digest(memory: Any, shape: Shape, used_slots: int) -> list[str]:
    """SHA-256 of every KV page of the first ``used_slots`` slots, per layer tensor."""
    import hashlib

    out = []
    for layer in range(shape.layers):
        for tensor in memory.kv_tensors(layer):
            pages = tensor[: used_slots * shape.pages].contiguous().view(-1).view(__import__("torch").uint8).numpy()
            out.append(hashlib.sha256(pages.tobytes()).hexdigest())
    return out


# -- the driver ---------------------------------------------------------------------


class Pair:
    """Two brokers and two engine processes for one room shape."""

    def __init__(self, shape: Shape, slots: int, workdir: Path) -> None:
        from kvbroker.testing import BrokerProcess

        self.shape = shape
        self.slots = slots
        workdir.mkdir()
        self.brokers = BrokerProcess.start_many(["prefill", "decode"], workdir, ["--log-level", "warning"])
        prefill_broker, decode_broker = self.brokers
        p_peer, d_peer = multiprocessing.get_context("spawn").Pipe()
        self.prefill = spawn("prefill engine", prefill_main, p_peer, prefill_broker.address, shape, slots)
        self.decode = spawn(
            "decode engine", decode_main, d_peer, decode_broker.address, prefill_broker.address, shape, slots
        )
        for child in (self.prefill, self.decode):
            child.recv(120, "ready")
        self.next_room = (os.getpid() << 24) + 1

    def rooms(self, count: int) -> int:
        base = self.next_room
        self.next_room += count
        return base

    def pids(self) -> dict[str, int]:
        return {
            "prefill broker": self.brokers[0].process.pid,
            "decode broker": self.brokers[1].process.pid,
            "prefill engine": self.prefill.proc.pid or 0,
            "decode engine": self.decode.proc.pid or 0,
        }

    def blocked(self) -> list[float]:
        return self.prefill.ask("blocked", None)[1]  # type: ignore[no-any-return]

    def close(self) -> None:
        for child in (self.prefill, self.decode):
            child.stop(("stop", None), wait=30)
        for broker in self.brokers:
            try:
                broker.stop()
            except Exception:
                broker.kill()


def run_shape(name: str, args: argparse.Namespace, held: Held) -> dict[str, Any]:
    shape = SHAPES[name]
    slots = max(args.windows) + 56
    pair = Pair(shape, slots, held.workdir / name)
    try:
        return _measure(pair, shape, slots, args, held.problems)
    finally:
        pair.close()


def _measure(pair: Pair, shape: Shape, slots: int, args: argparse.Namespace, problems: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": shape.name, "bytes_per_room": shape.pages * shape.layers * 2 * shape.page_size * shape.heads * shape.head_dim * 2}
    # Warm-up: handshakes, first descriptors, the session streams.
    base = pair.rooms(slots)
    pair.prefill.conn.send(("window", (base, slots, 16)))
    elapsed, bad = pair.decode.ask("window", (base, slots, 16))[1]
    pair.prefill.recv(600)
    problems.extend(f"{shape.name} warm-up: {b}" for b in bad[:3])
    pair.blocked()
    expected = _digest_prefill(pair, shape, slots)

    rtts = pair.decode.ask("rtt", (base, args.rtt_calls))[1]
    poll_rtt = statistics.median(rtts)
    out["poll_rtt_us"] = poll_rtt * 1e6

    base = pair.rooms(args.latency_rooms)
    pair.prefill.conn.send(("latency", (base, args.latency_rooms)))
    latencies, walls, bad = pair.decode.ask("latency", (base, args.latency_rooms))[1]
    pair.prefill.recv(600)
    problems.extend(f"{shape.name} latency: {b}" for b in bad[:3])
    blocked = pair.blocked()
    out["latency"] = {
        "median_us": statistics.median(latencies) * 1e6,
        "p90_us": percentile(latencies, 0.9) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "median_rtts": statistics.median(latencies) / poll_rtt,
        "p90_rtts": percentile(latencies, 0.9) / poll_rtt,
        "p99_rtts": percentile(latencies, 0.99) / poll_rtt,
    }
    out["latency"]["timeline_ms"] = _timelines(pair, base, walls)
    all_blocked = list(blocked)
    out["windows"] = {}
    for window in args.windows:
        count = args.rooms if shape.pages == 1 else max(window * 4, args.rooms // 8)
        base = pair.rooms(count)
        pids = pair.pids()
        cpu0 = cpu_snapshot(pids)
        pair.prefill.conn.send(("window", (base, count, window)))
        elapsed, bad = pair.decode.ask("window", (base, count, window))[1]
        pair.prefill.recv(600)
        cpu = {name: (v - cpu0[name]) for name, v in cpu_snapshot(pids).items()}
        problems.extend(f"{shape.name} W={window}: {b}" for b in bad[:3])
        blocked = pair.blocked()
        all_blocked += blocked
        out["windows"][window] = {
            "rooms": count,
            "seconds": elapsed,
            "rooms_per_s": count / elapsed,
            "cpu_ms_per_room": {name: v / count * 1e3 for name, v in cpu.items()},
            "send_blocked_median_us": statistics.median(blocked) * 1e6,
        }
    got = pair.decode.ask("verify", slots)[1]
    if got != expected:
        problems.append(f"{shape.name}: the decode pool differs from the prefill pool in {sum(a != b for a, b in zip(got, expected))} layer tensors")
    out["verified_layer_tensors"] = len(expected)
    out["send_blocked"] = {"median_us": statistics.median(all_blocked) * 1e6, "p99_us": percentile(all_blocked, 0.99) * 1e6, "calls": len(all_blocked)}
    return out


def _timelines(pair: Pair, base: int, walls: list[tuple[float, float]]) -> dict[str, float]:
    """Median time of each event of the latency rooms' GetRoom timelines on
    both brokers ("decode.registered", "prefill.ready", ...), and of the decode
    engine's init call and its seeing SUCCESS ("engine.init", "engine.success";
    one host, one wall clock), in ms after the decode broker opened the room:
    where a single room's time goes."""
    import grpc

    from kvbroker.v1 import admin_pb2, admin_pb2_grpc

    offsets: dict[str, list[float]] = {}
    channels = {b.name: grpc.insecure_channel(b.address) for b in pair.brokers}
    try:
        stubs = {name: admin_pb2_grpc.AdminStub(channel) for name, channel in channels.items()}
        for room, (init, seen) in zip(range(base, base + len(walls)), walls):
            events = {"engine.init": init, "engine.success": seen}
            events |= {
                f"{name}.{event.event}": event.at
                for name, stub in stubs.items()
                for side in stub.GetRoom(admin_pb2.GetRoomRequest(room=room), timeout=10).sides
                for event in side.timeline
            }
            opened = events.get("decode.opened")
            if opened is None:
                continue
            for name, at in events.items():
                offsets.setdefault(name, []).append((at - opened) * 1e3)
    finally:
        for channel in channels.values():
            channel.close()
    return dict(sorted(((name, statistics.median(v)) for name, v in offsets.items()), key=lambda kv: kv[1]))


def _digest_prefill(pair: Pair, shape: Shape, slots: int) -> list[str]:
    """The prefill pool's digest, computed here from the same seed the prefill engine used."""
    from kvbroker.client import EngineMemory, RankSpec

    memory = EngineMemory.allocate(RankSpec(PREFILL_GROUP, "prefill"), _model(shape), num_pages=slots * shape.pages)
    try:
        assert memory.raw is not None
        fill_pattern(memory.raw.numpy(), 7)
        return _digest(memory, shape, slots)
    finally:
        memory.close()


def print_report(result: dict[str, Any]) -> None:
    for shape in result["shapes"]:
        print(f"\n{shape['shape']} ({shape['bytes_per_room'] / 1024:.0f} KiB per room)")
        print(f"  bare Poll round trip (decode engine -> its broker): {shape['poll_rtt_us']:.0f} us")
        lat = shape["latency"]
        print(
            f"  single-room latency: median {lat['median_us']:.0f} us ({lat['median_rtts']:.1f} Poll RTTs), "
            f"p90 {lat['p90_us']:.0f} us ({lat['p90_rtts']:.1f}), p99 {lat['p99_us']:.0f} us ({lat['p99_rtts']:.1f})"
        )
        steps = ", ".join(f"{name} {ms:.2f}" for name, ms in lat["timeline_ms"].items() if name != "decode.opened")
        print(f"  where it goes (median ms after the decode broker opened the room, GetRoom timelines): {steps}")
        blocked = shape["send_blocked"]
        print(f"  KVSender.send blocked the caller: median {blocked['median_us']:.0f} us, p99 {blocked['p99_us']:.0f} us ({blocked['calls']} calls)")
        print("  W     rooms   rooms/s   CPU ms per room: prefill broker / decode broker / prefill engine / decode engine")
        for window, w in shape["windows"].items():
            cpu = w["cpu_ms_per_room"]
            print(
                f"  {window:<5} {w['rooms']:<7} {w['rooms_per_s']:>7.0f}   "
                f"{cpu['prefill broker']:.3f} / {cpu['decode broker']:.3f} / {cpu['prefill engine']:.3f} / {cpu['decode engine']:.3f}"
            )
        print(f"  bytes verified: {shape['verified_layer_tensors']} layer tensors of the decode pool equal the prefill pool")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["small", "large"])
    parser.add_argument("--windows", nargs="+", type=int, default=[1, 16, 200])
    parser.add_argument("--rooms", type=int, default=4000, help="rooms per window for 1-page rooms (larger rooms: an eighth, at least 4 W)")
    parser.add_argument("--latency-rooms", type=int, default=300)
    parser.add_argument("--rtt-calls", type=int, default=500)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def measure(held: Held) -> dict[str, Any]:
        return {"shapes": [run_shape(name, args, held) for name in args.shapes]}

    return bench_main("rooms_bench", args, measure, print_report=print_report)


if __name__ == "__main__":
    sys.exit(main())

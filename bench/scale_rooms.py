"""The room tables at scale: 10,000 rooms open at once on one broker pair.

Two ``kvbroker serve`` processes (127.0.0.1; short finished-room and tombstone
TTLs so the tables can be seen to empty), a prefill and a decode engine rank
registered from this process (1-page rooms of a 1-layer model: the cost under
test is the records, not the bytes).

1. Idle: each broker's RSS after a warm-up (whose rooms are then evicted),
   the round trip of a bare unary ``Poll`` of one room from the decode engine,
   and the session round trip: a fresh decode room aborted through the session
   until its FAILED status is back (command out, state change in).
2. ``--rooms`` rooms opened on both sides (the decode side in batches of
   ``EngineHandle.expect``, the prefill side ``init``): the first half get a
   first chunk (TRANSFERRING, data landed), the second half nothing (WAITING_FOR_INPUT).
   Then: RSS per open room of each broker ((open - idle) / rooms; target
   ≤ 4 KiB), and the Poll and session round trips again (target: within 2x
   of idle).
3. The first half get their last chunk (SUCCESS, byte-exact: checked), the
   second half are aborted by the decode side; every room must end so.
4. After the TTLs: every per-room table of both brokers must be back at zero.

Exit status 1 if a room ends otherwise, a byte differs, or a table is not
empty; the two targets are printed as ratios (this VM is noisy: no timed
assertion).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from common import (
    Held,
    bench_main,
    fill_pattern,
    model_spec,
    poll_round_trips,
    rss_bytes,
    timed_calls,
    wait_open,
)

PREFILL_GROUP = "scale-prefill"
TTL = "1.0"


def _round_trips(calls: int, fn: Callable[[], object]) -> float:
    return statistics.median(timed_calls(calls, fn))


def run(args: argparse.Namespace, held: Held) -> dict[str, Any]:
    import torch

    from kvbroker.client import ExpectSpec, RankSpec, RoomState, SenderRef

    problems = held.problems
    n = args.rooms
    model = model_spec(1, kv_heads=1, head_dim=8, page_size=1)
    extra = ["--log-level", "warning", "--finished-room-ttl", TTL, "--tombstone-ttl", TTL, "--receiver-data-timeout", "600",
             "--sender-info-timeout", "600"]
    brokers = held.start_brokers(["prefill", "decode"], extra)
    p, d = brokers
    pr, dr = RankSpec(PREFILL_GROUP, "prefill"), RankSpec("scale-decode", "decode")
    # Room i moves pages 2i and 2i + 1 (one chunk each).
    pm = held.allocate(pr, model, num_pages=2 * n)
    dm = held.allocate(dr, model, num_pages=2 * n)
    assert pm.raw is not None and dm.raw is not None
    fill_pattern(pm.raw.numpy(), 5)
    dm.raw.zero_()
    pe, de = held.register(p.address, pr, pm), held.register(d.address, dr, dm)
    ref = SenderRef(p.address, PREFILL_GROUP)
    base = (os.getpid() << 24) + 1
    next_room = [base]

    def fresh() -> int:
        next_room[0] += 1
        return next_room[0]

    def move(room: int, page: int) -> None:
        de.receiver(room, ref).init([page])
        sender = pe.sender(room)
        sender.init(1)
        sender.send([page])

    def session_rtt() -> None:
        room = fresh()
        receiver = de.receiver(room, ref)
        receiver.init([0])
        receiver.abort("scale: round trip")
        receiver.wait(30)

    def poll_rtt() -> float:
        return statistics.median(poll_round_trips(de, base, args.calls))

    # Warm-up: handshakes, first descriptors, the streams; then evicted.
    warm = [fresh() for _ in range(200)]
    for i, room in enumerate(warm):
        move(room, i)
    de.wait(warm, timeout_seconds=60)
    _round_trips(50, session_rtt)
    time.sleep(float(TTL) * 2 + 1.5)
    idle_rss = {b.name: rss_bytes(b.process.pid) for b in brokers}
    idle_poll = poll_rtt()
    idle_session = _round_trips(args.calls // 5, session_rtt)

    rooms = [fresh() for _ in range(n)]
    half = n // 2
    t0 = time.perf_counter()
    for i in range(0, n, 1000):
        de.expect([ExpectSpec(room, ref, [2 * (i + j), 2 * (i + j) + 1]) for j, room in enumerate(rooms[i : i + 1000])])
    senders = []
    for room in rooms:
        sender = pe.sender(room)
        sender.init(2)
        senders.append(sender)
    pe.send([(senders[i], [2 * i]) for i in range(half)])
    pe.flush(120)
    de.flush(120)
    # Every room registered (the first half also landed its first chunk).
    wait_open(de, rooms, 120, interval=0.1)
    open_s = time.perf_counter() - t0
    stats = {b.name: b.stats() for b in brokers}
    open_counts = {name: dict(s.per_room_state) for name, s in stats.items()}
    open_rss = {b.name: rss_bytes(b.process.pid) for b in brokers}
    open_poll = poll_rtt()
    open_session = _round_trips(args.calls // 5, session_rtt)

    # Finish: the first half complete, the second half are aborted.
    pe.send([(senders[i], [2 * i + 1]) for i in range(half)])
    for room in rooms[half:]:
        de.receiver(room, ref).abort("scale: done")
    final = de.wait(rooms, timeout_seconds=180)
    sent = set(rooms[:half])
    bad = [(r, s.cause.message) for r, s in final.items() if (s.state == RoomState.SUCCESS) != (r in sent)]
    if bad:
        problems.append(f"{len(bad)} rooms ended otherwise than planned, e.g. {bad[:2]}")
    for layer in range(model.num_layers):
        for src, dst in zip(pm.kv_tensors(layer), dm.kv_tensors(layer)):
            if not torch.equal(src[: 2 * half].view(torch.uint8), dst[: 2 * half].view(torch.uint8)):
                problems.append(f"layer {layer}: the decode pages of the completed rooms differ from the prefill pages")
    # The TTLs pass; every table must empty.
    deadline = time.monotonic() + float(TTL) * 2 + 30
    while True:
        left = {b.name: {k: v for k, v in b.stats().per_room_state.items() if v} for b in brokers}
        if not any(left.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if any(left.values()):
        problems.append(f"per-room tables not empty after the TTLs: {left}")
        for b in brokers:
            print(f"--- {b.name} broker log (tail)\n{b.log_tail(3000)}", file=sys.stderr)
    return {
        "rooms": n,
        "open_seconds": open_s,
        "rss_idle_mib": {k: v / 2**20 for k, v in idle_rss.items() if v},
        "rss_open_mib": {k: v / 2**20 for k, v in open_rss.items() if v},
        "rss_per_open_room_kib": {k: (open_rss[k] - idle_rss[k]) / n / 1024 for k in idle_rss if open_rss[k] and idle_rss[k]},
        "open_tables": open_counts,
        "poll_rtt_us": {"idle": idle_poll * 1e6, "open": open_poll * 1e6, "ratio": open_poll / idle_poll},
        "session_rtt_us": {"idle": idle_session * 1e6, "open": open_session * 1e6, "ratio": open_session / idle_session},
        "tables_after": left,
    }


def print_report(res: dict[str, Any]) -> None:
    n = res["rooms"]
    print(f"{n} rooms open on one broker pair (opened in {res['open_seconds']:.1f} s; half with a chunk landed, half waiting)")
    for name in ("prefill", "decode"):
        print(
            f"  {name:8} broker RSS {res['rss_idle_mib'][name]:.1f} MiB idle -> {res['rss_open_mib'][name]:.1f} MiB open: "
            f"{res['rss_per_open_room_kib'][name]:.2f} KiB per open room (target <= 4)"
        )
        counts = {k: v for k, v in res["open_tables"][name].items() if v}
        print(f"           tables while open: {counts}")
    poll, sess = res["poll_rtt_us"], res["session_rtt_us"]
    print(f"  Poll round trip: idle {poll['idle']:.0f} us, {n} open {poll['open']:.0f} us: {poll['ratio']:.2f}x (target <= 2x)")
    print(f"  session round trip (abort -> FAILED seen): idle {sess['idle']:.0f} us, {n} open {sess['open']:.0f} us: {sess['ratio']:.2f}x (target <= 2x)")
    left = res["tables_after"]
    print(f"  per-room tables after the TTLs: {'all zero' if not any(left.values()) else left}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rooms", type=int, default=10_000)
    parser.add_argument("--calls", type=int, default=500, help="round trips per Poll measurement (a fifth of it for the session's)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    return bench_main("scale_rooms", args, lambda held: run(args, held), print_report=print_report)


if __name__ == "__main__":
    sys.exit(main())

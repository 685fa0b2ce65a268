"""The same KV transfer measured three ways: through kvbroker, with raw NIXL, with memcpy.

What is moved: ``--rooms`` rooms, each sending ``--pages-per-room`` pages of
every layer's K and V (``--layers`` layers, ``--page-kib`` KiB per page of one
layer) from a prefill KV pool to a decode KV pool, in ``--chunks`` chunks per
room. Page lists are non-contiguous but made of contiguous runs (mean length
``--run-pages``) placed in shuffled order with gaps, independently on the two
sides; each run coalesces into one descriptor per layer region. The warm-up
room (excluded from timing) uses its own pages.

(a) broker   two ``kvbroker serve`` processes on 127.0.0.1 (a prefill and a
             decode broker), a prefill and a decode engine registered from
             this process through the client API (each EngineMemory is its own
             memfd; the brokers map them). Timed from the first ExpectRoom to
             the last room SUCCESS seen by the decode engine's session
             (``EngineHandle.wait``); all room commands (ExpectRoom,
             BeginSend, SendChunk) are made one after another from this
             process, as one engine would; they queue on the engines' session
             streams.
(b) raw NIXL two bare NIXL agents (this process initiates, a spawned child is
             the target), no progress thread, both polled, same UCX backend
             params as the brokers, same buffers (the source is the prefill
             engine's memfd, the target a memfd of the same size) and the same
             (src page, dst page) runs coalesced with ``coalesce_runs`` into
             one descriptor per run and layer region. Variants:
             ``chunked``  one initialize_xfer + transfer per chunk per room,
                          like the broker (notification on the last one);
             ``single``   one transfer for everything;
             ``prepped``  the broker's own call pattern: per-page prepared
                          lists (``build_descriptor_table``) and one
                          make_prepped_xfer per chunk with per-page indices.
             Timed from the first post until every transfer is DONE at the
             initiator and the notification reached the target (the target
             polls every 100 us; CLOCK_MONOTONIC is shared across processes).
(c) memcpy   one thread, numpy slice assignment of the same runs between two
             buffers of this process: what one core can do.

Also: how long ``KVSender.send`` of a 1-page chunk blocks the engine (it
queues the chunk on the engine's session stream) on rooms whose receiver has
registered and on rooms with no receiver yet, and the round trip of a bare
unary Poll of one room.

Every method's destination is zeroed before and checked after each
measurement: the chosen pages must equal the source pages byte for byte
(compared as uint8, never as floats) and every other page must still be zero.
Any difference aborts the run with exit status 1.

How to read it: compare numbers within one run, as ratios (broker/raw NIXL,
broker/memcpy); this 2-core VM varies by +-15-30% between runs. ``--repeat``
runs every measurement N times (interleaved) and prints the best and the
median. The broker path shares 2 cores between 2 broker processes and this
one; the raw NIXL path between 2 processes. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    KV_HEADS,
    BenchFailed,
    Held,
    cpu_snapshot,
    fill_pattern,
    kv_mismatches,
    model_spec,
    percentile,
    poll_round_trips,
    wait_open,
)
from transfer_raw import RawNixl, Regions, RoomPlan, copy_list, make_plans, verify

PREFILL_GROUP = "bench-prefill"
DECODE_GROUP = "bench-decode"
HEAD_DIM = 64  # bfloat16: 1 KiB per token, so page_kib tokens per page


# -- statistics ------------------------------------------------------------


@dataclass
class Samples:
    seconds: list[float] = field(default_factory=list)
    details: list[dict[str, float]] = field(default_factory=list)

    def best(self) -> float:
        return min(self.seconds)

    def median(self) -> float:
        return statistics.median(self.seconds)


def rtt_stats(values: Sequence[float]) -> dict[str, float]:
    us = [v * 1e6 for v in values]
    return {
        "n": len(us),
        "median_us": statistics.median(us),
        "p90_us": percentile(us, 0.9),
        "min_us": min(us),
    }


# -- the broker path ----------------------------------------------------------


class BrokerBench:
    """Two brokers and a prefill and a decode engine registered from this process (``held``'s)."""

    def __init__(self, args: argparse.Namespace, held: Held, num_pages: int) -> None:
        from kvbroker.client import RankSpec

        extra = ["--ucx-error-mode", args.ucx_error_mode, "--log-level", "warning"]
        self.brokers = held.start_brokers(["prefill", "decode"], extra)
        self.prefill_broker, self.decode_broker = self.brokers
        model = model_spec(args.layers, kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=args.page_kib)
        ranks = RankSpec(PREFILL_GROUP, "prefill"), RankSpec(DECODE_GROUP, "decode")
        self.prefill_mem = held.allocate(ranks[0], model, num_pages=num_pages)
        self.decode_mem = held.allocate(ranks[1], model, num_pages=num_pages)
        assert self.prefill_mem.raw is not None and self.decode_mem.raw is not None
        fill_pattern(self.prefill_mem.raw.numpy(), args.seed)
        self.decode_mem.raw.zero_()
        self.prefill = held.register(self.prefill_broker.address, ranks[0], self.prefill_mem)
        self.decode = held.register(self.decode_broker.address, ranks[1], self.decode_mem)
        self.room_base = secrets.randbits(40) << 20
        self.next_room = 0
        self.timeout = args.timeout

    def rooms(self, n: int) -> list[int]:
        ids = [self.room_base + self.next_room + i for i in range(n)]
        self.next_room += n
        return ids

    def run(self, plans: Sequence[RoomPlan]) -> tuple[float, dict[str, Any]]:
        """Move ``plans``; seconds from the first ExpectRoom to the last SUCCESS."""
        from kvbroker.client import RoomState, SenderRef

        ids = self.rooms(len(plans))
        ref = SenderRef(self.prefill_broker.address, PREFILL_GROUP)
        send_rtts = []
        sides = {"prefill": self.prefill_broker.process.pid, "decode": self.decode_broker.process.pid}
        pids = {"engines (this process)": os.getpid(), **{f"{side} broker": pid for side, pid in sides.items()}}
        cpu0 = cpu_snapshot(pids, sides)
        t0 = time.perf_counter()
        for rid, plan in zip(ids, plans):
            self.decode.receiver(rid, ref).init(plan.dst)
        t_expect = time.perf_counter()
        for rid, plan in zip(ids, plans):
            sender = self.prefill.sender(rid)
            sender.init(num_pages=len(plan.src))
            for a, b in plan.chunks:
                t = time.perf_counter()
                sender.send(plan.src[a:b])
                send_rtts.append(time.perf_counter() - t)
        t_sent = time.perf_counter()
        statuses = self.decode.wait(ids, timeout_seconds=self.timeout)
        t_end = time.perf_counter()
        cpu_ms = {name: (s - cpu0[name]) * 1e3 for name, s in cpu_snapshot(pids, sides).items()}
        bad = [(r, s.cause.message) for r, s in statuses.items() if s.state != RoomState.SUCCESS]
        if bad:
            raise BenchFailed(f"broker: {len(bad)} rooms did not succeed, e.g. {bad[0]}")
        return t_end - t0, {
            "expect_ms": (t_expect - t0) * 1e3,
            "sent_ms": (t_sent - t0) * 1e3,
            "end_ms": (t_end - t0) * 1e3,
            "send_chunk_median_us": statistics.median(send_rtts) * 1e6,
            "bytes_reported": sum(s.bytes for s in statuses.values()),
            "cpu_ms": cpu_ms,
        }

    def control_rtts(self, calls: int, pages_per_room: int) -> dict[str, dict[str, float]]:
        """Round trips of SendChunk (1 page) with and without a registered receiver, and of Poll."""
        from kvbroker.client import RoomState, SenderRef

        per_room = max(1, pages_per_room)
        n_rooms = math.ceil(calls / per_room)
        pages = np.arange(per_room, dtype=np.int32)
        ref = SenderRef(self.prefill_broker.address, PREFILL_GROUP)

        # Receiver registered: every SendChunk posts a NIXL WRITE inside the call.
        ids = self.rooms(n_rooms)
        for rid in ids:
            self.decode.receiver(rid, ref).init(pages)
        wait_open(self.decode, ids, self.timeout, interval=0.005)
        senders = []
        for rid in ids:
            sender = self.prefill.sender(rid)
            sender.init(num_pages=per_room)
            senders.append(sender)
        posting = []
        for sender in senders:
            for p in range(per_room):
                t = time.perf_counter()
                sender.send(pages[p : p + 1])
                posting.append(time.perf_counter() - t)
        statuses = self.decode.wait(ids, timeout_seconds=self.timeout)
        if any(s.state != RoomState.SUCCESS for s in statuses.values()):
            raise BenchFailed("RTT rooms did not succeed")

        # No receiver: the chunk is validated and queued, nothing is posted.
        ids = self.rooms(n_rooms)
        queued = []
        for rid in ids:
            sender = self.prefill.sender(rid)
            sender.init(num_pages=per_room)
            for p in range(per_room):
                t = time.perf_counter()
                sender.send(pages[p : p + 1])
                queued.append(time.perf_counter() - t)
            sender.abort("benchmark: RTT room without a receiver")

        poll = poll_round_trips(self.prefill, ids[0], calls)
        return {
            "send_chunk": rtt_stats(posting),
            "send_chunk_no_receiver": rtt_stats(queued),
            "poll": rtt_stats(poll),
        }

    def stats(self) -> dict[str, dict[str, int]]:
        out = {}
        for b in self.brokers:
            s = b.stats()
            out[b.name] = {
                "transfers_posted": s.transfers_posted,
                "descriptors_transferred": s.descriptors_transferred,
                "bytes_sent": s.bytes_sent,
                "bytes_received": s.bytes_received,
                "rooms_succeeded": s.rooms_succeeded,
                "rooms_failed": s.rooms_failed,
            }
        return out

    def check(self, what: str, plans: Sequence[RoomPlan]) -> None:
        """The engines' own K/V tensors, as bytes: decode[dst pages] == prefill[src pages] for every layer."""
        src, dst = (np.concatenate([getattr(p, side) for p in plans]) for side in ("src", "dst"))
        wrong = kv_mismatches(what, [self.prefill_mem], [self.decode_mem], src, dst)
        if wrong:
            raise BenchFailed(wrong[0])


# -- main -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Measure one KV transfer through kvbroker, raw NIXL and memcpy (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument(
        "--page-kib",
        type=int,
        default=16,
        help="bytes of one page of one layer's K (or V), in KiB (4-64)",
    )
    p.add_argument("--pages-per-room", type=int, default=32)
    p.add_argument("--rooms", type=int, default=8)
    p.add_argument(
        "--chunks", type=int, default=4, help="SendChunk calls (and NIXL transfers) per room"
    )
    p.add_argument(
        "--run-pages", type=int, default=4, help="mean length of the contiguous page runs"
    )
    p.add_argument("--ucx-error-mode", choices=("peer", "none"), default="peer")
    p.add_argument(
        "--ucx-tls",
        default=None,
        help="set UCX_TLS for every process (default: leave the environment alone)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="run every measurement N times; print the best and the median",
    )
    p.add_argument(
        "--no-warm-pass",
        dest="warm_pass",
        action="store_false",
        help="skip the untimed full pass before the timed ones (then the first sample pays first-touch page faults)",
    )
    p.add_argument(
        "--rtt-calls", type=int, default=300, help="calls per round-trip measurement (0: skip them)"
    )
    p.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for one measurement's rooms"
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args(argv)
    if not 1 <= args.page_kib <= 1024:
        p.error("--page-kib must be between 1 and 1024")
    for name in ("layers", "pages_per_room", "rooms", "chunks", "run_pages", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls
    try:
        result = run(args)
    except BenchFailed as exc:
        print(f"transfer_bench: FAILED: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    page_bytes = args.page_kib * 1024
    plans, num_pages = make_plans(
        args.rooms + 1, args.pages_per_room, args.chunks, args.run_pages, args.seed
    )
    num_pages = max(num_pages, args.pages_per_room)
    warm, timed = plans[-1:], plans[:-1]
    total_bytes = args.rooms * args.pages_per_room * args.layers * 2 * page_bytes
    held = Held(Path(tempfile.mkdtemp(prefix="kvb-bench-")))
    raw: RawNixl | None = None
    results: dict[str, Samples] = {
        k: Samples() for k in ("broker", "raw_chunked", "raw_single", "raw_prepped", "memcpy")
    }
    rtts: dict[str, Any] = {}
    t_start = time.perf_counter()
    try:
        broker = BrokerBench(args, held, num_pages)
        layout = broker.prefill_mem.layout
        from kvbroker.v1 import common_pb2

        kv_kinds = (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE)
        kv = [r for r in layout.regions if r.kind in kv_kinds]
        if any(r.item_bytes != page_bytes or r.length_bytes != num_pages * page_bytes for r in kv):
            raise BenchFailed("unexpected engine layout: KV regions are not num_pages x page_bytes")
        regions = Regions(np.array([r.offset_bytes for r in kv], dtype=np.uint64), page_bytes)
        assert len(kv) == 2 * args.layers, (len(kv), args.layers)
        src = broker.prefill_mem.raw.numpy()
        decode_np = broker.decode_mem.raw.numpy()

        # Descriptor counts: what the broker should post if runs coalesce.
        from kvbroker.plan._descriptors import count_runs  # not exported by kvbroker.plan

        coalesced = sum(
            len(regions.offsets) * count_runs(p.src[a:b], p.dst[a:b])
            for p in timed
            for a, b in p.chunks
        )

        # (a) warm-up room: handshake, NIXL connection, first-touch.
        broker.run(warm)
        verify("broker warm-up", src, decode_np, regions, num_pages, warm)
        raw = RawNixl(args.ucx_error_mode, src, layout, num_pages)
        work = raw.prepare(regions, timed)
        warm_work = raw.prepare(regions, warm)
        for variant in ("chunked", "prepped"):
            raw.dst[:] = 0
            raw.run(variant, warm_work[variant])
            verify(f"raw NIXL {variant} warm-up", src, raw.dst, regions, num_pages, warm)
        copies = copy_list(regions, timed)
        stats_before = broker.stats()

        # Round -1 is the warm pass (not recorded): every page of the pattern
        # is touched once through every mapping involved, as in steady state.
        for rep in range(-1 if args.warm_pass else 0, args.repeat):
            record = rep >= 0
            decode_np[:] = 0
            seconds, detail = broker.run(timed)
            broker.check("broker", timed)
            verify("broker", src, decode_np, regions, num_pages, timed)
            if detail["bytes_reported"] != total_bytes:
                raise BenchFailed(
                    f"broker: rooms report {detail['bytes_reported']} bytes, expected {total_bytes}"
                )
            if record:
                results["broker"].seconds.append(seconds)
                results["broker"].details.append(detail)
            if rep == -1:
                stats_before = broker.stats()
            for variant in ("chunked", "single", "prepped"):
                raw.dst[:] = 0
                seconds, detail = raw.run(variant, work[variant])
                verify(f"raw NIXL {variant}", src, raw.dst, regions, num_pages, timed)
                if record:
                    results[f"raw_{variant}"].seconds.append(seconds)
                    results[f"raw_{variant}"].details.append(detail)
            raw.dst[:] = 0
            dst = raw.dst
            t0 = time.perf_counter()
            for so, do, n in copies:
                dst[do : do + n] = src[so : so + n]
            if record:
                results["memcpy"].seconds.append(time.perf_counter() - t0)
            verify("memcpy", src, dst, regions, num_pages, timed)

        stats_after = broker.stats()
        if args.rtt_calls > 0:
            rtts = broker.control_rtts(args.rtt_calls, args.pages_per_room)
    finally:
        # Every step runs even if an earlier one fails: no broker or target
        # process may outlive the benchmark.
        for what, close in (("raw NIXL", raw.close if raw else None), ("brokers", held.close)):
            try:
                for problem in (close() if close else None) or ():
                    print(f"transfer_bench: cleanup of {what}: {problem}", file=sys.stderr)
            except Exception as exc:
                print(f"transfer_bench: cleanup of {what} failed: {exc!r}", file=sys.stderr)
        shutil.rmtree(held.workdir, ignore_errors=True)

    delta = {
        name: {k: stats_after[name][k] - stats_before[name][k] for k in stats_after[name]}
        for name in stats_after
    }
    timed_descs = sum(len(local) for local, _ in work["chunked"])
    out: dict[str, Any] = {
        "config": {
            "layers": args.layers,
            "page_bytes": page_bytes,
            "pages_per_room": args.pages_per_room,
            "rooms": args.rooms,
            "chunks_per_room": len(timed[0].chunks),
            "mean_run_pages": args.run_pages,
            "pool_pages": num_pages,
            "ucx_error_mode": args.ucx_error_mode,
            "UCX_TLS": os.environ.get("UCX_TLS", "<unset>"),
            "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "<unset>"),
            "repeat": args.repeat,
            "cpus": os.cpu_count(),
        },
        "bytes": total_bytes,
        "descriptors_coalesced": coalesced,
        "descriptors_per_page": args.rooms * args.pages_per_room * args.layers * 2,
        "raw_chunked_descriptors": timed_descs,
        "wall_seconds": round(time.perf_counter() - t_start, 1),
        "results": {},
        "broker_stats_delta": delta,
        "rtt": rtts,
    }
    for name, s in results.items():
        out["results"][name] = {
            "best_s": s.best(),
            "median_s": s.median(),
            "best_gbps": total_bytes / s.best() / 1e9,
            "median_gbps": total_bytes / s.median() / 1e9,
            "samples_s": s.seconds,
            "details": s.details,
        }
    r = out["results"]
    out["ratios"] = {
        "broker_over_raw_nixl": {
            "best": r["broker"]["best_gbps"] / r["raw_chunked"]["best_gbps"],
            "median": r["broker"]["median_gbps"] / r["raw_chunked"]["median_gbps"],
        },
        "broker_over_memcpy": {
            "best": r["broker"]["best_gbps"] / r["memcpy"]["best_gbps"],
            "median": r["broker"]["median_gbps"] / r["memcpy"]["median_gbps"],
        },
        "raw_nixl_over_memcpy": {
            "best": r["raw_chunked"]["best_gbps"] / r["memcpy"]["best_gbps"],
            "median": r["raw_chunked"]["median_gbps"] / r["memcpy"]["median_gbps"],
        },
    }
    return out


def print_table(res: dict[str, Any]) -> None:
    c = res["config"]
    r = res["results"]
    print(
        "kvbroker transfer benchmark (compare within this run; this VM varies +-15-30% between runs)"
    )
    print(
        f"config: layers={c['layers']} page={c['page_bytes']} B ({c['page_bytes'] // 1024} KiB) per layer, K and V; pages/room={c['pages_per_room']} "
        f"rooms={c['rooms']} chunks/room={c['chunks_per_room']} mean-run={c['mean_run_pages']} pages "
        f"ucx-error-mode={c['ucx_error_mode']} UCX_TLS={c['UCX_TLS']} UCX_NET_DEVICES={c['UCX_NET_DEVICES']} "
        f"repeat={c['repeat']} cpus={c['cpus']}"
    )
    print(
        f"moved per measurement: {res['bytes']} bytes ({res['bytes'] / 2**20:.1f} MiB) in "
        f"{c['rooms'] * c['chunks_per_room']} chunks; descriptors: {res['descriptors_coalesced']} coalesced runs "
        f"x region ({res['descriptors_per_page']} pages x region)"
    )
    print()
    print(f"{'method':48} {'best GB/s':>9} {'median GB/s':>11} {'best ms':>8} {'median ms':>9}")
    names = {
        "broker": "(a) broker: 2 kvbroker serve, gRPC + NIXL",
        "raw_chunked": "(b) raw NIXL, 1 transfer per chunk",
        "raw_single": "    raw NIXL, 1 transfer for everything",
        "raw_prepped": "    raw NIXL, per-page prepped (broker's calls)",
        "memcpy": "(c) memcpy, 1 thread (numpy slices)",
    }
    for key, label in names.items():
        x = r[key]
        print(
            f"{label:48} {x['best_gbps']:9.2f} {x['median_gbps']:11.2f} {x['best_s'] * 1e3:8.1f} {x['median_s'] * 1e3:9.1f}"
        )
    print()
    ra = res["ratios"]
    print(
        f"ratios (GB/s, best/best; median/median): broker/raw-NIXL = {ra['broker_over_raw_nixl']['best']:.2f} "
        f"({ra['broker_over_raw_nixl']['median']:.2f}); broker/memcpy = {ra['broker_over_memcpy']['best']:.2f} "
        f"({ra['broker_over_memcpy']['median']:.2f}); raw-NIXL/memcpy = {ra['raw_nixl_over_memcpy']['best']:.2f} "
        f"({ra['raw_nixl_over_memcpy']['median']:.2f})"
    )
    chunks = c["rooms"] * c["chunks_per_room"]
    extra = (r["broker"]["median_s"] - r["raw_chunked"]["median_s"]) * 1e3
    print(
        f"broker minus raw NIXL (medians): {extra:.1f} ms over {chunks} chunks = {extra * 1e3 / chunks:.0f} us per chunk "
        f"(+ {c['rooms']} ExpectRoom/BeginSend pairs)"
    )
    if res["rtt"]:
        t = res["rtt"]
        s, q, p = t["send_chunk"], t["send_chunk_no_receiver"], t["poll"]
        print(
            f"KVSender.send blocks, 1 page, receiver registered:     median {s['median_us']:.0f} us, "
            f"p90 {s['p90_us']:.0f} us (n={s['n']})"
        )
        print(
            f"KVSender.send blocks, 1 page, no receiver yet:         median {q['median_us']:.0f} us, "
            f"p90 {q['p90_us']:.0f} us (n={q['n']})"
        )
        print(
            f"unary Poll round trip, 1 room:                         median {p['median_us']:.0f} us, p90 {p['p90_us']:.0f} us (n={p['n']})"
        )

    def med(key: str, name: str) -> float:
        return float(statistics.median(d[name] for d in r[key]["details"]))

    print()
    print(
        "broker timeline (median ms from the first ExpectRoom): "
        f"all ExpectRoom returned {med('broker', 'expect_ms'):.1f}, last SendChunk returned {med('broker', 'sent_ms'):.1f}, "
        f"last SUCCESS {med('broker', 'end_ms'):.1f}; SendChunk under load median {med('broker', 'send_chunk_median_us'):.0f} us"
    )
    cpu = {name: statistics.median(d["cpu_ms"][name] for d in r["broker"]["details"]) for name in r["broker"]["details"][0]["cpu_ms"]}
    wall = med("broker", "end_ms")
    print(
        "broker CPU per measurement (median ms; the machine has "
        f"{c['cpus']} cores = {c['cpus'] * wall:.0f} core-ms in the {wall:.0f} ms): "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in cpu.items() if "/" not in name)
        + f"; total {sum(ms for name, ms in cpu.items() if '/' not in name):.0f}; by broker thread: "
        + ", ".join(f"{name} {ms:.0f}" for name, ms in cpu.items() if "/" in name and ms >= 0.5)
    )
    for key in ("raw_chunked", "raw_single", "raw_prepped"):
        print(
            f"{key:11} timeline (median ms): posted {med(key, 'post_ms'):.1f}, all DONE {med(key, 'done_ms'):.1f}, "
            f"notification at target {med(key, 'notif_ms'):.1f}; NIXL descriptors per measurement {int(med(key, 'descriptors'))}"
        )
    pre = res["broker_stats_delta"]["prefill"]
    reps = c["repeat"]
    print(
        f"prefill broker per measurement: {pre['transfers_posted'] // reps} transfers, "
        f"{pre['descriptors_transferred'] // reps} NIXL descriptors (coalesced runs would be {res['descriptors_coalesced']})"
    )
    print(f"wall time {res['wall_seconds']} s")


if __name__ == "__main__":
    sys.exit(main())

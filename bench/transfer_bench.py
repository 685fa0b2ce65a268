"""One KV transfer measured three ways, through kvbroker, with raw NIXL and with memcpy; ``--hetero``: staging
vs per-token descriptors vs raw NIXL for heterogeneous tp.

    python bench/transfer_bench.py [--ucx-error-mode none] [--hetero]

The method and the figures: docs/benchmarks.md; raw NIXL's variants: ``chunked`` a transfer per chunk,
``single`` one for everything, ``prepped`` the broker's own calls (``build_descriptor_table`` lists, one
make_prepped_xfer a chunk). Every destination is zeroed before and checked after each sample.
"""

from __future__ import annotations

import argparse
import math
import os
import secrets
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import harness as h
import numpy as np
import torch

from kvbroker.plan import BufferPlacement, Layout, RankKey, build_descriptor_table
from kvbroker.plan._descriptors import coalesce_runs, count_runs  # not exported by kvbroker.plan
from kvbroker.testing.idle import wait_until_warm
from kvbroker.testing.rawpeer import RawPeer
from kvbroker.testing.scenario import Scenario, run_scenario
from kvbroker.v1 import common_pb2

HEAD_DIM = 64  # bfloat16: 1 KiB per token, so page_kib tokens per page
STATS = ("transfers_posted", "descriptors_transferred", "bytes_sent", "bytes_received", "rooms_succeeded", "rooms_failed")
METHODS = {"broker": "(a) broker: 2 kvbroker serve, gRPC + NIXL", "raw_chunked": "(b) raw NIXL, 1 transfer per chunk",
           "raw_single": "    raw NIXL, 1 transfer for everything", "raw_prepped": "    raw NIXL, per-page prepped (broker's calls)",
           "memcpy": "(c) memcpy, 1 thread (numpy slices)"}
#: The report's ratios: their labels and the two methods whose GB/s they divide.
RATIOS = {"broker_over_raw_nixl": ("broker/raw-NIXL", "broker", "raw_chunked"), "broker_over_memcpy": ("broker/memcpy", "broker", "memcpy"),
          "raw_nixl_over_memcpy": ("raw-NIXL/memcpy", "raw_chunked", "memcpy")}


@dataclass(frozen=True)
class RoomPlan:
    src: np.ndarray  # int32 page indices, in room order
    dst: np.ndarray
    #: [start, end) of each chunk over the room's pages.
    chunks: tuple[tuple[int, int], ...]


def _place(rng: np.random.Generator, lengths: np.ndarray, base: int) -> tuple[np.ndarray, int]:
    """Pages of runs of ``lengths`` (room order) laid out in shuffled order with gaps of 1-3 pages."""
    n, pos = len(lengths), 0
    order, gaps, starts = rng.permutation(n), rng.integers(1, 4, size=n), np.empty(n, dtype=np.int64)
    for i, run in enumerate(order):
        pos += int(gaps[i])
        starts[run] = pos
        pos += int(lengths[run])
    pages = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in range(n)]) + base
    return pages.astype(np.int32), pos + 1


def make_plans(n: int, pages: int, chunks: int, mean_run: int, seed: int) -> tuple[list[RoomPlan], int]:
    """``n`` rooms on disjoint pages of each side; the pool size (pages) both sides need."""
    rng, plans, src_base, dst_base = np.random.default_rng(seed), [], 0, 0
    for _ in range(n):
        lengths, left = [], pages
        while left > 0:
            lengths.append(run := min(left, int(rng.integers(1, 2 * mean_run))))
            left -= run
        src, src_extent = _place(rng, np.array(lengths, dtype=np.int64), src_base)
        dst, dst_extent = _place(rng, np.array(lengths, dtype=np.int64), dst_base)
        src_base, dst_base = src_base + src_extent, dst_base + dst_extent
        bounds = np.linspace(0, pages, max(1, min(chunks, pages)) + 1).astype(int)
        plans.append(RoomPlan(src, dst, tuple((int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]))))
    return plans, max(src_base, dst_base, pages)


def chunk_runs(offsets: np.ndarray, item: int, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """(src byte offset, dst byte offset, bytes) of each coalesced run of one chunk in every region (region-major)."""
    runs = coalesce_runs(src, dst).astype(np.uint64) * np.uint64(item)  # (src start, dst start, length)
    out = np.empty((len(offsets), len(runs), 3), dtype=np.uint64)
    out[:, :, :2] = offsets[:, None, None] + runs[None, :, :2]
    out[:, :, 2] = runs[None, :, 2]
    return out.reshape(-1, 3)


def verify(what: str, src: np.ndarray, dst: np.ndarray, offsets: np.ndarray, item: int, pages: int,
           plans: Sequence[RoomPlan]) -> None:
    """The chosen dst pages equal the src pages, byte for byte; every other dst page is zero."""
    s_idx, d_idx = (np.concatenate([getattr(p, side) for p in plans]).astype(np.int64) for side in ("src", "dst"))
    untouched = np.ones(pages, dtype=bool)
    untouched[d_idx] = False
    for r, off in enumerate(offsets.tolist()):
        sv, dv = (buf[off : off + pages * item].reshape(pages, item) for buf in (src, dst))
        got, want = dv[d_idx], sv[s_idx]
        if not np.array_equal(got, want):
            bad = int(np.count_nonzero(np.any(got != want, axis=1)))
            raise h.BenchFailed(f"{what}: region {r}: {bad} of {len(d_idx)} destination pages differ from their source pages")
        if np.any(dv[untouched]):
            bad = int(np.count_nonzero(np.any(dv[untouched] != 0, axis=1)))
            raise h.BenchFailed(f"{what}: region {r}: {bad} pages outside the rooms were written")


class BrokerPath:
    """Two brokers, and a prefill and a decode engine registered from this process (``held``'s)."""

    def __init__(self, args: argparse.Namespace, held: h.Held, num_pages: int) -> None:
        extra = ["--ucx-error-mode", args.ucx_error_mode, "--log-level", "warning", *args.broker_arg]
        self.brokers = held.start_brokers(["prefill", "decode"], extra)
        model = h.model_spec(args.layers, kv_heads=h.KV_HEADS, head_dim=HEAD_DIM, page_size=args.page_kib)
        self.prefill = held.group(self.brokers[0].address, "prefill", model, num_pages, seed=args.seed)
        self.decode = held.group(self.brokers[1].address, "decode", model, num_pages)
        self.next_room = secrets.randbits(40) << 20
        self.timeout = args.timeout

    def rooms(self, n: int) -> list[int]:
        self.next_room += n
        return list(range(self.next_room - n, self.next_room))

    def run(self, plans: Sequence[RoomPlan]) -> tuple[float, dict[str, Any]]:
        """Move ``plans``; seconds from the first ExpectRoom to the last SUCCESS."""
        ids, ref = self.rooms(len(plans)), self.prefill.ref()
        prefill, decode = self.prefill.engines[0], self.decode.engines[0]
        send_rtts = []
        sides = {"prefill": self.brokers[0].process.pid, "decode": self.brokers[1].process.pid}
        pids = {"engines (this process)": os.getpid(), **{f"{side} broker": pid for side, pid in sides.items()}}
        cpu0 = h.cpu_snapshot(pids, sides)
        t0 = time.perf_counter()
        for rid, plan in zip(ids, plans):
            decode.receiver(rid, ref).init(plan.dst)
        t_expect = time.perf_counter()
        for rid, plan in zip(ids, plans):
            sender = prefill.sender(rid)
            sender.init(num_pages=len(plan.src))
            for a, b in plan.chunks:
                t = time.perf_counter()
                sender.send(plan.src[a:b])
                send_rtts.append(time.perf_counter() - t)
        t_sent = time.perf_counter()
        statuses = decode.wait(ids, timeout_seconds=self.timeout)
        t_end = time.perf_counter()
        cpu_ms = h.cpu_delta(cpu0, h.cpu_snapshot(pids, sides))
        h.failed_rooms("broker", statuses)
        return t_end - t0, {
            "expect_ms": (t_expect - t0) * 1e3, "sent_ms": (t_sent - t0) * 1e3, "end_ms": (t_end - t0) * 1e3,
            "send_chunk_median_us": statistics.median(send_rtts) * 1e6,
            "bytes_reported": sum(s.bytes for s in statuses.values()), "cpu_ms": cpu_ms}

    def control_rtts(self, calls: int, pages_per_room: int) -> dict[str, dict[str, float]]:
        """Round trips of SendChunk (1 page) with and without a registered receiver, and of Poll."""
        prefill, decode, ref = self.prefill.engines[0], self.decode.engines[0], self.prefill.ref()
        per_room = max(1, pages_per_room)
        n_rooms = math.ceil(calls / per_room)
        pages = np.arange(per_room, dtype=np.int32)

        def sends(ids: list[int]) -> tuple[list[Any], list[float]]:
            senders, took = [prefill.sender(rid) for rid in ids], []
            for sender in senders:
                sender.init(num_pages=per_room)
            for sender in senders:
                for p in range(per_room):
                    t = time.perf_counter()
                    sender.send(pages[p : p + 1])
                    took.append(time.perf_counter() - t)
            return senders, took

        # Receiver registered: every SendChunk posts a NIXL WRITE inside the call.
        ids = self.rooms(n_rooms)
        for rid in ids:
            decode.receiver(rid, ref).init(pages)
        h.wait_open(decode, ids, self.timeout, interval=0.005)
        _, posting = sends(ids)
        h.failed_rooms("RTT rooms", decode.wait(ids, timeout_seconds=self.timeout))
        # No receiver: the chunk is validated and queued, nothing is posted.
        ids = self.rooms(n_rooms)
        senders, queued = sends(ids)
        for sender in senders:
            sender.abort("benchmark: RTT room without a receiver")
        poll = h.poll_round_trips(prefill, ids[0], calls)
        return {name: h.us_stats(v, 0.9) for name, v in
                (("send_chunk", posting), ("send_chunk_no_receiver", queued), ("poll", poll))}

    def stats(self) -> dict[str, dict[str, int]]:
        return {b.name: {k: getattr(s, k) for k in STATS} for b, s in ((b, b.stats()) for b in self.brokers)}


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    torch.set_num_threads(1)
    item = args.page_kib * 1024
    plans, num_pages = make_plans(2 * args.rooms + 1, args.pages_per_room, args.chunks, args.run_pages, args.seed)
    num_pages = max(num_pages, args.pages_per_room, (1 << 30) // (args.layers * 2 * item))  # engines of 1 GiB at least
    warm, timed, fresh = plans[-1:], plans[: args.rooms], plans[args.rooms : -1]  # fresh: moved right after registration
    total_bytes = args.rooms * args.pages_per_room * args.layers * 2 * item
    samples: dict[str, list[tuple[float, dict[str, Any]]]] = {k: [] for k in METHODS}
    t_start = time.perf_counter()
    broker = BrokerPath(args, held, num_pages)
    memory = broker.prefill.memories[0]
    kv = [r for r in memory.layout.regions if r.kind in (common_pb2.REGION_KIND_KEY, common_pb2.REGION_KIND_VALUE)]
    if len(kv) != 2 * args.layers or any(r.item_bytes != item or r.length_bytes != num_pages * item for r in kv):
        raise h.BenchFailed("unexpected engine layout: KV regions are not num_pages x page_bytes")
    offsets = np.array([r.offset_bytes for r in kv], dtype=np.uint64)
    src, decode_np = memory.raw.numpy(), broker.decode.memories[0].raw.numpy()
    # Descriptor counts: what the broker should post if runs coalesce.
    coalesced = sum(len(offsets) * count_runs(p.src[a:b], p.dst[a:b]) for p in timed for a, b in p.chunks)

    def check(what: str, dst: np.ndarray, plans: Sequence[RoomPlan]) -> None:
        verify(what, src, dst, offsets, item, num_pages, plans)

    # (a) warm-up room: handshake, NIXL connection; then rooms right after registration, while the memory warms.
    broker.run(warm)
    just = broker.run(fresh)
    check("broker right after registration", decode_np, [*warm, *fresh])
    warmed_after = wait_until_warm(*broker.brokers)
    raw = RawPeer(held, torch.device("cpu"), src.size, src=memory.raw, ucx_error_mode=args.ucx_error_mode, telemetry=True)
    assert raw.dst is not None
    agent, dram = raw.agent, common_pb2.MEMORY_KIND_DRAM
    # The broker's own form for "prepped": strided rows of every page, one per region, prepared once.
    lay = Layout.from_proto(memory.layout, rank=RankKey("raw", 0, 0), buffer_sizes=[src.size])
    tables = [build_descriptor_table(lay, [BufferPlacement(addr, src.size, dram, 0)]) for addr in (src.ctypes.data, raw.dst_ptr)]
    base = np.array([tables[0].region_base[lay.kv_regions[(k, layer)]]
                     for layer in range(lay.layer_begin, lay.layer_end) for k in lay.kv_kinds()], dtype=np.int32)
    dlists = (agent.prep_xfer_dlist("NIXL_INIT_AGENT", tables[0].rows[dram], "DRAM"),
              agent.prep_xfer_dlist(raw.peer, tables[1].rows[dram], "DRAM"))

    def work(plans: Sequence[RoomPlan]) -> dict[str, list[tuple[Any, Any]]]:
        """Everything built before the clock starts: numpy descriptor arrays and index arrays."""
        # Each chunk's (local, remote) rows (address, bytes, device 0): its runs from src and into raw's destination.
        chunked = [tuple(np.stack([runs[:, side] + np.uint64(addr), runs[:, 2], 0 * runs[:, 2]], axis=1)
                         for side, addr in ((0, src.ctypes.data), (1, raw.dst_ptr)))
                   for runs in (chunk_runs(offsets, item, p.src[a:b], p.dst[a:b]) for p in plans for a, b in p.chunks)]
        prepped = [tuple((base[:, None] + getattr(p, side)[a:b][None, :]).ravel().astype(np.int32) for side in ("src", "dst"))
                   for p in plans for a, b in p.chunks]
        single = [(np.concatenate([lo for lo, _ in chunked]), np.concatenate([re for _, re in chunked]))]
        return {"chunked": chunked, "single": single, "prepped": prepped}

    def descs(local: Any, remote: Any, notif: bytes) -> Any:
        return agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"), agent.get_xfer_descs(remote, "DRAM"), raw.peer, notif)

    def prepped(local: Any, remote: Any, notif: bytes) -> Any:
        return agent.make_prepped_xfer("WRITE", dlists[0], local, dlists[1], remote, notif)

    def raw_run(variant: str, todo: list[tuple[Any, Any]], plans: Sequence[RoomPlan]) -> tuple[float, dict[str, Any]]:
        raw.dst[:] = 0
        out = raw.post_all(todo, f"raw NIXL ({variant})", 60.0, notify=True, make=prepped if variant == "prepped" else descs)
        check(f"raw NIXL {variant}", raw.dst, plans)
        return out

    todo, warm_todo = work(timed), work(warm)
    for variant in ("chunked", "prepped"):
        raw_run(variant, warm_todo[variant], warm)
    copies = [tuple(map(int, row)) for p in timed for a, b in p.chunks for row in chunk_runs(offsets, item, p.src[a:b], p.dst[a:b])]
    # Round -1, the warm pass, is no sample (only "first pass once warm"): it touches every page through every mapping.
    for rep in range(-1, args.repeat):
        decode_np[:] = 0
        sample = broker.run(timed)
        h.check_kv("broker", broker.prefill, broker.decode, np.concatenate([p.src for p in timed]), np.concatenate([p.dst for p in timed]))
        check("broker", decode_np, timed)
        if sample[1]["bytes_reported"] != total_bytes:
            raise h.BenchFailed(f"broker: rooms report {sample[1]['bytes_reported']} bytes, expected {total_bytes}")
        if rep == -1:
            stats_before, first_warm = broker.stats(), sample
        this = {"broker": sample, **{f"raw_{v}": raw_run(v, todo[v], timed) for v in ("chunked", "single", "prepped")}}
        raw.dst[:] = 0
        dst = raw.dst
        t0 = time.perf_counter()
        for so, do, n in copies:
            dst[do : do + n] = src[so : so + n]
        this["memcpy"] = (time.perf_counter() - t0, {})
        check("memcpy", dst, timed)
        for key, value in this.items() if rep >= 0 else ():
            samples[key].append(value)
    stats_after = broker.stats()
    rtts = broker.control_rtts(args.rtt_calls, args.pages_per_room) if args.rtt_calls > 0 else {}
    out: dict[str, Any] = {
        "config": {"layers": args.layers, "page_bytes": item, "pages_per_room": args.pages_per_room, "rooms": args.rooms,
                   "chunks_per_room": len(timed[0].chunks), "mean_run_pages": args.run_pages, "pool_pages": num_pages,
                   "ucx_error_mode": args.ucx_error_mode, "UCX_TLS": os.environ.get("UCX_TLS", "<unset>"),
                   "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "<unset>"), "repeat": args.repeat, "cpus": os.cpu_count()},
        "bytes": total_bytes, "descriptors_coalesced": coalesced, "descriptors_per_page": args.rooms * args.pages_per_room * args.layers * 2,
        "raw_chunked_descriptors": sum(len(local) for local, _ in todo["chunked"]), "wall_seconds": round(time.perf_counter() - t_start, 1),
        "results": {}, "rtt": rtts, "registration": {"right_after_s": just[0], "warm_first_s": first_warm[0], "warm_wait_s": warmed_after},
        "broker_stats_delta": {n: {k: v - stats_before[n][k] for k, v in s.items()} for n, s in stats_after.items()}}
    for name, s in samples.items():
        secs = [x for x, _ in s]
        best, median = min(secs), statistics.median(secs)
        out["results"][name] = {"best_s": best, "median_s": median, "best_gbps": total_bytes / best / 1e9,
                                "median_gbps": total_bytes / median / 1e9, "samples_s": secs, "details": [d for _, d in s]}
    r = out["results"]
    out["ratios"] = {key: {how: r[x][f"{how}_gbps"] / r[y][f"{how}_gbps"] for how in ("best", "median")}
                     for key, (_, x, y) in RATIOS.items()}
    return out


def print_report(res: dict[str, Any]) -> None:
    c, r, ra = res["config"], res["results"], res["ratios"]
    print("kvbroker transfer benchmark (compare within this run; this VM varies +-15-30% between runs)")
    print(f"config: layers={c['layers']} page={c['page_bytes']} B ({c['page_bytes'] // 1024} KiB) per layer, K and V; "
          f"pages/room={c['pages_per_room']} rooms={c['rooms']} chunks/room={c['chunks_per_room']} mean-run={c['mean_run_pages']} pages "
          f"ucx-error-mode={c['ucx_error_mode']} UCX_TLS={c['UCX_TLS']} UCX_NET_DEVICES={c['UCX_NET_DEVICES']} "
          f"repeat={c['repeat']} cpus={c['cpus']}")
    print(f"moved per measurement: {res['bytes']} bytes ({res['bytes'] / 2**20:.1f} MiB) in {c['rooms'] * c['chunks_per_room']} "
          f"chunks; descriptors: {res['descriptors_coalesced']} coalesced runs x region ({res['descriptors_per_page']} pages x region)")
    print(f"\n{'method':48} {'best GB/s':>9} {'median GB/s':>11} {'best ms':>8} {'median ms':>9}")
    for key, label in METHODS.items():
        x = r[key]
        print(f"{label:48} {x['best_gbps']:9.2f} {x['median_gbps']:11.2f} {x['best_s'] * 1e3:8.1f} {x['median_s'] * 1e3:9.1f}")
    print("\nratios (GB/s, best/best; median/median): "
          + "; ".join(f"{label} = {ra[key]['best']:.2f} ({ra[key]['median']:.2f})" for key, (label, _, _) in RATIOS.items()))
    reg, gbps = res["registration"], lambda s: res["bytes"] / s / 1e9
    print(f"rooms right after the engines registered {gbps(reg['right_after_s']):.2f} GB/s, once no engine's memory warmed ({reg['warm_wait_s']:.1f} s "
          f"later; the timed rooms' first pass) {gbps(reg['warm_first_s']):.2f}: ratio {reg['warm_first_s'] / reg['right_after_s']:.2f} (target >= 0.9)")
    chunks = c["rooms"] * c["chunks_per_room"]
    extra = (r["broker"]["median_s"] - r["raw_chunked"]["median_s"]) * 1e3
    print(f"broker minus raw NIXL (medians): {extra:.1f} ms over {chunks} chunks = {extra * 1e3 / chunks:.0f} us per chunk "
          f"(+ {c['rooms']} ExpectRoom/BeginSend pairs)")
    for key, label in (("send_chunk", "KVSender.send blocks, 1 page, receiver registered:"),
                       ("send_chunk_no_receiver", "KVSender.send blocks, 1 page, no receiver yet:"),
                       ("poll", "unary Poll round trip, 1 room:")) if res["rtt"] else ():
        t = res["rtt"][key]
        print(f"{label:54} median {t['median_us']:.0f} us, p90 {t['p90_us']:.0f} us (n={t['n']})")

    def med(key: str, name: str) -> float:
        return float(statistics.median(d[name] for d in r[key]["details"]))

    print("\nbroker timeline (median ms from the first ExpectRoom): "
          f"all ExpectRoom returned {med('broker', 'expect_ms'):.1f}, last SendChunk returned {med('broker', 'sent_ms'):.1f}, "
          f"last SUCCESS {med('broker', 'end_ms'):.1f}; SendChunk under load median {med('broker', 'send_chunk_median_us'):.0f} us")
    details = r["broker"]["details"]
    cpu = {name: statistics.median(d["cpu_ms"][name] for d in details) for name in details[0]["cpu_ms"]}
    wall = med("broker", "end_ms")
    print(f"broker CPU per measurement (median ms; the machine has {c['cpus']} cores = {c['cpus'] * wall:.0f} core-ms in the "
          f"{wall:.0f} ms): " + ", ".join(f"{name} {ms:.0f}" for name, ms in cpu.items() if "/" not in name)
          + f"; total {sum(ms for name, ms in cpu.items() if '/' not in name):.0f}; by broker thread: "
          + ", ".join(f"{name} {ms:.0f}" for name, ms in cpu.items() if "/" in name and ms >= 0.5))
    for key in ("raw_chunked", "raw_single", "raw_prepped"):
        print(f"{key:11} timeline (median ms): posted {med(key, 'post_ms'):.1f}, all DONE {med(key, 'done_ms'):.1f}, "
              f"notification at target {med(key, 'notif_ms'):.1f}; NIXL descriptors per measurement {int(med(key, 'descriptors'))}")
    pre, reps = res["broker_stats_delta"]["prefill"], c["repeat"]
    print(f"prefill broker per measurement: {pre['transfers_posted'] // reps} transfers, {pre['descriptors_transferred'] // reps} "
          f"NIXL descriptors (coalesced runs would be {res['descriptors_coalesced']})")
    print(f"wall time {res['wall_seconds']} s")


def run_hetero(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    common = ["--log-level", "warning", "--finished-room-ttl", "1", *args.broker_arg]
    pairs = {"staging": held.start_brokers(["p-stage", "d-stage"], [*common, "--staging-mib", str(args.staging_mib)]),
             "per-token": held.start_brokers(["p-plain", "d-plain"], [*common, "--no-staging"])}
    layouts: list[dict[str, Any]] = []
    held.result.update(config=vars(args), layouts=layouts)
    for ps, pd in ((1, 2), (2, 1)):
        rates: dict[str, list[float]] = {}
        busy: list[dict[str, float]] = []
        walls: list[float] = []
        counts: dict[str, tuple[int, int, int]] = {}
        for _ in range(args.repeat):
            for path, (p, d) in pairs.items():
                scenario = Scenario(prefill_tp=ps, decode_tp=pd, kv_heads=8, head_dim=args.head_dim, layers=args.layers,
                                    page_size=args.page_size, pages=args.pages_per_room, rooms=args.rooms + 1, chunks=args.chunks)
                sides = {"prefill": p.process.pid, "decode": d.process.pid}
                result = run_scenario(p.address, d.address, scenario, timeout_seconds=600, warmup_rooms=1,
                                      probe=lambda p=p, sides=sides: (h.cpu_snapshot({"engines": os.getpid()}, sides), p.stats()))
                if not result.ok:
                    held.problems.extend(result.problems[:10])
                    continue
                assert result.probes is not None
                (cpu0, before), (cpu1, after) = result.probes
                if path == "staging":
                    busy.append(h.cpu_delta(cpu0, cpu1))
                    walls.append(result.transfer_seconds * 1e3)
                rates.setdefault(path, []).append(result.bytes / result.transfer_seconds / 1e9)
                counts[path] = (result.bytes, after.transfers_posted - before.transfers_posted,
                                after.descriptors_transferred - before.descriptors_transferred)
        row: dict[str, Any] = {"prefill_tp": ps, "decode_tp": pd, "paths": {}}
        for path, values in rates.items():
            nbytes, transfers, descriptors = counts[path]
            row["paths"][path] = {"bytes": nbytes, "best_gbps": max(values), "median_gbps": statistics.median(values),
                                  "transfers": transfers, "descriptors": descriptors}
        if len(rates) == 2:
            nbytes = counts["staging"][0]
            part = 2 * args.layers * (args.pages_per_room // args.chunks) * args.page_size * (8 // max(ps, pd)) * args.head_dim * 2
            raw = RawPeer(held, torch.device("cpu"), nbytes)
            work = [(raw.one(raw.src.data_ptr() + o, min(part, nbytes - o)), raw.one(raw.dst_ptr + o, min(part, nbytes - o)))
                    for o in range(0, nbytes, part)]
            samples = [raw.post_all(work, "raw NIXL", 60, notify=True)[0] for _ in range(args.repeat + 1)][1:]
            raw.check("raw NIXL", (1, nbytes, 1), None)
            raw.close()
            gbps = [nbytes / s / 1e9 for s in samples]
            row["paths"]["raw NIXL"] = {"bytes": nbytes, "best_gbps": max(gbps), "median_gbps": statistics.median(gbps),
                                        "transfers": len(work), "part_bytes": part}
            row["ratios"] = {f"staging_over_{other}": {how: row["paths"]["staging"][f"{how}_gbps"] / row["paths"][path][f"{how}_gbps"]
                                                       for how in ("best", "median")}
                             for other, path in (("per_token", "per-token"), ("raw_nixl", "raw NIXL"))}
        if busy:
            row["staging_cpu_ms"] = {k: statistics.median(b[k] for b in busy) for k in busy[0]}
            row["staging_wall_ms"] = statistics.median(walls)
        layouts.append(row)
        held.say(f"  measured: tp{ps} -> tp{pd}")
    return {"config": vars(args), "cpus": os.cpu_count(), "layouts": layouts}


def print_hetero(res: dict[str, Any]) -> None:
    a = res["config"]
    print("heterogeneous tp, 8 KV heads, bfloat16: "
          f"{a['layers']} layers x K,V, {a['pages_per_room']} pages/room of {a['page_size']} tokens, head dim {a['head_dim']}, "
          f"{a['rooms']} rooms x {a['chunks']} chunks, best and median of {a['repeat']}")
    print(f"{'layout':14} {'path':10} {'MiB':>8} {'best GB/s':>10} {'median GB/s':>12} {'transfers':>10} {'descriptors':>12}")
    for row in res["layouts"]:
        layout = f"tp{row['prefill_tp']} -> tp{row['decode_tp']}"
        for path, x in row["paths"].items():
            tail = f"{'':>12}   (same bytes, {x['part_bytes'] >> 20} MiB writes)" if "part_bytes" in x else f"{x['descriptors']:12d}"
            print(f"{layout:14} {path:10} {x['bytes'] / 2**20:8.1f} {x['best_gbps']:10.2f} {x['median_gbps']:12.2f} {x['transfers']:10d} {tail}")
        if "ratios" in row:
            pt, rn = row["ratios"]["staging_over_per_token"], row["ratios"]["staging_over_raw_nixl"]
            print(f"{'':14} staging / per-token = {pt['best']:.1f}x (best), {pt['median']:.1f}x (median); "
                  f"staging / raw NIXL = {rn['best']:.2f} (best), {rn['median']:.2f} (median)")
        if "staging_cpu_ms" in row:
            cores, wall = res.get("cpus") or os.cpu_count() or 1, row["staging_wall_ms"]
            print(f"{'':14} staging CPU per run (median ms, {cores} cores = {cores * wall:.0f} core-ms in the {wall:.0f} ms of the "
                  "scenario): " + ", ".join(f"{k} {v:.0f}" for k, v in row["staging_cpu_ms"].items() if v >= 0.5))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Measure one KV transfer through kvbroker, raw NIXL and memcpy (docs/benchmarks.md).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--layers", type=int, default=32)
    add("--page-kib", type=int, default=16, help="bytes of one page of one layer's K (or V), in KiB (4-64)")
    add("--pages-per-room", type=int, default=32)
    add("--hetero", action="store_true", help="heterogeneous tp: staging vs per-token descriptors vs raw NIXL")
    add("--rooms", type=int, help="rooms per measurement (default 8; --hetero: 4)")
    add("--chunks", type=int, default=4, help="SendChunk calls (and NIXL transfers) per room")
    add("--run-pages", type=int, default=4, help="mean length of the contiguous page runs")
    add("--ucx-error-mode", choices=("peer", "none"), default="peer")
    add("--repeat", type=int, default=3, help="run every measurement N times; print the best and the median")
    add("--rtt-calls", type=int, default=300, help="calls per round-trip measurement (0: skip them)")
    add("--timeout", type=float, default=120.0, help="seconds to wait for one measurement's rooms")
    add("--seed", type=int, default=1)
    add("--page-size", type=int, default=16, help="--hetero: tokens per page")
    add("--head-dim", type=int, default=128, help="--hetero")
    add("--staging-mib", type=int, default=64, help="--hetero: the staging pair's --staging-mib")
    h.add_run_options(p)
    args = p.parse_args(argv)
    args.rooms = args.rooms or (4 if args.hetero else 8)
    if not 1 <= args.page_kib <= 1024:
        p.error("--page-kib must be between 1 and 1024")
    for name in ("layers", "pages_per_room", "rooms", "chunks", "run_pages", "repeat"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hetero:
        return h.bench_main("transfer_bench --hetero", args, lambda held: run_hetero(args, held), print_hetero)
    return h.bench_main("transfer_bench", args, lambda held: run(args, held), print_report)

if __name__ == "__main__":
    sys.exit(main())

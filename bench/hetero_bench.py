"""Heterogeneous tensor parallelism: staging vs per-token descriptors vs raw NIXL, in one run.

    python bench/hetero_bench.py [--layers 32] [--pages 32] [--rooms 4] [--chunks 4] [--repeat 3]

Two pairs of ``kvbroker serve`` processes on loopback, one pair with staging
buffers and one started with ``--no-staging``, move the same rooms of a
non-MLA model with 8 KV heads from prefill tp Pp to decode tp Pd, for
(Pp, Pd) = (1, 2) and (2, 1). Every engine rank is registered from this
process (one memfd each), and one warm-up room moves first (the handshake
for the new ranks). The time is from the first ExpectRoom of the timed
rooms to the last room SUCCESS on every rank; afterwards every received
byte is checked against the reference pattern, outside the timing. Printed:
GB/s of each path, staging/per-token, the transfers and descriptors the
prefill broker posted, and the CPU time of the staging path by process and
broker thread (loop, nixl, copy, ...) within the timed window.

Raw NIXL of the same bytes (``bench/rawnixl.py``): two bare NIXL agents in
two processes write the same number of bytes in blocks the size of one
staged part, back to back. That is the floor a staged transfer (gather, one
bulk write per part, scatter, and the control calls around them) is
compared with: staging / raw NIXL. Compare within one run (this machine
varies by 15-30%).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from common import cpu_snapshot
from rawnixl import bulk_write_seconds

from kvbroker.testing import BrokerProcess
from kvbroker.testing.scenario import Scenario, run_scenario


def _cpu(p: BrokerProcess, d: BrokerProcess) -> dict[str, float]:
    """CPU seconds so far: this process (the engines), and each broker by thread role."""
    return cpu_snapshot({"engines": os.getpid()}, {"prefill": p.process.pid, "decode": d.process.pid})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--pages", type=int, default=32, help="pages per room")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rooms", type=int, default=4)
    parser.add_argument("--chunks", type=int, default=4, help="chunks per room")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--staging-mib", type=int, default=64)
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="kvb-hetero-"))
    common = ["--log-level", "warning", "--finished-room-ttl", "1"]
    staged = BrokerProcess.start_many(["p-stage", "d-stage"], workdir, [*common, "--staging-mib", str(args.staging_mib)])
    plain = BrokerProcess.start_many(["p-plain", "d-plain"], workdir, [*common, "--no-staging"])
    pairs = {"staging": staged, "per-token": plain}
    failed = False
    try:
        print("heterogeneous tp, 8 KV heads, bfloat16: "
              f"{args.layers} layers x K,V, {args.pages} pages/room of {args.page_size} tokens, head dim {args.head_dim}, "
              f"{args.rooms} rooms x {args.chunks} chunks, best and median of {args.repeat}")
        print(f"{'layout':14} {'path':10} {'MiB':>8} {'best GB/s':>10} {'median GB/s':>12} {'transfers':>10} {'descriptors':>12}")
        for ps, pd in ((1, 2), (2, 1)):
            rates: dict[str, list[float]] = {}
            busy: list[dict[str, float]] = []
            walls: list[float] = []
            counts: dict[str, tuple[int, int, int]] = {}
            for _ in range(args.repeat):
                for path, (p, d) in pairs.items():
                    scenario = Scenario(
                        prefill_tp=ps,
                        decode_tp=pd,
                        kv_heads=8,
                        head_dim=args.head_dim,
                        layers=args.layers,
                        page_size=args.page_size,
                        pages=args.pages,
                        rooms=args.rooms + 1,
                        chunks=args.chunks,
                    )
                    result = run_scenario(
                        p.address, d.address, scenario, timeout_seconds=600, probe=lambda p=p, d=d: (_cpu(p, d), p.stats()),
                        warmup_rooms=1,
                    )
                    if not result.ok:
                        print("\n".join(result.problems[:10]), file=sys.stderr)
                        failed = True
                        continue
                    assert result.probes is not None
                    (cpu0, before), (cpu1, after) = result.probes
                    if path == "staging":
                        busy.append({k: (cpu1[k] - cpu0[k]) * 1e3 for k in cpu1})
                        walls.append(result.transfer_seconds * 1e3)
                    rates.setdefault(path, []).append(result.bytes / result.transfer_seconds / 1e9)
                    counts[path] = (
                        result.bytes,
                        after.transfers_posted - before.transfers_posted,
                        after.descriptors_transferred - before.descriptors_transferred,
                    )
            for path, values in rates.items():
                nbytes, transfers, descriptors = counts[path]
                print(
                    f"tp{ps} -> tp{pd}     {path:10} {nbytes / 2**20:8.1f} {max(values):10.2f} {statistics.median(values):12.2f} "
                    f"{transfers:10d} {descriptors:12d}"
                )
            if len(rates) == 2:
                nbytes = counts["staging"][0]
                heads = 8 // max(ps, pd)
                part = 2 * args.layers * (args.pages // args.chunks) * args.page_size * heads * args.head_dim * 2
                raw = [nbytes / s / 1e9 for s in bulk_write_seconds(nbytes, part, args.repeat)]
                print(
                    f"tp{ps} -> tp{pd}     {'raw NIXL':10} {nbytes / 2**20:8.1f} {max(raw):10.2f} {statistics.median(raw):12.2f} "
                    f"{len(range(0, nbytes, part)):10d} {'':>12}   (same bytes, {part >> 20} MiB writes)"
                )
                stage, token = rates["staging"], rates["per-token"]
                print(f"{'':14} staging / per-token = {max(stage) / max(token):.1f}x (best), "
                      f"{statistics.median(stage) / statistics.median(token):.1f}x (median); "
                      f"staging / raw NIXL = {max(stage) / max(raw):.2f} (best), "
                      f"{statistics.median(stage) / statistics.median(raw):.2f} (median)")
            if busy:
                cpu = {k: statistics.median(b[k] for b in busy) for k in busy[0]}
                wall = statistics.median(walls)
                print(f"{'':14} staging CPU per run (median ms, {os.cpu_count()} cores = "
                      f"{(os.cpu_count() or 1) * wall:.0f} core-ms in the {wall:.0f} ms of the scenario): "
                      + ", ".join(f"{k} {v:.0f}" for k, v in cpu.items() if v >= 0.5))
    finally:
        for broker in (*staged, *plain):
            broker.stop()
    if failed:
        print(f"broker logs: {workdir}", file=sys.stderr)
    else:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

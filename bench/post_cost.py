"""What one NIXL WRITE costs to build and post: from prepared lists, or from fresh descriptor lists.

    UCX_NET_DEVICES=lo python bench/post_cost.py

Two bare agents (``rawpeer.bare_agent``, made as the broker makes its own) move random items of a 64 MiB
region, one post at a time, each waited for: ``prepared`` makes each post from indices into lists prepared once
(``make_prepped_xfer``: the broker's engine regions), ``fresh`` from N x 3 lists built for it
(``initialize_xfer``: the broker's packed parts and staged blocks). The modes alternate, twice each; every
destination item is checked after.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import harness as h
import numpy as np

REGION = 64 << 20
CASES = ((4096, 1), (4096, 16), (65536, 1), (1 << 20, 1), (1 << 20, 16))


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    from kvbroker.testing.rawpeer import bare_agent
    a, b = bare_agent("post_a"), bare_agent("post_b")
    rng = np.random.default_rng(0)
    src, dst = rng.integers(0, 255, REGION, dtype=np.uint8), np.zeros(REGION, np.uint8)
    a.register_memory([(src.ctypes.data, REGION, 0, "")], "DRAM")
    b.register_memory([(dst.ctypes.data, REGION, 0, "")], "DRAM")
    a.add_remote_agent(b.get_agent_metadata())
    rows: dict[str, Any] = {}
    for item, descs in CASES:
        count = REGION // item
        lists = [a.prep_xfer_dlist(agent, np.array([[base, item, 0, item, count]], np.uint64), "DRAM")
                 for agent, base in (("NIXL_INIT_AGENT", src.ctypes.data), ("post_b", dst.ctypes.data))]
        posts = args.posts if item < 1 << 20 else args.posts // 8
        picks = [rng.choice(count, descs, replace=False).astype(np.int32) for _ in range(posts)]

        def make(mode: str, pick: Any, item: int = item, lists: list[Any] = lists) -> Any:
            if mode == "prepared":
                return a.make_prepped_xfer("WRITE", lists[0], pick, lists[1], pick, b"n")
            offsets, sizes, zeros = pick.astype(np.uint64) * item, np.full(len(pick), item, np.uint64), np.zeros(len(pick), np.uint64)
            local = a.get_xfer_descs(np.stack([src.ctypes.data + offsets, sizes, zeros], 1), "DRAM")
            return a.initialize_xfer("WRITE", local, a.get_xfer_descs(np.stack([dst.ctypes.data + offsets, sizes, zeros], 1), "DRAM"),
                                     "post_b", b"n")

        took: dict[str, list[float]] = {"prepared": [], "fresh": []}
        for mode in ("fresh", "prepared", "fresh", "prepared"):
            dst[:] = 0
            built = total = 0.0
            for pick in picks:
                t0 = time.perf_counter()
                xfer = make(mode, pick)
                t1 = time.perf_counter()
                state = a.transfer(xfer)
                while state == "PROC":
                    b.get_new_notifs()  # (in one process the target's worker must progress too)
                    state = a.check_xfer_state(xfer)
                a.release_xfer_handle(xfer)
                built, total = built + t1 - t0, total + time.perf_counter() - t0
                if state != "DONE":
                    held.problems.append(f"{mode} post of {descs} x {item} B ended {state}")
            moved = np.unique(np.concatenate(picks))
            if not all(np.array_equal(src[i * item:(i + 1) * item], dst[i * item:(i + 1) * item]) for i in moved[:256]):
                held.problems.append(f"{mode} posts of {descs} x {item} B: destination differs from the source")
            took[mode].append((built / posts, total / posts))
        rows[f"{descs} x {item}"] = {m: min(v, key=lambda t: t[1]) for m, v in took.items()}
    return {"posts": args.posts, "rows": rows}


def print_report(r: dict[str, Any]) -> None:
    print(f"one WRITE at a time, best of 2 ({r['posts']} posts a case; 1 MiB items: an eighth), us a post: build / post+wait")
    for case, m in r["rows"].items():
        (fb, ft), (pb, pt) = m["fresh"], m["prepared"]
        print(f"{case:>13} B: fresh {fb * 1e6:5.1f} / {ft * 1e6:7.1f}, prepared {pb * 1e6:5.1f} / {pt * 1e6:7.1f}; saved {(ft - pt) * 1e6:5.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--posts", type=int, default=2000, help="posts per case and mode")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the report")
    args = parser.parse_args()
    return h.bench_main("post_cost", args, lambda held: run(args, held), print_report)


if __name__ == "__main__":
    raise SystemExit(main())

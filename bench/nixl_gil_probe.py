"""Does NIXL's Python ``transfer()`` hold the GIL while UCX copies?

    UCX_NET_DEVICES=lo python bench/nixl_gil_probe.py

A Python thread counts loop iterations while this thread posts one WRITE between two NIXL agents, sleeps
or spins: near its idle rate, ``transfer()`` released the GIL; near 0, it held it for the copy.
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable
from typing import Any

import harness as h
import torch


class Spinner:
    """A thread that counts loop iterations until stopped."""

    def __init__(self) -> None:
        self.count, self._stop = 0, False
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        while not self._stop:
            self.count += 1

    def rate_during(self, work: Callable[[], None]) -> tuple[float, float]:
        """(iterations per second while ``work`` runs, seconds it took)."""
        self._thread.start()
        time.sleep(0.1)  # let it get going
        c0, t0 = self.count, time.perf_counter()
        work()
        c1, t1 = self.count, time.perf_counter()
        self._stop = True
        self._thread.join()
        return (c1 - c0) / (t1 - t0), t1 - t0


def run(args: argparse.Namespace, held: h.Held) -> dict[str, Any]:
    from nixl._api import nixl_agent, nixl_agent_config
    size = args.mib << 20
    cfg = nixl_agent_config(backends=["UCX"])
    a, b = nixl_agent("probe_a", cfg), nixl_agent("probe_b", cfg)
    src, dst = torch.ones(size, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    a.register_memory(src)
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    handle = a.initialize_xfer("WRITE", a.get_xfer_descs(src), b.get_xfer_descs(dst), "probe_b", b"probe")

    def post() -> None:
        state = a.transfer(handle)
        while state not in ("DONE", "ERR"):
            state = a.check_xfer_state(handle)
        if state != "DONE":
            held.problems.append(f"the transfer ended {state}")

    def busy() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < took:
            pass

    during, took = Spinner().rate_during(post)
    idle, _ = Spinner().rate_during(lambda: time.sleep(took))
    contended, _ = Spinner().rate_during(busy)
    ok = bool((dst == 1).all())
    if not ok:
        held.problems.append("the destination's bytes differ from the source's")
    return {"mib": args.mib, "seconds": took, "gbps": size / took / 1e9, "verified": ok, "idle_rate": idle,
            "contended_rate": contended, "during_rate": during}


def print_report(r: dict[str, Any]) -> None:
    during, idle, contended = r["during_rate"], r["idle_rate"], r["contended_rate"]
    print(f"one WRITE of {r['mib']} MiB took {r['seconds'] * 1000:.0f} ms ({r['gbps']:.2f} GB/s), bytes {'verified' if r['verified'] else 'WRONG'}")
    print(f"spinning thread, iterations/s: idle main thread {idle:,.0f}; main thread busy in Python {contended:,.0f}; "
          f"main thread inside transfer() {during:,.0f}")
    print(f"during the post / idle: {during / idle:.2f} (near 0: transfer() held the GIL for the copy; "
          f"well above 0: it released it; two Python threads sharing the GIL give {contended / idle:.2f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes moved by the one WRITE (MiB)")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of the report")
    args = parser.parse_args()
    return h.bench_main("nixl_gil_probe", args, lambda held: run(args, held), print_report)

if __name__ == "__main__":
    raise SystemExit(main())

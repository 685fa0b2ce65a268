"""Does NIXL's Python ``transfer()`` hold the GIL while UCX copies?

Two NIXL agents in this process (UCX, DRAM) and one WRITE of ``--mib`` MiB.
A Python thread counts loop iterations while the main thread posts the
transfer; the same count is taken with the main thread asleep (the idle
rate) and busy in Python (two threads sharing the GIL). A call that holds the
GIL for the whole copy stops the counting thread (ratio near 0); one that
releases it leaves the counter running (near the idle rate, less what the
copy takes from a shared core and memory bus), and then a broker could post
from a thread of its own while its event loop keeps answering gRPC.

    UCX_NET_DEVICES=lo python bench/nixl_gil_probe.py
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import torch

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402


class Spinner:
    """A thread that counts loop iterations until stopped."""

    def __init__(self) -> None:
        self.count = 0
        self._stop = False
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes moved by the one WRITE (MiB)")
    args = parser.parse_args()
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
            raise SystemExit(f"transfer ended {state}")

    during, took = Spinner().rate_during(post)
    idle, _ = Spinner().rate_during(lambda: time.sleep(took))

    def busy() -> None:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < took:
            pass

    contended, _ = Spinner().rate_during(busy)
    ok = bool((dst == 1).all())
    print(f"one WRITE of {args.mib} MiB took {took * 1000:.0f} ms ({size / took / 1e9:.2f} GB/s), bytes {'verified' if ok else 'WRONG'}")
    print(f"spinning thread, iterations/s: idle main thread {idle:,.0f}; main thread busy in Python {contended:,.0f}; "
          f"main thread inside transfer() {during:,.0f}")
    print(f"during the post / idle: {during / idle:.2f} (near 0: transfer() held the GIL for the copy; "
          f"well above 0: it released it; two Python threads sharing the GIL give {contended / idle:.2f})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

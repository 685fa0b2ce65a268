"""CPU time and memory of processes, and CPU of a broker's threads, read from /proc (Linux).

Shared by the benchmark scripts (they import it as a sibling module).
"""

from __future__ import annotations

import os

__all__ = ["cpu_seconds", "rss_bytes", "thread_cpu_seconds", "THREAD_ROLES"]

#: A broker's threads by role: its control loop (the main thread), the NIXL
#: data plane (kvb-nixl), the copy thread (kvb-copy: staging gather and
#: scatter), the memory thread (kvb-memory: mapping and faulting in engine
#: buffers), and every other thread (gRPC's pollers, exporters).
THREAD_ROLES = ("loop", "nixl", "copy", "memory", "other")
_BY_NAME = {"kvb-nixl": "nixl", "kvb-copy": "copy", "kvb-memory": "memory"}


def _ticks(stat: str) -> int:
    # The command name (field 2) may contain spaces: split after its ')'.
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime and stime, fields 14 and 15 of proc(5)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process ``pid`` (all its threads) used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        return _ticks(fh.read()) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds a broker's threads used so far, summed by role (:data:`THREAD_ROLES`)."""
    out = dict.fromkeys(THREAD_ROLES, 0.0)
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue  # the thread ended
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        role = "loop" if int(tid) == pid else _BY_NAME.get(name, "other")
        out[role] += _ticks(stat) / os.sysconf("SC_CLK_TCK")
    return out


def rss_bytes(pid: int) -> int | None:
    """Resident memory of process ``pid`` (VmRSS), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None

"""Raw NIXL bulk writes between two processes: the baseline a staged transfer is compared with.

``bulk_write_seconds(total, part)`` moves ``total`` bytes from a buffer of
this process into a buffer of a spawned target process with bare NIXL
agents, made with the broker's own agent wrapper (``UcxAgent``: UCX backend,
no progress thread, the same error mode), one WRITE of ``part`` bytes per
part, all posted back to back and polled until every one is DONE and the
target has seen the notification of the last. That is what staging's bulk
write would cost with nothing else to do: no gather, no scatter, no control
calls. Both buffers are mapped and faulted in before the timing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
from common import spawn

__all__ = ["bulk_write_seconds"]

_DRAM = 1  # kvbroker.v1.MEMORY_KIND_DRAM


def _agent(name: str) -> Any:
    from kvbroker.broker.dataplane import AgentConfig, UcxAgent

    return UcxAgent(AgentConfig(name=name))


def _target(conn: Any, name: str, size: int) -> None:
    from kvbroker.broker.memory._importers import map_anonymous

    agent = _agent(name)
    address = map_anonymous(size)
    agent.register(address, size, _DRAM, 0)
    conn.send((agent.metadata(), address))
    while True:
        command = conn.recv()
        if command == "stop":
            break
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(payload == command.encode() for _, payload in agent.get_notifs()):
                conn.send(time.monotonic())
                break
            time.sleep(50e-6)
        else:
            conn.send(None)
    agent.close()


def bulk_write_seconds(total_bytes: int, part_bytes: int, repeat: int = 3) -> list[float]:
    """Seconds to write ``total_bytes`` in parts of ``part_bytes``, once per repeat."""
    from kvbroker.broker.memory import array_at
    from kvbroker.broker.memory._importers import map_anonymous

    child = spawn("raw NIXL target", _target, f"raw-target-{os.getpid()}", total_bytes)
    here = child.conn
    agent = _agent(f"raw-initiator-{os.getpid()}")
    try:
        source = map_anonymous(total_bytes)
        array_at(source, total_bytes)[:] = 7
        agent.register(source, total_bytes, _DRAM, 0)
        metadata, target = here.recv()
        remote = agent.add_remote(metadata)
        out = []
        for i in range(repeat + 1):  # the first is a warm-up (connection, first touch)
            tag = f"done-{i}"
            offsets = range(0, total_bytes, part_bytes)
            start = time.monotonic()
            handles = []
            for n, offset in enumerate(offsets):
                length = min(part_bytes, total_bytes - offset)
                local = np.array([[source + offset, length, 0]], dtype=np.uint64)
                far = np.array([[target + offset, length, 0]], dtype=np.uint64)
                notif = tag.encode() if n == len(offsets) - 1 else b""
                handles.append(agent.post_write_descs(local, _DRAM, far, _DRAM, remote, notif))
            here.send(tag)
            for handle in handles:
                while agent.check(handle).value == "PROC":
                    pass
                agent.release_xfer(handle)
            seen = here.recv()
            if seen is None:
                raise RuntimeError("the raw NIXL target never saw the last notification")
            if i:
                out.append(max(seen, time.monotonic()) - start)
        return out
    finally:
        child.stop("stop", wait=30)
        agent.close()

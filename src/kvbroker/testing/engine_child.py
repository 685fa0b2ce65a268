"""Engine ranks in child processes, for tests that kill engines or move them to another host.

``hold_rooms`` registers one prefill rank, fills it, opens the given rooms
and sends the first half of each room's pages (not the last chunk), reports
``"ready"`` on the pipe and then waits forever, holding its rooms open, until
the test kills the process.

``serve_decode`` runs a decode rank on a host of its own
(``kvbroker.testing.hosts``): it enters the host's network namespace, reaches
its broker over TCP, and answers the test's requests on the pipe (a tuple,
its verb first) until ``("close",)``:

- ``("receive", room, pages, sender_address, sender_group)``: open a
  receiving room into ``pages``; answers ``None``;
- ``("status", room)``: the room's status as a dict (``state``,
  ``cause_kind``, ``cause_message``, ``pages_settled``, ``chunks``);
- ``("pages", pages)``: the bytes of those pages of every KV tensor, one
  ``bytes`` per (layer, tensor), to compare with the sender's;
- ``("close",)``: close the engine (``Unavailable`` tolerated) and return.

An exception answers ``("error", repr)`` and ends nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec, SenderRef

__all__ = ["MODEL", "hold_rooms", "serve_decode"]

MODEL = ModelSpec(num_layers=2, total_kv_heads=2, head_dim=8, dtype=torch.float16, page_size=4)


def hold_rooms(address: str, group: str, rooms: list[int], pages: int, conn: Any) -> None:
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    rank = RankSpec(group=group, role="prefill")
    memory = EngineMemory.allocate(rank, MODEL, num_pages=max(pages, 1), aux_rows=1, aux_row_bytes=[16])
    client = BrokerClient(address)
    engine = client.register_engine(rank, memory)
    for room in rooms:
        sender = engine.sender(room)
        sender.init(num_pages=pages, aux_row=0)
        sender.send(np.arange(pages // 2, dtype=np.int32), is_last=False)
    conn.send("ready")
    while True:
        time.sleep(60)


def serve_decode(host: Any, address: str, group: str, pages: int, broker_lost_after_seconds: float, conn: Any) -> None:
    """A decode rank on ``host`` (a ``Host``), registered with the broker at ``address``."""
    host.enter()
    rank = RankSpec(group=group, role="decode")
    memory = EngineMemory.allocate(rank, MODEL, num_pages=pages, aux_rows=4, aux_row_bytes=[16])
    # Over TCP even though its engine socket is a file this process could reach (these hosts
    # share one filesystem; two machines would not).
    client = BrokerClient(address, prefer_unix_socket=False, broker_lost_after_seconds=broker_lost_after_seconds)
    engine = client.register_engine(rank, memory)
    receivers: dict[int, Any] = {}

    def answer(verb: str, *args: Any) -> Any:
        if verb == "receive":
            room, into, sender_address, sender_group = args
            receivers[room] = engine.receiver(room, SenderRef(sender_address, sender_group))
            receivers[room].init(np.asarray(into), aux_row=0)
            return None
        if verb == "status":
            status = receivers[args[0]].status()
            return {
                "state": int(status.state),
                "cause_kind": int(status.cause.kind),
                "cause_message": status.cause.message,
                "pages_settled": bool(status.pages_settled),
                "chunks": int(status.chunks),
            }
        if verb == "pages":
            index = torch.as_tensor(args[0], dtype=torch.int64)
            return [t.view(torch.uint8)[index].numpy().tobytes() for layer in range(MODEL.num_layers) for t in memory.kv_tensors(layer)]
        raise ValueError(f"unknown request {verb!r}")

    conn.send("ready")
    while True:
        verb, *args = conn.recv()
        if verb == "close":
            break
        try:
            conn.send(answer(verb, *args))
        except Exception as exc:  # the test reads it
            conn.send(("error", repr(exc)))
    try:
        engine.close()
    except Exception:  # the broker may be out of reach: the test judges what it sees
        pass
    client.close()
    conn.send("closed")

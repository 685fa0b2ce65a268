"""A prefill engine rank in a child process, for tests that kill engines.

``hold_rooms`` registers one prefill rank, fills it, opens the given rooms
and sends the first half of each room's pages (not the last chunk), reports
``"ready"`` on the pipe and then waits forever, holding its rooms open, until
the test kills the process.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from kvbroker.client import BrokerClient, EngineMemory, ModelSpec, RankSpec

__all__ = ["MODEL", "hold_rooms"]

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

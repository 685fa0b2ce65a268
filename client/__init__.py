"""The engine-facing client of kvbroker.

Typical use on a prefill rank::

    client = BrokerClient("127.0.0.1:50051")
    memory = EngineMemory.allocate(rank, model, num_pages=4096, aux_rows=256, aux_row_bytes=[64])
    engine = client.register_engine(rank, memory)
    sender = engine.sender(room)
    sender.init(num_pages=len(pages), aux_row=row)
    sender.send(pages)                       # the last chunk (reaches num_pages)
    while sender.poll() not in (RoomState.SUCCESS, RoomState.FAILED): ...

and on a decode rank::

    receiver = engine.receiver(room, SenderRef("prefill-host:50051", "prefill-0"))
    receiver.init(pages=dst_pages, aux_row=row)
    status = receiver.wait(timeout_seconds=30)
"""

from __future__ import annotations

from kvbroker.client.adopt import StateTensors
from kvbroker.client.connection import BrokerClient
from kvbroker.client.engine import EngineHandle, ExpectSpec
from kvbroker.client.memory import (
    EngineMemory,
    ModelSpec,
    RankSpec,
    StateSpec,
    even_pp_layer_begins,
)
from kvbroker.client.rooms import KVReceiver, KVSender, RoomState, SenderRef
from kvbroker.plan import RoomTimeouts

__all__ = [
    "BrokerClient",
    "EngineHandle",
    "EngineMemory",
    "ExpectSpec",
    "KVReceiver",
    "KVSender",
    "ModelSpec",
    "RankSpec",
    "RoomState",
    "RoomTimeouts",
    "SenderRef",
    "StateSpec",
    "StateTensors",
    "even_pp_layer_begins",
]

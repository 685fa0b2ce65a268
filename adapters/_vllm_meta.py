"""What kvbroker's vLLM connector passes from its scheduler side to its
workers each step (``KVBrokerMetadata``, vLLM's connector metadata): the
rooms to send, to receive, to abort and to announce, each with what its
worker needs to open it (blocks, the prefill's parameters, the room's class
and deadline).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvbroker.adapters._priorities import RoomClass

__all__ = ["KVBrokerMetadata"]


@dataclass
class _Send:
    request_id: str
    block_ids: list[int]
    #: The room's class and deadline, as the scheduler read them off the request.
    room_class: RoomClass = field(default_factory=RoomClass)
    #: Why the request's class was refused (its room is then refused at once); "" when it was not.
    refusal: str = ""


@dataclass
class _Recv:
    request_id: str
    local_block_ids: list[int]
    params: dict[str, Any]
    #: Leading blocks of the prompt this engine holds already (its prefix cache).
    prefix_blocks: int = 0
    room_class: RoomClass = field(default_factory=RoomClass)
    refusal: str = ""


@dataclass
class _Announce:
    """A decode request left waiting in vLLM's queue before its blocks were
    allocated: its room is announced, so the decode's broker renews the
    prefill's lease on the prefill's blocks meanwhile."""

    request_id: str
    params: dict[str, Any]


@dataclass
class _Abort:
    """A decode request that finished before its KV arrived: its room is
    aborted, so the prefill's broker fails it and the prefill frees its blocks."""

    request_id: str
    params: dict[str, Any]
    #: Its blocks were allocated and its room handed to the worker: vLLM frees
    #: them once the worker reports the room in ``finished_recving`` (which it
    #: does once the aborted room's pages are settled).
    holds_blocks: bool


@dataclass
class KVBrokerMetadata(KVConnectorMetadata):
    """What one step asks of the workers: rooms to send, to receive, to abort, to announce."""

    sends: list[_Send] = field(default_factory=list)
    recvs: list[_Recv] = field(default_factory=list)
    aborts: list[_Abort] = field(default_factory=list)
    announces: list[_Announce] = field(default_factory=list)

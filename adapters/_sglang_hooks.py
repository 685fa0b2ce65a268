"""What the SGLang backend's ``install`` hooks into SGLang, besides its KV classes.

SGLang's transfer backends are a closed enum: :func:`add_enum_member` adds
``KVBROKER`` to it. :func:`custom_mem_pool` wraps SGLang's custom memory pool
setting (on CUDA, with this backend, KV pools allocate from kvbroker's VMM
allocator). :func:`with_queue` wraps the disaggregation queues'
``_init_kv_manager`` so that the manager they build finds its queue in
:data:`QUEUE` (the KV pool's tensors and the metadata buffers: SGLang's own
managers get raw pointers only). :func:`with_request` wraps the queues'
``create_sender`` and ``_create_receiver_and_enqueue`` so that the sender or
receiver they build finds its request (``Req``) in :data:`REQUEST`: SGLang
hands those classes the bootstrap address and room only, and the room's
class comes from the request's priority.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "BACKEND",
    "ENV_VMM_POOL",
    "QUEUE",
    "REQUEST",
    "add_enum_member",
    "custom_mem_pool",
    "request_priority",
    "with_queue",
    "with_request",
]

#: The value of ``--disaggregation-transfer-backend``.
BACKEND = "kvbroker"
#: ``0``: SGLang's own allocator for CUDA KV pools, not kvbroker's VMM pool.
ENV_VMM_POOL = "KVBROKER_VMM_POOL"

#: The SGLang queue whose ``_init_kv_manager`` is running (set by :func:`with_queue`).
QUEUE: contextvars.ContextVar[Any] = contextvars.ContextVar("kvbroker_sglang_queue", default=None)
#: The SGLang request (``Req``) whose KV sender or receiver is being built (set by :func:`with_request`).
REQUEST: contextvars.ContextVar[Any] = contextvars.ContextVar("kvbroker_sglang_request", default=None)


def add_enum_member(enum_class: Any, name: str, value: str) -> None:
    """Add a member to a closed ``Enum`` (what ``TransferBackend(value)`` looks up)."""
    member = object.__new__(enum_class)
    member._name_ = name
    member._value_ = value
    enum_class._member_map_[name] = member
    enum_class._value2member_map_[value] = member
    enum_class._member_names_.append(name)
    type.__setattr__(enum_class, name, member)


def custom_mem_pool(original: Callable[..., Any], device: Any, *args: Any, **kwargs: Any) -> Any:
    """SGLang's custom memory pool setting: on CUDA, with the kvbroker backend,
    kvbroker's VMM allocator (``KVBROKER_VMM_POOL=0`` leaves SGLang's own)."""
    from sglang.srt.runtime_context import get_disagg

    try:
        ours = get_disagg().disaggregation_transfer_backend == BACKEND
    except ValueError:  # no config published in this process
        ours = False
    if not ours or not str(device).startswith("cuda") or os.environ.get(ENV_VMM_POOL, "1") == "0":
        return original(device, *args, **kwargs)

    from kvbroker import vmmpool

    index = torch.device(device).index
    return True, vmmpool.mem_pool(torch.cuda.current_device() if index is None else index), "KVBROKER_VMM"


def with_queue(original: Callable[..., Any], queue: Any, *args: Any, **kwargs: Any) -> Any:
    token = QUEUE.set(queue)
    try:
        return original(queue, *args, **kwargs)
    finally:
        QUEUE.reset(token)


def with_request(original: Callable[..., Any], queue: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """Around ``PrefillBootstrapQueue.create_sender(req, ...)`` and
    ``DecodePreallocQueue._create_receiver_and_enqueue(req, ...)``: the sender
    or receiver built inside reads ``req`` from :data:`REQUEST`."""
    token = REQUEST.set(req)
    try:
        return original(queue, req, *args, **kwargs)
    finally:
        REQUEST.reset(token)


def request_priority() -> int | None:
    """The SGLang priority (``Req.priority``: an int, None when it has none) of the request whose
    sender or receiver is being built; None outside :func:`with_request`."""
    priority = getattr(REQUEST.get(), "priority", None)
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else None

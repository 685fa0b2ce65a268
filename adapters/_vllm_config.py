"""What kvbroker's vLLM connector reads of vLLM: its KV caches' layout, its
parallel config, and the compatibility digest both sides declare.

``kv_layout_of`` turns vLLM's per-layer KV caches into kvbroker's
``ModelSpec`` and tensors (or refuses them by name); ``check_parallel``
refuses data- and pipeline-parallel engines at start; ``compatibility_of``
is what must match between a prefill and a decode beyond shapes;
``room_timeouts_of`` reads the engine's own room timeouts from
``kv_connector_extra_config`` (the prefill's lease also from NixlConnector's
``kv_lease_duration``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from kvbroker.adapters._timeouts import first_set, timeouts_from
from kvbroker.client import ModelSpec, RoomTimeouts
from kvbroker.errors import Unimplemented

__all__ = ["NIXL_LEASE_KEY", "TIMEOUT_KEYS", "check_parallel", "compatibility_of", "kv_layout_of", "room_timeouts_of"]

#: NixlConnector's name for the prefill's lease, which kvbroker reads too.
NIXL_LEASE_KEY = "kv_lease_duration"
#: ``RoomTimeouts`` field -> the ``kv_connector_extra_config`` keys that set
#: it (seconds), first set wins; none set: the broker's flag of the same name.
TIMEOUT_KEYS: dict[str, tuple[str, ...]] = {
    # The prefill's lease: how long a finished request's blocks wait for its
    # decode to open the room, renewed while the decode's request waits in its
    # queue (then the room fails and vLLM frees them). kv_lease_duration is
    # NixlConnector's name for it; sender_info_timeout wins where both are set.
    "sender_info_seconds": ("sender_info_timeout", NIXL_LEASE_KEY),
    # How long a decode's room looks for the prefill's broker and group.
    "bootstrap_seconds": ("bootstrap_timeout",),
    # How long a decode's room, once the prefill's broker has it, waits for its KV.
    "receiver_data_seconds": ("receiver_data_timeout",),
}


def kv_layout_of(
    caches: list[torch.Tensor], *, total_heads: int, block_size: int
) -> tuple[ModelSpec, dict[int, list[torch.Tensor]]]:
    """The model's KV layout and kvbroker's view of vLLM's per-layer KV caches.

    - CPU (vLLM's CPU attention): ``[blocks, kv heads, block_size, 2 *
      head_dim]`` per layer, the fused layout.
    - CUDA, FlashAttention's layout ``[2, blocks, block_size, kv heads,
      head_dim]``: K and V are the two halves, token-major pages ("nhd").
    - CUDA, MLA ``[blocks, block_size, latent dim]``: one latent tensor.

    Other layouts (FlashInfer's ``[blocks, 2, ...]`` interleaves K and V per
    block; stride-permuted HND caches, whose shape reads NHD but whose
    memory is head-major) raise ``Unimplemented`` naming the shape and
    strides, as do caches whose layers differ. CUDA caches are exported
    where they lie (``EngineMemory.adopt``); that path has not run on a GPU."""
    first = caches[0]
    shape = tuple(first.shape)
    for cache in caches:
        if tuple(cache.shape) != shape or cache.dtype != first.dtype or cache.device != first.device:
            raise Unimplemented(
                f"vLLM's KV caches differ between layers ({shape} {first.dtype} on {first.device} and "
                f"{tuple(cache.shape)} {cache.dtype} on {cache.device}): kvbroker moves one layout per engine"
            )
        if not cache.is_contiguous():
            raise Unimplemented(
                f"vLLM's {cache.device.type} KV cache of shape {shape} has strides {tuple(cache.stride())}: a "
                "stride-permuted (HND) cache is not a layout kvbroker moves; use a backend whose cache is "
                "contiguous in the shape it reports (FlashAttention's NHD)"
            )
    if first.device.type == "cpu":
        if first.dim() != 4 or shape[3] % 2:
            raise Unimplemented(
                f"vLLM's CPU KV cache of shape {shape} is not the CPU attention's [blocks, kv heads, "
                "block_size, 2 * head_dim]"
            )
        _blocks, _heads, size, fused = shape
        model = ModelSpec(
            num_layers=len(caches), total_kv_heads=total_heads, head_dim=fused // 2, dtype=first.dtype,
            page_size=size, kv_layout="hnd_fused",
        )
        return model, {i: [t] for i, t in enumerate(caches)}
    if first.dim() == 5 and shape[0] == 2 and shape[2] == block_size:
        model = ModelSpec(num_layers=len(caches), total_kv_heads=total_heads, head_dim=shape[4], dtype=first.dtype, page_size=block_size)
        return model, {i: [t[0], t[1]] for i, t in enumerate(caches)}
    if first.dim() == 3 and shape[1] == block_size:
        model = ModelSpec(num_layers=len(caches), total_kv_heads=1, head_dim=shape[2], dtype=first.dtype, page_size=block_size, mla=True)
        return model, {i: [t] for i, t in enumerate(caches)}
    raise Unimplemented(
        f"vLLM's {first.device.type} KV cache of shape {shape} is not a layout kvbroker moves: it takes "
        "FlashAttention's (2, blocks, block_size, kv heads, head_dim) and MLA's (blocks, block_size, dim)"
    )


def check_parallel(parallel: Any) -> None:
    """Refuse, by name, parallel layouts the connector does not register:
    its ranks are one engine's tensor-parallel ranks under one group, so a
    second data-parallel or pipeline-parallel rank would collide with the
    first (AlreadyExists) in the middle of start-up."""
    for name, size in (
        ("data_parallel_size", parallel.data_parallel_size),
        ("pipeline_parallel_size", parallel.pipeline_parallel_size),
    ):
        if size != 1:
            raise Unimplemented(
                f"kvbroker's vLLM connector does not support {name} {size} yet: it registers one engine's "
                "tensor-parallel ranks; run one engine (with its own group) per data-parallel rank, and pp 1"
            )


def room_timeouts_of(extra: dict[str, Any]) -> RoomTimeouts:
    """The engine's own room timeouts from ``kv_connector_extra_config``
    (:data:`TIMEOUT_KEYS`); ``InvalidArgument`` naming a key whose value is
    not a number of seconds above 0 and at most a day."""
    return timeouts_from(first_set(extra, TIMEOUT_KEYS), "kv_connector_extra_config")


def compatibility_of(vllm_config: Any, model: ModelSpec, device_type: str) -> str:
    """What must match between a prefill and a decode engine beyond the KV
    shapes, as a digest (``ModelSpec.compatibility``): vLLM and its version,
    the model and its revision, dtype and cache dtype, the KV layout, the
    attention backend asked for, the device type. Not the block size: the
    broker moves KV between different page sizes where the layout allows
    it and refuses it by name where not."""
    import vllm

    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    attention = getattr(vllm_config, "attention_config", None)
    fields = {
        "engine": "vllm",
        "version": vllm.__version__,
        "model": str(model_config.model),
        "revision": str(getattr(model_config, "revision", None)),
        "dtype": str(model_config.dtype),
        "cache_dtype": str(cache_config.cache_dtype),
        "kv_layout": model.kv_layout,
        "attention": str(getattr(attention, "backend", None) or os.environ.get("VLLM_ATTENTION_BACKEND")),
        "device": device_type,
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return f"vllm-{vllm.__version__}:{digest}"

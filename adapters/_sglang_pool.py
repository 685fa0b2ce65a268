"""SGLang's KV pool, metadata buffers and Mamba state as kvbroker's engine memory.

What the SGLang backend (``adapters/sglang.py``) hands the broker when its
KV manager starts: the pool's per-layer tensors (token-major ``[tokens,
heads, dim]``; one ``kv`` tensor per layer for MLA), the metadata buffers in
``get_buf_infos`` order, and a hybrid pool's Mamba state. Adoption moves host
memory into shared memory, so the addresses SGLang keeps in ``KVArgs`` are
rewritten here. Nothing here imports SGLang: its objects are duck-typed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvbroker.client import EngineMemory, ModelSpec, RankSpec, StateTensors
from kvbroker.errors import InvalidArgument, Unimplemented

__all__ = ["adopt_pool", "compatibility_of", "kv_tensors", "moved_state", "state_of"]


def compatibility_of(server_args: Any, mla: bool) -> str:
    """What must match between a prefill and a decode engine beyond the KV
    shapes, as a digest (``ModelSpec.compatibility``): SGLang and its version,
    the model and its revision, dtype and KV cache dtype, the attention
    backend, MLA (not the page size: the broker moves KV between page sizes)."""
    import hashlib
    import json

    import sglang

    version = str(getattr(sglang, "__version__", "?"))
    fields = {
        "engine": "sglang",
        "version": version,
        "model": str(getattr(server_args, "model_path", None)),
        "revision": str(getattr(server_args, "revision", None)),
        "dtype": str(getattr(server_args, "dtype", None)),
        "cache_dtype": str(getattr(server_args, "kv_cache_dtype", None)),
        "attention": str(getattr(server_args, "attention_backend", None)),
        "mla": mla,
    }
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]
    return f"sglang-{version}:{digest}"


def kv_tensors(pool: Any, mla: bool) -> list[list[torch.Tensor]]:
    """Per attention layer of the pool, its KV tensors: [k, v], or [kv] for MLA
    (a hybrid pool's full-attention sub-pool)."""
    full = getattr(pool, "full_kv_pool", pool)
    if mla:
        return [[t] for t in full.kv_buffer]
    return [[k, v] for k, v in zip(full.k_buffer, full.v_buffer)]


def moved_state(state_type: Any) -> str | None:
    """kvbroker's component for an SGLang state type (None: not moved)."""
    return "mamba" if str(getattr(state_type, "value", state_type)) == "mamba" else None


def _mamba_state(pool: Any) -> dict[str, StateTensors]:
    """A hybrid pool's Mamba state: per Mamba layer, its conv and temporal tensors
    ([slots, ...] each), in the order SGLang lists them to transfer backends."""
    mamba = getattr(pool, "mamba_pool", None)
    if mamba is None:
        return {}
    layers: dict[int, list[torch.Tensor]] = {}
    for _field, tensor, _axis, layer in mamba._iter_transfer_state_entries():
        layers.setdefault(int(layer), []).append(tensor)
    return {"mamba": StateTensors("mamba", layers)} if layers else {}


def adopt_pool(
    rank: RankSpec, pool: Any, args: Any, metadata: Any, model_config: Any, mla: bool, compatibility: str = ""
) -> EngineMemory:
    """The pool, the metadata buffers and any Mamba state handed to the broker
    (host memory moves into shared memory); ``args`` then gives their new addresses."""
    layers = kv_tensors(pool, mla)
    first = layers[0][0]
    if first.dim() != 3:
        raise Unimplemented(f"kvbroker's SGLang backend takes token-major [tokens, heads, dim] pools, got {tuple(first.shape)}")
    heads, head_dim = int(first.shape[1]), int(first.shape[2])
    num_layers = int(model_config.num_hidden_layers)
    start = int(getattr(pool, "start_layer", 0) or 0)
    # SGLang's layer id of each KV entry (a hybrid model's attention layers).
    layer_ids = [int(i) for i in (getattr(args, "kv_layer_ids", None) or [])][: len(layers)]
    if len(layer_ids) != len(layers):
        layer_ids = [start + i for i in range(len(layers))]
    model = ModelSpec(
        num_layers=num_layers,
        total_kv_heads=1 if mla else int(model_config.get_total_num_kv_heads()),
        head_dim=head_dim,
        dtype=first.dtype,
        page_size=int(pool.page_size),
        mla=mla,
        kv_layers=None if layer_ids == list(range(num_layers)) else tuple(layer_ids),
        compatibility=compatibility,
    )
    if not mla and model.heads_per_rank(rank.tp_size) != heads:
        raise InvalidArgument(f"the pool holds {heads} KV heads per rank; {model.total_kv_heads} heads over tp {rank.tp_size} give {model.heads_per_rank(rank.tp_size)}")
    state = _mamba_state(pool) if any(moved_state(t) for t in getattr(args, "state_types", []) or []) else {}
    aux = _aux_tensors(metadata)
    memory = EngineMemory.adopt(rank, model, kv=dict(zip(layer_ids, layers)), aux=aux, state=state)
    # The pool keeps tables of its buffers' addresses (for its copy kernels): rebuild them.
    refresh = getattr(getattr(pool, "full_kv_pool", pool), "_init_data_ptrs_and_strides", None)
    if refresh is not None:
        refresh()
    args.kv_data_ptrs = [layer[kind].data_ptr() for kind in range(len(layers[0])) for layer in layers]
    args.aux_data_ptrs = [t.data_ptr() for t in aux]
    if state:
        # SGLang's list of state buffers, in the order it gives them: now in shared memory.
        (index,) = [i for i, t in enumerate(args.state_types) if moved_state(t)]
        args.state_data_ptrs[index] = [t.data_ptr() for _, t, _, _ in pool.mamba_pool._iter_transfer_state_entries()]
    return memory


def _aux_tensors(metadata: Any) -> list[torch.Tensor]:
    """The metadata buffers in ``get_buf_infos`` order (one row per request slot)."""
    ptrs = metadata.get_buf_infos()[0]
    by_ptr = {t.data_ptr(): t for t in vars(metadata).values() if isinstance(t, torch.Tensor)}
    return [by_ptr[p] for p in ptrs]


def state_of(state_types: Sequence[Any], state_indices: Sequence[Any] | None) -> dict[str, np.ndarray]:
    """SGLang's state indices (one payload per state type, aligned with
    ``KVArgs.state_types``) as kvbroker's {component: indices}."""
    out: dict[str, np.ndarray] = {}
    for state_type, payload in zip(state_types, state_indices or []):
        if payload is None:
            continue
        name = moved_state(state_type)
        if name is None:
            raise Unimplemented(f"kvbroker's SGLang backend moves Mamba state only, not {state_type}")
        parts = payload if isinstance(payload, (list, tuple)) else [payload]
        out[name] = np.concatenate([np.asarray(p, dtype=np.int64).reshape(-1) for p in parts])
    return out
